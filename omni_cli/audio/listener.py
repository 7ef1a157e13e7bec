"""The always-open microphone of talk mode: turns found by voice activity, and barge-in while the assistant speaks.

`Listener(options)` opens one PortAudio input stream (16 kHz mono float32 by default) and keeps it open
for the whole of talk mode, so the microphone hears the user while the speaker plays (full duplex: the
speaker's output stream is another stream, opened per reply). The stream's callback only copies each
block onto a list; the listener's own thread takes them in order and, for each:

1. cancels the echo (audio/echo.py) with what the speaker played as the reference: `reference(block,
   rate)` is the speaker's tap (`SpeakerSink.tap`), called on the audio thread; it only queues the copy,
   and this thread resamples it to the microphone's rate and takes as many reference samples as the
   microphone block has (silence when none is queued: nothing is playing);
2. measures the level (`on_level(dbfs)`, once per block, for the live meter);
3. runs the VAD (WebRTC's or Silero's, audio/vad.py) and the turn `Endpoint`.

A turn (speech of at least `min_speech_ms`, then `end_silence_ms` of silence) becomes an AudioClip on
`turns`, from a short pre-roll before its first voiced frame to a short tail after its last one. While
`speaking` is set (the talk loop sets it for a whole reply: thinking and speaking), a stretch of speech
must reach `barge_in_ms` of voiced frames (pauses of up to BARGE_GAP_MS between words bridged; only
frames that pass `_near_end`: loud enough, and not what the canceller took for echo): then
`on_barge_in()` is called on this thread, once, and the turn that follows is kept; a shorter stretch
heard then (a cough, a click, residual echo) is dropped, so it neither interrupts nor becomes a turn.

`find_turns=False` (talk mode over a server's `/v1/realtime`, where the server's VAD ends the turns):
no turns are found; each block, echo cancelled, goes to `on_audio(block)` on this thread instead (the
level is still measured). With a canceller (speakers), the VAD still runs for barge-in alone: the same
judgement as above calls `on_barge_in()` after the block that decided it went to `on_audio`, and
`barge_in_after` says how far back the speech began; the talk loop uses it to keep echo residue from
the server's VAD (faces/chat/talk_remote.py). With headphones no VAD is made: there is no echo to judge.

It knows no model, no terminal and no reply: what a barge-in does (silence the speaker, stop the
generation) is the talk loop's business. An error on this thread is kept and raised by `next_turn`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import AudioDeviceError, UsageError
from ..media import AudioClip
from .echo import ECHO_KINDS, EchoResemblance, make_echo_canceller
from .microphone import (
    RECORD_HINT,
    block_dbfs,
    close_input,
    find_input_device,
    sounddevice_for_recording,
)
from .reference import ReferenceLine
from .sinks import failure_reason
from .vad import VAD_KINDS, Endpoint, make_vad

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

log = logging.getLogger(__name__)

# The worker waits at most this long for a block before it looks at `closing` again (seconds).
POLL_SECONDS = 0.02
# While a reply plays, a microphone block waits at most this long for the speaker's reference for it
# (the devices hand their blocks over in bursts of up to ~60 ms; a wait adds that to the VAD's delay).
REFERENCE_WAIT_SECONDS = 0.1
REFERENCE_POLL_SECONDS = 0.005
# Barge-in counts the voiced frames of one stretch of speech, across the short pauses between words
# (up to this long): a word of one syllable is shorter than --barge-in-ms, a sentence is not.
BARGE_GAP_MS = 150
# It counts only voiced frames of blocks louder than this after cancelling (a voice near the
# microphone is -40 to -15 dBFS; what the canceller leaves of the echo, when it keeps up, -70 or less)...
BARGE_FLOOR_DBFS = -50.0
# ...and, with a canceller, of blocks where it kept at least this share of the microphone's power
# (measured on speech-like signals: blocks of the user over the echo keep -8 dB median, down to -20 dB
# where AEC3 damps the user while it also hears echo; echo alone -35 to -70 dB).
ECHO_KEPT_DB = -25.0
# How much the canceller takes away changes, though: 11-12 dB in the first reply, 40 dB and more once it
# has converged, less again around a reply's start while it finds the echo's delay. With a noise-like
# voice (a random-weight model's) that residue passed ECHO_KEPT_DB at a reply's start and cut it with
# nobody speaking (the room on an H200 and on this CPU, scripts/measure_talk.py room, 0.6-0.8 s into a
# reply). So while a reply plays, a block counts only where the canceller kept ECHO_MARGIN_DB more of it
# than it kept of this reply's echo so far (the median over the blocks where the speaker played and the
# microphone heard something); before ECHO_SETTLE_MS of those, only where it kept ECHO_UNSETTLED_DB:
# speech over the echo keeps -8 dB median, as loud as the echo about -3. A pause in the reference (an
# underrun, or between words) starts that over: after a gap the echo may come back shifted against the
# reference, and AEC3 then leaves it 15-20 dB down for a few hundred ms where it had taken all of it (a
# loud noise-like voice: the median at -77 dB, the bar at ECHO_KEPT_DB), which cut replies with nobody
# speaking (the Qwen3 room over a server, on an H200 and on this CPU with the true-size code2wav's voice).
ECHO_MARGIN_DB = 10.0
ECHO_SETTLE_MS = 500
ECHO_UNSETTLED_DB = -6.0
# And while the speaker plays, the share of what the canceller kept that is the reference again
# (echo.EchoResemblance) is taken off before those two bars: what is left is what may be the user. AEC3
# at times passes a stretch of echo through whole, at 0 dB, late in a long reply (ten harmonic
# speech-like replies: one false interruption, that stretch 91-100 % explained), and what it keeps of a
# noise-like voice it has not learned is 40-70 % explained (the tiny Qwen3's voice served: a false cut
# 2 s into a reply); the user's voice over the echo is 0-20 % explained, at its onset up to 66 %. A
# block this much explained or more is the echo, whatever is left of it.
ECHO_EXPLAINED = 0.8
REFERENCE_SILENT_DBFS = -60.0  # a reference block this quiet: the speaker is not playing now
# For this long after the speaker went quiet its echo may still come in (a device's latency and the room):
# those blocks are judged by the bar of the last block it played, not the lenient ECHO_KEPT_DB.
ECHO_TAIL_MS = 400
# What the canceller keeps of the echo is measured on the blocks' echo-like part: a block the reference
# explains ECHO_WHOLE or more of is echo whole (what AEC3 keeps of a voice it has not learned is 25-90 %
# explained, mostly 35-55), one it explains no more than a filter explains of an unrelated signal by
# chance (ECHO_CHANCE: the user's speech over a noise-like voice, 7-12 %) is not echo, and between the two
# in proportion. So the user's blocks do not count as echo: they held the bar up while the user spoke
# 10 dB under a loud voice that AEC3 learned late (the room on an H200: 11-21 dB kept for 1.8 s, then -80).
# And the bar follows a canceller that has just learned the echo: it is the lower of the medians over the
# last 2 s and the last 0.5 s. (With every block scaled by its explained share, the bar fell under the
# uneven residue of an unlearned voice: a false cut in 2 of 13 rooms on this CPU, recorded and replayed.)
ECHO_CHANCE = 0.1
ECHO_WHOLE = 0.3
ECHO_RECENT_BLOCKS = 50  # 10 ms blocks: 0.5 s


@dataclass(frozen=True)
class ListenOptions:
    """How talk mode listens."""

    # The input device: None = the default; an index; or (part of) its name.
    device: str | int | None = None
    # The rate the microphone is opened at: WebRTC's VAD and echo canceller and the audio encoders all
    # take 16 kHz, so nothing is resampled on the way (a sound server resamples for the device).
    sample_rate: int = 16000
    # Which VAD ends turns: "webrtc" (light, no torch) or "silero" (a small neural model; needs torch).
    vad: str = "webrtc"
    # WebRTC VAD aggressiveness, 0-3 (3: the least noise taken for speech).
    vad_mode: int = 3
    # Silero: a frame is speech from this probability on.
    silero_threshold: float = 0.5
    # Silence after speech that ends the turn (ms): longer than the pauses between a speaker's words.
    end_silence_ms: int = 800
    # Voiced time that counts as speech when the assistant is quiet (ms).
    min_speech_ms: int = 200
    # Voiced time that interrupts the assistant while it speaks (ms): a cough or a click is shorter.
    barge_in_ms: int = 300
    # The echo canceller: "webrtc" (WebRTC's AEC3) or "off" (headphones: no echo to cancel).
    echo: str = "webrtc"
    # Kept before the first voiced frame and after the last one (ms): the VAD hears a word late.
    pre_roll_ms: int = 300
    tail_ms: int = 300
    # The longest turn (seconds): it ends there, whatever is heard.
    max_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.vad not in VAD_KINDS:
            raise UsageError(f"unknown VAD '{self.vad}': choose {' or '.join(VAD_KINDS)}")
        if self.echo not in ECHO_KINDS:
            raise UsageError(f"unknown echo canceller '{self.echo}': choose {' or '.join(ECHO_KINDS)}")
        if self.vad_mode not in (0, 1, 2, 3):
            raise UsageError(f"the VAD mode must be 0, 1, 2 or 3, not {self.vad_mode}")
        for name in ("end_silence_ms", "min_speech_ms", "barge_in_ms", "pre_roll_ms", "tail_ms"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must not be negative (got {getattr(self, name)})")
        if not self.max_seconds > 0:
            raise UsageError(f"the longest turn must be more than 0 s (got {self.max_seconds})")
        if self.sample_rate not in (8000, 16000, 32000, 48000):
            raise UsageError(f"talk mode listens at 8, 16, 32 or 48 kHz, not {self.sample_rate} Hz")


class Listener:
    """See the module docstring. `start()`, then `next_turn()` as often as wanted, then `close()`."""

    def __init__(self, options: ListenOptions | None = None, *, on_level: Callable[[float], None] | None = None,
                 backend: Any = None, hint: str = RECORD_HINT, find_turns: bool = True,
                 on_audio: Callable[[np.ndarray], None] | None = None) -> None:
        self.options = options if options is not None else ListenOptions()
        # False: no turns; each cleaned block goes to `on_audio` (this thread); barge-in is judged with a canceller.
        self.find_turns = find_turns
        self.on_audio = on_audio
        self.rate = self.options.sample_rate
        self.on_level = on_level
        self.hint = hint
        self._sd = backend
        # Set by the talk loop for the whole of a reply: speech then must reach barge_in_ms.
        self.speaking = threading.Event()
        # Called on this listener's thread when speech interrupts a reply (at most once per reply).
        self.on_barge_in: Callable[[], None] | None = None
        # Finished turns, oldest first.
        self.turns: "queue.Queue[AudioClip]" = queue.Queue()
        # perf_counter() of each barge-in, and stretches dropped as too short while speaking.
        self.barge_ins: list[float] = []
        self.dropped = 0
        # For each barge-in: seconds of microphone audio from the first counted frame of its speech to it.
        self.barge_in_after: list[float] = []
        self._barge_from = 0
        self.overflows = 0
        # No VAD without turns to find nor echo to judge (Silero's would load torch for nothing).
        judge = find_turns or self.options.echo != "off"
        self._vad: Any = make_vad(self.options.vad, self.rate, mode=self.options.vad_mode,
                                  threshold=self.options.silero_threshold) if judge else None
        self._echo = make_echo_canceller(self.options.echo, self.rate)
        self._resemblance = EchoResemblance(self.rate) if self.options.echo != "off" else None
        self._frame_ms = self._vad.frame_ms if self._vad is not None else 10
        self._frame = round(self._frame_ms * self.rate / 1000)  # samples a VAD flag stands for
        # (block, perf_counter() at arrival) from the stream's callback; deque append/popleft are atomic.
        self._arrived: collections.deque = collections.deque()
        self._wake = threading.Event()
        # (block, rate, microphone samples delivered then) from the speaker's tap; None: a new stream.
        self._refs: collections.deque = collections.deque()
        self._reference = ReferenceLine(self.rate)
        self._delivered = 0  # microphone samples the stream's callback has handed over
        self._closing = threading.Event()
        self._error: BaseException | None = None
        self._stream: Any = None
        self._thread: threading.Thread | None = None
        self._audio: list = []  # what was heard (echo cancelled) since self._audio_start
        self._audio_start = 0  # stream sample of self._audio's first sample
        self._samples = 0  # stream samples judged
        self._barged = False  # this reply was interrupted (reset at each turn and reply)
        self._stretch_while_speaking = False  # the current stretch of speech began during a reply
        self._barge_voiced = 0  # voiced frames of the current stretch that passed `_near_end`
        self._barge_quiet = 0  # unvoiced frames in a row since (a longer run than BARGE_GAP_MS ends it)
        # `_near_end` of the last blocks (a VAD frame spans up to three 10 ms blocks).
        self._loud: collections.deque = collections.deque(maxlen=3)
        # What the canceller kept of this reply's echo, a value a block (`_near_end`), the last 2 s.
        self._echo_kept: collections.deque = collections.deque(maxlen=200)
        self._echo_samples = 0  # the microphone's samples those were measured over, this reply
        self._last_bar = ECHO_UNSETTLED_DB  # the bar of the last block the speaker played (`_near_end`)
        self._quiet_samples = 0  # the microphone's samples since the speaker last played, this reply
        self._new_reply = False  # set by the talk loop's thread, seen by this one: the echo's figures restart
        self._new_turn(0)

    # -- the stream and the thread -----------------------------------------------------------------
    def start(self) -> None:
        sd = self._sd if self._sd is not None else sounddevice_for_recording(self.hint)
        device = find_input_device(self.options.device, sd, self.hint)
        try:
            self._stream = sd.InputStream(samplerate=self.rate, channels=1, dtype="float32", device=device["index"],
                                          blocksize=self.rate // 100, callback=self._callback)
            self._stream.start()
        except Exception as exc:
            close_input(self._stream)
            raise AudioDeviceError(f"cannot record from audio device '{device['name']}': {failure_reason(exc)}; "
                                   f"{self.hint}") from exc
        self._thread = threading.Thread(target=self._run, name="omni-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        close_input(self._stream)  # first: then nothing more arrives
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _callback(self, indata, frames, time_info, status) -> None:
        # PortAudio's thread: copy and hand over, nothing else.
        self._arrived.append((indata[:, 0].copy(), time.perf_counter()))
        self._delivered += frames
        self._wake.set()
        if status and status.input_overflow:
            self.overflows += 1

    def reference(self, block: "np.ndarray", rate: int) -> None:
        """What the speaker played (its tap, on the audio thread): queued for the echo canceller."""
        self._refs.append((block, rate, self._delivered))
        self._wake.set()  # a microphone block may be waiting for it

    def next_turn(self, stop: threading.Event | None = None) -> AudioClip | None:
        """The next finished turn; None once `stop` is set. Raises what failed on the listener's thread."""
        while True:
            if self._error is not None:
                raise self._error
            if stop is not None and stop.is_set():
                return None
            try:
                return self.turns.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._error is None:
                    raise AudioDeviceError(f"the microphone stopped listening; {self.hint}")

    def check(self) -> None:
        """Raise what failed on the listener's thread (`find_turns=False`: no `next_turn` to raise it)."""
        if self._error is not None:
            raise self._error
        if self._thread is not None and not self._thread.is_alive() and not self._closing.is_set():
            raise AudioDeviceError(f"the microphone stopped listening; {self.hint}")

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                if self._arrived and self._ready(*self._arrived[0]):
                    self.feed(self._arrived.popleft()[0])
                    continue
                self._wake.wait(POLL_SECONDS if not self._arrived else REFERENCE_POLL_SECONDS)
                self._wake.clear()
                if not self._arrived and self._stream is not None and not self._stream.active:
                    raise AudioDeviceError(f"the microphone stopped recording (was it unplugged?); {self.hint}")
        except BaseException as exc:  # noqa: BLE001 - carried to the talk loop's thread
            self._error = exc

    def _ready(self, block: "np.ndarray", arrived: float) -> bool:
        """Whether a block may be judged now: while a reply plays, once the speaker's reference for it has
        come (the two devices' blocks come in uneven bursts), or it has waited REFERENCE_WAIT_SECONDS
        (then the missing part is taken as silence; nothing after it shifts: reference.py)."""
        if not self.speaking.is_set():
            return True
        self._drain_references()
        end = self._reference.placed_end()
        if end is None or end >= self._samples + block.shape[0]:
            return True
        return time.perf_counter() - arrived >= REFERENCE_WAIT_SECONDS

    # -- one block ----------------------------------------------------------------------------------
    def feed(self, block: "np.ndarray") -> None:
        """Judge one microphone block (the worker's step; tests call it directly)."""
        reference = self._take_reference(block.shape[0])
        clean = self._echo.process(block, reference)
        level = block_dbfs(clean)
        if self.on_level is not None and clean.shape[0]:
            self.on_level(level)
        if not self.find_turns:
            self._samples += clean.shape[0]
            if self.on_audio is not None and clean.shape[0]:
                self.on_audio(clean)
            if self._vad is not None:  # barge-in alone: after on_audio, so the block that decides it is out
                self._loud.append(self._near_end(block, clean, level, reference))
                for speech in self._vad.feed(clean):
                    self._barge_flag(speech)
            return
        self._loud.append(self._near_end(block, clean, level, reference))
        self._audio.append(clean)
        self._samples += clean.shape[0]
        for speech in self._vad.feed(clean):
            self._frame_flag(speech)

    def _near_end(self, block: "np.ndarray", clean: "np.ndarray", level: float, reference: "np.ndarray") -> bool:
        """Whether this block may hold the user rather than the assistant's echo, for barge-in: its cleaned
        level is above BARGE_FLOOR_DBFS and, with a canceller, the canceller kept at least ECHO_KEPT_DB of
        the microphone's power (it takes most of a block of echo away, little of the user's voice), and
        while the speaker plays, more than it keeps of the echo now (`_echo_bar`, over `echo_part`s),
        counting only the part of what it kept that the reference does not explain (the comments above
        ECHO_MARGIN_DB and ECHO_CHANCE). The VAD alone will not do: WebRTC's calls a faint harmonic residue
        of echo, 60 dB down, speech."""
        if self.options.echo == "off" or not block.shape[0]:
            return level >= BARGE_FLOOR_DBFS
        assert self._resemblance is not None  # made with the canceller
        self._resemblance.push(clean, reference)
        if self._new_reply:
            self._new_reply = False
            self._echo_kept.clear()
            self._echo_samples = 0
            self._last_bar, self._quiet_samples = ECHO_UNSETTLED_DB, 0
        heard = block_dbfs(block)
        kept = level - heard
        bar, explained = ECHO_KEPT_DB, None  # explained: EchoResemblance.explained(), computed once a block
        playing = block_dbfs(reference) >= REFERENCE_SILENT_DBFS
        if self.speaking.is_set() and not playing:
            self._echo_samples = 0  # a pause: what follows settles again (the comment above ECHO_MARGIN_DB)
            self._echo_kept.clear()
            self._quiet_samples += block.shape[0]
            if self._quiet_samples <= ECHO_TAIL_MS * self.rate // 1000:
                bar = self._last_bar  # the echo of what was just played is still coming in
        elif self.speaking.is_set() and heard >= BARGE_FLOOR_DBFS:
            bar = self._last_bar = self._echo_bar()
            if kept >= ECHO_KEPT_DB:  # may hold the user: only its echo-like part is echo
                explained = self._resemblance.explained()
            self._echo_kept.append(echo_part(kept, explained))
            self._echo_samples += block.shape[0]
        if playing:
            self._quiet_samples = 0
        counts = level >= BARGE_FLOOR_DBFS and kept >= bar
        if counts and self.speaking.is_set():  # computed once, where it may matter (1.8 ms on this CPU)
            explained = self._resemblance.explained() if explained is None else explained
            own = 10.0 * math.log10(max(1.0 - explained, 1e-3))  # dB: the part the reference does not explain
            counts = explained < ECHO_EXPLAINED and level + own >= BARGE_FLOOR_DBFS and kept + own >= bar
        return counts

    def _echo_bar(self) -> float:
        """The share the canceller must keep of a block, while the speaker plays, for the block to count
        as the user's (the comments above ECHO_MARGIN_DB and ECHO_CHANCE say why)."""
        if self._echo_samples < ECHO_SETTLE_MS * self.rate // 1000:
            return ECHO_UNSETTLED_DB
        ordered = sorted(self._echo_kept)
        recent = sorted(itertools.islice(self._echo_kept, max(0, len(self._echo_kept) - ECHO_RECENT_BLOCKS), None))
        return max(ECHO_KEPT_DB, min(ordered[len(ordered) // 2], recent[len(recent) // 2]) + ECHO_MARGIN_DB)

    def _drain_references(self) -> None:
        while self._refs:
            item = self._refs.popleft()
            if item is None:
                self._reference.new_stream()
            else:
                self._reference.add(*item)

    def _take_reference(self, n: int) -> "np.ndarray":
        """The reference for the next `n` microphone samples (reference.py says why by position)."""
        self._drain_references()
        return self._reference.take(self._samples, n)

    def _frame_flag(self, speech: bool) -> None:
        endpoint = self._endpoint
        ended = endpoint.push(speech)
        if speech and endpoint.voiced == 1:
            self._stretch_while_speaking = self.speaking.is_set()
        self._barge_flag(speech)
        limit = endpoint.frames * self._frame >= self.options.max_seconds * self.rate
        if ended or (limit and endpoint.heard):
            self._finish("silence" if ended else "limit")
        elif not endpoint.heard and endpoint.voiced == 0:
            self._forget()

    def _barge_flag(self, speech: bool) -> None:
        """One VAD frame for barge-in (both modes): voiced frames of this stretch that may be the user's
        (`_near_end` in any of the blocks the frame ended in) add up across pauses of up to BARGE_GAP_MS;
        while a reply runs, `barge_in_ms` of them call `on_barge_in()`, once a reply."""
        if not speech:
            self._barge_quiet += 1
            if self._barge_quiet * self._frame_ms > BARGE_GAP_MS:
                self._barge_voiced = 0
        else:
            self._barge_quiet = 0
            if any(self._loud):
                if self._barge_voiced == 0:
                    self._barge_from = self._samples
                self._barge_voiced += 1
        if self.speaking.is_set() and not self._barged and self._barge_voiced * self._frame_ms >= self.options.barge_in_ms:
            self._barged = True
            self.barge_ins.append(time.perf_counter())
            self.barge_in_after.append((self._samples - self._barge_from) / self.rate)
            if self.on_barge_in is not None:
                self.on_barge_in()

    def _finish(self, ended_by: str) -> None:
        """The turn ended: queued as a clip, unless it was a short stretch heard while the assistant spoke."""
        import numpy as np

        endpoint = self._endpoint
        frames_end = endpoint.frames
        if self._stretch_while_speaking and not self._barged:
            self.dropped += 1
        else:
            pcm = np.concatenate(self._audio) if self._audio else np.zeros(0, np.float32)
            start = self._base + endpoint.speech_start * self._frame - round(self.options.pre_roll_ms * self.rate / 1000)
            end = self._base + endpoint.speech_end * self._frame + round(self.options.tail_ms * self.rate / 1000)
            lo = max(0, start - self._audio_start)
            hi = min(pcm.shape[0], end - self._audio_start)
            speech_end = (endpoint.speech_end * self._frame + self._base - self._audio_start - lo) / self.rate
            clip = AudioClip(pcm=pcm[lo:hi].copy(), sample_rate=self.rate, source="microphone", ended_by=ended_by,
                             recorded_seconds=(hi - lo) / self.rate, speech_end=speech_end)
            self.turns.put(clip)
        self._new_turn(self._base + frames_end * self._frame)

    def _new_turn(self, base: int) -> None:
        """A fresh endpoint whose frame 0 is sample `base` of the stream."""
        o = self.options
        frame_ms = self._frame_ms
        self._endpoint = Endpoint(math.ceil(o.min_speech_ms / frame_ms), math.ceil(o.end_silence_ms / frame_ms))
        self._base = base
        self._barged = False
        self._stretch_while_speaking = False
        self._forget()

    def _forget(self) -> None:
        """Nothing is being said: keep only the pre-roll of what was heard (memory stays bounded)."""
        import numpy as np

        keep = round(self.options.pre_roll_ms * self.rate / 1000) + self._frame
        held = self._samples - self._audio_start
        if held > 4 * keep and self._audio:
            pcm = np.concatenate(self._audio)[-keep:]
            self._audio = [pcm]
            self._audio_start = self._samples - pcm.shape[0]

    def barged(self) -> bool:
        """Whether speech has interrupted the reply running now (reset by `reply_started`)."""
        return self._barged

    def reply_started(self) -> None:
        """The talk loop starts a reply: speech from now on must reach barge_in_ms, and may interrupt it."""
        self._barged = False
        self._barge_voiced = self._barge_quiet = 0
        self._refs.append(None)  # the reply's speaker stream is placed afresh on the microphone's clock
        self._new_reply = True
        self.speaking.set()

    def reply_ended(self) -> None:
        self.speaking.clear()


def echo_part(kept: float, explained: float | None) -> float:
    """What the canceller kept of the echo in a block it kept `kept` dB of while the speaker played: its
    echo-like part by the share of it the reference explains (the comment above ECHO_CHANCE); all of it
    where that share was not looked at (`explained` None: a block kept under ECHO_KEPT_DB never counts)."""
    if explained is None:
        return kept
    share = (explained - ECHO_CHANCE) / (ECHO_WHOLE - ECHO_CHANCE)
    return kept + 10.0 * math.log10(min(1.0, max(share, 1e-3)))
