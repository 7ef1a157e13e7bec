"""omni-say's keep-alive: the model stays loaded after a reply, in an omni-serve started in the
background, so that the next command on the same model is answered in a fraction of a second (as
`ollama run` does; measured on an H200 with a 7B folder: 0.67 s from the command to the first audio,
against 15 s for a command that loads the model itself, its caches warm).

`start_server(model, flags, keep_alive)` starts `python -m omni_cli.faces.serve` on the default address
(127.0.0.1:8484) in a session of its own (the terminal's Ctrl-C and hang-up do not reach it; its output
goes to a log file in the cache folder), waits until it serves, and returns a `RemoteAssistant` for it.
The server stops itself after `keep_alive` seconds without a request (omni-serve `--keep-alive`).

Ownership (api/ownership.py has the checks):
- The server writes its own record (`omni-serve.json`: pid, its start time, port, model key, log;
  paths.keep_alive_record()) once it has bound the port (`record_self`), whole (a temporary file and a
  rename) and 0600, in a 0700 folder. Commands find or start the server under a lock (`fcntl.flock` on
  paths.keep_alive_lock(), held until the server they started has written its record or exited), so
  commands started at once leave one server, and the record names it.
- A record is believed only while its pid runs with the recorded start time; one that names no such
  process, or is not a record (pid -1, 0, 1, 10**30, text), is ignored, and removed under the lock.
- A server is used (sent the API key, a prompt) only once it has proven the user's secret on the port
  (`client.proven_health`), and stopped only when that proof names the recorded pid and start time and
  the pid still has that start time when the signal goes. A server that cannot prove it (still loading:
  it listens before it serves; another user's; something else on the port) is never stopped; where it
  holds the port the command loads the model itself.

The next command on the same model waits for a server that is still loading; a command on another model
stops it if it is idle and proven (one model in memory at a time, as ollama swaps them) and starts its own.

It knows no terminal (the caller says what it does) and imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from .. import atomic, paths
from ..errors import OmniError, UsageError
from . import client, ownership
from .client import RemoteAssistant, ServerError, model_key

START_TIMEOUT = 900.0  # seconds a command waits for the server to load (a fresh 30B read from disk)
STOP_TIMEOUT = 15.0  # seconds to wait for an idle server of another model to exit


def parse_duration(text: str) -> float:
    """'300', '30s', '5m', '1h', '1.5m' -> seconds; '0' -> 0. A UsageError for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text).lower())
    if match is None:
        raise UsageError(f"not a duration: {text!r} (e.g. 300, 30s, 5m, 1h; 0 for none)")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


RECORD_ENV = "OMNI_SERVE_RECORD"  # set for the server `start_server` starts: it writes its own record
LOCK_WAIT = 120.0  # seconds a command waits for another to finish finding or starting the server
RECORD_WAIT = 60.0  # seconds a command holds the lock waiting for its server to write its record (Python's start)


def server_folder(make: bool = False) -> Path:
    """Where the background server's record and log are kept (`make`: create it, private to the user)."""
    folder = paths.server_dir()
    if make:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def log_file(port: int) -> Path:
    """The background server's log (its stdout and stderr)."""
    return server_folder() / f"omni-serve-{port}.log"


def _record_file() -> Path:
    return paths.keep_alive_record()


def _valid(record: object) -> dict | None:
    """`record` if it has the shape a server writes (a pid that may be signalled, a port, a start time,
    a model key), else None."""
    if not isinstance(record, dict):
        return None
    port = record.get("port")
    if (ownership.valid_pid(record.get("pid")) is None or isinstance(port, bool) or not isinstance(port, int)
            or not 0 < port < 65536 or not isinstance(record.get("started"), str)
            or not isinstance(record.get("key"), str)):
        return None
    return record


def _load_record() -> object:
    try:
        return json.loads(_record_file().read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def read_record(remove_stale: bool = False) -> dict | None:
    """The background server's record if its process still runs (the recorded pid with the recorded start
    time), else None. `remove_stale`: a record that is not one, or names no such process, is removed
    (under the lock only: a reader could otherwise remove a new server's record)."""
    record = _valid(_load_record())
    if record is not None and ownership.running(record["pid"], record["started"]):
        return record
    if remove_stale:
        with contextlib.suppress(OSError):
            _record_file().unlink()
    return None


def record_self(port: int, model: str | None, quantize: str | None = None) -> None:
    """omni-serve, once it has bound `port`: write its own record if `start_server` started it (RECORD_ENV;
    a server started by hand writes none and is never stopped by the commands). Whole and 0600; a record
    that cannot be written is a warning: the server works, but no command will stop it, nor wait for it."""
    if os.environ.pop(RECORD_ENV, "") != "1":
        return
    record = {"pid": os.getpid(), "started": ownership.start_time(os.getpid()), "port": port,
              "key": model_key(model), "model": str(model or "the default model"), "log": str(log_file(port)),
              "quantize": quantize}
    try:
        server_folder(make=True)
        with atomic.Replacement(_record_file()) as out:
            assert out.fd is not None
            os.fchmod(out.fd, 0o600)  # not an older record's mode
            data = json.dumps(record).encode("utf-8")
            while data:
                data = data[os.write(out.fd, data):]
    except (OSError, OmniError) as exc:
        logging.getLogger(__name__).warning("cannot write the background server's record: %s", exc)


def forget(pid: int) -> None:
    """The server `pid` is stopping: remove its record (not a newer server's)."""
    record = _valid(_load_record())
    if record is not None and record["pid"] == pid:
        with contextlib.suppress(OSError):
            _record_file().unlink()


@contextlib.contextmanager
def _find_or_start_lock(folder: Path, wait: float) -> Iterator[bool]:
    """Hold the lock under which a command finds or starts the background server (True), or give up after
    `wait` seconds (False). Where there is no flock (Windows), no lock: two first commands may then both
    start one, and the one that loses the port exits."""
    try:
        import fcntl
    except ImportError:
        yield True
        return
    fd = os.open(folder / paths.keep_alive_lock().name, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)  # which lets the lock go


def start_server(model: str | None, flags: list[str], keep_alive: float, api_key: str | None = None,
                 note=lambda text: None, quantize: str | None = None) -> RemoteAssistant | None:
    """A `RemoteAssistant` for a background omni-serve of `model` (started now, or one still loading),
    or None when there can be none (the port held by a server this module did not start or cannot prove
    is ours, or by a busy one of another model; no cache folder): the caller loads the model itself.
    `flags`: omni-serve's load flags (device, dtype, graphs); `note` hears what is done, and why when None.
    `quantize`: the packing asked for (RuntimeOptions.quantize): a server of the same model holding other
    weights (bfloat16 against int4) is another model here, stopped if idle and replaced."""
    url = client.DEFAULT_URL
    where = urlsplit(url)
    assert where.hostname is not None and where.port is not None, f"{url} names no host and port"
    key = model_key(model)
    try:
        folder = server_folder(make=True)
        log = log_file(where.port)
        log.touch()
    except OSError as exc:
        note(f"cannot keep a background server's log in {server_folder()} ({exc.strerror or exc}), so the model "
             "loads in this process")
        return None
    with _find_or_start_lock(folder, LOCK_WAIT) as locked:
        if not locked:
            note(f"another command has been starting a background omni-serve for {LOCK_WAIT:.0f} s, so the model "
                 "loads in this process")
            return None
        record = read_record(remove_stale=True)
        if record is not None and record["port"] == where.port and not client.listening(url):
            # A server writes its record once it listens: a recorded process that does not is no server of ours.
            with contextlib.suppress(OSError):
                _record_file().unlink()
            record = None
        if record is not None and record["port"] == where.port and same_weights(record, key, quantize):
            proc = None
        else:
            if record is not None and record["port"] == where.port and not _stop_idle(url, record):
                note(f"the background omni-serve at {url} is busy with another model (a reply, an open chat, or "
                     "still loading), so the model loads in this process")
                return None
            if client.listening(url):  # someone else's server (or one that cannot prove it is ours): left alone
                return _someone_elses(url, api_key, key, note, quantize)
            proc = _spawn(model, flags, keep_alive, api_key, where, log)
            minutes = f"{keep_alive / 60:g} min" if keep_alive >= 60 else f"{keep_alive:g} s"
            note(f"loading the model in a background omni-serve (pid {proc.pid}), kept for {minutes} after the last "
                 "request so the next command answers at once; --keep-alive 0 loads it in this process instead")
            _await_record(proc)
    if proc is None:
        assert record is not None
        note(f"waiting for omni-serve (pid {record['pid']}), still loading {model or 'the model'}")
        try:
            return _wait(url, api_key, pid=record["pid"], started=record["started"],
                         log=Path(str(record.get("log", ""))))
        except NotOurs:
            return _someone_elses(url, api_key, key, note, quantize)
    try:
        return _wait(url, api_key, proc=proc, log=log)
    except ServerError:
        if not client.listening(url):
            raise
    # Something took the port before our server could (an omni-serve started by hand, an older version's).
    return _someone_elses(url, api_key, key, note, quantize)


def serve_command(host: str, port: int, keep_alive: float, model: str | None, flags: list[str]) -> list[str]:
    """The command line of the background omni-serve."""
    return [sys.executable, "-m", "omni_cli.faces.serve", "--host", host, "--port", str(port),
            "--keep-alive", f"{keep_alive:g}", "--no-warm-up", *(["-m", str(model)] if model else []), *flags]


def _spawn(model, flags: list[str], keep_alive: float, api_key: str | None, where, log: Path) -> subprocess.Popen:
    command = serve_command(where.hostname, where.port, keep_alive, model, flags)
    # The server asks for the key this command sends (none: none), through the environment, not the
    # command line that `ps` shows; and it writes its own record once it has bound the port.
    env = {k: v for k, v in os.environ.items() if k != client.API_KEY_ENV}
    env[RECORD_ENV] = "1"
    if api_key:
        env[client.API_KEY_ENV] = api_key
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                env=env)


def _await_record(proc: subprocess.Popen, wait: float = RECORD_WAIT) -> None:
    """Wait (holding the lock) until the server `proc` has written its record, or exited: the next command
    then finds it. Past `wait` the lock goes anyway (that command then sees the port taken and loads its
    model itself)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and proc.poll() is None:
        record = _valid(_load_record())
        if record is not None and record["pid"] == proc.pid:
            return
        time.sleep(0.02)


def same_weights(record: dict, key: str, quantize: str | None) -> bool:
    """Whether the recorded server holds the model `key` packed as `quantize` asks (None: as stored). A
    record without the field is an older server's, which never packed weights."""
    return record["key"] == key and record.get("quantize") == quantize


def served_quantize(remote: RemoteAssistant) -> str | None:
    """How a server's weights are packed, as its model info says (None: as stored, or it does not say)."""
    runtime = remote.info.get("runtime")
    return runtime.get("quantize") if isinstance(runtime, dict) else None


def _someone_elses(url: str, api_key: str | None, key: str, note, quantize: str | None = None) -> RemoteAssistant | None:
    """The port is taken, not by the recorded server: use it if it proves it is the user's omni-serve of
    this model with the weights packed as asked (only then is it sent the key), else None."""
    found = client.proven_health(url, client.PROBE_TIMEOUT)
    if found is not None and found["proof"]["key"] == key:
        remote = None
        with contextlib.suppress(ServerError):
            remote = RemoteAssistant.connect(url, api_key, timeout=START_TIMEOUT)  # waits while it loads
        if remote is not None:
            if served_quantize(remote) == quantize:
                return remote
            remote.close()
            note(f"the server at {url} holds {_weights(served_quantize(remote))} weights, not the {_weights(quantize)} "
                 "ones asked for, so the model loads in this process")
            return None
    note(f"another server answers at {url}, so the model loads in this process")
    return None


def _weights(quantize: str | None) -> str:
    return quantize or "unpacked"


class Hold:
    """A server held open by this process (see `hold`): `release()` lets it go at once."""

    def __init__(self, url: str, holder: str, every: float) -> None:
        import threading

        self.url, self.holder = url, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), name="keep-alive-hold", daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                client.health(self.url, 5.0, hold=self.holder)
            except (OSError, ValueError):
                pass  # gone or busy: the next request says so

    def release(self) -> None:
        """Stop holding: the server may stop when idle again, or make room for another model's command."""
        self._stop.set()
        with contextlib.suppress(OSError, ValueError):
            client.health(self.url, 2.0, release=self.holder)


def hold(url: str) -> Hold | None:
    """Keep the server at `url` from stopping while this process uses it (an open omni-chat, whose person
    may think longer than the keep-alive): a daemon thread asks its `/health?hold=ID` three times per
    keep-alive period, which counts as a request and marks the server held (another model's command does
    not stop it as idle) until `release()`. A server that does not stop when idle (or does not say) is
    left alone (None); one that is gone is the next request's error."""
    holder = f"{os.getpid()}-{os.urandom(4).hex()}"
    try:
        idle = client.health(url, 5.0, hold=holder).get("keep_alive")
    except (OSError, ValueError, AttributeError):
        return None
    if not idle:
        with contextlib.suppress(OSError, ValueError):
            client.health(url, 2.0, release=holder)
        return None
    return Hold(url, holder, max(0.2, float(idle) / 3))


class NotOurs(ServerError):
    """The server on the port answers, but does not prove it is the one this command waits for."""


def _wait(url: str, api_key: str | None, proc: subprocess.Popen | None = None, pid: int | None = None,
          started: str | None = None, log: Path | None = None) -> RemoteAssistant:
    """Poll until the server (`proc`, or the process `pid` that started at `started`) proves itself on
    `url`, then connect (`GET /v1/models`, the first request with the key). It listens before it loads,
    so a connection waits in its backlog until it serves; one that fails (not listening yet, or a read
    timeout) is tried again while the process runs. A ServerError with the server's own last error line
    if it exits first; NotOurs if another server answers there."""
    deadline = time.monotonic() + START_TIMEOUT
    expected = proc.pid if proc is not None else pid
    while time.monotonic() < deadline:
        alive = proc.poll() is None if proc is not None else ownership.running(pid, started)
        if not alive:
            raise ServerError(f"the background omni-serve stopped before it served: {_last_error(log)}")
        found = client.ask_proof(url, 5.0)
        if found is not None and (found["proof"] is None or found["proof"]["pid"] != expected):
            # It serves, but is not the server waited for (something else took the port): never sent the key.
            raise NotOurs(f"the server at {url} does not prove it is the background omni-serve (pid {expected})")
        if found is not None:
            try:
                return RemoteAssistant.connect(url, api_key, timeout=5.0)
            except ServerError:
                pass
        time.sleep(0.05)
    raise ServerError(f"the background omni-serve did not serve within {START_TIMEOUT:.0f} s (its log: {log})")


def _last_error(log: Path | None) -> str:
    try:
        text = log.read_text(errors="replace") if log is not None else ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
    except OSError:
        lines = []
    errors = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    return (errors or lines or [f"no output (log: {log})"])[-1]


def _proven(url: str, record: dict) -> dict | None:
    """The `/health` of the server on `url` if it proves it is the recorded one (the user's secret, the
    recorded pid and start time), else None."""
    found = client.proven_health(url, client.PROBE_TIMEOUT)
    if found is None or found["proof"]["pid"] != record["pid"] or found["proof"]["started"] != record["started"]:
        return None
    return found


def _stop_idle(url: str, record: dict) -> bool:
    """Stop the recorded background server (another model's) if it proves it is the one recorded and
    serves no request now; True once it is gone. One that cannot prove it (still loading, or not ours)
    is left running."""
    found = _proven(url, record)
    if found is None or found.get("queued", 0) or found.get("held"):
        return False  # not proven ours, or busy with another command's reply, or held by an open chat
    ownership.terminate(record["pid"], record["started"])
    return _gone(record, STOP_TIMEOUT)


def stop_background(wait: float = STOP_TIMEOUT, busy_too: bool = False) -> tuple[dict | None, str]:
    """Stop the background omni-serve this module started (`omni-say --stop`): (its record, what came of
    it: "stopped", "busy" (a reply, or an open chat; stopped anyway with `busy_too`), "unproven" (it does
    not prove it is the recorded server: still loading, or not ours), "running" (did not stop within
    `wait`)). No record of a running server: (None, "none"). Nothing is signalled but the recorded server."""
    record = read_record()
    if record is None:
        return None, "none"
    found = _proven(f"http://127.0.0.1:{record['port']}", record)
    if found is None:
        return record, "unproven"
    if not busy_too and (found.get("queued", 0) or found.get("held")):
        return record, "busy"
    ownership.terminate(record["pid"], record["started"])
    return record, "stopped" if _gone(record, wait) else "running"


def _gone(record: dict, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not ownership.running(record["pid"], record["started"]):
            return True
        time.sleep(0.05)
    return False
