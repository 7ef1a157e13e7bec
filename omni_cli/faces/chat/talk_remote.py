"""omni-chat's talk mode over a server's `/v1/realtime` session (`--talk --server URL`): hands-free, the
server's VAD ends the turns, speech stops a reply.

`RemoteTalk(repl, options, session).run()` sets the session (`session.update`: server VAD with
`--end-silence-ms` of silence ending a turn, `interrupt_response` and `create_response` on; the chat's
voice and system prompt; text only when muted), hands it the chat's earlier turns as items, and opens
the microphone once (audio/listener.py with `find_turns=False`: echo cancelled unless `--headphones`,
no VAD of its own). Every cleaned block is resampled to 24 kHz and sent as `input_audio_buffer.append`
from the listener's thread; this thread reads the server's events:

- `input_audio_buffer.speech_stopped`: the turn ended (thinking); `response.output_audio_transcript.delta`
  (or `output_text.delta`) is the reply's text, shown as it comes; `response.output_audio.delta` is played
  on the chat's speaker (a SpeakerSink this thread owns, whose played signal is the echo canceller's
  reference); at `response.done` the speaker is told the input ended (`close(wait=False)`) and plays out,
  and the reply ends once it has.
- `input_audio_buffer.speech_started` while a reply runs or plays (barge-in): the speaker is aborted (the
  sound stops at once), and `conversation.item.truncate` says how much of the reply's audio was handed to
  the device (`audio_end_ms`), so the server keeps only the text that was heard (heard.py's rule, which
  this side uses too for what it shows and keeps). The server stops generating by itself
  (`interrupt_response`); the speech is the next turn once the server's VAD ends it.

With speakers (not `--headphones`) the server's VAD would also hear what the echo canceller leaves of the
reply's own voice, and cut it with nobody speaking. So while the speaker plays, the audio goes through an
echo gate (audio/gate.py) that sends digital silence in its place, and the listener judges barge-in as
local talk mode does (`--barge-in-ms` of voiced, loud frames the canceller mostly kept). When the judge
hears the user, the gate lets the held speech through from just before its start (the server's VAD
hears it whole and cuts the reply) and the reply is cut here at once, as for `speech_started`, without
waiting for the server's round trip. With headphones nothing is gated and the server's VAD barges in.

The turns go into the chat's conversation and transcript as local talk mode keeps them (the user's
speech as a clip cut from the audio sent, by the server's `audio_start_ms` / `audio_end_ms`), so typed
turns after talk mode follow on. A line on stdin (Enter) leaves talk mode; the session is closed then,
which stops a reply the server is still making.

It knows the realtime client (api/realtime_client.py), the listener, the echo gate, the speaker's sink
protocol and the chat's conversation; no model, no engine, no torch. It does not know the server's VAD or
its timing: what counts as speech, and when a turn ends, is the server's (while a reply plays, only after
this side's judge let it through); nor what the device still holds past what the speaker handed it
(`audio_end_ms` may run ahead of what was heard by the device's buffer).
"""

from __future__ import annotations

import base64
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...api.client import ServerError
from ...api.realtime_client import RATE, Event
from ...audio.gate import EchoGate
from ...heard import heard_text
from ...media import AudioClip
from ..console import isatty, shown
from .talk import (
    LISTENING,
    SPEAKING,
    THINKING,
    ReplyFigures,
    TalkMeter,
    interrupted_line,
    keep_turn,
    ms_after,
    stdin_closed,
    stdin_stop,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

POLL_SECONDS = 0.02  # how long one wait for a server event lasts before Enter and the speaker are looked at
SEND_SAMPLES = RATE // 50  # audio is sent in messages of at least 20 ms (the listener's blocks are 10 ms)
KEEP_SECONDS = 90.0  # the audio sent kept here, for the user's turns as clips (a turn is at most 60 s)
PRE_ROLL_MS, TAIL_MS = 300, 100  # kept around the server's speech start and end in a turn's clip
# When the judge hears the user, the echo gate lets through the speech from the judge's first counted
# frame and this much before it: that frame ends up to a VAD frame (30 ms) after the speech began, and a
# word's soft start may not count. Short, as what comes before the speech is the reply's residue (the
# server's VAD would take it for the speech's start), and the server pads the user's item itself.
GATE_PRE_ROLL_MS = 100
# While the speaker plays, the gate holds --barge-in-ms of the judge's voiced frames, the pre-roll and
# this much more: the pauses between words the judge bridges across.
HOLD_SLACK_MS = 500


@dataclass
class RemoteReply:
    """One reply of the session, as this side saw it."""

    response_id: str
    figures: ReplyFigures
    clip: AudioClip | None = None  # the user's turn it answers
    item_id: str | None = None  # the assistant item (what a truncate names)
    sink: Any = None  # its speaker, started at response.created (None: muted)
    pieces: list[str] = field(default_factory=list)
    made: int = 0  # samples of audio received
    done: bool = False  # response.done came
    status: str | None = None
    cut: bool = False  # speech interrupted it here
    cut_at: float | None = None  # perf_counter() of what cut it (for "here": when the judge heard the speech)
    cut_by: str = ""  # "here" (this side's judge), "server" (its speech_started), "next" (a new reply), "leaving"


class RemoteTalk:
    """One stretch of talk mode over a realtime session (see the module docstring)."""

    def __init__(self, repl: Any, options: Any, session: Any, *, listener: Callable[..., Any] | None = None,
                 stop: threading.Event | None = None, stdin: bool = True) -> None:
        self.repl = repl
        self.watch_stdin = stdin  # Enter on fd 0 leaves talk mode (False: only `stop` does; tests)
        self.options = options  # audio/listener.ListenOptions
        self.session = session  # api/realtime_client.RealtimeSession, connected
        if listener is None:
            from ...audio.listener import Listener

            listener = Listener
        self._make_listener = listener
        self.stop = stop if stop is not None else threading.Event()
        self.meter = TalkMeter(repl.err, interactive=isatty(repl.err.file) and not repl.piped)
        self.figures: list[ReplyFigures] = []  # every reply of this stretch, timed
        self.replies: list[RemoteReply] = []
        self.truncates: list[tuple[str, int]] = []  # (item_id, audio_end_ms) sent
        self.listener: Any = None
        self.sent = 0  # samples (24 kHz) sent
        self._pending: list = []  # resampled audio not sent yet (under SEND_SAMPLES)
        self._resampler: Any = None
        self._kept: collections.deque = collections.deque()  # (first sample, block) of the audio sent
        self._kept_lock = threading.Lock()
        self.configured = False  # configure() was done (run() does it otherwise)
        self._reply: RemoteReply | None = None
        self._speech_from: float | None = None  # the server's audio_start_ms of the speech now heard
        self._clip: AudioClip | None = None  # the last turn, for the reply that answers it
        self._turn_ended: float | None = None
        # Speakers: the listener's barge-in judge decides what of the microphone the server hears while a
        # reply plays (audio/gate.py says why). Not the server's VAD made stricter by session.update
        # while a reply plays: it still hears only the cleaned signal, so residue and the user look alike
        # to it (this side also has the microphone before cancelling), omni-serve's threshold is one of
        # WebRTC's four modes and a changed turn_detection restarts its detector, and the update would
        # race the reply's first sound. Headphones: no echo, nothing gated (the server's VAD barges in).
        hold = (options.barge_in_ms + GATE_PRE_ROLL_MS + HOLD_SLACK_MS) / 1000
        self._gate = EchoGate(RATE, hold, GATE_PRE_ROLL_MS / 1000) if options.echo != "off" else None
        self._heard_over: RemoteReply | None = None  # the reply the judge heard the user over (its thread)

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        """Until Enter (a line on stdin), or its end; errors propagate (one line, by the REPL)."""
        repl = self.repl
        done = threading.Event()
        watcher = None
        try:
            if not self.configured:
                self.configure()
            self.listener = self._make_listener(self.options, on_level=self.meter.level, find_turns=False,
                                                on_audio=self._send_audio)
            self.listener.on_barge_in = self._heard_over_reply
            self.listener.start()
            watcher = stdin_stop(self.stop, done) if self.watch_stdin and not stdin_closed() else None
            repl.say("talk mode (the server's realtime session): speak; Enter leaves it"
                     + (" (headphones: no echo cancelling)" if self.options.echo == "off" else ""))
            self.meter.set(LISTENING)
            while not self.stop.is_set():
                self.listener.check()  # what failed on the microphone's thread (a lost connection too)
                event = self.session.receive(POLL_SECONDS)
                self._cut_if_heard()  # first: the server's speech_started for the speech let through may be this event
                if event is not None:
                    self._on_event(event)
                self._played_out()
        finally:
            done.set()
            if self.listener is not None:
                self.listener.close()
            try:
                self._played_out()  # a reply that had just played out is whole, not cut
                reply = self._reply
                if reply is not None and not reply.cut:
                    self._cut(reply, "leaving")  # Enter during a reply: it stops as for speech
            finally:
                self._reply = None
                self.session.close()
                self.meter.clear()
                if watcher is not None:
                    watcher.join(timeout=1.0)
        repl.say("talk mode ended")

    def configure(self) -> None:
        """The session's turn detection, voice and instructions; the chat's earlier turns as its items.
        A `ServerError` if the server refuses them (a /v1/realtime of another shape)."""
        repl = self.repl
        detection = {"type": "server_vad", "silence_duration_ms": int(self.options.end_silence_ms),
                     "interrupt_response": True, "create_response": True}
        history = repl.chat.history
        self.session.update(voice=None if repl.muted else repl.options.voice,
                            instructions=history.system or None, turn_detection=detection,
                            text_only=bool(repl.muted))
        for turn in history.turns:
            if turn["role"] == "assistant":
                self.session.send({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": turn["content"]}]}})
                continue
            parts: list[dict] = [{"type": "input_audio", "audio": _b64_at_rate(clip)}
                                 for clip in turn.get("media", {}).get("audio", [])]
            if turn["content"]:
                parts.append({"type": "input_text", "text": turn["content"]})
            if parts:
                self.session.send({"type": "conversation.item.create",
                                   "item": {"type": "message", "role": "user", "content": parts}})
        self.configured = True

    # -- the microphone's thread -------------------------------------------------------------------
    def _send_audio(self, block: np.ndarray) -> None:
        """A cleaned block at the listener's rate: resampled to 24 kHz, through the echo gate (speakers),
        sent in blocks of 20 ms or more."""
        import numpy as np

        rate = self.listener.rate if self.listener is not None else self.options.sample_rate
        if rate != RATE:
            if self._resampler is None:
                import soxr

                self._resampler = soxr.ResampleStream(rate, RATE, 1, dtype="float32")
            block = self._resampler.resample_chunk(np.asarray(block, np.float32))
        block = np.asarray(block, np.float32)
        self._send(self._gate.push(block) if self._gate is not None else [block])

    def _heard_over_reply(self) -> None:
        """The listener's judge heard the user over a reply (its thread; the block that decided it has gone
        through the gate): the held speech goes out from its start, so the server's VAD hears all of it
        and cuts the reply itself, and the main thread cuts it here at its next look (within POLL_SECONDS),
        not waiting for the server's speech_started. Stopping here risks little more than a false
        judgement already costs: the audio let through (--barge-in-ms of voiced frames) is what the
        server's VAD, less strict, cuts a reply for anyway. Should it not, the reply stays cut here all
        the same (its later deltas are dropped, the truncate keeps the server's history to what was heard)
        and the server finishes it unheard."""
        heard = self.listener.barge_in_after
        if self._gate is not None:
            self._gate.open(heard[-1] if heard else 0.0)
            self._send(self._gate.flush())
        self._heard_over = self._reply

    def _send(self, blocks: list[np.ndarray]) -> None:
        """Onto the session, in messages of SEND_SAMPLES or more; what is sent is kept for the turns' clips."""
        import numpy as np

        self._pending.extend(blocks)
        if sum(b.shape[0] for b in self._pending) < SEND_SAMPLES:
            return
        pcm = np.concatenate(self._pending)
        self._pending = []
        with self._kept_lock:
            self._kept.append((self.sent, pcm))
            while self._kept and self.sent - self._kept[0][0] > KEEP_SECONDS * RATE:
                self._kept.popleft()
            self.sent += pcm.shape[0]
        self.session.append(pcm)

    def _clip_of(self, start_ms: float | None, end_ms: float) -> AudioClip | None:
        """The audio sent from `start_ms` (less the pre-roll) to `end_ms` (plus a tail), as a clip."""
        import numpy as np

        lo = max(0, round(((start_ms if start_ms is not None else end_ms - 1000) - PRE_ROLL_MS) * RATE / 1000))
        hi = round((end_ms + TAIL_MS) * RATE / 1000)
        with self._kept_lock:
            parts = [b[max(0, lo - at):max(0, hi - at)] for at, b in self._kept if at < hi and at + b.shape[0] > lo]
        if not parts:
            return None
        pcm = np.concatenate(parts).astype(np.float32)
        return AudioClip(pcm=pcm, sample_rate=RATE, source="microphone", ended_by="silence",
                         recorded_seconds=pcm.shape[0] / RATE,
                         speech_end=max(0.0, min(pcm.shape[0] / RATE, (end_ms * RATE / 1000 - lo) / RATE)))

    # -- the server's events -----------------------------------------------------------------------
    def _on_event(self, event: Event) -> None:
        kind, data = event.type, event.data
        reply = self._reply
        if kind == "input_audio_buffer.speech_started":
            self._speech_from = data.get("audio_start_ms")
            if reply is not None and not reply.cut:
                self._cut(reply, "server")
            self.meter.set(LISTENING)
        elif kind == "input_audio_buffer.speech_stopped":
            self._turn_ended = time.perf_counter()
            self._clip = self._clip_of(self._speech_from, float(data.get("audio_end_ms") or 0))
            self._speech_from = None
            self.meter.set(THINKING)
        elif kind == "response.created":
            if reply is not None and not reply.cut:  # an earlier one still playing out: the new one takes over
                self._cut(reply, "next")
            response_id = str((data.get("response") or {}).get("id", ""))
            figures = ReplyFigures(turn_ended=self._turn_ended)
            self._reply = RemoteReply(response_id, figures, clip=self._clip)
            self._clip = None
            self.figures.append(figures)
            self.replies.append(self._reply)
            self._open_speaker(self._reply)
            self.meter.set(THINKING)
        elif reply is None or _response_of(data) not in (None, reply.response_id):
            if kind == "error":
                self.repl.error(ServerError((data.get("error") or {}).get("message") or "the server refused it"))
        elif kind == "response.output_item.added":
            reply.item_id = (data.get("item") or {}).get("id") or reply.item_id
        elif event.text is not None and not reply.cut:
            reply.item_id = data.get("item_id") or reply.item_id
            reply.pieces.append(event.text)
            self._on_text(event.text)
        elif kind == "response.output_audio.delta" and not reply.cut:
            reply.item_id = data.get("item_id") or reply.item_id
            self._play(reply, event.audio)
        elif kind == "response.done":
            self._done(reply, data)
        elif kind == "error":
            self.repl.error(ServerError((data.get("error") or {}).get("message") or "the server refused it"))

    def _open_speaker(self, reply: RemoteReply) -> None:
        """The reply's speaker, started as the reply begins (as a local reply's is): its adaptive start
        judges the rate the audio comes at from here, the server's thinking included, so a reply made
        slower than real time is buffered enough to play through."""
        repl = self.repl
        if repl.muted or repl.speaker is None:
            return
        sink = repl.speaker()
        sink.tap = lambda block: self.listener.reference(block, RATE)
        if self._gate is not None:
            self._gate.shut()  # from now on its echo may reach the microphone
        self.listener.reply_started()  # the reply's speaker stream is placed afresh on the microphone's clock
        sink.start(RATE)
        reply.sink = sink

    def _play(self, reply: RemoteReply, pcm: np.ndarray | None) -> None:
        if pcm is None or not pcm.shape[0]:
            return
        reply.made += pcm.shape[0]
        if reply.sink is not None:
            self.meter.set(SPEAKING)
            reply.sink.write(pcm)

    def _done(self, reply: RemoteReply, data: dict) -> None:
        body = data.get("response") or {}
        reply.done, reply.status = True, body.get("status")
        reply.figures.stopped = time.perf_counter()
        if reply.cut:  # speech stopped it: it was kept as heard already
            if self.repl.verbose and reply.cut_at is not None and reply.status == "cancelled":
                since = "this side heard the speech" if reply.cut_by == "here" else "it heard the speech"
                self.repl.say(f"barge-in: the server stopped the reply {ms_after(reply.figures.stopped, reply.cut_at)} ms "
                              f"after {since}")
            self._reply = None
            return
        self.meter.end_text(self.repl.out, bool(reply.pieces))
        if reply.status == "failed":
            message = ((body.get("status_details") or {}).get("error") or {}).get("message")
            self.repl.error(ServerError(message or "the server's reply failed"))
        if reply.sink is not None:
            reply.sink.close(wait=False)  # it plays out; speech may still stop it
        self._played_out()

    def _played_out(self) -> None:
        """A reply whose response is done and whose speaker has played it all ends here."""
        reply = self._reply
        if reply is None or reply.cut or not reply.done:
            return
        sink = reply.sink
        if sink is not None and not sink.finished.is_set():
            return
        self._reply = None
        figures = reply.figures
        if sink is not None:
            sink.close()  # played out already: this closes the stream (and raises what the device said)
            self.listener.reply_ended()
            if self._gate is not None:
                # Nobody spoke over it: what is held goes out as silence (the local rule: a stretch begun
                # during a reply that never reached --barge-in-ms is dropped).
                self._gate.open()
            figures.first_sound = sink.first_sound_time
            figures.played = sink.played / RATE
        figures.made = reply.made / RATE
        figures.text = figures.kept = "".join(reply.pieces)
        if reply.status in ("completed", "incomplete"):
            keep_turn(self.repl, reply.clip, figures.kept)
            if self.repl.verbose and figures.first_sound is not None and figures.turn_ended is not None:
                gaps = f"; {sink.underruns} gaps in its sound" if sink is not None and sink.underruns else ""
                self.repl.say(f"first sound {ms_after(figures.first_sound, figures.turn_ended)} ms after the turn "
                              f"ended{gaps}")
        self.meter.set(LISTENING)

    # -- barge-in ----------------------------------------------------------------------------------
    def _cut_if_heard(self) -> None:
        """The judge heard the user over the reply playing now (`_heard_over_reply`): cut it here."""
        reply, self._heard_over = self._heard_over, None
        if reply is not None and reply is self._reply and not reply.cut:
            self._cut(reply, "here")

    def _cut(self, reply: RemoteReply, by: str) -> None:
        """Speech (this side's judge's, or the server's), a new reply, or Enter over a reply: the sound
        off now, the server told what was heard of it."""
        leaving = by == "leaving"
        figures = reply.figures
        judged = self.listener.barge_ins[-1:] if by == "here" else []  # when the judge heard it (its thread)
        reply.cut, reply.cut_at, reply.cut_by = True, judged[0] if judged else time.perf_counter(), by
        figures.barge_in = reply.cut_at
        sink = reply.sink
        if sink is not None:
            sink.abort()
            self.listener.reply_ended()
        if self._gate is not None:
            # The server heard speech (in audio sent before the gate shut): the user is speaking, so what
            # is held goes as it is. Otherwise as silence (after the judge's cut the gate is open already).
            self._gate.open(self._gate.most / RATE if by == "server" else 0.0)
        figures.silenced = time.perf_counter()
        figures.played = (sink.played / RATE) if sink is not None else 0.0
        figures.made = reply.made / RATE
        figures.first_sound = sink.first_sound_time if sink is not None else None
        figures.text = "".join(reply.pieces)
        if reply.item_id is not None and not self.repl.muted:
            end_ms = round(figures.played * 1000)
            self.truncates.append((reply.item_id, end_ms))
            try:
                self.session.truncate(reply.item_id, end_ms)
            except ServerError:
                if not leaving:
                    raise
        if reply.done:
            self._reply = None  # the server had finished it: only the playing is stopped
        self.meter.end_text(self.repl.out, bool(reply.pieces) and not reply.done)
        figures.kept = figures.text if self.repl.muted else heard_text(
            reply.pieces, figures.played, figures.made, self.repl._steps[1])
        keep_turn(self.repl, reply.clip, figures.kept)
        repl = self.repl
        repl.say(interrupted_line(figures))
        if repl.verbose and by in ("here", "server"):
            heard = self.listener.barge_in_after[-1:] if by == "here" else []
            repl.say(f"barge-in: sound off {ms_after(figures.silenced, figures.barge_in)} ms after "
                     + ("this side heard the speech" if by == "here" else "the server heard the speech")
                     + (f" ({heard[0] * 1000:.0f} ms of the microphone's audio from its start)" if heard else ""))

    # -- the screen --------------------------------------------------------------------------------
    def _on_text(self, piece: str) -> None:
        self.meter.begin_text()
        self.repl._show(shown(piece, self.repl.out.file))


def _response_of(data: dict) -> str | None:
    """The response an event belongs to (None: it names none)."""
    value = data.get("response_id") or (data.get("response") or {}).get("id")
    return str(value) if value else None


def _b64_at_rate(clip: AudioClip) -> str:
    """A clip as the API's base64 PCM16 at 24 kHz."""
    from ...audio.format import pcm16

    return base64.b64encode(pcm16(clip.at(RATE).pcm)).decode("ascii")
