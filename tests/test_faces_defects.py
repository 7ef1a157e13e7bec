"""The defects a new user hit (issue 28), each checked where it was: the faces driven in-process (typer's
CliRunner) with a fake assistant and the keep-alive's functions stubbed, so no model and no server runs.

- a built-in model named with -m, answered by a server, gets one note saying what it is, not "no model given";
- a mistyped -m path is a usage error before any server is asked, started or stopped;
- leaving omni-chat lets its server go at once (it no longer counts as held);
- `--verbose` counts the first sound from the reply's start, as the first audio; a device that is not paced
  by a clock does not report minutes of silence;
- Ctrl-C during a reply with -o and --play leaves no file and prints no more text;
- one-shot --system, `-v '?'`, omni-chat -q, /show's defaults, the unknown command's `error:`.
"""

from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from audio_device import FakeSoundDevice
from conftest import REPO_ROOT
from fakes import FakeAssistant

QWEN3 = REPO_ROOT / "assets" / "tiny-qwen3-omni"


class FakeRemote(FakeAssistant):
    """A server's client as the faces see it: a URL, the server's model entry, `send` before `stream`."""

    def __init__(self, name="tiny-qwen3-omni", is_demo=True, **kwargs):
        super().__init__(**kwargs)
        self.name, self.is_demo = name, is_demo
        self.url = "http://127.0.0.1:9"
        self.info = {"key": "k", "runtime": None}
        self.sent = []

    def send(self, prompt, options=None, **kwargs):
        self.sent.append((prompt, kwargs))


def say(*args, input=None):
    from omni_cli.faces.say import say_app

    return CliRunner().invoke(say_app, [str(a) for a in args], prog_name="omni-say", input=input)


def chat(*args, input=""):
    from omni_cli.faces.chat.main import chat_app

    return CliRunner().invoke(chat_app, [str(a) for a in args], prog_name="omni-chat", input=input)


@pytest.fixture
def servers(monkeypatch):
    """The keep-alive's and the client's entry points, recorded: which were asked, started or stopped."""
    from omni_cli.api import client, keep_alive

    state = SimpleNamespace(found=None, asked=[], started=[], stopped=[])
    monkeypatch.delenv("OMNI_LOCAL", raising=False)  # conftest's default: these tests look for servers

    def find_local_server(model, api_key=None):
        state.asked.append(model)
        return state.found

    monkeypatch.setattr(client, "find_local_server", find_local_server)
    monkeypatch.setattr(keep_alive, "start_server", lambda *a, **k: state.started.append(a) or None)
    monkeypatch.setattr(keep_alive, "_stop_idle", lambda *a: state.stopped.append(a) or True)
    return state


def test_a_builtin_model_named_with_m_and_served_gets_one_note_of_what_it_is(servers, tmp_path):
    servers.found = FakeRemote()
    result = say("hi", "-m", QWEN3, "-o", tmp_path / "a.wav")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert "no model given" not in result.stderr
    assert [n for n in notes if "built-in tiny model" in n] == [
        "note: tiny-qwen3-omni is a built-in tiny model: its weights are random, so it prints gibberish and speaks "
        "noise"]


def test_a_server_named_with_server_that_serves_a_builtin_model_says_so(monkeypatch, tmp_path):
    """--server URL answered by the built-in tiny model: the same note as a local load of it (random
    weights), once."""
    from omni_cli.api import client

    monkeypatch.setattr(client.RemoteAssistant, "connect", classmethod(lambda cls, url, key=None: FakeRemote()))
    result = say("hi", "--server", "http://127.0.0.1:9", "-o", tmp_path / "a.wav")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("its weights are random") == 1, result.stderr


def test_no_model_given_and_served_says_so_once(servers, tmp_path):
    servers.found = FakeRemote(name="tiny-qwen2.5-omni")
    result = say("hi", "-o", tmp_path / "a.wav")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("no model given, using the built-in tiny demo model") == 1


@pytest.mark.parametrize("face", [say, chat])
def test_a_mistyped_model_path_is_a_usage_error_before_any_server_is_touched(servers, face, tmp_path):
    missing = tmp_path / "nonexistent"
    result = face("hi", "-m", missing) if face is say else face("-m", missing, "--mute")
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: model folder {missing} does not exist (pass a model folder or a hub "
                                     "id such as Qwen/Qwen2.5-Omni-7B)")
    assert (servers.asked, servers.started, servers.stopped) == ([], [], [])


def test_leaving_omni_chat_releases_its_server(servers, monkeypatch):
    from omni_cli.api import keep_alive

    servers.found = FakeRemote(is_demo=False, name="fake")
    holds = []

    class Recorded:
        def __init__(self, url):
            self.url, self.released = url, False
            holds.append(self)

        def release(self):
            self.released = True

    monkeypatch.setattr(keep_alive, "hold", Recorded)
    result = chat("--mute", input="Hello\n/bye\n")
    assert result.exit_code == 0, result.output
    assert [(h.url, h.released) for h in holds] == [("http://127.0.0.1:9", True)]


def test_a_released_holder_no_longer_holds_the_server():
    """The server's side: /health?hold=ID marks it held, /health?release=ID lets go at once (another
    holder still holds it)."""
    from starlette.testclient import TestClient

    from omni_cli.api.server import create_app

    app = create_app(ServedFake(), "fake")
    app.state.keep_alive = 300.0
    with TestClient(app, base_url="http://localhost") as http:
        assert http.get("/health").json()["held"] is False
        assert http.get("/health?hold=a").json()["held"] is True
        assert http.get("/health?hold=b").json()["held"] is True
        assert http.get("/health?release=a").json()["held"] is True  # b still holds it
        assert http.get("/health?release=b").json()["held"] is False


class ServedFake(FakeAssistant):
    """What create_app reads of a local assistant, beyond the faces' interface."""

    eos_ids = [0]
    limits = {"text": 8, "codes": 50}
    max_context = 4096
    runtime = {"device": "cpu", "dtype": "float32", "graphs": False, "compile": False}


def test_time_to_first_sound_counts_from_the_replys_start():
    from omni_cli.faces.timing import timing_lines

    stats = {"started_at": 100.0, "time_to_first_text": 0.05, "time_to_first_audio": 0.395, "audio_seconds": 1.0,
             "total_time": 1.0}
    playback = {"first_sound_at": 100.46, "start_delay": 0.061, "underruns": 0, "underrun_seconds": 0.0}
    rows = dict(timing_lines(stats, playback))
    assert rows["time to first audio"] == "395 ms"
    assert rows["time to first sound"] == "460 ms"  # not the 61 ms from when the speaker was opened


def _unpaced_silence(wall_clock: bool) -> tuple[dict, float]:
    """Four 0.1 s blocks, 0.15 s apart, to a device that asks for buffers 1000 times faster than real time."""
    from omni_cli.audio.speaker import SpeakerSink

    sink = SpeakerSink(backend=FakeSoundDevice(speed=1000.0, wall_clock=wall_clock), prebuffer=0.0)
    rate = 24_000
    sink.open(rate)
    sink.start(rate)
    t0 = time.perf_counter()
    block = np.full(rate // 10, 0.1, dtype=np.float32)
    for _ in range(4):
        sink.write(block)
        time.sleep(0.15)
    sink.close()
    return sink.stats, time.perf_counter() - t0


def test_an_unpaced_device_reports_no_more_silence_than_its_clock_saw():
    """ALSA's null device asks for audio as fast as it can but gives its DAC time on the wall clock: the
    silence counted is what that clock saw pass (here at most the run's 0.6 s), not the frames asked for."""
    stats, wall = _unpaced_silence(wall_clock=True)
    assert stats["underruns"] == 3, stats
    assert 0.2 < stats["underrun_seconds"] <= wall, stats
    # The same device without time info: only the frames are known, and they are minutes' worth.
    stats, _ = _unpaced_silence(wall_clock=False)
    assert stats["underrun_seconds"] > 60, stats


def test_ctrl_c_with_o_and_play_leaves_no_file_and_prints_no_more_text(monkeypatch, tmp_path):
    """SIGINT in the middle of a reply that goes to a file and the speakers: the file never appears, and
    the text stops where it was."""
    import omni_cli
    import omni_cli.audio.speaker

    sd = FakeSoundDevice(speed=20.0)
    monkeypatch.setattr(omni_cli.audio.speaker, "import_sounddevice", lambda hint=None: sd)

    class Slow(FakeAssistant):
        def stream(self, prompt, options=None, *, sink=None, **fields):
            from omni_cli.runtime.events import TextDelta

            sink.start(self.sample_rate)
            for i in range(200):
                if i == 3:
                    signal.raise_signal(signal.SIGINT)  # as the terminal's Ctrl-C (main thread)
                yield TextDelta(f"w{i} ")
                sink.write(np.zeros(240, dtype=np.float32))
            sink.close()

    monkeypatch.setattr(omni_cli, "load", lambda *a, **k: Slow())
    out = tmp_path / "F.wav"
    result = say("hi", "-o", out, "--play", "--keep-alive", "0")
    assert threading.current_thread() is threading.main_thread()
    assert result.exit_code == 130, result.output
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []
    assert "w5" not in result.stdout and "w0" in result.stdout


def test_system_for_one_question_and_voice_question_mark(monkeypatch, tmp_path, tiny_model_dir):
    import omni_cli

    fake = FakeAssistant()
    seen = []
    real = fake.stream

    def stream(prompt, options=None, **kwargs):
        seen.append(kwargs.get("conversation"))
        return real(prompt, options, **kwargs)

    fake.stream = stream
    monkeypatch.setattr(omni_cli, "load", lambda *a, **k: fake)
    result = say("hi", "-s", "Answer in French.", "-o", tmp_path / "a.wav", "--keep-alive", "0")
    assert result.exit_code == 0, result.output
    assert seen[0] is not None and seen[0].system == "Answer in French."
    listed = say("-v", "?", "-m", tiny_model_dir)
    assert (listed.exit_code, listed.stdout.split()) == (0, ["Chelsie", "Ethan"])


def test_chat_quiet_and_the_unknown_command_line(monkeypatch):
    import omni_cli

    monkeypatch.setattr(omni_cli, "load", lambda *a, **k: FakeAssistant())
    result = chat("--mute", "-q", "--keep-alive", "0", input="/nosuch\n")
    assert result.exit_code == 2
    assert "note:" not in result.stderr
    assert "error: unknown command '/nosuch': type /? for help" in result.stderr


def test_v1_models_shows_no_path_of_the_servers_machine(tmp_path):
    """The key by which the commands recognise a served model is a digest, not the folder's path."""
    from starlette.testclient import TestClient

    from omni_cli.api.client import model_key
    from omni_cli.api.server import create_app

    folder = tmp_path / "secret-folder" / "my-model"
    folder.mkdir(parents=True)
    key = model_key(folder)
    assert key == model_key(str(folder) + "/") and key != model_key(tmp_path)  # the same folder, however typed
    with TestClient(create_app(ServedFake(), "my-model", key=key), base_url="http://localhost") as http:
        body = http.get("/v1/models").text
    assert "secret-folder" not in body and str(tmp_path) not in body and key in body


def test_the_readmes_out_of_range_message_is_the_one_printed():
    readme = (REPO_ROOT / "README.md").read_text()
    shown = readme.split('$ omni-say "Hello" --max-codes -5\n', 1)[1].split("\n", 1)[0]
    result = say("Hello", "--max-codes", "-5")
    assert (result.exit_code, result.stderr.strip()) == (2, shown)
