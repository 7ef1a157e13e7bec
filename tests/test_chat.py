"""omni-chat's REPL as a person uses it, through prompt_toolkit's pipe input: turns, slash commands,
multi-line input, Ctrl-C (on the prompt, and during a reply: the sound stops, the session goes on),
Ctrl-D; then with the real tiny model in-process (a paced fake sound device) and as a subprocess
reading a script on stdin.

A real terminal (tmux) is in test_tmux.py; real PortAudio playback of a chat turn in test_playback.py.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import soundfile as sf
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from audio_device import FakeSoundDevice
from conftest import cli_env
from fakes import FakeAssistant
from omni_cli.chat import ChatRepl, line_reader
from omni_cli.config import ReplyOptions
from omni_cli.prompt import DEFAULT_SYSTEM
from omni_cli.sinks import SpeakerSink
from omni_cli.ui import make_console, make_history, make_session


class Session:
    """A ChatRepl fed keystrokes through a prompt_toolkit pipe; what it printed, split by stream."""

    def __init__(self, assistant=None, sd=None, **kwargs):
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
    assert s.err == "unknown command '/frobnicate': type /? for help\n"


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


def _interrupt_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_ctrl_c_during_a_reply_stops_it_and_the_session_goes_on(hang_guard):
    # 2 s of audio in 10 blocks, one every 0.2 s, played at real time.
    s = Session(assistant=FakeAssistant(seconds=2.0, blocks=10, block_delay=0.2), sd=FakeSoundDevice(speed=1.0))
    _interrupt_after(0.7)
    s.run("Tell me a story\r\x04")
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
    from omni_cli.ui import default_history_file, history_disabled_by_env

    monkeypatch.setenv("XDG_DATA_HOME", "/somewhere")
    assert str(default_history_file()) == "/somewhere/omni-cli/chat_history"
    for value, off in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("OMNI_NOHISTORY", value)
        assert history_disabled_by_env() is off


def test_line_reader_for_pipes():
    read = line_reader(io.StringIO("one\r\ntwo\n"))
    assert (read(">>> "), read(">>> ")) == ("one", "two")
    with pytest.raises(EOFError):
        read(">>> ")


# -- the real tiny model, in-process ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    import omni_cli
    from omni_cli.config import RuntimeOptions

    return omni_cli.load(runtime=RuntimeOptions(max_context=512))


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


def test_real_ctrl_c_during_a_reply_with_the_tiny_model(tiny, hang_guard):
    # A 30 s reply played at real time; Ctrl-C after 1 s: generation and sound stop within 200 ms.
    s = Session(assistant=tiny, sd=FakeSoundDevice(speed=1.0), options=ReplyOptions(seed=0, max_text_tokens=200, max_codes=1500))
    records = []
    for attempt in range(3):
        timer = _interrupt_after(1.0 + 0.13 * attempt)
        s.run("Tell me a long story\r\x04")
        timer.join()
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
    s.repl.max_codes, s.repl.max_text_tokens = 30, 4
    s.run("Short one\r\x04")
    assert len(s.repl.chat.history.turns) == 2 and s.repl.replies == 1


def test_real_context_overflow_drops_the_oldest_turns(tiny, capfd):
    s = Session(assistant=tiny, options=ReplyOptions(seed=1, max_text_tokens=60), muted=True)
    s.run("".join(f"Message number {i} with a few more words in it to fill up the context\r" for i in range(8)) + "\x04")
    err = capfd.readouterr().err
    assert "note: dropped the oldest" in err and "exchange(s) to fit the context" in err
    assert s.repl.replies == 8
    assert len(s.repl.transcript) == 16 and len(s.repl.chat.history.turns) < 16


# -- omni-chat as a subprocess, reading a script on stdin -----------------------------------------


def test_chat_script_on_stdin(run_chat, tmp_path):
    script = "Hello\n/voice Ethan\n\"\"\"\nTwo\nlines\n\"\"\"\n/frob\n/save talk\n"
    result = run_chat("--mute", "--seed", "0", "--max-text-tokens", "5", input=script, cwd=tmp_path,
                      env=cli_env(OMNI_NOHISTORY="1"))
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2  # two replies, nothing else on stdout
    err = result.stderr.splitlines()
    assert err[0].startswith("note: ")  # the demo model
    assert "voice: Ethan" in err and "unknown command '/frob': type /? for help" in err
    assert any(line.startswith("saved talk.json (2 exchanges; no speech to save)") for line in err), err
    turns = json.loads((tmp_path / "talk.json").read_text())["turns"]
    assert [t["content"] for t in turns[::2]] == ["Hello", "Two\nlines"]


def test_chat_bad_model_and_no_device(run_chat, tmp_path):
    from audio_device import no_alsa_device

    result = run_chat("-m", tmp_path / "nope", "--mute", input="")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"error: model folder {tmp_path / 'nope'} does not exist\n"
    result = run_chat(input="", env=cli_env(**no_alsa_device(tmp_path)))
    assert result.returncode == 1
    assert result.stderr.startswith("error: cannot play audio: no sound output device found")
    assert "start omni-chat with --mute" in result.stderr and result.stderr.count("\n") == 1
