"""The microphone: record one spoken turn into a clip, ended by silence, a key or a length limit.

`record(options, stop, on_level)` opens a sounddevice/PortAudio input stream on the chosen device at
that device's own rate. The stream's callback only copies each block onto a list; the calling thread
takes them in order, measures the level (RMS dBFS, reported to `on_level` every tenth of a second of
audio, for a live meter), runs voice-activity detection, and ends the turn when `stop` is set (the
user pressed Enter), when speech was heard and the configured silence followed, or at the longest
clip length. Trailing silence beyond a short tail is cut off. A turn with no speech in it (VAD on), or
never louder than a floor (VAD off), raises `SilentMicrophone`, which carries the clip; Ctrl-C stops
the stream and re-raises the KeyboardInterrupt with the clip attached as its `clip` attribute. So
nothing recorded is lost. `save_clip` writes a clip as a 16-bit WAV that exists only when whole.
A clip is media.py's `AudioClip` (source "microphone"), the type every audio input has; `Clip` is
the same class under its old name here.

Voice activity is audio/vad.py's (WebRTC's VAD, resampled to one of its rates where the device's is
not one). It does not know models or prompts: the clip keeps the device's rate, and resampling it for a
model's audio encoder is the caller's business. It prints nothing and draws no meter: the terminal
face decides what a person sees from `on_level` and from the errors (one line each).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import atomic
from ..errors import AudioDeviceError, OmniError, UsageError
from ..media import AudioClip
from .format import wav_bytes
from .sinks import failure_reason
from . import speaker
from .speaker import devices_of_kind, match_device
from .vad import VAD_FRAME_MS, Endpoint, WebRtcVad

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

log = logging.getLogger(__name__)

# What to say after a failure to record (the CLI may pass its own).
RECORD_HINT = "check that a microphone is connected, chosen and not muted"

# The level meter's period: on_level is called once per this much audio (seconds).
LEVEL_SECONDS = 0.1
# The level reported for digital silence (exact zeros), instead of minus infinity.
SILENCE_DBFS = -120.0
# The drain loop waits at most this long (seconds) for a block before it looks at `stop` again: the
# longest a set `stop` can go unnoticed.
POLL_SECONDS = 0.02


@dataclass(frozen=True)
class RecordOptions:
    """How to record one turn."""

    # The input device: None = the default; an index; or (part of) its name (see input_devices()).
    device: str | int | None = None
    # Sample rate to record at; None = the device's default rate (the clip keeps it: no resampling).
    sample_rate: int | None = None
    # End the turn by voice activity (speech, then `end_silence_ms` of silence). Off: only `stop` or
    # `max_seconds` end it, and "silence" means a level never above `floor_dbfs`.
    vad: bool = True
    # WebRTC VAD aggressiveness, 0-3: higher calls less noise speech (and risks missing soft speech).
    vad_mode: int = 2
    # Silence after speech that ends the turn (ms): longer than the pauses between a speaker's words.
    end_silence_ms: int = 800
    # Voiced time that counts as speech (ms): a click or a cough shorter than this does not start a turn.
    min_speech_ms: int = 200
    # Silence kept after the last speech (VAD on) or the last sound above the floor (VAD off), in ms:
    # the rest of the trailing silence is cut off. Never more than the silence that ended the turn.
    tail_ms: int = 300
    # The longest clip (seconds): the turn ends there, whatever is heard.
    max_seconds: float = 60.0
    # With VAD on, a turn in which no speech has started after this many seconds ends there (and is
    # silent): a muted or dead microphone is said within seconds, not at the length limit.
    start_seconds: float = 8.0
    # A level (RMS dBFS over LEVEL_SECONDS) at or below this is silence: with VAD off, a recording never
    # louder is refused as silent, and the trailing stretch at or below it is trimmed.
    floor_dbfs: float = -50.0

    def __post_init__(self) -> None:
        if self.vad_mode not in (0, 1, 2, 3):
            raise UsageError(f"the VAD mode must be 0, 1, 2 or 3, not {self.vad_mode}")
        for name in ("end_silence_ms", "min_speech_ms", "tail_ms"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must not be negative (got {getattr(self, name)})")
        if not self.max_seconds > 0:
            raise UsageError(f"the longest clip must be more than 0 s (got {self.max_seconds})")
        if not self.start_seconds > 0:
            raise UsageError(f"the wait for speech must be more than 0 s (got {self.start_seconds})")
        if self.sample_rate is not None and self.sample_rate <= 0:
            raise UsageError(f"the sample rate must be positive (got {self.sample_rate})")


# A recording is an AudioClip (media.py) with `ended_by`, `recorded_seconds`, `speech_end` and
# `overflows` filled in; the old name stays importable from here.
Clip = AudioClip


class SilentMicrophone(OmniError):
    """The microphone gave silence: no speech (VAD on) or no level above the floor (VAD off).

    `clip` holds what was recorded (untrimmed), so a caller may still keep or save it."""

    def __init__(self, message: str, clip: AudioClip) -> None:
        super().__init__(message)
        self.clip = clip


# -- devices -----------------------------------------------------------------------------------


def sounddevice_for_recording(hint: str) -> Any:
    """sounddevice, imported now (PortAudio reads the sound setup here); errors say "record"."""
    try:
        return speaker.import_sounddevice(hint)  # looked up now: one place to replace it (tests)
    except AudioDeviceError as exc:  # its words are for playing: same failure, our verb
        raise AudioDeviceError(str(exc).replace("cannot play audio", "cannot record audio", 1)) from exc.__cause__


def input_devices(sd: Any = None, hint: str = RECORD_HINT) -> list[dict]:
    """The input devices PortAudio sees: dicts with index, name, hostapi, channels, samplerate, default."""
    return devices_of_kind("input", sd if sd is not None else sounddevice_for_recording(hint), hint)


def _listing(devices: list[dict]) -> str:
    return ", ".join(f"{d['index']}: {d['name']}" for d in devices)


def find_input_device(spec: str | int | None, sd: Any = None, hint: str = RECORD_HINT) -> dict:
    """The input device named by `spec`: None = the default; an index; or (part of) a name."""
    devices = input_devices(sd, hint)
    if not devices:
        raise AudioDeviceError(f"cannot record audio: no sound input device found (no microphone?); {hint}")
    text = "" if spec is None else str(spec).strip()
    found = match_device(devices, text)
    if isinstance(found, dict):
        return found
    if found == "default":
        raise AudioDeviceError("cannot record audio: there is no default sound input device: choose one "
                               f"(input devices: {_listing(devices)})")
    if found == "index":
        raise UsageError(f"audio device {text} is not an input device here (input devices: {_listing(devices)})")
    if found == "name":
        raise UsageError(f"no audio input device is called '{text}' (input devices: {_listing(devices)})")
    raise UsageError(f"audio input device '{text}' is ambiguous ({_listing(found[:5])}): give its index")


# -- what the drain thread does with each block ----------------------------------------------------


class _LevelMeter:
    """RMS level in dBFS over each LEVEL_SECONDS of audio, handed to `on_level` and kept (for the floor
    and the trim). Periods are counted in samples, so the reports follow the audio, not the clock."""

    def __init__(self, rate: int, on_level: Callable[[float, float], None] | None) -> None:
        self.rate = rate
        self.period = max(1, round(rate * LEVEL_SECONDS))
        self.on_level = on_level
        self.levels: list[float] = []  # one per full period, in order
        self._energy = 0.0  # sum of squares in the current period
        self._filled = 0  # samples in the current period

    def feed(self, block: "np.ndarray") -> None:
        import numpy as np

        at = 0
        while at < block.shape[0]:
            take = min(self.period - self._filled, block.shape[0] - at)
            part = block[at:at + take].astype(np.float64)
            self._energy += float(np.dot(part, part))
            self._filled += take
            at += take
            if self._filled == self.period:
                self._report()

    def _report(self) -> None:
        level = dbfs(self._energy / self.period)
        self.levels.append(level)
        self._energy, self._filled = 0.0, 0
        if self.on_level is not None:
            self.on_level(level, len(self.levels) * self.period / self.rate)

    def loudest(self) -> float:
        """The loudest level so far, the unfinished last period included."""
        partial = [dbfs(self._energy / self._filled)] if self._filled else []
        return max(self.levels + partial, default=SILENCE_DBFS)

    def loud_until(self, floor: float) -> float | None:
        """The end (seconds) of the last period louder than `floor`; None if none was."""
        for i in range(len(self.levels) - 1, -1, -1):
            if self.levels[i] > floor:
                return (i + 1) * self.period / self.rate
        return None


def dbfs(mean_square: float) -> float:
    """A mean square of float samples (full scale 1.0) in dBFS; SILENCE_DBFS for digital silence."""
    return 10.0 * math.log10(mean_square) if mean_square > 10 ** (SILENCE_DBFS / 10) else SILENCE_DBFS


def block_dbfs(block) -> float:
    """A block of float samples' level in dBFS (`dbfs` of its mean square); SILENCE_DBFS for no samples."""
    import numpy as np

    return dbfs(float(np.mean(np.square(block, dtype=np.float64)))) if block.shape[0] else SILENCE_DBFS


class _Turn:
    """Everything recorded so far, and the decision when to stop.

    The stream's callback appends each block to `arrived`, and only that; the drain thread judges
    the blocks in order (level, VAD, limit). Nothing is ever taken out of `arrived`, so an interrupt
    that lands anywhere on the drain thread cannot lose a block: Ctrl-C's clip is all that arrived."""

    def __init__(self, options: RecordOptions, rate: int, on_level: Callable[[float, float], None] | None) -> None:
        self.options = options
        self.rate = rate
        self.limit = max(1, round(options.max_seconds * rate))  # samples
        self.arrived: list = []  # every block the device delivered, in order (list.append is atomic)
        self.wake = threading.Event()  # set by the callback after each block: the drain thread waits on it
        self.judged = 0  # blocks of `arrived` the meter and the VAD have seen
        self.samples = 0  # samples in those blocks (up to the limit)
        self.meter = _LevelMeter(rate, on_level)
        self.vad = WebRtcVad(rate, options.vad_mode) if options.vad else None
        # Whole frames, rounded up: at least the configured speech and silence (800 ms: 27 frames, 810 ms).
        self.endpoint = Endpoint(math.ceil(options.min_speech_ms / VAD_FRAME_MS),
                                  math.ceil(options.end_silence_ms / VAD_FRAME_MS))
        self.ended_at: int | None = None  # samples of audio when the VAD ended the turn
        self.overflows = 0  # input overflows PortAudio reported (counted by the stream's callback)

    def callback(self, indata, frames, time_info, status) -> None:
        # PortAudio's thread: copy the block out of PortAudio's buffer and hand it over, nothing else
        # (a callback that takes its time makes the device drop input).
        self.arrived.append(indata[:, 0].copy())
        self.wake.set()
        if status and status.input_overflow:
            self.overflows += 1  # written here only; the drain thread reads it once the stream is closed

    def judge(self, upto: int) -> str | None:
        """Judge the blocks that arrived before `upto`; the reason the turn ends ("silence", "limit"), or None."""
        while self.judged < upto:
            block = self.arrived[self.judged]
            self.judged += 1
            ended = self._judge(block)
            if ended is not None:
                return ended
        return None

    def _judge(self, block: "np.ndarray") -> str | None:
        ended = None
        if self.samples + block.shape[0] >= self.limit:
            block, ended = block[:self.limit - self.samples], "limit"
        self.samples += block.shape[0]
        self.meter.feed(block)
        if self.vad is not None:
            for speech in self.vad.feed(block):
                if self.endpoint.push(speech):
                    # The turn ended at this frame's end: what the device gave after it is not part of it.
                    self.ended_at = round(self.endpoint.frames * VAD_FRAME_MS / 1000 * self.rate)
                    return "silence"
            if not self.endpoint.heard and self.samples >= self.options.start_seconds * self.rate:
                return "no speech"  # nobody spoke: `silence()` makes it the silent-microphone error
        return ended

    def clip(self, ended_by: str, trim: bool, everything: bool = False) -> AudioClip:
        """The recording: the blocks judged (`everything`: all that arrived), up to the turn's end."""
        import numpy as np

        blocks = self.arrived if everything else self.arrived[:self.judged]
        pcm = np.concatenate(blocks) if blocks else np.zeros(0, np.float32)
        pcm = pcm[:min(self.limit, self.ended_at if self.ended_at is not None else self.limit)]
        speech_end = self.endpoint.speech_end * VAD_FRAME_MS / 1000 if self.vad is not None and self.endpoint.heard else None
        recorded = pcm.shape[0] / self.rate
        if trim:
            sound_end = speech_end if self.vad is not None else self.meter.loud_until(self.options.floor_dbfs)
            if sound_end is not None:
                tail = min(self.options.tail_ms, self.options.end_silence_ms) / 1000
                pcm = pcm[:min(pcm.shape[0], round((sound_end + tail) * self.rate))]
        return AudioClip(pcm=pcm, sample_rate=self.rate, source="microphone", ended_by=ended_by,
                         recorded_seconds=recorded, speech_end=speech_end, overflows=self.overflows)

    def silence(self) -> str | None:
        """Why this recording counts as silent (the error's words), or None when it has sound in it."""
        seconds = self.samples / self.rate
        if self.vad is not None:
            if not self.endpoint.heard:
                return f"the microphone gave silence: no speech was heard in {seconds:.1f} s"
            return None
        loudest = self.meter.loudest()
        if loudest <= self.options.floor_dbfs:
            return (f"the microphone gave silence: its level never rose above {self.options.floor_dbfs:g} dBFS "
                    f"in {seconds:.1f} s (loudest {loudest:.0f} dBFS)")
        return None


# -- recording -----------------------------------------------------------------------------------


def record(options: RecordOptions | None = None, stop: threading.Event | None = None,
           on_level: Callable[[float, float], None] | None = None, *, hint: str = RECORD_HINT,
           backend: Any = None) -> AudioClip:
    """Record one turn from the microphone (see the module docstring) and return it, trimmed.

    Ends when `stop` is set, when speech was followed by `options.end_silence_ms` of silence (VAD on),
    or at `options.max_seconds`. `on_level(level_dbfs, seconds_so_far)` is called on this thread once
    per LEVEL_SECONDS of audio (an exception it raises ends the recording and propagates). Raises
    SilentMicrophone (with `.clip`) for a silent turn. A Ctrl-C from the moment the device is opened
    stops the stream and re-raises the KeyboardInterrupt with all the device delivered, untrimmed, as
    its `clip` attribute (an empty clip if none came yet). `backend` replaces the sounddevice module (tests)."""
    options = options if options is not None else RecordOptions()
    sd = backend if backend is not None else sounddevice_for_recording(hint)
    device = find_input_device(options.device, sd, hint)
    rate = int(options.sample_rate or device["samplerate"] or 16000)
    turn = _Turn(options, rate, on_level)
    stream = None
    try:
        stream = _open(sd, device, rate, turn.callback, hint)
        _start(stream, device, hint)
        ended = _drain(stream, turn, stop, device, hint)
    except KeyboardInterrupt as exc:
        close_input(stream)  # first: then nothing more arrives
        exc.clip = turn.clip("interrupted", trim=False, everything=True)  # type: ignore[attr-defined]
        raise
    finally:
        close_input(stream)
    if turn.overflows:
        log.warning("the microphone dropped input %d times (the machine was too busy to take it)", turn.overflows)
    why = turn.silence()
    if why is not None:
        raise SilentMicrophone(f"{why}; {hint}", turn.clip(ended, trim=False))
    return turn.clip(ended, trim=True)


def _open(sd: Any, device: dict, rate: int, callback: Callable, hint: str) -> Any:
    try:
        return sd.InputStream(samplerate=rate, channels=1, dtype="float32", device=device["index"],
                              callback=callback)
    except Exception as exc:
        raise AudioDeviceError(f"cannot record from audio device '{device['name']}': {failure_reason(exc)}; {hint}") from exc


def _start(stream: Any, device: dict, hint: str) -> None:
    try:
        stream.start()
    except Exception as exc:
        raise AudioDeviceError(f"cannot record from audio device '{device['name']}': {failure_reason(exc)}; {hint}") from exc


def _drain(stream: Any, turn: _Turn, stop: threading.Event | None, device: dict, hint: str) -> str:
    """Judge blocks as they arrive until the turn ends; the reason it ended."""
    while True:
        if stop is not None and stop.is_set():
            # Blocks that had arrived were spoken before the key was pressed: they count.
            return turn.judge(len(turn.arrived)) or "stop"
        if turn.judged < len(turn.arrived):
            ended = turn.judge(turn.judged + 1)  # one block at a time: `stop` is looked at between them
            if ended is not None:
                return ended
            continue
        # A block that arrives between the check above and clear() is found by the next check; the
        # wait only bounds how long a set `stop` goes unnoticed.
        turn.wake.wait(POLL_SECONDS)
        turn.wake.clear()
        if turn.judged == len(turn.arrived) and not stream.active:
            raise AudioDeviceError(f"the audio device '{device['name']}' stopped recording (was it unplugged?); {hint}")


def close_input(stream: Any) -> None:
    """Stop at once (input needs no draining) and close; never raises; None or a closed stream: nothing."""
    if stream is None or getattr(stream, "closed", False):
        return
    try:
        stream.abort()
    except Exception:
        pass
    try:
        stream.close()
    except Exception:
        pass


def save_clip(clip: AudioClip, path: str | os.PathLike) -> Path:
    """Write `clip` as a 16-bit WAV at its own rate (the one PCM16 rule: full scale at most, never wrapped
    around), through atomic.atomic_write: a file that exists is whole. Returns the path."""
    atomic.atomic_write(path, wav_bytes(clip.pcm, clip.sample_rate))
    return Path(path)


def stage_clip(clip: AudioClip, path: str | os.PathLike) -> "atomic.Replacement | None":
    """`save_clip`, left under its temporary name (atomic.stage): for files renamed together (/save)."""
    return atomic.stage(path, wav_bytes(clip.pcm, clip.sample_rate))
