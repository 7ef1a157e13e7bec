"""omni-chat's read-eval-print loop: turns, slash commands, multi-line input, Ctrl-C and Ctrl-D.

`ChatRepl(assistant, ...)` holds one session: the conversation (`assistant.conversation()`), the
voice, mute, the transcript and the speech of every reply (for `/save`), and the last reply's timing
(for `/stats`). `run(read)` loops until `/bye` or end of input and returns the exit code; `read(prompt)`
is a prompt_toolkit session's `prompt` on a terminal, or a line reader on a pipe, so the same loop is
driven by a person, by a script, and by the tests.

A reply's text streams to the `out` console while its speech plays through a `SpeakerSink` (one per
turn). Ctrl-C during a reply aborts the sink at once (the sound stops), closes the reply's event
stream (the engine's threads stop) and comes back to the prompt with the conversation as it was
before that turn. Errors a person can act on are one line and the session goes on.

It knows nothing of typer or of how the model is loaded (cli.py does both), nor of the engine's inside.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from .config import ReplyOptions
from .errors import OmniError, OutputError, UsageError, known_failure
from .ui import InterruptTimes, Terminated, print_timing, stop_on_interrupt

PROMPT = ">>> "
CONTINUATION = "... "
MULTILINE = '"""'

# After "cannot play audio: ..." in omni-chat.
CHAT_PLAY_HINT = "to chat in text only, start omni-chat with --mute"

# Seconds of silence between two replies in the WAV that /save writes.
SAVE_GAP = 0.5

HELP = [
    ("/help, /?", "this help"),
    ("/bye, /exit", "leave (Ctrl-D does too)"),
    ("/clear", "start a new conversation"),
    ("/voice [NAME]", "show the voices, or speak with NAME"),
    ("/mute, /unmute", "text only / speak again"),
    ("/system [TEXT]", "show the system prompt, or set it (/system default restores it)"),
    ("/save PATH", "write PATH.json (the transcript) and PATH.wav (every reply's speech)"),
    ("/stats", "timing of the last reply, totals of the session"),
    ('"""', 'begin and end a multi-line message'),
]


class ChatRepl:
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
    ) -> None:
        """
        out, err: rich consoles (the answer; everything else).
        options: what each reply is asked for (voice, sampling, limits); /voice and /set change it.
        speaker: makes the sink for one reply's sound (a SpeakerSink); None = nothing to play on.
        """
        self.assistant = assistant
        self.out = out
        self.err = err
        self.chat = assistant.conversation(system)
        options = options or ReplyOptions()
        if options.voice is None and assistant.has_audio:
            options = replace(options, voice=getattr(assistant, "default_voice", None) or assistant.voices[0])
        self.options = options
        self.muted = muted or not assistant.has_audio
        self.speaker = speaker
        self.verbose = verbose
        self.debug = debug
        # Every message of the session (the model's history may drop old turns; this never does).
        self.transcript: list[dict] = []
        # (index in transcript of the reply, float32 audio) for each spoken reply.
        self.speech: list[tuple[int, Any]] = []
        self.last_stats: dict | None = None
        self.last_playback: dict | None = None
        self.replies = 0
        self.underruns = 0
        # One dict per interrupted reply: seconds from Ctrl-C to silence and to the prompt.
        self.interrupts: list[dict] = []

    @property
    def voice(self) -> str | None:
        return self.options.voice

    # -- the loop --------------------------------------------------------------------------------
    def run(self, read: Callable[[str], str]) -> int:
        """Read, answer, repeat; the exit code (0) once the user leaves."""
        while True:
            try:
                text = self.read_message(read)
            except Terminated:
                raise  # SIGTERM / SIGHUP: the program ends (cli.py gives exit 128+N)
            except KeyboardInterrupt:
                self.err.print("[dim]Use Ctrl-D or /bye to leave.[/dim]")
                continue
            except EOFError:
                return 0
            if text is None or not text.strip():
                continue
            if text.lstrip().startswith("/"):
                if self.command(text.strip()) == "bye":
                    return 0
                continue
            self.turn(text)

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
            if line.rstrip().endswith(MULTILINE):
                last = line.rstrip()[: -len(MULTILINE)]
                if last:
                    lines.append(last)
                return "\n".join(lines)
            lines.append(line)

    # -- one reply -------------------------------------------------------------------------------
    def turn(self, text: str) -> None:
        from .assistant import AudioBlock, Done, TextDelta
        from .ui import AudioClock

        sink = None
        times = InterruptTimes()
        printed = False
        reply = None
        clock = AudioClock()
        try:
            if not self.muted and self.speaker is not None:
                sink = self.speaker()
            with stop_on_interrupt(sink, times=times):
                events = self.chat.stream(text, self.options, sink=sink, text_only=self.muted or sink is None)
                try:
                    for event in events:
                        if isinstance(event, TextDelta):
                            self.out.print(event.text, end="", markup=False, highlight=False)
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
            if printed:
                self.out.print()
            self._interrupted(times, back)
            return
        except OmniError as exc:
            if printed:
                self.out.print()
            self.error(exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bug: say so, keep the session
            if printed:
                self.out.print()
            self.error(exc)
            return
        finally:
            if sink is not None:
                sink.abort()  # a no-op after a normal close(); silence after anything else
        self.out.print()
        self._record(text, reply, sink, clock.stats(reply.stats))

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
            print_timing(self.err, self.last_stats, self.last_playback)

    def error(self, exc: BaseException) -> None:
        exc = known_failure(exc)
        if self.debug:
            self.err.print("".join(traceback.format_exception(exc)), end="", markup=False, highlight=False)
        detail = " ".join(str(exc).split())
        if isinstance(exc, OmniError):
            message = f"error: {detail}"
        else:
            message = f"error: internal error: {type(exc).__name__}: {detail}"
        self.err.print(message, style="red", markup=False, highlight=False)

    # -- slash commands --------------------------------------------------------------------------
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
            "/save": self.cmd_save,
            "/stats": self.cmd_stats,
        }
        if name not in handlers:
            self.err.print(f"unknown command '{name}': type /? for help", style="yellow", markup=False, highlight=False)
            return None
        handler = handlers[name]
        if handler is None:
            return "bye"
        try:
            handler(arg)
        except OmniError as exc:
            self.error(exc)
        return None

    def say(self, message: str) -> None:
        self.err.print(message, markup=False, highlight=False)

    def cmd_help(self, arg: str) -> None:
        width = max(len(c) for c, _ in HELP)
        for cmd, what in HELP:
            self.say(f"  {cmd.ljust(width)}  {what}")
        self.say("  Ctrl-C stops a reply; Ctrl-D on an empty line leaves.")

    def cmd_clear(self, arg: str) -> None:
        self.chat.clear()
        self.transcript.clear()
        self.speech.clear()
        self.say("new conversation")

    def cmd_voice(self, arg: str) -> None:
        from .loader import check_voice

        voices = list(self.assistant.voices)
        if not arg:
            self.say(f"voice: {self.voice} (voices: {', '.join(voices)})")
            return
        self.options = replace(self.options, voice=check_voice(voices, arg))
        self.say(f"voice: {self.voice}")

    def cmd_mute(self, arg: str) -> None:
        self.muted = True
        self.say("muted: text only")

    def cmd_unmute(self, arg: str) -> None:
        if not self.assistant.has_audio:
            raise UsageError("this model has no talker: it answers in text only")
        if self.speaker is None:
            raise UsageError("there is nothing to play on in this session")
        self.speaker().abort()  # the device is there and opens
        self.muted = False
        self.say("unmuted: replies are spoken")

    def cmd_system(self, arg: str) -> None:
        from .prompt import DEFAULT_SYSTEM

        history = self.chat.history
        if not arg:
            self.say(f"system: {history.system}")
            return
        history.system = DEFAULT_SYSTEM if arg.lower() == "default" else arg
        self.say("system prompt set")
        if history.system != DEFAULT_SYSTEM and not self.muted:
            self.say("note: Qwen2.5-Omni speaks reliably only under its default system prompt (/system default)")

    def cmd_stats(self, arg: str) -> None:
        if self.last_stats is None:
            self.say("no reply yet")
        else:
            print_timing(self.err, self.last_stats, self.last_playback, title="last reply")
        seconds = sum(len(a) for _, a in self.speech) / self.assistant.sample_rate
        self.say(f"session: {_count(self.replies, 'reply', 'replies')}, {seconds:.1f} s of speech, "
                 f"{_count(self.underruns, 'underrun')}")

    def cmd_save(self, arg: str) -> None:
        if not arg:
            raise UsageError("/save needs a path: /save PATH writes PATH.json and PATH.wav")
        base = Path(arg).expanduser()
        if base.suffix.lower() in (".json", ".wav"):
            base = base.with_suffix("")
        json_path = base.with_name(base.name + ".json")
        wav_path = base.with_name(base.name + ".wav")
        seconds = self._save_wav(wav_path) if self.speech else None
        data = {
            "model": getattr(self.assistant, "name", None),
            "voice": self.voice,
            "system": self.chat.history.system,
            "turns": self.transcript,
            "audio": wav_path.name if seconds is not None else None,
            "audio_segments": self._segments(),
        }
        _write_text_atomic(json_path, json.dumps(data, ensure_ascii=False, indent=2) + "\n")
        if seconds is None:
            self.say(f"saved {json_path} ({_count(len(self.transcript) // 2, 'exchange')}; no speech to save)")
        else:
            self.say(f"saved {json_path} ({_count(len(self.transcript) // 2, 'exchange')}) and {wav_path} ({seconds:.1f} s)")

    def _segments(self) -> list[dict]:
        """Where each reply's speech is in the saved WAV."""
        rate, at, out = self.assistant.sample_rate, 0, []
        for i, (index, audio) in enumerate(self.speech):
            if i:
                at += int(SAVE_GAP * rate)
            out.append({"turn": index, "start": at / rate, "seconds": len(audio) / rate})
            at += len(audio)
        return out

    def _save_wav(self, path: Path) -> float:
        import numpy as np

        from .sinks import WavSink

        rate = self.assistant.sample_rate
        with WavSink(path) as sink:  # checks the folder first; the file appears whole or not at all
            sink.start(rate)
            for i, (_, audio) in enumerate(self.speech):
                if i:
                    sink.write(np.zeros(int(SAVE_GAP * rate), dtype=np.float32))
                sink.write(audio)
        return sink.seconds


def _count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {plural or word + 's'}"


def _write_text_atomic(path: Path, text: str) -> None:
    parent = path.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {path}: folder {parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".part")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except (OSError, UnboundLocalError):
            pass
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc


def line_reader(stream=None) -> Callable[[str], str]:
    """`read(prompt)` for a pipe: the next line without its newline (no prompt shown); EOFError at the end."""

    def read(prompt: str) -> str:
        line = (stream or sys.stdin).readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    return read


if __name__ == "__main__":
    from omni_cli.cli import chat_main

    chat_main()
