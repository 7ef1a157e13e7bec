"""omni-chat's slash commands (/help, /voice, /set, /show, /audio, /listen, ...): a part of `ChatRepl`
(loop.py), which holds the session they read and change.

Each command is a method `cmd_NAME(arg)`; an OmniError it raises is one line and the session goes on.
What a model offers (voices, whether it speaks, its default sampling and limits, its steps' name and
rate) is read from the assistant's declared interface, never assumed.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

from ...errors import OmniError, UsageError
from ...prompt import check_text
from ..timing import memory_rows, print_timing
from .meter import Meter
from .state import SessionState

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
    ("/talk", "talk hands-free: each turn ends when you stop speaking, speech interrupts a reply;"
              " Enter leaves"),
    ('"""', 'begin and end a multi-line message'),
]



class Commands(SessionState):
    """The slash commands of `ChatRepl` (which sets every attribute they use; it dispatches to them)."""

    # -- slash commands --------------------------------------------------------------------------

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
        from ...media import read_audio

        clip = read_audio(arg, limits=self.limits)
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
        from ...media import read_image

        self.shown.append((arg, read_image(arg, limits=self.limits)))
        self.say(f"attached {arg}: it goes with your next message")

    def cmd_listen(self, arg: str) -> None:
        """Record one spoken turn (a live level meter on stderr; it ends when the speaker stops, on Enter,
        or at the length limit) and send it as the user's message. A recording that ends in an error is
        kept in a file whose name is said."""
        from ...audio.microphone import RecordOptions, SilentMicrophone, record

        meter = Meter(self.err, interactive=not self.piped)
        self.say("listening: speak now" + ("; Enter ends the turn" if meter.interactive else ""))
        try:
            clip = record(self.record_options or RecordOptions(), stop=meter.stop, on_level=meter)
        except SilentMicrophone as exc:
            meter.done()
            raise OmniError(f"{exc}; the recording is kept in {self._keep(exc.clip)}") from None
        except KeyboardInterrupt as exc:
            meter.done()
            heard = getattr(exc, "clip", None)  # what the microphone had when Ctrl-C came (if anything)
            kept = f": the recording is kept in {self._keep(heard)}" if heard is not None and heard.seconds else ""
            self.say(f"stopped listening{kept}")
            return
        meter.done()
        self.say(f"heard {clip.seconds:.1f} s")
        self.attached.append(clip)  # the microphone's clip, source "microphone"
        self.turn("")

    def cmd_talk(self, arg: str) -> None:
        """Talk mode with the session's listening options, until Enter: over a server's `/v1/realtime`
        session where there is one (talk_remote.py), else turn by turn (talk.py: a local model, or a
        server without it, over HTTP)."""
        from ...audio.listener import ListenOptions
        from .talk import TalkMode

        if arg:
            raise UsageError("/talk takes no argument (the flags --headphones, --vad-model, --barge-in-ms set it up)")
        options = self.listen_options or ListenOptions()
        self.talk = self._realtime_talk(options) or TalkMode(self, options)
        self.talk.run()

    def _realtime_talk(self, options):
        """Talk mode over the chat's server's realtime session, set up; None: no server, or one without
        `/v1/realtime` (an older omni-serve, vLLM-Omni) or that refuses the session's settings, said in
        one line."""
        url = getattr(self.assistant, "url", None)
        if url is None:
            return None
        from ...api.client import ServerError
        from ...api.realtime_client import RealtimeSession
        from .talk_remote import RemoteTalk

        session = None
        try:
            session = RealtimeSession.connect(url, api_key=getattr(self.assistant, "api_key", None))
            talk = RemoteTalk(self, options, session)
            talk.configure()
            return talk
        except ServerError as exc:
            if session is not None:
                session.close()
            self.say(f"no realtime session ({exc}): talking turn by turn over HTTP")
            return None

    def _keep(self, clip) -> Path:
        """Save a recording that could not be sent (a file under the data folder) and return its path."""
        from ...audio.microphone import save_clip
        from ...paths import recordings_dir

        path = recordings_dir() / time.strftime("listen-%Y%m%d-%H%M%S.wav")
        path.parent.mkdir(parents=True, exist_ok=True)
        return save_clip(clip, path)

    def cmd_voice(self, arg: str) -> None:
        from ...loader import check_voice

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
        limit = self.assistant.model_info.max_steps
        if name == "max_codes" and value is not None and limit is not None and value > limit:
            # The API would refuse it at the next turn; say so now, where it was typed.
            raise UsageError(f"max_codes {value} is above this session's limit of {limit}")
        self.options = options
        self.say(f"{name}: {self._setting_text(name)}")
        if self.options.greedy and name in ("temperature", "top_p", "top_k"):
            self.say("note: greedy is on, so sampling settings have no effect (/set greedy off)")

    def cmd_show(self, arg: str) -> None:
        a = self.assistant
        info = a.model_info
        model = (f"{info.name or 'unknown'}" + (f" ({info.title})" if info.title else "")
                 + (f" on {info.where}" if info.where else ""))
        if info.is_demo:
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
        rows += memory_rows(getattr(a, "memory", None))  # a model loaded here: its bytes and the device's peak
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
        info = self.assistant.model_info
        if name in info.text_sampling:
            value = info.text_sampling[name]
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            return shown if info.text_samples else f"{shown}, but the model decodes greedily"
        if name == "max_text_tokens" and info.default_text_tokens is not None:
            return str(info.default_text_tokens)
        if name == "max_codes" and info.default_steps is not None:
            return self._speech_length(info.default_steps)
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
        self.say(f"session: {count(self.replies, 'reply', 'replies')}, {seconds:.1f} s of speech, "
                 f"{count(self.underruns, 'underrun')}")


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


def count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {plural or word + 's'}"

