"""omni-say's keep-alive (api/keep_alive.py): the first command starts an omni-serve in the background
and is answered by it, the next command on the same model uses it, another model's idle one is stopped
for a new one, a server that is not ours is left alone, a load that fails is one line, and the server
stops itself once idle. Each test has its own port ($OMNI_PORT) and cache folder, and stops what it
started."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
import soundfile as sf

from conftest import REPO_ROOT, cli_env, run_omni_say

from omni_cli.api.client import model_key
from omni_cli.api.keep_alive import parse_duration
from omni_cli.errors import UsageError

QWEN3 = REPO_ROOT / "assets" / "tiny-qwen3-omni"


def test_durations():
    assert [parse_duration(t) for t in ("300", "30s", "5m", "1.5m", "1h", "0", " 2 m ")] == \
        [300, 30, 300, 90, 3600, 0, 120]
    for bad in ("soon", "-5", "5d", ""):
        with pytest.raises(UsageError):
            parse_duration(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # a child of a command that has exited is reparented and reaped; a zombie would still answer here
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")


def _served(port: int) -> int:
    """Replies the server on `port` has served (0 while it does not answer yet)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return json.loads(response.read())["served"]
    except OSError:
        return 0


class Place:
    """A port and a cache folder of the test's own, and the environment that points omni-say at them."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = _free_port()
        self.cache = tmp_path / "cache"
        self.env = cli_env(XDG_CACHE_HOME=str(self.cache), OMNI_PORT=str(self.port), OMNI_KEEP_ALIVE="60")
        self.env.pop("OMNI_LOCAL", None)
        self.started: list[int] = []

    @property
    def record(self) -> dict | None:
        path = self.cache / "omni_cli" / "serve" / "omni-serve.json"
        return json.loads(path.read_text()) if path.exists() else None

    def say(self, *args, **env):
        result = run_omni_say(*args, "--seed", "1", "--max-codes", "60", env={**self.env, **env}, timeout=300)
        if self.record:
            self.started.append(self.record["pid"])
        return result

    def wait_gone(self, pid: int, seconds: float = 30.0) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not _alive(pid):
                return True
            time.sleep(0.1)
        return False

    def stop_all(self) -> None:
        for pid in set(self.started):
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)
                if not self.wait_gone(pid, 10):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def place(tmp_path):
    where = Place(tmp_path)
    yield where
    where.stop_all()


def test_the_next_command_uses_the_server_the_first_started_and_another_model_replaces_it(place, tmp_path):
    place.env["OMNI_API_KEY"] = "k-123"  # the background server asks for the key the commands send
    first = place.say("Hello there", "-o", tmp_path / "a.wav", "--verbose")
    assert first.returncode == 0, first.stderr
    assert "background omni-serve" in first.stderr and "tiny demo model" in first.stderr
    # --verbose: the background server's own start (served in its model info) as parts of its row
    rows = re.findall(r"^( {0,2}\S.*?) +(\d+\.\d\d) s$", first.stderr, re.M)
    names = [name for name, _ in rows]
    at, end = names.index("start omni-serve in the background, until it serves"), names.index("start-up in all")
    parts = dict(rows[at + 1 : end])
    assert {"  before loading", "  import torch and the engine", "  start Python, import omni-serve"} <= set(parts)
    assert all(name.startswith("  ") for name in parts) and "  the warm-up reply" not in parts  # --no-warm-up
    assert sum(map(float, parts.values())) <= float(rows[at][1])
    top = [float(v) for name, v in rows[:end] if not name.startswith(" ")]
    assert abs(sum(top) - float(rows[end][1])) <= 0.01 * len(top)  # the parts are not counted twice
    pid = place.record["pid"]
    assert _alive(pid)  # outlives the command that started it
    second = place.say("Hello there", "-o", tmp_path / "b.wav")
    assert second.returncode == 0, second.stderr
    assert "using omni-serve" in second.stderr and "background" not in second.stderr
    a, rate = sf.read(tmp_path / "a.wav")
    b, _ = sf.read(tmp_path / "b.wav")
    assert rate == 24000 and len(a) > 0 and (a == b).all()  # same prompt and seed, both through the server
    assert place.record["pid"] == pid  # no second server
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{place.port}/v1/models", timeout=10)
    assert refused.value.code == 401
    # A command on another model stops this server, idle now, and starts one of its own.
    result = place.say("Hi", "-m", QWEN3, "-o", tmp_path / "q3.wav")
    assert result.returncode == 0, result.stderr
    assert place.wait_gone(pid, 5)
    assert place.record["pid"] != pid and place.record["key"] == model_key(QWEN3) and place.record["model"] == str(QWEN3)
    assert len(sf.read(tmp_path / "q3.wav")[0]) > 0


def test_an_idle_server_stops_itself_and_forgets_its_record(place, tmp_path):
    result = place.say("Hi", "-o", tmp_path / "a.wav", OMNI_KEEP_ALIVE="1s")
    assert result.returncode == 0, result.stderr
    pid = place.record["pid"]
    assert place.wait_gone(pid), "the background server did not stop after its keep-alive"
    assert place.record is None
    log = (place.cache / "omni_cli" / "serve" / f"omni-serve-{place.port}.log").read_text()
    assert "no request for 1 s, stopping" in log


def test_a_server_that_is_not_ours_is_left_alone(place, tmp_path):
    """Something else listens on the port (and never answers): the command loads the model itself."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", place.port))
        other.listen(8)
        result = place.say("Hi", "-o", tmp_path / "a.wav")
    assert result.returncode == 0, result.stderr
    assert "loads in this process" in result.stderr and place.record is None
    assert len(sf.read(tmp_path / "a.wav")[0]) > 0


def test_a_load_that_fails_is_one_line(place, tmp_path, fake_model):
    folder = fake_model("broken", files=("model.safetensors", "tokenizer.json"))  # empty weights
    out = tmp_path / "x.wav"
    result = place.say("Hi", "-m", folder, "-o", out)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: the background omni-serve stopped before it served: "), lines
    assert "has no spk_dict.pt" in lines[-1]  # the server's own reason
    assert "Traceback" not in result.stderr and not out.exists()


def test_three_commands_at_once_share_one_server_and_its_record_names_it(place, tmp_path):
    """All three find no server; one starts it (under the lock), the server records itself once it
    listens, the other two wait for it. Before: each started a server and wrote the record, which in 1
    of 5 trials named the one that lost the port and exited."""
    import subprocess
    import sys

    from omni_cli.api import ownership

    env = {**place.env, "OMNI_LOCAL": ""}
    procs = [subprocess.Popen([sys.executable, "-m", "omni_cli.faces.say", "Hi", "--seed", "1", "--max-codes", "30",
                               "-o", str(tmp_path / f"{i}.wav")], env=env, cwd=REPO_ROOT,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(3)]
    results = [(p.wait(timeout=300), p.stderr.read().decode()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    servers = subprocess.run(["pgrep", "-f", f"omni_cli.faces.serve .*--port {place.port}"], capture_output=True, text=True)
    place.started += [int(pid) for pid in servers.stdout.split()]
    for code, err in results:
        assert code == 0, err
    assert len(servers.stdout.split()) == 1, servers.stdout  # one server was started
    record = place.record
    assert record is not None and record["pid"] == int(servers.stdout) and _alive(record["pid"])
    assert record["started"] == ownership.start_time(record["pid"])
    assert sum("waiting for omni-serve" in err for _, err in results) == 2, [err for _, err in results]
    assert all(len(sf.read(tmp_path / f"{i}.wav")[0]) > 0 for i in range(3))


def test_a_record_of_a_process_that_is_not_a_server_is_ignored_and_left_alone(place, tmp_path):
    """After a reboot the record's pid may be any process's: it is not waited for, nor sent SIGTERM."""
    import subprocess

    other = subprocess.Popen(["sleep", "120"])
    try:
        folder = place.cache / "omni_cli" / "serve"
        folder.mkdir(parents=True)
        for key in (str((REPO_ROOT / "assets" / "tiny-qwen2.5-omni").resolve()), "another model"):
            (folder / "omni-serve.json").write_text(json.dumps({"pid": other.pid, "key": key, "port": place.port}))
            result = place.say("Hi", "-o", tmp_path / "a.wav")
            assert result.returncode == 0, result.stderr
            assert "background omni-serve (pid" in result.stderr and "waiting" not in result.stderr
            assert other.poll() is None  # not stopped
            place.stop_all()
    finally:
        other.kill()
        other.wait()


def test_without_a_cache_folder_the_command_loads_the_model_itself(place, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    result = place.say("Hi", "-o", tmp_path / "a.wav", XDG_CACHE_HOME=str(blocker))
    assert result.returncode == 0, result.stderr
    assert "so the model loads in this process" in result.stderr and "background omni-serve (pid" not in result.stderr
    assert len(sf.read(tmp_path / "a.wav")[0]) > 0


def test_omni_chat_keeps_the_model_loaded_too(place, tmp_path):
    """omni-chat starts the background server as omni-say does (with its --max-context); an omni-say after
    it is answered by that server, and `--keep-alive 0` loads the model in the chat's own process."""
    from conftest import run_omni_chat

    chat = run_omni_chat("--mute", "--seed", "1", "--max-context", "2048", env=place.env, input="Hello there\n",
                         timeout=300)
    assert chat.returncode == 0, chat.stderr
    assert "background omni-serve" in chat.stderr and chat.stdout.strip()
    record = place.record
    assert record is not None and _alive(record["pid"])  # outlives the chat
    place.started.append(record["pid"])
    assert "--max-context 2048" in Path(f"/proc/{record['pid']}/cmdline").read_text().replace("\0", " ")
    say = place.say("Hello there", "-o", tmp_path / "a.wav")
    assert say.returncode == 0 and "using omni-serve" in say.stderr, say.stderr
    again = run_omni_chat("--mute", "--seed", "1", env=place.env, input="Hi\n", timeout=300)  # 4096, the default
    assert again.returncode == 0 and "using omni-serve" in again.stderr, again.stderr
    assert "the server keeps 2048 tokens of conversation, not the 4096 of --max-context" in again.stderr
    os.kill(record["pid"], signal.SIGTERM)
    assert place.wait_gone(record["pid"]) and place.record is None
    own = run_omni_chat("--mute", "--keep-alive", "0", env=place.env, input="Hi\n", timeout=300)
    assert own.returncode == 0 and "omni-serve" not in own.stderr and own.stdout.strip(), own.stderr
    assert place.record is None  # no server started


def test_an_open_chat_holds_a_server_that_stops_when_idle(place, tmp_path):
    """A person may think longer than the keep-alive: while omni-chat is open, the server it uses does not
    stop for want of requests (the chat asks its /health), nor for another model's command, and stops
    once the chat has gone."""
    import subprocess
    import sys

    place.env["OMNI_KEEP_ALIVE"] = "2"
    proc = subprocess.Popen([sys.executable, "-m", "omni_cli.faces.chat.main", "--mute", "--seed", "1", "--max-text-tokens", "8"],
                            env=place.env, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("Hello there\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 120
        while place.record is None:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        pid = place.record["pid"]
        place.started.append(pid)
        while _served(place.port) < 1:  # the first reply (the server loaded meanwhile)
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        time.sleep(6)  # three keep-alive periods without a reply
        assert _alive(pid)
        # Another model's command does not stop a held server as idle: it loads its model itself.
        other = place.say("Hi", "-m", REPO_ROOT / "assets" / "tiny-qwen3-omni", "-o", tmp_path / "q3.wav")
        assert other.returncode == 0 and "busy with another model" in other.stderr, other.stderr
        assert _alive(pid) and place.record["pid"] == pid
        out, err = proc.communicate("And again?\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert len([line for line in out.splitlines() if line.strip()]) == 2  # both replies
    assert place.wait_gone(pid, 30)  # the chat gone, the server stops after its keep-alive
