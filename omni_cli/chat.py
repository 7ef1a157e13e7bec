"""omni-chat's read-eval-print loop: turns, slash commands, multi-line input, Ctrl-C and Ctrl-D.

`ChatRepl(assistant, ...)` holds one session: the conversation (`assistant.conversation()`), the
reply options (voice, sampling, limits: /voice and /set change them), mute, the transcript and the
speech of every reply (for `/save`; `/load` and `load_transcript` resume a saved one), and the last
reply's timing (for `/stats`). `run(read)` loops until `/bye` or end of input and returns the exit
code; `read(prompt)` is a prompt_toolkit session's `prompt` on a terminal, or `line_reader()` on a
pipe, so the same loop is driven by a person, by a script, and by the tests.

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
before that turn. Errors a person can act on are one line and the session goes on.

What differs between model families (the voices and the default one, the default system prompt,
whether the talker's steps are codes or frames and how many make a second, the sample rate) is read
from the assistant, never assumed.

It knows nothing of typer or of how the model is loaded (cli.py does both), nor of the engine's inside.
"""

from __future__ import annotations

import json
import math
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
from .prompt import TRANSCRIPT_FORMAT, check_text
from .ui import InterruptTimes, StreamWrapper, Terminated, print_timing, speech_steps, stop_on_interrupt, terminal_width

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
    ("/set [NAME VALUE]", "show the sampling settings and limits, or change one (/set temperature 0.7)"),
    ("/show", "the model, voice, sound, system prompt and every setting"),
    ("/save PATH", "write PATH.json (the transcript) and PATH.wav (every reply's speech)"),
    ("/load PATH", "resume a conversation saved with /save (PATH or PATH.json)"),
    ("/stats", "timing of the last reply, totals of the session"),
    ("/audio [PATH]", "say this audio file with your next message (no PATH: what is attached)"),
    ("/image [PATH]", "show the model this image with your next message (no PATH: what is attached)"),
    ("/listen", "speak: record from the microphone until you stop talking (or Enter), then send it;"
                " Ctrl-T on an empty line does the same"),
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
        piped: bool | None = None,
        wrap: int | bool | None = None,
        record: Any = None,
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
        self.piped = (not _isatty(sys.stdin)) if piped is None else bool(piped)
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

    @property
    def voice(self) -> str | None:
        return self.options.voice

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
        from .runtime.events import AudioBlock, Done, TextDelta
        from .ui import AudioClock

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
                            self._show(wrapper.feed(event.text) if wrapper else event.text)
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
        self._record(text, reply, sink, clock.stats(reply.stats))

    def _wrapper(self) -> StreamWrapper | None:
        if self.wrap is False:
            return None
        width = self.wrap if isinstance(self.wrap, int) and self.wrap is not True else terminal_width(self.out.file)
        return StreamWrapper(width) if width else None

    def _show(self, text: str) -> None:
        if text:
            self.out.print(text, end="", markup=False, highlight=False)

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

    def error(self, exc: BaseException) -> None:
        exc = known_failure(exc)
        if self.debug:
            self.err.print("".join(traceback.format_exception(exc)), end="", markup=False, highlight=False)
        detail = " ".join(str(exc).split())
        if isinstance(exc, OmniError):
            message = f"error: {detail}"
            self.failures.append(int(getattr(exc, "exit_code", 1)))
        else:
            message = f"error: internal error: {type(exc).__name__}: {detail}"
            self.failures.append(1)
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
            "/set": self.cmd_set,
            "/show": self.cmd_show,
            "/save": self.cmd_save,
            "/load": self.cmd_load,
            "/stats": self.cmd_stats,
            "/audio": self.cmd_audio,
            "/listen": self.cmd_listen,
            "/image": self.cmd_image,
        }
        if name not in handlers:
            self.err.print(f"unknown command '{name}': type /? for help", style="yellow", markup=False, highlight=False)
            self.failures.append(UsageError.exit_code)
            return None
        handler = handlers[name]
        if handler is None:
            return "bye"
        try:
            handler(arg)
        except Terminated:
            raise
        except Exception as exc:  # noqa: BLE001 - an OmniError, or a bug: one line either way, the session goes on
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
        self.attachments.clear()
        self.say("new conversation")

    def cmd_audio(self, arg: str) -> None:
        """/audio PATH attaches a clip to the next message (read and checked now); /audio lists them."""
        if not arg:
            if not self.attached:
                self.say("nothing attached: /audio PATH says an audio file with your next message")
            for clip in self.attached:
                self.say(f"attached: {clip.source} ({clip.seconds:.1f} s)")
            return
        from .media import read_audio

        clip = read_audio(arg)
        self.attached.append(clip)
        self.say(f"attached {clip.source} ({clip.seconds:.1f} s of audio): it goes with your next message")

    def cmd_image(self, arg: str) -> None:
        """/image PATH attaches an image to the next message (opened and checked now); /image lists them."""
        if not arg:
            if not self.shown:
                self.say("no image attached: /image PATH shows an image with your next message")
            for name, _image in self.shown:
                self.say(f"attached: {name}")
            return
        from .media import read_image

        self.shown.append((arg, read_image(arg)))
        self.say(f"attached {arg}: it goes with your next message")

    def cmd_listen(self, arg: str) -> None:
        """Record one spoken turn (a live level meter on stderr; it ends when the speaker stops, on Enter,
        or at the length limit) and send it as the user's message. A recording that ends in an error is
        kept in a file whose name is said."""
        from .audio.microphone import RecordOptions, SilentMicrophone, record
        from .media import AudioClip

        meter = _Meter(self.err, interactive=not self.piped)
        self.say("listening: speak now" + ("; Enter ends the turn" if meter.interactive else ""))
        try:
            clip = record(self.record_options or RecordOptions(), stop=meter.stop, on_level=meter)
        except SilentMicrophone as exc:
            meter.done()
            raise OmniError(f"{exc}; the recording is kept in {self._keep(exc.clip)}") from None
        except KeyboardInterrupt as exc:
            meter.done()
            clip = getattr(exc, "clip", None)
            kept = f": the recording is kept in {self._keep(clip)}" if clip is not None and clip.seconds else ""
            self.say(f"stopped listening{kept}")
            return
        meter.done()
        self.say(f"heard {clip.seconds:.1f} s")
        self.attached.append(AudioClip(clip.pcm, clip.sample_rate, "microphone"))
        self.turn("")

    def _keep(self, clip) -> Path:
        """Save a recording that could not be sent (a file under the data folder) and return its path."""
        from .audio.microphone import save_clip
        from .ui import data_dir

        path = data_dir() / "recordings" / time.strftime("listen-%Y%m%d-%H%M%S.wav")
        path.parent.mkdir(parents=True, exist_ok=True)
        return save_clip(clip, path)

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
        history = self.chat.history
        if not arg:
            self.say(f"system: {history.system}" if history.system else "system: (none)")
            return
        default = self.assistant.default_system
        history.system = default if arg.lower() == "default" else check_text(arg, "the system prompt")
        self.say("system prompt set")
        if history.system != default and not self.muted and self.assistant.speaks_only_under_default_system:
            self.say("note: this model speaks reliably only under its default system prompt (/system default)")

    # -- settings --------------------------------------------------------------------------------
    def cmd_set(self, arg: str) -> None:
        words = arg.split()
        if words[:1] == ["parameter"]:  # ollama's spelling: /set parameter temperature 0.7
            words = words[1:]
        if not words:
            self._print_settings()
            self.say("  /set NAME VALUE changes one; /set NAME default goes back to the model's")
            return
        name = words[0].lower().replace("-", "_")
        if name not in SETTINGS:
            raise UsageError(f"unknown setting '{words[0]}': the settings are {', '.join(SETTINGS)}")
        if len(words) != 2:
            raise UsageError(f"/set {name} needs one value, e.g. /set {name} {self._example(name)}")
        value = _parse_setting(name, words[1])
        options = replace(self.options, **{name: value}).check()  # a bad value changes nothing
        limit = getattr(getattr(self.assistant, "engine", None), "max_codes", None)
        if name == "max_codes" and value is not None and limit is not None and value > limit:
            # The API would refuse it at the next turn; say so now, where it was typed.
            raise UsageError(f"max_codes {value} is above this session's limit of {limit}")
        self.options = options
        self.say(f"{name}: {self._setting_text(name)}")
        if self.options.greedy and name in ("temperature", "top_p", "top_k"):
            self.say("note: greedy is on, so sampling settings have no effect (/set greedy off)")

    def cmd_show(self, arg: str) -> None:
        a = self.assistant
        where = getattr(getattr(a, "loaded", None), "device", None)
        title = getattr(getattr(a, "family", None), "TITLE", None)
        model = (f"{getattr(a, 'name', None) or 'unknown'}" + (f" ({title})" if title else "")
                 + (f" on {where}" if where else ""))
        if getattr(a, "is_demo", False):
            model += " (the built-in demo model: random weights)"
        if not a.has_audio:
            sound = "none (this model has no talker: text only)"
        else:
            sound = "muted (text only)" if self.muted else ("on" if self.speaker is not None else "no sound device")
        system = self.chat.history.system
        short = system if len(system) <= 60 else system[:57].rstrip() + "..."
        rows = [("model", model), ("voice", str(self.voice) if a.has_audio else "-"), ("sound", sound),
                ("system", (repr(short) if system else "(none)") + ("  (/system shows it whole)" if short != system else ""))]
        if self.loaded_from is not None:
            rows.append(("loaded from", str(self.loaded_from)))
        width = max(len(k) for k in [*SETTINGS, *(r[0] for r in rows)])
        for key, value in rows:
            self.say(f"  {key.ljust(width)}  {value}")
        self._print_settings(width)

    def _print_settings(self, width: int | None = None) -> None:
        width = width or max(len(k) for k in SETTINGS)
        for name in SETTINGS:
            self.say(f"  {name.ljust(width)}  {self._setting_text(name)}")

    def _setting_text(self, name: str) -> str:
        value = getattr(self.options, name)
        if name == "greedy":
            return "on" if value else "off"
        if value is not None:
            if name == "max_codes":
                return self._speech_length(value)
            return f"{value:g}" if isinstance(value, float) else str(value)
        if name == "seed":
            return "random (a new seed for each reply)"
        default = self._model_default(name)
        return "model default" + (f" ({default})" if default is not None else "")

    def _model_default(self, name: str) -> str | None:
        """The value the model uses when the setting is not given (None if this assistant does not say)."""
        a = self.assistant
        base = getattr(a, "thinker_sampling", None)  # the checkpoint's SamplingOptions
        limits = getattr(a, "limits", None)
        if name in ("temperature", "top_p", "top_k") and base is not None and hasattr(base, name):
            value = getattr(base, name)
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            return shown if getattr(base, "do_sample", True) else f"{shown}, but the model decodes greedily"
        if name == "max_text_tokens" and isinstance(limits, dict) and "text" in limits:
            return str(limits["text"])
        if name == "max_codes" and isinstance(limits, dict) and "codes" in limits:
            return self._speech_length(limits["codes"])
        return None

    def _speech_length(self, steps: int) -> str:
        """A count of talker steps as people read it: "150 codes, 3.0 s" (Qwen2.5-Omni), "38 frames,
        3.0 s" (Qwen3-Omni); the bare number for an assistant that does not say its rate."""
        unit, per_second = self._steps
        return f"{steps} {unit}, {steps / per_second:.1f} s" if per_second else str(steps)

    def _example(self, name: str) -> str:
        """An example value for `/set NAME VALUE`: for max_codes, 30 s of speech in this model's steps."""
        per_second = self._steps[1]
        if name == "max_codes" and per_second:
            return str(round(30 * per_second))
        return SETTINGS[name][1]

    def cmd_stats(self, arg: str) -> None:
        if self.last_stats is None:
            self.say("no reply yet")
        else:
            print_timing(self.err, self.last_stats, self.last_playback, title="last reply", unit=self._steps[0])
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
            "format": TRANSCRIPT_FORMAT,
            "model": getattr(self.assistant, "name", None),
            "voice": self.voice,
            "system": self.chat.history.system,
            "turns": self.transcript,
            "context_from": self._context_from(),
            "audio": wav_path.name if seconds is not None else None,
            "audio_segments": self._segments(),
            # Audio said with a message: {"turn": index, "audio": [files]} (recordings written beside).
            "attachments": self._save_attachments(base),
        }
        _write_text_atomic(json_path, json.dumps(data, ensure_ascii=False, indent=2) + "\n")
        if seconds is None:
            self.say(f"saved {json_path} ({_count(len(self.transcript) // 2, 'exchange')}; no speech to save)")
        else:
            self.say(f"saved {json_path} ({_count(len(self.transcript) // 2, 'exchange')}) and {wav_path} ({seconds:.1f} s)")

    def _save_attachments(self, base: Path) -> list[dict]:
        """The attachments as the transcript names them: a file's path, or for a recording (/listen) the
        name of a WAV written beside the transcript (BASE.listen-N.wav)."""
        from .audio.microphone import Clip, save_clip

        out, n = [], 0
        for entry in self.attachments:
            names = list(entry.get("names", []))  # from a loaded transcript: the audio files it named
            for clip in entry.get("clips", []):
                if clip.source != "microphone":
                    names.append(clip.source)
                    continue
                n += 1
                path = base.with_name(f"{base.name}.listen-{n}.wav")
                save_clip(Clip(clip.pcm, clip.sample_rate, "saved", clip.seconds), path)
                names.append(path.name)
            saved = {"turn": entry["turn"], "audio": names}
            if entry.get("images"):
                saved["images"] = list(entry["images"])
            out.append(saved)
        return out

    def _context_from(self) -> int:
        """Where the model's history starts in the transcript (turns dropped to fit the context come
        before it), so that a loaded conversation prompts the model exactly as this one would."""
        history = self.chat.history.text_turns()
        start = len(self.transcript) - len(history)
        if start >= 0 and start % 2 == 0 and self.transcript[start:] == history:
            return start
        return 0  # not a suffix (cannot happen through this REPL): keep everything

    def _restore_media(self, start: int) -> None:
        """Give the loaded turns back the clips and images the transcript names, so that the model goes
        on hearing and seeing them as the saved session did (a server too: each request carries them).
        A file that is gone or unreadable is a note; its turn goes on without it."""
        if not getattr(self.assistant, "keeps_media", False):
            return
        from .media import read_audio, read_image

        history = self.chat.history.turns
        for entry in self.attachments:
            turn = entry["turn"] - start
            if not 0 <= turn < len(history):
                continue  # dropped from the model's history before the save
            media = {"audio": [], "images": []}
            for kind, names, read in (("audio", entry["names"], lambda n: read_audio(n).at()),
                                      ("images", entry["images"], read_image)):
                for name in names:
                    try:
                        media[kind].append(read(name))
                    except OmniError as exc:
                        self.say(f"note: {exc}; that turn goes on without it")
            if media["audio"] or media["images"]:
                history[turn]["media"] = media

    # -- resuming a saved conversation -----------------------------------------------------------
    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise UsageError("/load needs a path: /load PATH reads PATH or PATH.json (written by /save)")
        self.load_transcript(arg)

    def load_transcript(self, path: str | os.PathLike) -> None:
        """Resume the conversation saved with /save at `path` (or `path`.json): its system prompt and turns
        become the model's history and this session's transcript, so the next reply follows on from it
        and the next /save writes all of it. The speech of its replies stays in the WAV saved beside it
        (this session's WAV holds the replies from now on). Raises UsageError (the file is missing, is
        not JSON, or is not a transcript) and then changes nothing. `omni-chat --load PATH` calls this."""
        from .prompt import TranscriptError, parse_json, read_transcript

        file = _transcript_path(path)
        try:
            raw = file.read_bytes()
        except FileNotFoundError:
            tried = f"{file}" if str(file) == str(path) else f"{path} or {file}"
            raise UsageError(f"cannot load {tried}: no such file (/save PATH writes PATH.json)") from None
        except IsADirectoryError:
            raise UsageError(f"cannot load {file}: it is a folder, not a transcript file") from None
        except OSError as exc:
            raise UsageError(f"cannot load {file}: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise UsageError(f"cannot load {file}: it is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                             f"{exc.start}), so not a transcript") from None
        try:
            data = parse_json(text)
            system, turns, start = read_transcript(data)
        except TranscriptError as exc:
            raise TranscriptError(f"cannot load {file}: {exc}") from None
        replaced = len(self.transcript) // 2
        self.chat.history.system = system
        self.chat.history.turns[:] = [dict(t) for t in turns[start:]]
        self.transcript = [dict(t) for t in turns]
        self.speech = []  # indexes into the transcript: the loaded turns have no audio in this session
        self.attachments = _loaded_attachments(data.get("attachments"), file.parent, len(turns))
        self._restore_media(start)
        self.loaded_from = file
        self.say(f"loaded {file} ({_count(len(turns) // 2, 'exchange')})"
                 + (f"; it replaces this session's {_count(replaced, 'exchange')}" if replaced else ""))
        audio = data.get("audio")
        if isinstance(audio, str) and audio:
            self.say(f"note: the speech of those replies stays in {file.with_name(audio)}; "
                     "the next /save writes the speech of the replies from now on")
        model = data.get("model")
        if isinstance(model, str) and model and model != getattr(self.assistant, "name", model):
            self.say(f"note: it was saved with the model {model}; this session runs {self.assistant.name}")
        if start:
            self.say(f"note: the model sees the last {_count((len(turns) - start) // 2, 'exchange')} "
                     "(the older ones no longer fitted its context)")

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

        from .audio.sinks import WavSink

        rate = self.assistant.sample_rate
        with WavSink(path) as sink:  # checks the folder first; the file appears whole or not at all
            sink.start(rate)
            for i, (_, audio) in enumerate(self.speech):
                if i:
                    sink.write(np.zeros(int(SAVE_GAP * rate), dtype=np.float32))
                sink.write(audio)
        return sink.seconds


# /set's settings: the ReplyOptions field, and an example value for the usage message (for max_codes,
# 30 s of Qwen2.5-Omni's codes; ChatRepl._example gives the model's own).
SETTINGS = {
    "temperature": (float, "0.7"),
    "top_p": (float, "0.9"),
    "top_k": (int, "40"),
    "seed": (int, "3"),
    "greedy": (bool, "on"),
    "max_codes": (int, "1500"),
    "max_text_tokens": (int, "256"),
}

_ON = ("on", "true", "yes", "1")
_OFF = ("off", "false", "no", "0")


def _parse_setting(name: str, text: str):
    """The value `text` means for setting `name`; None for "default" (the model's own); UsageError else.
    The range is checked by ReplyOptions.check()."""
    kind = SETTINGS[name][0]
    word = text.lower()
    if kind is bool:
        if word in _ON or word in _OFF:
            return word in _ON
        if word == "default":
            return False
        raise UsageError(f"greedy is on or off (got '{text}')")
    if word in ("default", "none") or (name == "seed" and word == "random"):
        return None
    try:
        value = kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise UsageError(f"{name} must be {what} (got '{text}')") from None
    if kind is float and not math.isfinite(value):  # "nan" and "inf" parse as floats
        raise UsageError(f"{name} must be a finite number (got '{text}')")
    return value


def _transcript_path(path: str | os.PathLike) -> Path:
    """What /load PATH reads: PATH, or PATH.json when PATH is not a file (as /save PATH wrote it);
    PATH.wav names the JSON beside it."""
    file = Path(path).expanduser()
    if file.suffix.lower() == ".wav":
        return file.with_suffix(".json")
    if not file.is_file() and file.suffix.lower() != ".json":
        return file.with_name(file.name + ".json")
    return file


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


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


if __name__ == "__main__":
    from omni_cli.cli import chat_main

    chat_main()


class _Meter:
    """/listen's live line on stderr: a level bar and the seconds heard, redrawn in place; on a terminal
    it also watches stdin for Enter, which ends the turn (`stop`)."""

    WIDTH = 20  # characters of the bar, for -60..0 dBFS

    def __init__(self, err: Any, interactive: bool) -> None:
        import threading

        self.err = err
        self.interactive = interactive and _isatty(sys.stdin)
        self.stop = threading.Event()
        self.drawn = False

    def __call__(self, level_dbfs: float, seconds: float) -> None:
        filled = max(0, min(self.WIDTH, round((level_dbfs + 60) / 60 * self.WIDTH)))
        if self.interactive:
            self.err.file.write(f"\r  [{'#' * filled}{' ' * (self.WIDTH - filled)}] {seconds:4.1f} s ")
            self.err.file.flush()
            self.drawn = True
            if self._enter_pressed():
                self.stop.set()

    def _enter_pressed(self) -> bool:
        import select

        try:
            ready, _, _ = select.select([sys.stdin], [], [], 0)
        except (OSError, ValueError):
            return False
        if ready:
            sys.stdin.readline()
            return True
        return False

    def done(self) -> None:
        if self.drawn:
            self.err.file.write("\r" + " " * (self.WIDTH + 14) + "\r")
            self.err.file.flush()


def _loaded_attachments(entries, folder: Path, turns: int) -> list[dict]:
    """A saved transcript's attachments, kept for the next /save: each file as a path that still finds it
    from anywhere (a name beside the transcript becomes a path under its folder). Entries that do not
    name a user turn of the transcript are dropped (a hand-edited file)."""
    out = []
    for entry in entries if isinstance(entries, list) else []:
        turn = entry.get("turn") if isinstance(entry, dict) else None
        names = entry.get("audio", []) if isinstance(entry, dict) else None
        images = entry.get("images", []) if isinstance(entry, dict) else None
        if isinstance(turn, int) and not isinstance(turn, bool) and 0 <= turn < turns and turn % 2 == 0 \
                and all(isinstance(x, list) and all(isinstance(n, str) for n in x) for x in (names, images)):
            out.append({"turn": turn, "names": [str(folder / n) if "/" not in n else n for n in names],
                        "images": list(images)})
    return out
