"""omni-say's keep-alive: the model stays loaded after a reply, in an omni-serve started in the
background, so that the next command on the same model is answered in a fraction of a second (as
`ollama run` does; measured on an H200 with a 7B folder: 0.67 s from the command to the first audio,
against 15 s for a command that loads the model itself, its caches warm).

`start_server(model, flags, keep_alive)` starts `python -m omni_cli.faces.serve` on the default address
(127.0.0.1:8484) in a session of its own (the terminal's Ctrl-C and hang-up do not reach it; its output
goes to a log file in the cache folder), waits until it serves, and returns a `RemoteAssistant` for it.
The server stops itself after `keep_alive` seconds without a request (omni-serve `--keep-alive`).

A record in the cache folder (`omni-serve.json`: pid, model, port; paths.keep_alive_record()) says which
server was started this way; it is written whole or not at all (atomic.atomic_write), so a command that
reads it while another writes it never sees half a record. The next command on the same model waits for it while it is still loading; a command on another
model stops it if it is idle (one model in memory at a time, as ollama swaps them) and starts its own;
a server this module did not start (nor a process that took a recorded pid after a reboot) is never
stopped, and if it holds the port the command loads the model itself.

It knows no terminal (the caller says what it does) and imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from .. import atomic, paths
from ..errors import OmniError, UsageError
from . import client
from .client import RemoteAssistant, ServerError, model_key

START_TIMEOUT = 900.0  # seconds a command waits for the server to load (a fresh 30B read from disk)
STOP_TIMEOUT = 15.0  # seconds to wait for an idle server of another model to exit


def parse_duration(text: str) -> float:
    """'300', '30s', '5m', '1h', '1.5m' -> seconds; '0' -> 0. A UsageError for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text).lower())
    if match is None:
        raise UsageError(f"not a duration: {text!r} (e.g. 300, 30s, 5m, 1h; 0 for none)")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def server_folder(make: bool = False) -> Path:
    """Where the background server's record and log are kept (`make`: create it)."""
    folder = paths.server_dir()
    if make:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def _record_file() -> Path:
    return paths.keep_alive_record()


def read_record() -> dict | None:
    """The background server's record if its process still runs, else None."""
    try:
        record = json.loads(_record_file().read_text())
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if _is_server(pid) else None


def _is_server(pid: int) -> bool:
    """Whether `pid` runs and is an omni-serve. A record outlives a reboot, after which its pid may be any
    process's: one that is not a server must never be waited for, nor sent SIGTERM. (Where the command
    line cannot be read, a running process is taken for the server.)"""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        return b"omni_cli.faces.serve" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return not Path("/proc/self").exists()  # no /proc (macOS): trust the pid


def forget(pid: int) -> None:
    """The server `pid` is stopping: remove its record (not a newer server's)."""
    try:
        if json.loads(_record_file().read_text()).get("pid") == pid:
            _record_file().unlink()
    except (OSError, ValueError, AttributeError):
        pass


def start_server(model: str | None, flags: list[str], keep_alive: float, api_key: str | None = None,
                 note=lambda text: None) -> RemoteAssistant | None:
    """A `RemoteAssistant` for a background omni-serve of `model` (started now, or one still loading),
    or None when there can be none (the port held by a server this module did not start, or by a busy
    one of another model; no cache folder): the caller loads the model itself. `flags`: omni-serve's
    load flags (device, dtype, graphs); `note` hears what is done, and why when None."""
    url = client.DEFAULT_URL
    where = urlsplit(url)
    assert where.hostname is not None and where.port is not None, f"{url} names no host and port"
    key = model_key(model)
    record = read_record()
    if record is not None and record.get("port") == where.port:
        if record.get("key") == key:
            note(f"waiting for omni-serve (pid {record['pid']}), still loading {model or 'the model'}")
            return _wait(url, api_key, pid=int(record["pid"]), log=Path(record.get("log", "")))
        if not _stop_idle(url, int(record["pid"])):
            note(f"the background omni-serve at {url} is busy with another model (a reply, or an open chat), so "
                 "the model loads in this process")
            return None
    if client.listening(url):  # someone else's server: leave it alone
        note(f"another server answers at {url}, so the model loads in this process")
        return None
    try:
        log = server_folder(make=True) / f"omni-serve-{where.port}.log"
        log.touch()
    except OSError as exc:
        note(f"cannot keep a background server's log in {server_folder()} ({exc.strerror or exc}), so the model "
             "loads in this process")
        return None
    command = [sys.executable, "-m", "omni_cli.faces.serve", "--host", where.hostname, "--port", str(where.port),
               "--keep-alive", f"{keep_alive:g}", "--no-warm-up", *(["-m", str(model)] if model else []), *flags]
    # The server asks for the key this command sends (none: none), through the environment, not the
    # command line that `ps` shows.
    env = {k: v for k, v in os.environ.items() if k != client.API_KEY_ENV}
    if api_key:
        env[client.API_KEY_ENV] = api_key
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                env=env)
    try:
        record = {"pid": proc.pid, "key": key, "model": str(model or "the default model"), "port": where.port,
                  "log": str(log)}
        atomic.atomic_write(_record_file(), json.dumps(record))
    except (OSError, OmniError):
        pass  # the server works without it; only the next command cannot tell that it is ours
    minutes = f"{keep_alive / 60:g} min" if keep_alive >= 60 else f"{keep_alive:g} s"
    note(f"loading the model in a background omni-serve (pid {proc.pid}), kept for {minutes} after the last "
         "request so the next command answers at once; --keep-alive 0 loads it in this process instead")
    try:
        return _wait(url, api_key, proc=proc, log=log)
    except ServerError:
        if not client.listening(url):
            raise
    # Another command started its server at the same moment and took the port first: use that one.
    remote = RemoteAssistant.connect(url, api_key, timeout=START_TIMEOUT)  # waits while it loads
    if remote.info.get("key") != key:
        remote.close()
        note(f"another server answers at {url}, so the model loads in this process")
        return None
    return remote


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


def _alive(proc: subprocess.Popen | None, pid: int | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    assert pid is not None, "_alive needs the process or its pid"
    return _is_server(pid)


def _wait(url: str, api_key: str | None, proc: subprocess.Popen | None = None, pid: int | None = None,
          log: Path | None = None) -> RemoteAssistant:
    """Poll until the server answers `GET /v1/models`. It listens before it loads, so a connection waits
    in its backlog until it serves; one that fails (not listening yet, or a read timeout) is tried again
    while the process runs. A ServerError with the server's own last error line if it exits first."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if not _alive(proc, pid):
            raise ServerError(f"the background omni-serve stopped before it served: {_last_error(log)}")
        try:
            return RemoteAssistant.connect(url, api_key, timeout=5.0)
        except ServerError:
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


def _stop_idle(url: str, pid: int) -> bool:
    """Stop the background server `pid` (another model's) if it serves no request now; True once it is gone."""
    try:
        health = client.health(url, client.PROBE_TIMEOUT)
        if health.get("queued", 0) or health.get("held"):
            return False  # busy with another command's reply, or held by an open chat
    except (OSError, ValueError):
        pass  # still loading, or not answering: stopping it loses nothing
    os.kill(pid, signal.SIGTERM)
    return _gone(pid, STOP_TIMEOUT)


def stop_background(wait: float = STOP_TIMEOUT, busy_too: bool = False) -> tuple[dict | None, bool]:
    """Stop the background omni-serve this module started (`omni-say --stop`): (its record, whether it is
    gone). One that is serving a reply or held by an open chat is left running unless `busy_too`. A
    server it did not start is never stopped; no record: (None, True)."""
    record = read_record()
    if record is None:
        return None, True
    port = record.get("port") or urlsplit(client.DEFAULT_URL).port
    assert port is not None, f"{client.DEFAULT_URL} names no port"
    url = f"http://127.0.0.1:{int(port)}"
    pid = int(record["pid"])
    if busy_too:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        return record, _gone(pid, wait)
    return record, _stop_idle(url, pid)


def _gone(pid: int, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not _alive(None, pid):
            return True
        time.sleep(0.05)
    return False
