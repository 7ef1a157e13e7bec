"""Nothing stopped that is not ours, nothing sent to a server that is not ours (issue 29, "Ownership"):
a record that names a foreign process (a `sleep`, a `tail -f ...omni_cli.faces.serve.log`, a server
started by hand on another port) leaves it running; records with pids -1, 0, 1, 10**30 or garbage are
ignored, never an internal error, never a signal; a fake server on the keep-alive port gets neither a
prompt nor the API key; three first commands at once leave exactly one server, and its record names it;
the user's secret is private and created once; `omni-say --ps/--stop` use the same checks.

No model: the "servers" are a small http.server in a thread, or in a subprocess (FAKE_SERVE) that does
what omni-serve does for ownership (binds the port, writes its own record, proves the secret)."""

from __future__ import annotations

import http.server
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from typer.testing import CliRunner

from conftest import REPO_ROOT

from omni_cli import paths
from omni_cli.api import client, keep_alive, ownership
from omni_cli.api.client import model_key

# A stand-in for a background omni-serve, in its own process: argv = port, model ("" = the default).
FAKE_SERVE = r"""
import http.server, json, sys
from urllib.parse import parse_qs, urlsplit
from omni_cli.api import keep_alive, ownership
from omni_cli.api.client import model_key

port, model = int(sys.argv[1]), sys.argv[2] or None
key = model_key(model)

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        query = parse_qs(urlsplit(self.path).query)
        if self.path.startswith("/health"):
            body = {"status": "ok", "queued": 0, "held": False, "keep_alive": 60}
            if "challenge" in query:
                body["proof"] = ownership.answer(query["challenge"][0], port, key)
        else:
            body = {"data": [{"id": "fake-serve", "omni": {"key": key}}]}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

try:
    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
except OSError:
    sys.exit(3)  # the port is taken, as omni-serve's "cannot listen"
keep_alive.record_self(port, model)
print("serving", flush=True)
server.serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Home:
    """A cache folder and a keep-alive port of the test's own; the processes it started are ended at the end."""

    def __init__(self, tmp_path: Path, monkeypatch) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        monkeypatch.setattr(client, "DEFAULT_URL", self.url)
        monkeypatch.setattr(keep_alive, "serve_command",
                            lambda host, port, keep, model, flags: [sys.executable, "-c", FAKE_SERVE, str(port), model or ""])
        self.procs: list[subprocess.Popen] = []
        real = keep_alive._spawn
        monkeypatch.setattr(keep_alive, "_spawn", lambda *a: self._started(real(*a)))
        self.notes: list[str] = []

    def _started(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(proc)
        return proc

    def process(self, *argv: str) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def serve_by_hand(self, port: int, model: str | None = None) -> subprocess.Popen:
        """A proving server of this user on `port` that writes no record (RECORD_ENV unset): one started by hand."""
        env = {k: v for k, v in os.environ.items() if k != keep_alive.RECORD_ENV}
        proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVE, str(port), model or ""], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"serving"
        return proc

    def record(self, **fields) -> dict:
        record = {"key": "sha256:another-model", "model": "another model", "port": self.port, **fields}
        keep_alive.server_folder(make=True)
        paths.keep_alive_record().write_text(json.dumps(record))
        return record

    def note(self, text: str) -> None:
        self.notes.append(text)

    def end(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def home(tmp_path, monkeypatch):
    place = Home(tmp_path, monkeypatch)
    yield place
    place.end()


def _named(proc: subprocess.Popen) -> dict:
    """A record's pid and start time for `proc`, as a server's own record would have them (what a record
    that outlived its server says of whatever now has its pid)."""
    started = ownership.start_time(proc.pid)
    assert started is not None
    return {"pid": proc.pid, "started": started}


# -- foreign processes ------------------------------------------------------------------------------------

@pytest.fixture(params=["sleep", "tail"])
def foreign(request, home, tmp_path):
    if request.param == "sleep":
        return home.process("sleep", "120")
    log = tmp_path / "omni_cli.faces.serve.log"  # the text the old check matched on the command line
    log.write_text("")
    return home.process("tail", "-f", str(log))


def test_a_record_naming_a_foreign_process_leaves_it_running(home, foreign):
    """Before: `omni-say --stop` (and another model's command) sent the `tail` SIGTERM, its command line
    holding "omni_cli.faces.serve". Now: the pid and its start time match the record, but nothing on the
    port proves it is that server: --stop leaves it, another model's command starts its own server."""
    home.record(**_named(foreign))
    assert keep_alive.read_record() is not None  # the record is believed to name a live process...
    assert keep_alive.stop_background(wait=0.5) == (keep_alive.read_record(), "unproven")  # ...which is not stopped
    result = CliRunner().invoke(_say_app(), ["--stop"])
    assert result.exit_code == 1 and "does not answer as the server it recorded" in result.output
    assert "Traceback" not in result.output
    remote = keep_alive.start_server(None, [], 60.0, note=home.note)  # the port is free: the record was no server's
    assert remote is not None
    remote.close()
    assert foreign.poll() is None
    assert keep_alive.read_record()["pid"] == home.procs[-1].pid != foreign.pid


def test_a_foreign_process_behind_a_server_that_does_not_prove_it_is_left_running(home, foreign):
    """The record names the process, and something answers on the port as omni-serve would, but cannot
    prove the secret: another model's command loads its model itself, the same model's does not wait
    on it (nor send it the key), --stop leaves it."""
    fake = FakeServer(home.port)
    try:
        for key in ("sha256:another-model", model_key(None)):
            home.record(**_named(foreign), key=key)
            assert keep_alive.start_server(None, [], 60.0, api_key="KEY", note=home.note) is None
            assert keep_alive.stop_background(wait=0.5)[1] == "unproven"
            assert foreign.poll() is None
        assert [n.split(",")[0] for n in home.notes[-1:]] == [f"another server answers at {home.url}"]
        assert fake.keys() == [None] and fake.posts == []
        assert home.procs[1:] == []  # no server started: the port is taken
    finally:
        fake.close()


def test_a_server_started_by_hand_on_another_port_is_left_running(home):
    """An omni-serve of this user started by hand elsewhere proves the secret on its own port; a record
    naming it (pid and start time right) with the keep-alive port is not proven there: never stopped."""
    by_hand = home.serve_by_hand(_free_port())
    home.record(**_named(by_hand))
    assert keep_alive.stop_background(wait=0.5)[1] == "unproven"
    remote = keep_alive.start_server(None, [], 60.0, note=home.note)
    assert remote is not None
    remote.close()
    assert by_hand.poll() is None


def test_the_recorded_server_proven_is_stopped_when_idle(home):
    """The control: a server the keep-alive started (its own record, its proof on the port) is stopped by
    --stop, and its record goes."""
    remote = keep_alive.start_server(None, [], 60.0, note=home.note)
    assert remote is not None and len(home.procs) == 1
    remote.close()
    result = CliRunner().invoke(_say_app(), ["--ps"])
    assert result.exit_code == 0 and f"pid {home.procs[0].pid}" in result.output and "idle" in result.output
    record, outcome = keep_alive.stop_background(wait=5)
    assert outcome == "stopped" and record["pid"] == home.procs[0].pid
    assert home.procs[0].wait(5) == -15 and keep_alive.read_record() is None


@pytest.mark.parametrize("pid", [-1, 0, 1, 10**30, "1234", None, 2.5, True, [2]])
def test_records_with_impossible_pids_are_ignored_and_removed(home, monkeypatch, pid):
    """Before: pid 10**30 was an OverflowError ("internal error") in every command until the record was
    deleted; on macOS (no /proc) a pid of -1 would have signalled every process of the user."""
    sent, real = [], os.kill

    def kill(target, sig):  # what the code signals is noted; only the test's own processes get it
        sent.append(target)
        if target in {p.pid for p in home.procs}:
            real(target, sig)

    monkeypatch.setattr(os, "kill", kill)
    home.record(pid=pid, started="x")
    assert keep_alive.read_record() is None
    assert keep_alive.stop_background(wait=0.1) == (None, "none")
    result = CliRunner().invoke(_say_app(), ["--ps"])
    assert result.exit_code == 0 and "no background omni-serve" in result.output
    assert not ownership.terminate(pid, "x")  # type: ignore[arg-type]
    remote = keep_alive.start_server(None, [], 60.0, note=home.note)  # the record is removed and replaced
    assert remote is not None
    remote.close()
    assert sent == [] and keep_alive.read_record()["pid"] == home.procs[-1].pid


@pytest.mark.parametrize("text", ["", "not json", "[]", "{}", '{"pid": 5}', "\x00\xff", json.dumps({"pid": 2**40,
                                  "started": "x", "port": 8484, "key": "k"}), '{"pid": 99999999, "port": "x"}'])
def test_garbage_records_are_ignored(home, text):
    keep_alive.server_folder(make=True)
    paths.keep_alive_record().write_bytes(text.encode("utf-8", "surrogateescape"))
    assert keep_alive.read_record() is None and keep_alive.stop_background(wait=0.1) == (None, "none")
    keep_alive.forget(5)  # never raises


def test_a_record_whose_pid_has_another_start_time_is_stale(home):
    """The pid runs, but it is not the process recorded (a reboot, or the pid used again)."""
    other = home.process("sleep", "120")
    home.record(pid=_named(other)["pid"], started="an earlier start")
    assert keep_alive.read_record() is None
    assert keep_alive.stop_background(wait=0.1) == (None, "none") and other.poll() is None


def test_start_times_of_processes():
    assert ownership.start_time(os.getpid()) == ownership.start_time(os.getpid()) is not None
    for pid in (-1, 0, 1, 10**30, "1"):
        assert ownership.valid_pid(pid) is None and not ownership.running(pid, "x")
    assert ownership.start_time(1) is None  # never a pid to signal, whatever runs as it
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        started = _named(sleeper)["started"]
        assert ownership.running(sleeper.pid, started) and not ownership.running(sleeper.pid, started + "0")
        assert ownership.terminate(sleeper.pid, started) and sleeper.wait(5) == -15
        assert ownership.start_time(sleeper.pid) is None and not ownership.terminate(sleeper.pid, started)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_zombie_has_no_start_time():
    """A child that has exited but is not reaped yet (its parent command still runs) is gone."""
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ownership.start_time(zombie.pid) is None
    zombie.wait()


# -- a fake server on the port ----------------------------------------------------------------------------

class FakeServer:
    """Listens on `port` as an omni-serve would answer, claiming the model; `proof(nonce)` is what its
    /health says to a challenge. Every request is kept: (method, path, Authorization header, body)."""

    def __init__(self, port: int, proof=lambda nonce: None) -> None:
        self.seen: list[tuple] = []
        seen, key = self.seen, model_key(None)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                seen.append(("GET", self.path, self.headers.get("Authorization"), b""))
                if self.path.startswith("/health"):
                    nonce = parse_qs(urlsplit(self.path).query).get("challenge", [""])[0]
                    self._send({"status": "ok", "model": "\x1b]0;owned\x07", "queued": 0, "held": False,
                                "proof": proof(nonce)})
                else:
                    self._send({"data": [{"id": "fake", "omni": {"key": key}}]})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append(("POST", self.path, self.headers.get("Authorization"), body))
                self._send({})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def posts(self) -> list[tuple]:
        return [r for r in self.seen if r[0] == "POST"]

    def keys(self) -> list:
        return sorted({r[2] for r in self.seen}, key=str)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _forged(nonce: str) -> dict:
    return {"pid": 4242, "started": "x", "port": 0, "key": model_key(None), "hmac": "0" * 64}


@pytest.mark.parametrize("kind", ["none", "forged", "wrong secret", "another port's", "the secret itself"])
def test_a_fake_server_on_the_port_gets_no_prompt_and_no_key(home, kind):
    """Before: a process on the keep-alive port that claimed the model in /v1/models was sent the prompt
    and `Authorization: Bearer $OMNI_API_KEY`. Now it is asked /health?challenge=NONCE only, and what it
    answers does not prove the secret: a forged proof, one made with another secret, a real server's
    proof for another port (passed on), or the secret itself."""
    import hashlib
    import hmac

    secret = ownership.secret()
    assert secret is not None
    proofs = {
        "none": lambda nonce: None,
        "forged": _forged,
        "wrong secret": lambda nonce: {**(f := _forged(nonce)), "port": home.port,
                                       "hmac": ownership._mac(b"x" * 32, nonce, {**f, "port": home.port})},
        "another port's": lambda nonce: ownership.answer(nonce, home.port + 1, model_key(None)),
        "the secret itself": lambda nonce: {**_forged(nonce), "port": home.port, "hmac": secret.hex(),
                                            "sha": hashlib.sha256(secret).hexdigest(), "mac": hmac.new(secret, b"", "sha256").hexdigest()},
    }
    fake = FakeServer(home.port, proofs[kind])
    try:
        assert client.find_local_server(None, "THE-KEY") is None
        from omni_cli.faces import connect

        assert connect.find_server(connect.Where(api_key="THE-KEY", quiet=True)) is None
        assert keep_alive.start_server(None, [], 60.0, api_key="THE-KEY", note=home.note) is None
        assert home.notes == [f"another server answers at {home.url}, so the model loads in this process"]
    finally:
        fake.close()
    assert fake.posts == [] and fake.keys() == [None]
    assert {urlsplit(r[1]).path for r in fake.seen} == {"/health"} and home.procs == []


def test_a_server_that_proves_the_secret_is_trusted_with_the_key(home):
    """The control for the test above: the same fake, answering with a true proof, is then asked for its
    models with the key (so the test above fails if anything is accepted as a proof)."""
    fake = FakeServer(home.port, lambda nonce: ownership.answer(nonce, home.port, model_key(None)))
    try:
        remote = client.find_local_server(None, "THE-KEY")
        assert remote is not None
        remote.close()
    finally:
        fake.close()
    assert ("GET", "/v1/models", "Bearer THE-KEY", b"") in fake.seen


def test_omni_serves_health_proves_the_secret_without_showing_it(tmp_path, monkeypatch):
    """The server's side (api/server.py): /health?challenge=NONCE answers the proof for the port it is
    bound to; the secret itself is in no answer; a challenge that is not a nonce gets no proof."""
    from starlette.testclient import TestClient

    from fakes import FakeAssistant

    from omni_cli.api.server import create_app

    class Served(FakeAssistant):
        eos_ids = [0]
        limits = {"text": 8, "codes": 50}
        max_context = 4096
        runtime = None

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = model_key(None)
    with TestClient(create_app(Served(), "fake", api_key="k", key=key)) as http_:
        nonce = ownership.new_nonce()
        answer = http_.get(f"/health?challenge={nonce}").json()
        assert "proof" not in http_.get("/health").json()
        assert http_.get("/health?challenge=not-a-nonce").json()["proof"] is None
        assert http_.get("/health", params={"challenge": nonce + "\n80"}).json()["proof"] is None
    proof = ownership.verify(answer["proof"], nonce, 80)  # TestClient's server address: testserver:80
    assert proof == {"pid": os.getpid(), "started": ownership.start_time(os.getpid()), "port": 80, "key": key}
    assert ownership.verify(answer["proof"], nonce, 8484) is None  # asked on another port
    assert ownership.verify(answer["proof"], ownership.new_nonce(), 80) is None  # another challenge
    assert ownership.verify({**answer["proof"], "pid": 1234}, nonce, 80) is None  # a field changed
    secret = ownership.secret()
    assert secret is not None and secret.hex() not in json.dumps(answer)


# -- the secret -------------------------------------------------------------------------------------------

def test_the_secret_is_private_created_once_and_a_foreign_file_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = paths.server_secret()
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(ownership.secret())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results[0]) == 32  # eight racing first uses: one secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert sorted(p.name for p in path.parent.iterdir()) == ["secret"]  # no temporary file left
    assert ownership.secret() == results[0]
    path.chmod(0o644)  # readable by others: replaced by a new one, private
    assert ownership.secret() not in (None, results[0]) and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.unlink()
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("a" * 64)
    elsewhere.chmod(0o600)
    path.symlink_to(elsewhere)  # a link: not ours to use nor replace
    assert ownership.secret() is None and path.is_symlink()
    assert ownership.answer(ownership.new_nonce(), 80, "k") is None


def test_without_a_cache_folder_nothing_is_trusted_and_nothing_fails(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert ownership.secret() is None
    assert ownership.verify({"pid": 5, "started": "x", "port": 80, "key": None, "hmac": "00"}, "ab" * 16, 80) is None


# -- three first commands at once -------------------------------------------------------------------------

def _at_once(home: Home, n: int) -> list:
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def command(i: int) -> None:
        barrier.wait()
        try:
            results[i] = keep_alive.start_server(None, [], 60.0, api_key="k", note=home.note)
        except BaseException as exc:  # noqa: BLE001 - the test says which
            results[i] = exc

    threads = [threading.Thread(target=command, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


@pytest.mark.parametrize("trial", range(3))
def test_three_first_commands_at_once_leave_one_server_recorded(home, trial):
    """Before: each command started a server and wrote the record itself, after Popen: in 1 of 5 trials
    the record named the server that lost the port and exited. Now one command starts the server (under
    the lock), the server writes its record once it listens, and the others wait for it."""
    results = _at_once(home, 3)
    assert all(isinstance(r, client.RemoteAssistant) for r in results), results
    for r in results:
        r.close()
    assert len(home.procs) == 1, home.notes  # one server started
    record = keep_alive.read_record()
    assert record is not None and record["pid"] == home.procs[0].pid and home.procs[0].poll() is None
    assert record["started"] == ownership.start_time(home.procs[0].pid) and record["port"] == home.port
    assert stat.S_IMODE(paths.keep_alive_record().stat().st_mode) == 0o600
    assert sum("waiting for omni-serve" in n for n in home.notes) == 2


def _say_app():
    from omni_cli.faces.say import say_app

    return say_app
