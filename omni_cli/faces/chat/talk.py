"""omni-chat's talk mode (`--talk`, `/talk`): a spoken conversation with no key pressed, and barge-in.

`TalkMode(repl, options).run()` opens the microphone once (audio/listener.py: echo cancelled, VAD,
turns) and loops: listening -> the user's turn ends by voice activity -> the reply (its text on
screen, its speech on the speaker, whose played signal is the echo canceller's reference) ->
listening again. A line on stdin (Enter) leaves talk mode; a reply running then is stopped.

Barge-in: speech heard while a reply runs (at least `barge_in_ms` voiced) calls `_barge_in` on the
listener's thread, which does what Ctrl-C does in `ChatRepl.turn`: the speaker is aborted (the sound
stops at once) and the reply is stopped (`assistant.interrupt()`, from another thread: the stream
raises at the consumer's next wait; its `close()` then stops the engine's threads). The reply is kept,
cut to what was heard (`heard_text`), in the conversation and the transcript, and the speech
that interrupted it becomes the next turn as soon as it ends.

The cut text is omni_cli/heard.py's rule (the one the realtime server's truncate uses too): the
played share of the reply's text pieces, at most one per talker step played, whole words only.
`played` is what the speaker handed to the device when it was aborted (heard up to the device's
buffer later).

The source of replies is the assistant's declared interface (local, or `--server` over HTTP): it
knows no engine and no model. `stdin_stop()` watches fd 0 for a line without reading past it, so
a piped script's later lines are left for the REPL.
"""

from __future__ import annotations

import os
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ...errors import OmniError
from ...heard import heard_text
from ..console import isatty, shown

# States the meter shows.
LISTENING, THINKING, SPEAKING = "listening", "thinking", "speaking"


@dataclass
class ReplyFigures:
    """One reply of talk mode, timed (perf_counter seconds; None where it did not happen)."""

    turn_ended: float | None = None  # the user's turn was ended by the VAD
    first_sound: float | None = None  # the speaker played the reply's first sample
    barge_in: float | None = None  # the listener heard enough speech to interrupt
    silenced: float | None = None  # the speaker was aborted (its sound off)
    stopped: float | None = None  # the reply's stream had ended (generation stopped)
    played: float = 0.0  # seconds of the reply's audio handed to the device
    made: float = 0.0  # seconds of its audio made
    text: str = ""  # all the text made
    kept: str = ""  # the text kept in the conversation (the cut one after a barge-in)
    extra: dict = field(default_factory=dict)


def stdin_stop(stop: threading.Event, done: threading.Event) -> threading.Thread:
    """A thread that sets `stop` at a line (or the end) on fd 0, reading byte by byte up to its newline
    only; it ends when `done` is set. Nothing is read past that line."""

    def watch() -> None:
        while not done.is_set():
            try:
                ready, _, _ = select.select([0], [], [], 0.05)
            except (OSError, ValueError):
                return
            if not ready:
                continue
            while True:
                byte = os.read(0, 1)
                if not byte or byte == b"\n":
                    stop.set()
                    return

    thread = threading.Thread(target=watch, name="omni-talk-stdin", daemon=True)
    thread.start()
    return thread


class TalkMeter:
    """The live line on stderr in talk mode: the state and the microphone's level, redrawn in place on
    a terminal; state changes only (one dim line each) into a pipe, where a redrawn line is noise."""

    WIDTH = 20

    def __init__(self, err: Any, interactive: bool) -> None:
        self.err = err
        self.interactive = interactive
        self.state = LISTENING
        self.hold = False  # a reply's text is being written: no redrawing over it
        self._drawn = False
        self._last = 0.0

    def begin_text(self) -> None:
        """A piece of a reply's text is about to be written: the live line cleared once and held."""
        if not self.hold:
            self.clear()
            self.hold = True
        self.set(SPEAKING)

    def end_text(self, out: Any, printed: bool) -> None:
        """The reply's text has ended: its line closed on `out` (once, if any was written), redrawing on."""
        if printed and self.hold:
            out.print()
        self.hold = False

    def set(self, state: str) -> None:
        if state == self.state:
            return
        self.state = state
        if not self.interactive:
            self.err.print(f"[dim]{state}[/dim]")

    def level(self, dbfs: float) -> None:
        """The listener's level (its thread): redrawn at most 20 times a second."""
        now = time.perf_counter()
        if not self.interactive or self.hold or now - self._last < 0.05:
            return
        self._last = now
        filled = max(0, min(self.WIDTH, round((dbfs + 60) / 60 * self.WIDTH)))
        self.err.file.write(f"\r  {self.state:<9} [{'#' * filled}{' ' * (self.WIDTH - filled)}] ")
        self.err.file.flush()
        self._drawn = True

    def clear(self) -> None:
        if self._drawn:
            self.err.file.write("\r" + " " * (self.WIDTH + 16) + "\r")
            self.err.file.flush()
            self._drawn = False


class TalkMode:
    """One stretch of talk mode over a `ChatRepl` (its conversation, options, speaker, transcript)."""

    def __init__(self, repl: Any, options: Any, *, listener: Callable[..., Any] | None = None,
                 stop: threading.Event | None = None) -> None:
        from ...audio.listener import Listener

        self.repl = repl
        self.options = options  # audio/listener.ListenOptions
        self._make_listener = listener or Listener
        self.stop = stop if stop is not None else threading.Event()
        self.meter = TalkMeter(repl.err, interactive=isatty(repl.err.file) and not repl.piped)
        # Every reply of this stretch, timed (the tests and --verbose read them).
        self.figures: list[ReplyFigures] = []
        self.listener: Any = None

    def run(self) -> None:
        """Until Enter (a line on stdin), or its end; errors propagate (one line, by the REPL)."""
        repl = self.repl
        self.listener = self._make_listener(self.options, on_level=self.meter.level)
        done = threading.Event()
        self.listener.start()
        watcher = stdin_stop(self.stop, done) if not stdin_closed() else None
        repl.say("talk mode: speak; Enter leaves it" + (" (headphones: no echo cancelling)"
                                                         if self.options.echo == "off" else ""))
        try:
            clip = None
            while not self.stop.is_set():
                if clip is None:
                    self.meter.set(LISTENING)
                    clip = self.listener.next_turn(self.stop)
                    if clip is None:
                        break
                clip = self.reply(clip)
        finally:
            done.set()
            self.listener.close()
            self.meter.clear()
            if watcher is not None:
                watcher.join(timeout=1.0)
        repl.say("talk mode ended")

    # -- one reply ---------------------------------------------------------------------------------
    def reply(self, clip: Any) -> Any:
        """Answer `clip`; the clip of the speech that interrupted the answer (the next turn), or None."""
        repl, listener = self.repl, self.listener
        figures = ReplyFigures(turn_ended=time.perf_counter())
        self.figures.append(figures)
        sink = repl.speaker() if not repl.muted and repl.speaker is not None else None
        barged, handled = threading.Event(), threading.Event()

        def barge_in() -> None:  # the listener's thread, as a Ctrl-C handler: sound off, generation off
            if barged.is_set():
                return
            figures.barge_in = time.perf_counter()
            barged.set()
            try:
                if sink is not None:
                    sink.abort()
                figures.silenced = time.perf_counter()
                repl.assistant.interrupt()
            finally:
                handled.set()

        if sink is not None:
            rate = repl.assistant.sample_rate
            sink.tap = lambda block: listener.reference(block, rate)
        listener.on_barge_in = barge_in
        listener.reply_started()
        self.meter.set(THINKING)
        pieces: list[str] = []
        reply = None
        error: BaseException | None = None
        try:
            reply = self._stream(clip, sink, pieces, barged, barge_in)
        except Exception as exc:  # noqa: BLE001 - after a barge-in, the stream's end is expected
            if not barged.is_set():
                error = exc
        finally:
            figures.stopped = time.perf_counter()
            listener.reply_ended()
            if sink is not None:
                sink.abort()  # a no-op after a normal close
            self.meter.end_text(self.repl.out, bool(pieces))
        if barged.is_set():
            handled.wait(timeout=2.0)  # the speaker's abort may still be under way on the listener's thread
        if sink is not None:
            figures.first_sound = sink.first_sound_time
            figures.played = sink.played / max(1, sink.sample_rate or 1)
            figures.made = sink.samples / max(1, sink.sample_rate or 1)
        figures.text = "".join(pieces)
        if error is not None:
            repl.error(error)
            return None
        if barged.is_set() or self.stop.is_set():
            self._keep_cut(clip, figures, pieces)
            if barged.is_set():
                return listener.next_turn(self.stop)
            return None
        if reply is None:
            repl.error(OmniError("the reply ended without its end (no Done event)"))
            return None
        figures.kept = reply.text
        if repl.verbose and figures.first_sound is not None and figures.turn_ended is not None:
            repl.say(f"first sound {ms_after(figures.first_sound, figures.turn_ended)} ms after the turn ended")
        repl.attached.append(clip)
        repl._record("", reply, sink, dict(reply.stats))
        return None

    def _stream(self, clip: Any, sink: Any, pieces: list[str], barged: threading.Event,
                barge_in: Callable[[], None]) -> Any:
        """The reply's events: its text shown and kept piece by piece; its Reply, or None when cut."""
        from ...runtime.events import Done, TextDelta

        repl = self.repl
        events = repl.chat.stream("", repl.options, sink=sink, text_only=repl.muted or sink is None, audio=[clip])
        reply = None
        try:
            for event in events:
                if self.stop.is_set():
                    barge_in()  # Enter leaves talk mode: the reply stops as for speech
                if barged.is_set():
                    break
                if isinstance(event, TextDelta):
                    pieces.append(event.text)
                    self._on_text(event.text)
                elif isinstance(event, Done):
                    reply = event.reply
        finally:
            events.close()  # a cut reply: this stops the engine's threads (as after Ctrl-C)
        return None if barged.is_set() else reply

    def _on_text(self, piece: str) -> None:
        self.meter.begin_text()
        self.repl._show(shown(piece, self.repl.out.file))

    def _keep_cut(self, clip: Any, figures: ReplyFigures, pieces: list[str]) -> None:
        """A reply cut short: what was heard of it goes into the conversation and the transcript."""
        repl = self.repl
        figures.kept = heard_text(pieces, figures.played, figures.made, repl._steps[1])
        keep_turn(repl, clip, figures.kept)
        repl.say(interrupted_line(figures))
        if repl.verbose and figures.barge_in is not None:
            heard = self.listener.barge_in_after[-1:] if self.listener is not None else []
            repl.say(f"barge-in: sound off {ms_after(figures.silenced, figures.barge_in)} ms, reply stopped "
                     f"{ms_after(figures.stopped, figures.barge_in)} ms after the speech was long enough"
                     + (f" ({heard[0] * 1000:.0f} ms of the microphone's audio from its start)" if heard else ""))


def keep_turn(repl: Any, clip: Any, kept: str) -> None:
    """A spoken turn (its clip, None if there is none) and the reply's text kept (whole, or cut to what was
    heard) into the chat's conversation and transcript: both talk modes' record of a turn."""
    clips = [clip] if clip is not None else []
    repl.chat.history.add("", kept, {"audio": clips})
    if clips:
        repl.attachments.append({"turn": len(repl.transcript), "clips": clips, "images": []})
    repl.transcript.append({"role": "user", "content": ""})
    repl.transcript.append({"role": "assistant", "content": kept})
    repl.replies += 1


def interrupted_line(figures: ReplyFigures) -> str:
    """What a cut reply says: how much of its text and its sound was kept."""
    return (f"interrupted: kept {len(figures.kept.split())} of {len(figures.text.split())} words "
            f"({figures.played:.1f} of {figures.made:.1f} s heard)")


def ms_after(later: float | None, earlier: float) -> str:
    """Milliseconds from `earlier` to `later` (perf_counter seconds), as shown; "?" when it did not happen."""
    return "?" if later is None else f"{(later - earlier) * 1000:.0f}"


def stdin_closed() -> bool:
    """Whether fd 0 is closed (then there is no Enter to watch for)."""
    try:
        os.fstat(0)
    except OSError:
        return True
    return False
