"""omni-chat's read-eval-print loop: turns, multi-line input, Ctrl-C and Ctrl-D.

`ChatRepl(assistant, ...)` holds one session: the conversation (`assistant.conversation()`), the
reply options (voice, sampling, limits: /voice and /set change them), mute, the transcript and the
speech of every reply (for `/save`; `/load` and `load_transcript` resume a saved one), and the last
reply's timing (for `/stats`). `run(read)` loops until `/bye` or end of input and returns the exit
code; `read(prompt)` is a prompt_toolkit session's `prompt` on a terminal, or `line_reader()` on a
pipe, so the same loop is driven by a person, by a script, and by the tests. The slash commands are
in `commands.py`, saving and resuming in `transcript.py`.

Exit codes: a person at a terminal sees each error and carries on, so the session ends with 0. A
script cannot see them, so when the input is piped (`piped=True`) a failed command or turn makes the
exit code non-zero once the input ends: 2 if every failure was a usage error (unknown command, bad
value, unknown voice, a file that is not a transcript), else 1 (a file that could not be written, a
reply that failed). The session still goes on to the next line either way. Input that is not UTF-8
ends a piped session at once with a UsageError: the lines after it cannot be trusted to be what the
script meant.

A reply's text streams to the `out` console while its speech plays through a `SpeakerSink` (one per
turn). Ctrl-C during a reply aborts the sink at once (the sound stops), closes the reply's event
stream (the engine's threads stop) and comes back to the prompt with the conversation as it was
before that turn. Ctrl-C during a slash command that blocks (a /load or /save of a slow file) stops
it and comes back to the prompt with the session as it was before the command. Errors a person can
act on are one line and the session goes on. What the model, a server or a file says is written with
console.shown / print_text: escaped on a terminal, as it is into a pipe.

What differs between model families (the voices and the default one, the default system prompt,
whether the talker's steps are codes or frames and how many make a second, the sample rate) is read
from the assistant, never assumed. It knows nothing of typer or of how the model is loaded (main.py
does both), nor of the engine's inside.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ...config import ReplyOptions
from ...errors import OmniError, UsageError, known_failure
from ...prompt import check_text
from ..console import StreamWrapper, isatty, print_text, shown, terminal_width
from ..program import InterruptTimes, Terminated, stop_on_interrupt
from ..timing import AudioClock, print_memory, print_timing, speech_steps
from .commands import Commands
from .transcript import Transcripts

PROMPT = ">>> "


CONTINUATION = "... "


MULTILINE = '"""'


# After "cannot play audio: ..." in omni-chat.
CHAT_PLAY_HINT = "to chat in text only, start omni-chat with --mute"



class ChatRepl(Commands, Transcripts):
    def __init__(
        self,
        assistant: Any,
        out: Any,
        err: Any,
        *,
        options: ReplyOptions | None = None,
        muted: bool = False,
        system: str | None = None,
        speaker: Callable[[], Any] | None = None,
        verbose: bool = False,
        debug: bool = False,
        piped: bool | None = None,
        wrap: int | bool | None = None,
        record: Any = None,
        listen: Any = None,
    ) -> None:
        """
        out, err: rich consoles (the answer; everything else).
        options: what each reply is asked for (voice, sampling, limits); /voice and /set change it.
        speaker: makes the sink for one reply's sound (a SpeakerSink); None = nothing to play on.
        piped: the input is a script, not a person: failed commands and turns make `run`'s exit code
            non-zero. None = when sys.stdin is not a terminal.
        wrap: word wrap of the reply's text: None = at the terminal's width when `out` writes to a
            terminal (looked up at each reply, so a resized window is followed), not at all into a pipe
            or a file; an int = at that width; False = never.
        """
        self.assistant = assistant
        self.out = out
        self.err = err
        self.chat = assistant.conversation(system)
        options = options or ReplyOptions()
        if options.voice is None and assistant.has_audio:
            options = replace(options, voice=assistant.default_voice)
        self.options = options
        self.muted = muted or not assistant.has_audio
        self.speaker = speaker
        self.verbose = verbose
        self.debug = debug
        self.piped = (not isatty(sys.stdin)) if piped is None else bool(piped)
        self.wrap = wrap
        # The exit code of each failure (command or turn) so far; what run() ends with when piped.
        self.failures: list[int] = []
        # The file the conversation was resumed from (/load, --load), for /show.
        self.loaded_from: Path | None = None
        # Every message of the session (the model's history may drop old turns; this never does).
        self.transcript: list[dict] = []
        # Audio clips for the next message (/audio), and what went with earlier ones (transcript index of
        # the user message, the clips' sources), for /save.
        self.attached: list = []
        self.shown: list[tuple[str, Any]] = []  # images for the next message (/image): (path, image)
        self.attachments: list[dict] = []
        # /listen's microphone settings (audio/microphone.RecordOptions; None: the defaults).
        self.record_options = record
        # Talk mode's listening settings (audio/listener.ListenOptions; None: the defaults), and the last
        # stretch of talk mode (faces/chat/talk.TalkMode: its figures), once there was one.
        self.listen_options = listen
        self.talk = None
        # (index in transcript of the reply, float32 audio) for each spoken reply.
        self.speech: list[tuple[int, Any]] = []
        self.last_stats: dict | None = None
        self.last_playback: dict | None = None
        self.replies = 0
        self.underruns = 0
        # One dict per interrupted reply: seconds from Ctrl-C to silence and to the prompt.
        self.interrupts: list[dict] = []
        # What the model's talker steps are called and how many make a second ("codes", 50.0;
        # "frames", 12.5), for /set, /show and the timing block.
        self._steps = speech_steps(assistant)

    # -- the loop --------------------------------------------------------------------------------
    def run(self, read: Callable[[str], str]) -> int:
        """Read, answer, repeat; the exit code once the user leaves (see the module's docstring).

        A UsageError from `read` (input that is not UTF-8) ends the loop: it propagates."""
        while True:
            try:
                text = self.read_message(read)
            except Terminated:
                raise  # SIGTERM / SIGHUP: the program ends (cli.py gives exit 128+N)
            except KeyboardInterrupt:
                self.err.print("[dim]Use Ctrl-D or /bye to leave.[/dim]")
                continue
            except EOFError:
                return self.exit_code()
            if text is None or not text.strip():
                continue
            if text.lstrip().startswith("/"):
                if self.command(text.strip()) == "bye":
                    return self.exit_code()
                continue
            self.turn(text)

    def exit_code(self) -> int:
        """0 at a terminal; when piped, 0 if nothing failed, 2 if every failure was a usage error, else 1."""
        if not self.piped or not self.failures:
            return 0
        return 2 if all(code == 2 for code in self.failures) else 1

    def read_message(self, read: Callable[[str], str]) -> str | None:
        """One message: a line, or a block between two \"\"\" lines (None if Ctrl-C cancelled the block)."""
        line = read(PROMPT)
        stripped = line.strip()
        if not stripped.startswith(MULTILINE):
            return line
        body = stripped[len(MULTILINE):]
        if len(body) >= len(MULTILINE) and body.endswith(MULTILINE):  # """on one line"""
            return body[: -len(MULTILINE)]
        lines = [body] if body else []
        while True:
            try:
                line = read(CONTINUATION)
            except Terminated:
                raise
            except KeyboardInterrupt:
                return None
            except EOFError:
                # Leaving inside a block: say that its text was not sent rather than drop it unseen.
                self.error(UsageError(f'the input ended inside a {MULTILINE} block: that message was not sent '
                                      f'(end it with a line that ends with {MULTILINE})'))
                raise
            if line.rstrip().endswith(MULTILINE):
                last = line.rstrip()[: -len(MULTILINE)]
                if last:
                    lines.append(last)
                return "\n".join(lines)
            lines.append(line)

    # -- one reply -------------------------------------------------------------------------------
    def turn(self, text: str) -> None:
        from ...runtime.events import AudioBlock, Done, TextDelta

        sink = None
        times = InterruptTimes()
        printed = False
        reply = None
        clock = AudioClock()
        wrapper = self._wrapper()
        try:
            check_text(text)  # before a sound device opens for nothing; the API checks it again
            if not self.muted and self.speaker is not None:
                sink = self.speaker()
            with stop_on_interrupt(sink, times=times):
                extra = {"audio": list(self.attached)} if self.attached else {}
                if self.shown:
                    extra["images"] = [image for _name, image in self.shown]
                events = self.chat.stream(text, self.options, sink=sink, text_only=self.muted or sink is None, **extra)
                try:
                    for event in events:
                        if isinstance(event, TextDelta):
                            piece = shown(event.text, self.out.file)  # before the wrapper counts its cells
                            self._show(wrapper.feed(piece) if wrapper else piece)
                            printed = True
                        elif isinstance(event, AudioBlock):
                            clock.tick()
                        elif isinstance(event, Done):
                            reply = event.reply
                finally:
                    events.close()  # an interrupted reply: this stops the engine's threads
        except Terminated:
            raise  # the sink is aborted below; the program ends
        except KeyboardInterrupt:
            back = time.perf_counter()
            self._end_reply(wrapper, printed)
            self._interrupted(times, back)
            return
        except Exception as exc:  # noqa: BLE001 - an OmniError, or a bug: say so, keep the session
            self._end_reply(wrapper, printed)
            self.error(exc)
            return
        finally:
            if sink is not None:
                sink.abort()  # a no-op after a normal close(); silence after anything else
        self._end_reply(wrapper, True)
        if reply is None:  # a stream ends with Done, or raises: anything else is a bug of the assistant's
            self.error(OmniError("the reply ended without its end (no Done event)"))
            return
        self._record(text, reply, sink, clock.stats(reply.stats))

    def _wrapper(self) -> StreamWrapper | None:
        if self.wrap is False:
            return None
        width = self.wrap if isinstance(self.wrap, int) and self.wrap is not True else terminal_width(self.out.file)
        return StreamWrapper(width) if width else None

    def _show(self, text: str) -> None:
        """A piece of the reply, written as it is (shown safely already, on a terminal): rich would drop
        BEL, BS and CR even into a pipe, where the text must stay as the model made it."""
        if text:
            file = self.out.file
            file.write(text)
            file.flush()

    def _end_reply(self, wrapper: StreamWrapper | None, printed: bool) -> None:
        """The word the wrapper still holds (also of a stopped reply: it was generated), then the line's end."""
        if wrapper is not None:
            self._show(wrapper.end())
        if printed:
            self.out.print()

    def _interrupted(self, times: InterruptTimes, back: float) -> None:
        record = {}
        if times.signal_at is not None:
            record = {"to_silence": (times.silenced_at or back) - times.signal_at, "to_prompt": back - times.signal_at}
            self.interrupts.append(record)
        if self.verbose and record:
            self.err.print(f"[dim]interrupted: silent after {record['to_silence'] * 1000:.0f} ms, "
                           f"back at the prompt after {record['to_prompt'] * 1000:.0f} ms[/dim]")
        else:
            self.err.print("[dim]interrupted[/dim]")

    def _record(self, text: str, reply: Any, sink: Any, stats: dict) -> None:
        if self.attached or self.shown:  # they went with this message: the transcript names them
            self.attachments.append({"turn": len(self.transcript), "clips": list(self.attached),
                                     "images": [name for name, _image in self.shown]})
            self.attached.clear()
            self.shown.clear()
        self.transcript.append({"role": "user", "content": text})
        self.transcript.append({"role": "assistant", "content": reply.text})
        if reply.audio is not None and len(reply.audio):
            self.speech.append((len(self.transcript) - 1, reply.audio))
        self.replies += 1
        self.last_stats = stats
        self.last_playback = dict(sink.stats) if sink is not None and hasattr(sink, "stats") else None
        if self.last_playback:
            self.underruns += self.last_playback.get("underruns", 0)
        if self.verbose:
            print_timing(self.err, self.last_stats, self.last_playback, unit=self._steps[0])
            print_memory(self.err, self.assistant)

    def error(self, exc: BaseException) -> None:
        exc = known_failure(exc)
        if self.debug:
            print_text(self.err, "".join(traceback.format_exception(exc)), end="")
        detail = " ".join(str(exc).split())
        if isinstance(exc, OmniError):
            message = f"error: {detail}"
            self.failures.append(int(getattr(exc, "exit_code", 1)))
        else:
            message = f"error: internal error: {type(exc).__name__}: {detail}"
            self.failures.append(1)
        print_text(self.err, message, style="red")

    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        name, arg = name.lower(), arg.strip()
        handlers = {
            "/help": self.cmd_help, "/?": self.cmd_help,
            "/bye": None, "/exit": None,
            "/clear": self.cmd_clear,
            "/voice": self.cmd_voice,
            "/mute": self.cmd_mute, "/unmute": self.cmd_unmute,
            "/system": self.cmd_system,
            "/set": self.cmd_set,
            "/show": self.cmd_show,
            "/save": self.cmd_save,
            "/load": self.cmd_load,
            "/stats": self.cmd_stats,
            "/audio": self.cmd_audio,
            "/listen": self.cmd_listen,
            "/talk": self.cmd_talk,
            "/image": self.cmd_image,
        }
        if name not in handlers:
            print_text(self.err, f"error: unknown command '{name}': type /? for help", style="red")
            self.failures.append(UsageError.exit_code)
            return None
        handler = handlers[name]
        if handler is None:
            return "bye"
        before = self._snapshot()
        try:
            handler(arg)
        except Terminated:
            raise
        except KeyboardInterrupt:
            # A command that blocks (/load of a slow file, /save to a slow disk): Ctrl-C stops it and the
            # session goes on with the conversation as it was before the command (not the program's exit).
            self._restore(before)
            self.say(f"interrupted: {name} stopped; the conversation is as it was")
        except Exception as exc:  # noqa: BLE001 - an OmniError, or a bug: one line either way, the session goes on
            self.error(exc)
        return None

    # What a slash command may change, put back whole when it is interrupted halfway.
    _KEPT = ("options", "muted", "loaded_from", "transcript", "attached", "shown", "attachments", "speech")

    def _snapshot(self) -> dict:
        saved = {name: getattr(self, name) for name in self._KEPT}
        saved = {name: list(value) if isinstance(value, list) else value for name, value in saved.items()}
        history = self.chat.history
        return {**saved, "system": history.system, "turns": list(history.turns)}

    def _restore(self, saved: dict) -> None:
        for name in self._KEPT:
            value = saved[name]
            setattr(self, name, list(value) if isinstance(value, list) else value)
        self.chat.history.system = saved["system"]
        self.chat.history.turns[:] = saved["turns"]

    def say(self, message: str) -> None:
        print_text(self.err, message)  # names from a transcript, a server or a path: text, shown safely


def line_reader(stream=None) -> Callable[[str], str]:
    """`read(prompt)` for a pipe: the next line without its newline (no prompt shown); EOFError at the end.

    Bytes are read and decoded as UTF-8 strictly (a byte-order mark at the start is skipped): a line
    that is not UTF-8 raises a UsageError naming the byte and where it is. sys.stdin's own decoding
    would not do: its "surrogateescape" handler (the default under the C and C.UTF-8 locales) passes
    such bytes on as lone surrogates, which the tokenizer rejects with a TypeError."""
    number = 0
    offset = 0  # bytes read before this line, to name the bad byte as omni-say does

    def read(prompt: str) -> str:
        nonlocal number, offset
        source = stream if stream is not None else sys.stdin
        binary = getattr(source, "buffer", source)
        line = binary.readline()
        if not line:
            raise EOFError
        number += 1
        start, offset = offset, offset + len(line)
        if isinstance(line, str):  # a text stream without a buffer (io.StringIO): already decoded
            return line.rstrip("\r\n")
        bom = 3 if number == 1 and line.startswith(b"\xef\xbb\xbf") else 0
        try:
            text = line[bom:].decode("utf-8")
        except UnicodeDecodeError as exc:
            at = bom + exc.start
            raise UsageError(
                f"stdin is not UTF-8 text (byte 0x{line[at]:02x} on line {number}, at offset {start + at}): "
                "convert it first, e.g. iconv -f latin1 -t utf-8"
            ) from None
        return text.rstrip("\r\n")

    return read

