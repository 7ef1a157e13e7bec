"""omni-chat's REPL as a person uses it, through prompt_toolkit's pipe input: turns, slash commands,
multi-line input, Ctrl-C (on the prompt, and during a reply: the sound stops, the session goes on),
Ctrl-D, /set and /show, /save and /load, exit codes in piped mode, input that is not UTF-8, and the
streaming word wrap; then with the real tiny model in-process (a paced fake sound device) and as a
subprocess reading a script on stdin; piped input and its exit codes in-process (CliRunner).

A real terminal (tmux) is in test_tmux.py; real PortAudio playback of a chat turn in test_playback.py.
"""

from __future__ import annotations

import io
import json
import os
import random
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from audio_device import FakeSoundDevice
from conftest import cli_env, invoke_chat
from fakes import FakeAssistant
from interrupting import interrupt_when
from omni_cli.faces.chat.loop import ChatRepl, line_reader
from omni_cli.config import ReplyOptions
from omni_cli.errors import OutputError, UsageError
from omni_cli.models.qwen2_5_omni import DEFAULT_SYSTEM
from omni_cli.prompt import Conversation, check_prompt, fit
from omni_cli.audio.speaker import SpeakerSink
from omni_cli.faces.chat.history import make_history, make_session
from omni_cli.faces.console import StreamWrapper, make_console


class Session:
    """A ChatRepl fed keystrokes through a prompt_toolkit pipe; what it printed, split by stream."""

    def __init__(self, assistant=None, sd=None, **kwargs):
        # A person at a terminal unless a test says otherwise (pytest's own stdin says nothing here).
        kwargs.setdefault("piped", False)
        self.assistant = assistant or FakeAssistant()
        self.sd = sd if sd is not None else FakeSoundDevice(speed=20.0)
        self.out_buf, self.err_buf = io.StringIO(), io.StringIO()
        self.sinks = []

        def speaker():
            sink = SpeakerSink(backend=self.sd, prebuffer=0.05)
            sink.open(24_000)
            self.sinks.append(sink)
            return sink

        kwargs.setdefault("speaker", speaker)
        self.repl = ChatRepl(self.assistant, make_console("stdout", file=self.out_buf),
                             make_console("stderr", file=self.err_buf), **kwargs)

    def run(self, keys: str, history=None) -> int:
        with create_pipe_input() as pipe:
            pipe.send_text(keys)
            session = make_session(history or InMemoryHistory(), input=pipe, output=DummyOutput())
            self.code = self.repl.run(session.prompt)
        return self.code

    def run_lines(self, *lines: str) -> int:
        """Feed str lines as they are (the pipe input can only carry text that encodes as UTF-8)."""
        feed = iter(lines)

        def read(prompt):
            try:
                return next(feed)
            except StopIteration:
                raise EOFError from None

        self.code = self.repl.run(read)
        return self.code

    @property
    def out(self) -> str:
        return self.out_buf.getvalue()

    @property
    def err(self) -> str:
        return self.err_buf.getvalue()


def test_a_turn_streams_text_and_plays_speech():
    s = Session()
    assert s.run("Hello\r\x04") == 0
    assert s.out == "Hi there.\n"
    assert s.assistant.calls[0]["prompt"] == "Hello" and s.assistant.calls[0]["text_only"] is False
    assert s.repl.chat.history.turns == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."}]
    (stream,) = s.sd.streams
    assert np.count_nonzero(stream.audio) == 12_000 and stream.closed
    assert s.err == ""


def test_bye_and_exit_leave_with_0():
    for word in ("/bye", "/exit", "/BYE"):
        s = Session()
        assert s.run(f"{word}\rHello\r") == 0
        assert s.assistant.calls == []


def test_ctrl_c_on_the_prompt_explains_how_to_leave_and_ctrl_d_leaves():
    s = Session()
    assert s.run("\x03half a line\x03\x04") == 0
    assert s.err.count("Use Ctrl-D or /bye to leave.") == 2
    assert s.assistant.calls == []


def test_help_lists_every_command():
    s = Session()
    s.run("/help\r/?\r\x04")
    for cmd in ("/help", "/?", "/bye", "/exit", "/clear", "/voice", "/mute", "/unmute", "/system", "/save", "/stats", '"""'):
        assert cmd in s.err
    assert s.err.count("/clear") == 2


def test_unknown_command():
    s = Session()
    s.run("/frobnicate now\r\x04")
    assert s.err == "error: unknown command '/frobnicate': type /? for help\n"


def test_multi_line_input():
    s = Session()
    s.run('"""First line\rsecond line\r  indented third"""\r"""\rafter an empty opener\r"""\r"""one line"""\r\x04')
    prompts = [c["prompt"] for c in s.assistant.calls]
    assert prompts == ["First line\nsecond line\n  indented third", "after an empty opener", "one line"]


def test_ctrl_c_cancels_a_multi_line_message():
    s = Session()
    s.run('"""\rdraft\r\x03Hello\r\x04')
    assert [c["prompt"] for c in s.assistant.calls] == ["Hello"]


def test_voice():
    s = Session()
    s.run("/voice\r/voice ethan\rHello\r/voice Bob\rHi\r\x04")
    assert "voice: Chelsie (voices: Chelsie, Ethan)" in s.err
    assert "voice: Ethan" in s.err
    assert "error: unknown voice 'Bob': this model's voices are Chelsie, Ethan" in s.err
    assert [c["voice"] for c in s.assistant.calls] == ["Ethan", "Ethan"]


def test_mute_and_unmute():
    s = Session()
    s.run("/mute\rHello\r/unmute\rHello again\r\x04")
    assert [c["text_only"] for c in s.assistant.calls] == [True, False]
    assert "muted: text only" in s.err and "unmuted: replies are spoken" in s.err
    assert len([st for st in s.sd.streams if st.audio.any()]) == 1


def test_unmute_without_a_device_says_so():
    s = Session(sd=FakeSoundDevice(devices=[]), muted=True)
    s.run("/unmute\rHello\r\x04")
    assert "error: cannot play audio: no sound output device found" in s.err and "--mute" not in s.err
    assert s.assistant.calls[0]["text_only"] is True


def test_system_prompt():
    s = Session()
    s.run("/system\r/system You are a pirate.\rHello\r/system default\r\x04")
    assert f"system: {DEFAULT_SYSTEM}" in s.err
    assert "system prompt set" in s.err and "speaks reliably only under its default system prompt" in s.err
    assert s.repl.chat.history.system == DEFAULT_SYSTEM


def test_clear_starts_a_new_conversation():
    s = Session()
    s.run("Hello\r/clear\rAgain\r\x04")
    assert "new conversation" in s.err
    assert s.repl.chat.history.turns == [{"role": "user", "content": "Again"}, {"role": "assistant", "content": "Hi there."}]
    assert len(s.repl.transcript) == 2


def test_save_writes_the_transcript_and_one_wav(tmp_path):
    s = Session()
    s.run(f"Hello\r/mute\rQuiet one\r/unmute\rLast\r/save {tmp_path / 'talk'}\r\x04")
    data = json.loads((tmp_path / "talk.json").read_text())
    assert [t["content"] for t in data["turns"]] == ["Hello", "Hi there.", "Quiet one", "Hi there.", "Last", "Hi there."]
    assert data["audio"] == "talk.wav" and data["voice"] == "Chelsie" and data["system"] == DEFAULT_SYSTEM
    assert data["audio_segments"] == [{"turn": 1, "start": 0.0, "seconds": 0.5}, {"turn": 5, "start": 1.0, "seconds": 0.5}]
    audio, rate = sf.read(tmp_path / "talk.wav", dtype="float32")
    assert rate == 24_000 and audio.shape == (24_000 + 12_000,)  # two replies and the gap between them
    assert not audio[12_000:24_000].any() and audio[:12_000].all() and audio[24_000:].all()
    assert f"saved {tmp_path / 'talk.json'} (3 exchanges) and {tmp_path / 'talk.wav'} (1.5 s)" in s.err
    assert sorted(os.listdir(tmp_path)) == ["talk.json", "talk.wav"]
    # The transcript loads back as a conversation.
    from omni_cli.prompt import Conversation

    assert len(Conversation.load(tmp_path / "talk.json").turns) == 6


def test_save_errors(tmp_path):
    s = Session()
    s.run(f"/save\rHello\r/save {tmp_path / 'no' / 'such' / 'x'}\r/save {tmp_path / 'ok.json'}\r\x04")
    assert "error: /save needs a path" in s.err
    assert "error: cannot write" in s.err and "does not exist" in s.err
    assert sorted(os.listdir(tmp_path)) == ["ok.json", "ok.wav"]


def test_stats():
    s = Session()
    s.run("/stats\rHello\r/stats\r\x04")
    assert "no reply yet" in s.err
    assert "-- last reply" in s.err and "time to first audio" in s.err and "underruns" in s.err
    assert "session: 1 reply, 0.5 s of speech, 0 underruns" in s.err


def test_verbose_prints_timing_after_each_reply():
    s = Session(verbose=True)
    s.run("Hello\r\x04")
    assert "-- timing" in s.err and "real-time factor" in s.err


def test_an_error_in_a_turn_keeps_the_session():
    from omni_cli.errors import OutputError

    s = Session()
    s.assistant.fail = OutputError("disk full")
    s.run("Hello\r\x04")
    assert "error: disk full" in s.err
    s.assistant.fail = RuntimeError("boom")
    s.run("Hello\rAgain\r\x04")
    assert "error: internal error: RuntimeError: boom" in s.err
    import torch

    s.assistant.fail = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    s.run("Hello\r\x04")
    assert "error: out of device memory while answering: try a shorter prompt" in s.err
    s.assistant.fail = None
    s.run("Fine now\r\x04")
    assert s.out.endswith("Hi there.\n")
    assert s.repl.chat.history.turns[-1]["content"] == "Hi there." and len(s.repl.chat.history.turns) == 2


def test_ctrl_c_during_a_reply_stops_it_and_the_session_goes_on(hang_guard):
    # 2 s of audio in 10 blocks, one every 0.2 s, played at real time.
    s = Session(assistant=FakeAssistant(seconds=2.0, blocks=10, block_delay=0.2), sd=FakeSoundDevice(speed=1.0))
    interrupter = interrupt_when(lambda: s.sd.streams[0].active, delay=0.3)  # 0.3 s into the sound
    s.run("Tell me a story\r\x04")
    interrupter.cancel()
    assert interrupter.reached
    assert "interrupted" in s.err
    (record,) = s.repl.interrupts
    assert record["to_silence"] < 0.2 and record["to_prompt"] < 0.2, record
    sink = s.sinks[0]
    assert sink.aborted and not s.sd.streams[0].active
    assert s.repl.chat.history.turns == []  # the interrupted turn left no trace
    s.assistant.block_delay = 0.0
    s.run("Next\r\x04")
    assert s.repl.chat.history.turns[-1]["content"] == "Hi there." and s.repl.replies == 1


def test_history_file(tmp_path):
    path = tmp_path / "data" / "omni-cli" / "chat_history"
    history = make_history(path, print)
    assert isinstance(history, FileHistory)
    Session().run("first message\r/voice\r\x04", history=history)
    text = path.read_text()
    assert "+first message" in text and "+/voice" in text
    assert isinstance(make_history(None, print), InMemoryHistory)
    warnings = []
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert isinstance(make_history(blocked / "history", warnings.append), InMemoryHistory)
    assert warnings and warnings[0].startswith("warning: cannot keep the input history")


def test_history_off_by_env(monkeypatch):
    from omni_cli.faces.chat.history import default_history_file, history_disabled_by_env

    monkeypatch.setenv("XDG_DATA_HOME", "/somewhere")
    assert str(default_history_file()) == "/somewhere/omni-cli/chat_history"
    for value, off in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("OMNI_NOHISTORY", value)
        assert history_disabled_by_env() is off


@pytest.mark.unit
def test_line_reader_for_pipes():
    read = line_reader(io.StringIO("one\r\ntwo\n"))
    assert (read(">>> "), read(">>> ")) == ("one", "two")
    with pytest.raises(EOFError):
        read(">>> ")


# -- input that is not UTF-8 ------------------------------------------------------------------


@pytest.mark.unit
def test_line_reader_decodes_strictly_and_names_the_bad_byte():
    read = line_reader(io.BytesIO("\ufeffok\r\nnaïve\ncaf\xe9\n".encode("utf-8").replace(b"caf\xc3\xa9", b"caf\xe9")))
    assert read(">>> ") == "ok"  # the byte-order mark is not part of the message
    assert read(">>> ") == "naïve"
    with pytest.raises(UsageError) as info:
        read(">>> ")
    # line 3 starts after 3 (BOM) + 4 ("ok\r\n") + 7 ("naïve\n") bytes; the bad byte is its 4th
    assert str(info.value) == ("stdin is not UTF-8 text (byte 0xe9 on line 3, at offset 17): convert it first, "
                               "e.g. iconv -f latin1 -t utf-8")


def test_non_utf8_piped_input_ends_the_session_with_a_usage_error():
    s = Session(piped=True)
    with pytest.raises(UsageError, match=r"byte 0xe9 on line 2"):
        s.repl.run(line_reader(io.BytesIO(b"Hello\ncaf\xe9\nnever read\n")))
    assert [c["prompt"] for c in s.assistant.calls] == ["Hello"]  # the lines after it are not trusted


def test_undecodable_text_from_a_terminal_is_one_error_and_the_session_goes_on():
    # prompt_toolkit decodes keyboard bytes with surrogateescape: a latin-1 terminal's é arrives as
    # U+DCE9, which the tokenizer would reject with a TypeError.
    s = Session()
    assert s.run_lines("caf\udce9", "/system pir\udce9te", "Hello") == 0
    assert s.err.splitlines() == [
        "error: the prompt is not UTF-8 text (byte 0xe9 at character 4): convert it first, e.g. iconv -f latin1 "
        "-t utf-8, or set the terminal to UTF-8",
        "error: the system prompt is not UTF-8 text (byte 0xe9 at character 4): convert it first, e.g. iconv -f "
        "latin1 -t utf-8, or set the terminal to UTF-8",
    ]
    assert [c["prompt"] for c in s.assistant.calls] == ["Hello"] and s.sd.streams  # no device opened for it
    assert s.repl.chat.history.system == DEFAULT_SYSTEM
    assert s.run_lines("caf\udce9") == 0  # a person saw the error: the exit code stays 0


@pytest.mark.unit
def test_check_prompt_names_a_lone_surrogate():
    with pytest.raises(UsageError, match=r"^the prompt holds a lone surrogate U\+D800 at character 1 of line 2, "):
        check_prompt("a\n\ud800")
    assert check_prompt("café 😀") == "café 😀"


# -- exit codes when piped ----------------------------------------------------------------------


def test_piped_failures_make_the_exit_code_non_zero_and_the_session_goes_on(tmp_path):
    missing = tmp_path / "no" / "x"
    # A usage error only: 2.
    s = Session(piped=True)
    assert s.run("/frob\rHello\r/set top_p 2\r/voice Bob\r\x04") == 2
    assert [c["prompt"] for c in s.assistant.calls] == ["Hello"]
    # A runtime failure (a file that could not be written) among them: 1; the next lines still ran.
    s = Session(piped=True)
    assert s.run(f"/frob\r/save {missing}\rHello\r/save {tmp_path / 'ok'}\r\x04") == 1
    assert (tmp_path / "ok.json").exists() and len(s.assistant.calls) == 1
    # A reply that failed: 1 (an OmniError's own code), a bug: 1.
    s = Session(piped=True, assistant=FakeAssistant(fail=OutputError("disk full")))
    assert s.run("Hello\r\x04") == 1
    s = Session(piped=True, assistant=FakeAssistant(fail=RuntimeError("boom")))
    assert s.run("Hello\r/bye\r") == 1  # /bye ends it with the same code as the end of input
    # Nothing failed: 0.
    s = Session(piped=True)
    assert s.run(f"Hello\r/set seed 3\r/save {tmp_path / 'fine'}\r\x04") == 0
    # The same failures typed by a person: 0, every error was on the screen.
    s = Session(piped=False)
    assert s.run(f"/frob\r/save {missing}\r\x04") == 0
    assert s.repl.failures == [2, 1]


def test_piped_defaults_to_whether_stdin_is_a_terminal(monkeypatch):
    class Stdin(io.StringIO):
        def __init__(self, tty):
            super().__init__()
            self.tty = tty

        def isatty(self):
            return self.tty

    for tty in (True, False):
        monkeypatch.setattr(sys, "stdin", Stdin(tty))
        repl = ChatRepl(FakeAssistant(), make_console(file=io.StringIO()), make_console(file=io.StringIO()))
        assert repl.piped is (not tty)


def test_input_that_ends_inside_a_multi_line_block_is_an_error():
    s = Session(piped=True)
    assert s.run_lines("Hello", '"""', "a draft that never ends") == 2
    assert s.err == 'error: the input ended inside a """ block: that message was not sent (end it with a line that ends with """)\n'
    assert [c["prompt"] for c in s.assistant.calls] == ["Hello"]


# -- /set and /show -----------------------------------------------------------------------------


def test_set_changes_the_options_of_the_next_replies():
    s = Session()
    s.run("/set temperature 0.7\r/set top_p 0.9\r/set TOP-K 40\r/set seed 3\r/set max_codes 1500\r"
          "/set parameter max_text_tokens 256\rHello\r/set greedy on\r/set temperature default\r/set seed random\r"
          "Again\r\x04")
    first, second = s.assistant.calls
    assert (first["temperature"], first["top_p"], first["top_k"], first["seed"], first["max_codes"],
            first["max_text_tokens"], first["greedy"]) == (0.7, 0.9, 40, 3, 1500, 256, False)
    assert (second["temperature"], second["seed"], second["greedy"], second["top_p"]) == (None, None, True, 0.9)
    assert s.repl.options == ReplyOptions(voice="Chelsie", greedy=True, top_p=0.9, top_k=40, max_codes=1500,
                                          max_text_tokens=256)
    for line in ("temperature: 0.7", "top_k: 40", "seed: 3", "greedy: on", "max_text_tokens: 256",
                 "temperature: model default", "seed: random (a new seed for each reply)"):
        assert line in s.err.splitlines()


def test_set_refuses_bad_values_and_changes_nothing():
    s = Session(piped=True)
    before = s.repl.options
    code = s.run("/set temperature hot\r/set temperature -1\r/set top_p 0\r/set top_k -3\r/set top_k 2.5\r"
                 "/set seed x\r/set greedy maybe\r/set max_codes 0\r/set max_text_tokens 1e3\r/set temperature nan\r"
                 "/set warmth 3\r/set temperature\r/set top_k 1 2\r\x04")
    assert code == 2 and s.repl.options == before
    assert s.err.splitlines() == [
        "error: temperature must be a number (got 'hot')",
        "error: temperature must be between 0 and 100 (got -1)",
        "error: top_p must be above 0 and at most 1 (got 0)",
        "error: top_k must be 0 (off) or more (got -3)",
        "error: top_k must be a whole number (got '2.5')",
        "error: seed must be a whole number (got 'x')",
        "error: greedy is on or off (got 'maybe')",
        "error: max_codes must be at least 1 (got 0)",
        "error: max_text_tokens must be a whole number (got '1e3')",
        "error: temperature must be a finite number (got 'nan')",
        "error: unknown setting 'warmth': the settings are temperature, top_p, top_k, seed, greedy, max_codes, "
        "max_text_tokens",
        "error: /set temperature needs one value, e.g. /set temperature 0.7",
        "error: /set top_k needs one value, e.g. /set top_k 40",
    ]


def test_set_alone_lists_the_settings():
    s = Session(options=ReplyOptions(temperature=0.5, greedy=True))
    s.run("/set\r\x04")
    assert s.err.splitlines() == [
        "  temperature      0.5",
        "  top_p            model default",
        "  top_k            model default",
        "  seed             random (a new seed for each reply)",
        "  greedy           on",
        "  max_codes        model default",
        "  max_text_tokens  model default",
        "  /set NAME VALUE changes one; /set NAME default goes back to the model's",
    ]


def test_show_names_the_model_voice_sound_system_and_settings():
    s = Session()
    s.run("/set seed 3\r/mute\r/show\r\x04")
    shown = s.err.splitlines()[2:]
    assert shown == [
        "  model            fake",
        "  voice            Chelsie",
        "  sound            muted (text only)",
        "  system           'You are Qwen, a virtual human developed by the Qwen Team,...'  (/system shows it whole)",
        "  temperature      model default",
        "  top_p            model default",
        "  top_k            model default",
        "  seed             3",
        "  greedy           off",
        "  max_codes        model default",
        "  max_text_tokens  model default",
    ]
    s = Session()
    s.run("/system Be brief.\r/show\r\x04")
    assert "  system           'Be brief.'" in s.err.splitlines()


def test_help_lists_set_show_and_load():
    s = Session()
    s.run("/?\r\x04")
    for cmd in ("/set [NAME VALUE]", "/show", "/load PATH"):
        assert cmd in s.err


# -- /save and /load ----------------------------------------------------------------------------


def test_save_then_load_resumes_the_conversation(tmp_path):
    first = Session()
    first.run(f"/system Be brief.\rHello\rHow are you?\r/save {tmp_path / 'talk'}\r\x04")
    data = json.loads((tmp_path / "talk.json").read_text())
    assert data["format"] == 1 and data["context_from"] == 0 and data["system"] == "Be brief."

    second = Session()
    second.run(f"/load {tmp_path / 'talk'}\r\x04")
    assert second.err.splitlines() == [
        f"loaded {tmp_path / 'talk.json'} (2 exchanges)",
        f"note: the speech of those replies stays in {tmp_path / 'talk.wav'}; the next /save writes the speech "
        "of the replies from now on",
    ]
    assert second.repl.chat.history == first.repl.chat.history  # system prompt and turns
    assert second.repl.transcript == first.repl.transcript
    second.run(f"And then?\r/save {tmp_path / 'more.json'}\r\x04")
    assert second.assistant.calls[0]["prompt"] == "And then?"
    more = json.loads((tmp_path / "more.json").read_text())
    # The whole conversation, and the new reply's speech where its turn is.
    assert [t["content"] for t in more["turns"][::2]] == ["Hello", "How are you?", "And then?"]
    assert more["system"] == "Be brief." and more["audio_segments"] == [{"turn": 5, "start": 0.0, "seconds": 0.5}]
    assert sf.info(tmp_path / "more.wav").frames == 12_000
    # Loading replaces what the session had; the .wav's name finds the JSON beside it.
    second.run(f"/load {tmp_path / 'talk.wav'}\r\x04")
    assert "it replaces this session's 3 exchanges" in second.err
    assert len(second.repl.transcript) == 4 and second.repl.speech == []


def test_load_transcript_errors(tmp_path):
    (tmp_path / "notjson.json").write_text("Hello there\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "shape.json").write_text('{"turns": [{"role": "assistant", "content": "hi"}]}')
    (tmp_path / "odd.json").write_text('{"turns": [{"role": "user", "content": "hi"}]}')
    (tmp_path / "newer.json").write_text('{"format": 2, "turns": []}')
    (tmp_path / "latin1.json").write_bytes(b'{"turns": [], "system": "caf\xe9"}')
    cases = {
        "nothing": f"cannot load {tmp_path / 'nothing'} or {tmp_path / 'nothing.json'}: no such file (/save PATH "
                   "writes PATH.json)",
        "notjson.json": f"cannot load {tmp_path / 'notjson.json'}: it is not JSON (line 1, column 1: Expecting value)",
        "list": f"cannot load {tmp_path / 'list.json'}: it is JSON but not a transcript (a list, not an object "
                'with "turns")',
        "shape": f"cannot load {tmp_path / 'shape.json'}: turn 1 is not a user message "
                 '({"role": "user", "content": "..."})',
        "odd": f"cannot load {tmp_path / 'odd.json'}: its last turn (1) is a user message without the assistant's reply",
        "newer": f"cannot load {tmp_path / 'newer.json'}: it was written in transcript format 2 by a newer "
                 "omni-cli; this one reads format 1: upgrade omni-cli",
        "latin1": f"cannot load {tmp_path / 'latin1.json'}: it is not UTF-8 text (byte 0xe9 at offset 28), so not a "
                  "transcript",
        "": "/load needs a path: /load PATH reads PATH or PATH.json (written by /save)",
    }
    s = Session(piped=True)
    s.run("Hello\r" + "".join(f"/load {tmp_path / name if name else ''}\r" for name in cases) + "Again\r\x04")
    assert s.err.splitlines() == [f"error: {message}" for message in cases.values()]
    assert s.code == 2  # all usage errors
    assert len(s.repl.transcript) == 4  # nothing was replaced; the session went on
    repl = Session().repl
    with pytest.raises(UsageError, match="no such file"):  # what omni-chat --load calls
        repl.load_transcript(tmp_path / "nothing")


def test_load_reads_files_without_a_format_and_the_api_s_own(tmp_path):
    # Written before "format" existed (/save's old shape) and by Conversation.save.
    (tmp_path / "old.json").write_text(json.dumps({"model": "fake", "voice": "Ethan", "system": DEFAULT_SYSTEM,
                                                   "turns": [{"role": "user", "content": "Hi"},
                                                             {"role": "assistant", "content": "Hello!"}],
                                                   "audio": None, "audio_segments": []}))
    Conversation(system="", turns=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]).save(
        tmp_path / "api.json")
    assert json.loads((tmp_path / "api.json").read_text())["format"] == 1
    s = Session()
    s.run(f"/load {tmp_path / 'old'}\r\x04")
    assert s.err == f"loaded {tmp_path / 'old.json'} (1 exchange)\n"
    assert s.repl.chat.history.turns[1]["content"] == "Hello!"
    s.run(f"/load {tmp_path / 'api.json'}\r/show\r\x04")
    assert s.repl.chat.history.system == "" and "  system           (none)" in s.err
    assert f"  loaded from      {tmp_path / 'api.json'}" in s.err


def test_load_notes_another_model(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"format": 1, "model": "Qwen/Qwen2.5-Omni-7B", "turns": []}))
    s = Session()
    s.run(f"/load {tmp_path / 't.json'}\r\x04")
    assert "note: it was saved with the model Qwen/Qwen2.5-Omni-7B; this session runs fake" in s.err


# -- word wrap of the streamed reply ------------------------------------------------------------


def wrap(width, *pieces):
    w = StreamWrapper(width)
    return "".join(w.feed(p) for p in pieces) + w.end()


@pytest.mark.unit
def test_stream_wrapper_tricky_input():
    assert wrap(10, "hello wor", "ld this is a test") == "hello\nworld this\nis a test"  # a word split by deltas
    assert wrap(10, "a  b   c") == "a  b   c"  # spaces inside a line are kept
    assert wrap(10, "hello     ", "world") == "hello\nworld"  # spaces where the line breaks are dropped
    assert wrap(5, "abcdefghijklmnop qr") == "abcde\nfghij\nklmno\np qr"  # longer than a line: hard breaks
    assert wrap(10, "xxxxxxxxxx", " y") == "xxxxxxxxxx\ny"  # a line may be exactly the width
    assert wrap(10, "one\n\ntwo three four") == "one\n\ntwo three\nfour"  # "\n" resets the column
    assert wrap(10, "one two  \nthree") == "one two\nthree"  # invisible trailing blanks go
    assert wrap(10, "one two\n  ind line here") == "one two\n  ind line\nhere"  # indentation is kept...
    assert wrap(10, "one two\n    indented") == "one two\nindented"  # ...unless the word would not fit after it
    assert wrap(6, "你好世界你好") == "你好世\n界你好"  # two cells each, and breakable anywhere
    assert wrap(7, "ab 你好世界") == "ab 你好\n世界"
    assert wrap(20, "a\tb") == "a       b"  # a tab: to the next multiple of 8
    assert wrap(1, "ab c") == "a\nb\nc"


@pytest.mark.unit
def test_stream_wrapper_streams_without_waiting_for_the_end():
    w = StreamWrapper(10)
    assert w.feed("Hello") == ""  # the word may still grow
    assert w.feed(" ") == "Hello"  # now it is whole
    # Longer than a line: it breaks hard wherever it starts, so it starts here and is printed as it comes.
    assert w.feed("supercalifragilistic") == " supe\nrcalifragi\n"
    assert w.feed("expi") == ""  # "listicexpi": a line's worth, may still move on as a whole
    assert w.feed("alidocious") == "listicexpi\n"
    assert w.end() == "alidocious"
    assert w.column == 10


@pytest.mark.unit
def test_stream_wrapper_any_split_gives_the_same_lines():
    rng = random.Random(0)
    words = ["a", "to", "the", "words", "streamed", "hippopotamus", "x" * 23, "", "\n", "  "]
    for _ in range(300):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        width = rng.randint(1, 16)
        whole = wrap(width, text)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 8))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        assert wrap(width, *pieces) == whole, (text, width, pieces)
        lines = whole.split("\n")
        assert all(len(line) <= width for line in lines), (text, width, whole)
        assert "".join(whole.split()) == "".join(text.split())  # nothing lost, nothing added
        for word in text.split():  # a word that fits on a line is never split
            if len(word) <= width:
                assert word in whole.split(), (word, whole)
        # Greedy: with single spaces and no newlines in the text, a line is broken only where the next
        # word (and the space before it) would not have fitted on it.
        if "  " in text or "\n" in text:
            continue
        for line, following in zip(lines, lines[1:]):
            nxt = following.split(" ")[0]
            if line and len(nxt) <= width:
                assert len(line) + 1 + len(nxt) > width, (line, nxt, width, text)


def test_the_reply_is_wrapped_on_a_terminal_and_not_into_a_pipe():
    s = Session(wrap=7)
    s.run("Hello\r\x04")
    assert s.out == "Hi\nthere.\n"  # "Hi " and "there." arrive as two deltas
    s = Session()  # wrap=None: the console writes to a StringIO, not a terminal
    s.run("Hello\r\x04")
    assert s.out == "Hi there.\n"
    s = Session(wrap=False)
    s.run("Hello\r\x04")
    assert s.out == "Hi there.\n"


# -- the real tiny model, in-process ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    import omni_cli
    from omni_cli.config import RuntimeOptions

    return omni_cli.load(runtime=RuntimeOptions(max_context=512))


@pytest.mark.model
def test_real_turns_with_the_tiny_model(tiny):
    s = Session(assistant=tiny, sd=FakeSoundDevice(speed=50.0), options=ReplyOptions(seed=0, max_text_tokens=6, max_codes=40))
    s.run("Hello\r/voice Ethan\rAnd you?\r/stats\r\x04")
    assert len(s.repl.chat.history.turns) == 4
    lines = s.out.splitlines()
    assert len(lines) == 2 and all(lines)
    assert "session: 2 replies" in s.err
    for stream, (_, audio) in zip(s.sd.streams, s.repl.speech):
        played = stream.audio
        np.testing.assert_array_equal(played[played != 0], audio[audio != 0])


@pytest.fixture
def hang_guard():
    """A turn that never comes back fails the run with every thread's traceback instead of hanging it."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.model
def test_real_ctrl_c_during_a_reply_with_the_tiny_model(tiny, hang_guard):
    # A 30 s reply played at real time (seed 2: the tiny model says 1500 codes; a reply that ended before
    # the Ctrl-C would let it reach pytest); Ctrl-C 1 s into the sound: generation and sound stop within 200 ms.
    s = Session(assistant=tiny, sd=FakeSoundDevice(speed=1.0), options=ReplyOptions(seed=2, max_text_tokens=200, max_codes=1500))
    records = []
    for attempt in range(3):
        turn = len(s.sd.streams)  # this turn's stream is the next one opened
        interrupter = interrupt_when(lambda: s.sd.streams[turn].active, delay=1.0 + 0.13 * attempt)
        s.run("Tell me a long story\r\x04")
        interrupter.cancel()
        assert interrupter.reached
        records.append(s.repl.interrupts[-1])
        assert s.sinks[-1].aborted and not s.sd.streams[-1].active
    assert all(r["to_silence"] < 0.2 and r["to_prompt"] < 0.2 for r in records), records
    assert s.repl.chat.history.turns == []
    # The engine's threads are gone; the vocoder's may finish the chunk it was in (it is joined
    # before the next turn), but not much later.
    deadline = time.monotonic() + 2.0
    while [t for t in threading.enumerate() if t.name.startswith("omni-")] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("omni-")]
    s.repl.options = replace(s.repl.options, max_codes=30, max_text_tokens=4)  # a short turn, not 30 s of it
    s.run("Short one\r\x04")
    assert len(s.repl.chat.history.turns) == 2 and s.repl.replies == 1


@pytest.mark.model
def test_real_context_overflow_drops_the_oldest_turns(tiny, caplog):
    # The library logs the note (it never prints); omni-chat's command shows it as "note: ..." on stderr.
    caplog.set_level("INFO", logger="omni_cli")
    s = Session(assistant=tiny, options=ReplyOptions(seed=1, max_text_tokens=60), muted=True)
    s.run("".join(f"Message number {i} with a few more words in it to fill up the context\r" for i in range(8)) + "\x04")
    notes = [r.getMessage() for r in caplog.records if r.name == "omni_cli.assistant"]
    assert notes and all(n.startswith("dropped the oldest") and n.endswith("exchange(s) to fit the context") for n in notes)
    assert s.repl.replies == 8
    assert len(s.repl.transcript) == 16 and len(s.repl.chat.history.turns) < 16


@pytest.mark.model
def test_real_surrogates_are_a_usage_error_not_a_tokenizer_type_error(tiny):
    with pytest.raises(UsageError, match=r"^the prompt is not UTF-8 text \(byte 0xe9 at character 4\)"):
        tiny.say("caf\udce9", text_only=True)
    with pytest.raises(UsageError, match=r"^the system prompt is not UTF-8 text"):
        tiny.conversation(system="pir\udce9te").say("Hello", text_only=True)


@pytest.mark.model
def test_real_a_media_marker_in_text_is_a_usage_error_and_one_in_a_reply_stays_text(tiny):
    # Typed, "<|AUDIO|>" is tokenized as the marker itself: with a clip, the prompt had one place more than
    # clips ("internal error: generator raised StopIteration"; on a GPU a device-side assert).
    from omni_cli.media import AudioClip

    clip = AudioClip(np.zeros(16_000, dtype=np.float32), 16_000)
    with pytest.raises(UsageError, match=r"^a user message holds <\|AUDIO\|>, the model's marker") as caught:
        tiny.say("What is <|AUDIO|> here?", audio=[clip], text_only=True)
    assert "shorter clip" not in str(caught.value)  # the too-long prompt's hint is not added
    with pytest.raises(UsageError, match=r"^the system prompt holds <\|vision_bos\|>"):
        tiny.conversation(system="Look: <|vision_bos|>").say("Hello", text_only=True)
    # A reply that spelled a marker out (ordinary tokens) goes into the next prompt as text, not as the marker.
    tokenizer = tiny.loaded.tokenizer
    marker = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    conv = Conversation("", [])
    conv.add("Say the marker", "It is <|AUDIO|>.")
    ids, _ = fit(tokenizer, conv, "Again?", 400)
    assert marker not in ids and "It is <\u200b|AUDIO|>." in tokenizer.decode(ids)
    assert tiny.say("Again?", conversation=conv, text_only=True, max_text_tokens=4).text_ids


def test_media_markers_are_found_in_both_families_tokenizers():
    from transformers import AutoTokenizer

    from omni_cli.prompt import MarkerError, build_ids, media_markers

    root = os.path.join(os.path.dirname(__file__), "..", "assets")
    want = {"tiny-qwen2.5-omni": {"<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>",
                                  "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>"},
            "tiny-qwen3-omni": {"<|audio_pad|>", "<|image_pad|>", "<|video_pad|>", "<|audio_start|>",
                                "<|audio_end|>", "<|vision_start|>", "<|vision_end|>"}}
    for name, markers in want.items():
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(root, name))
        assert markers <= set(media_markers(tokenizer)), name
        assert not {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} & set(media_markers(tokenizer))
        for marker in markers:  # a text part of a user message too
            with pytest.raises(MarkerError):
                build_ids(tokenizer, [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": marker}]}])


@pytest.mark.model
def test_real_save_and_load_give_the_prompt_of_a_session_that_never_stopped(tiny, tmp_path):
    # Long messages in a small context, so that older exchanges were dropped from the model's history:
    # the loaded session must prompt the model with exactly what the first one would have.
    options = ReplyOptions(seed=2, max_text_tokens=8)
    long = " ".join(["a message long enough to fill the tiny model's context quickly"] * 4)
    first = Session(assistant=tiny, options=options, muted=True)
    first.run("".join(f"{i}: {long}\r" for i in range(5)) + f"/save {tmp_path / 'talk'}\r\x04")
    history = first.repl.chat.history
    assert len(first.repl.transcript) == 10 and len(history.turns) < 10  # some were dropped
    saved = json.loads((tmp_path / "talk.json").read_text())
    assert saved["context_from"] == 10 - len(history.turns)

    second = Session(assistant=tiny, options=options, muted=True)
    second.repl.load_transcript(tmp_path / "talk")
    assert "the older ones no longer fitted its context" in second.err
    tokenizer, budget = tiny.loaded.tokenizer, tiny.max_context - options.max_text_tokens

    def next_prompt(repl):
        conv = Conversation(repl.chat.history.system, list(repl.chat.history.turns))
        return fit(tokenizer, conv, "And after that?", budget)

    assert next_prompt(second.repl) == next_prompt(first.repl)
    # The same through the real turn: both sessions answer the next message alike (same seed, same ids).
    first.run("And after that?\r\x04")
    second.run("And after that?\r\x04")
    assert second.repl.transcript[-1] == first.repl.transcript[-1]
    assert second.repl.chat.history == first.repl.chat.history


@pytest.mark.model
def test_real_load_gives_the_turns_their_clips_back(tiny, tmp_path):
    """A clip said with a message stays in the model's history (the next turns hear it again), and a
    saved and loaded session has it there too: its next prompt is the one the first session would send.
    A clip file gone by the time of the load is one note, and that turn goes on without it."""
    clip = tmp_path / "sound.wav"
    t = np.arange(16_000) / 16_000
    sf.write(clip, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 16_000)
    options = ReplyOptions(seed=2, max_text_tokens=4)
    first = Session(assistant=tiny, options=options, muted=True)
    first.run(f"/audio {clip}\rWhat is it?\rAnd now?\r/save {tmp_path / 'talk'}\r\x04")
    assert [len(t.get("media", {}).get("audio", [])) for t in first.repl.chat.history.turns] == [1, 0, 0, 0]
    audio_token = tiny.family.audio_token_id(tiny.loaded.model.config)

    def next_ids(repl):
        seen, original = {}, tiny.engine.stream
        tiny.engine.stream = lambda req: (seen.setdefault("ids", list(req.input_ids)), original(req))[1]
        try:
            repl.chat.say("Once more?", options)
        finally:
            tiny.engine.stream = original
        return seen["ids"]

    second = Session(assistant=tiny, options=options, muted=True)
    second.repl.load_transcript(tmp_path / "talk")
    ids = next_ids(second.repl)
    assert ids.count(audio_token) > 10  # the first turn's clip, heard again
    assert ids == next_ids(first.repl)

    clip.unlink()
    third = Session(assistant=tiny, options=options, muted=True)
    third.repl.load_transcript(tmp_path / "talk")
    assert "that turn goes on without it" in third.err
    assert next_ids(third.repl).count(audio_token) == 0


# -- omni-chat as a subprocess, reading a script on stdin -----------------------------------------


@pytest.mark.e2e
def test_chat_script_on_stdin(run_chat, tmp_path):
    script = "Hello\n/voice Ethan\n\"\"\"\nTwo\nlines\n\"\"\"\n/frob\n/save talk\n"
    result = run_chat("--mute", "--seed", "0", "--max-text-tokens", "5", input=script, cwd=tmp_path,
                      env=cli_env(OMNI_NOHISTORY="1"))
    assert result.returncode == 2, result.stderr  # piped, and /frob failed (a usage error); the rest ran
    assert len(result.stdout.splitlines()) == 2  # two replies, nothing else on stdout
    err = result.stderr.splitlines()
    assert err[0].startswith("note: ")  # the demo model
    assert "voice: Ethan" in err and "error: unknown command '/frob': type /? for help" in err
    assert any(line.startswith("saved talk.json (2 exchanges; no speech to save)") for line in err), err
    turns = json.loads((tmp_path / "talk.json").read_text())["turns"]
    assert [t["content"] for t in turns[::2]] == ["Hello", "Two\nlines"]


def test_chat_bad_model(fake, tmp_path):
    result = invoke_chat("-m", tmp_path / "nope", "--mute", input="")
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (f"error: model folder {tmp_path / 'nope'} does not exist (pass a model folder or a hub id "
                             "such as Qwen/Qwen2.5-Omni-7B)\n")
    assert fake.load_args is None


@pytest.mark.e2e
def test_chat_without_a_sound_device(run_chat, tmp_path):
    # PortAudio itself finds no device (ALSA's configuration, read as sounddevice is imported): a program run.
    from audio_device import no_alsa_device

    result = run_chat(input="", env=cli_env(**no_alsa_device(tmp_path)))
    assert result.returncode == 1
    assert result.stderr.startswith("error: cannot play audio: no sound output device found")
    assert "start omni-chat with --mute" in result.stderr and result.stderr.count("\n") == 1


def _omni_chat_piped(stdin: bytes, *args: str):
    """`printf ... | omni-chat --mute ARGS` in this process (CliRunner: stdin is not a terminal, so the
    chat reads it a line at a time, as bytes), with the fake assistant; its Result."""
    return invoke_chat("--mute", "--max-text-tokens", "4", *args, input=stdin)


def test_chat_piped_non_utf8_input_is_one_error_line_and_exit_2(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMNI_NOHISTORY", "1")
    result = _omni_chat_piped(b"caf\xe9\nhello\n")
    assert result.exit_code == 2 and result.stdout == ""
    err = [line for line in result.stderr.splitlines() if not line.startswith("note: ")]
    assert err == ["error: stdin is not UTF-8 text (byte 0xe9 on line 1, at offset 3): convert it first, "
                   "e.g. iconv -f latin1 -t utf-8"]
    assert fake.assistant.calls == []  # nothing after the bad line was said


def test_chat_piped_failures_give_a_non_zero_exit_after_the_rest_ran(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMNI_NOHISTORY", "1")
    result = _omni_chat_piped(b"Hello\n/save no/such/folder/x\n/frob\nAgain\n/save talk\n", "--seed", "0")
    assert result.exit_code == 1, result.stderr  # a runtime failure (the /save) among them
    assert len(result.stdout.splitlines()) == 2  # both messages were answered
    err = result.stderr.splitlines()
    assert f"error: cannot write {os.path.join('no', 'such', 'folder', 'x.json')}: folder " \
           f"{os.path.join('no', 'such', 'folder')} does not exist" in err
    assert len(json.loads((tmp_path / "talk.json").read_text())["turns"]) == 4
