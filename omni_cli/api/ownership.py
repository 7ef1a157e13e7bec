"""Whether a process, or a server on a port, is this user's omni-serve: the checks that come before a
command trusts a server with a prompt or the API key, and before it signals a process.

- A process is named by its pid AND its start time (`start_time`: Linux's /proc/PID/stat field 22, with
  the boot's id; elsewhere `ps -o lstart=`): a pid alone may be any process's after the first one ended
  or the machine rebooted. Only pids 2..2**31-1 are ever signalled (`valid_pid`): kill(-1) signals every
  process of the user, kill(0) the caller's group, 1 is init, and a pid beyond pid_t overflows.
- A server proves it is this user's by a challenge and response: the client sends a fresh nonce to
  `/health?challenge=NONCE` (no key, no prompt), the server answers HMAC-SHA256(secret, [nonce, port,
  pid, start time, model key]) with those fields (`answer`), and the client checks it (`verify`). The
  secret never travels; the port in the proof is the one the server bound, so a fake server on the
  keep-alive port cannot pass on the answer of a real one elsewhere.
- The secret is 32 random bytes in a 0600 file of the user's cache (paths.server_secret()), created once
  (written under a temporary name, then linked to its name: a second process that races to create it
  keeps the first one's). A file that is not ours (another owner, a link) is never used nor replaced:
  then nothing proves itself and no server is trusted. The secret is read at each use, not cached, so a
  cache folder wiped while a server runs gives a new secret that both sides read.

It knows processes, files and HMACs; nothing of HTTP (api/client.py asks, api/server.py answers) nor of
records (api/keep_alive.py). It imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import subprocess
from pathlib import Path

from .. import paths

log = logging.getLogger(__name__)

PROOF = "omni-serve-proof/1"  # what the HMAC's message starts with (another use of the secret never matches)
PID_MAX = 2**31 - 1  # pid_t is 32 bits: a bigger number overflows os.kill
_NONCE = re.compile(r"[0-9a-f]{32,128}")
_SECRET = re.compile(rb"[0-9a-f]{64}\n?")
_O_EXTRA = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def valid_pid(value: object) -> int | None:
    """`value` if it is a pid that may be signalled (an int 2..PID_MAX, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 1 < value <= PID_MAX else None


def start_time(pid: object) -> str | None:
    """When process `pid` started, as a token that two reads of the same process give alike, or None: no
    such process, a zombie (it has exited), not a valid pid, or no way to tell (no /proc nor ps)."""
    pid = valid_pid(pid)
    if pid is None:
        return None
    if Path("/proc/self/stat").exists():
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        fields = text.rpartition(")")[2].split()  # after the command name, which may hold spaces and ')'
        if len(fields) < 20 or fields[0] in ("Z", "X"):
            return None
        return f"{_boot_id()}+{fields[19]}"  # field 22: clock ticks after boot (fields[0] is field 3)
    return _ps_start(pid)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "boot"


def _ps_start(pid: int) -> str | None:
    """macOS and the BSDs: `ps -o stat= -o lstart=` (the state, to tell a zombie, and the start to the second)."""
    try:
        done = subprocess.run(["ps", "-o", "stat=", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True,
                              check=False, timeout=5, env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return None
    state, _, started = done.stdout.strip().partition(" ")
    if done.returncode != 0 or not started or state.startswith("Z"):
        return None
    return "lstart:" + " ".join(started.split())


def running(pid: object, started: object) -> bool:
    """Whether `pid` runs and is the process that started at `started` (a `start_time` token)."""
    return isinstance(started, str) and start_time(pid) == started


def terminate(pid: int, started: str, sig: int | None = None) -> bool:
    """Send SIGTERM (or `sig`) to `pid` if it is still the process that started at `started`; whether it
    was sent. Never to a pid that `valid_pid` refuses."""
    import signal

    pid_ = valid_pid(pid)
    if pid_ is None or not running(pid_, started):
        return False
    try:
        os.kill(pid_, signal.SIGTERM if sig is None else sig)
    except OSError:
        return False
    return True


# -- the secret ----------------------------------------------------------------------------------------------

def secret() -> bytes | None:
    """The user's secret, created on first use; None where there can be none (no cache folder, or a file
    there that is not ours: then no server is trusted, and a warning says why)."""
    path = paths.server_secret()
    state, value = _read_secret(path)
    if state in ("missing", "bad"):
        try:
            _create_secret(path, replace=state == "bad")
        except OSError as exc:
            log.debug("cannot create %s: %s", path, exc)
            return None
        state, value = _read_secret(path)
    if state != "ok":
        if state == "foreign":
            log.warning("%s is not a private file of this user: no omni-serve is trusted until it is removed", path)
        return None
    return value


def _read_secret(path: Path) -> tuple[str, bytes]:
    """("ok", secret), ("missing", b""), ("bad", b"": ours, but readable by others or not a secret: it is
    replaced) or ("foreign", b"": a link, another user's file, not a file: left alone)."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_EXTRA)
    except FileNotFoundError:
        return "missing", b""
    except OSError:
        return "foreign", b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return "foreign", b""
        data = os.read(fd, 256)
    finally:
        os.close(fd)
    if (os.name == "posix" and st.st_mode & 0o077) or not _SECRET.fullmatch(data):
        return "bad", b""
    return "ok", bytes.fromhex(data[:64].decode("ascii"))


def _create_secret(path: Path, replace: bool) -> None:
    """A new secret at `path`: written whole under a temporary name (O_EXCL, 0600), then linked to its
    name, which fails if another process made one meanwhile (theirs is kept); `replace`: renamed over a
    bad one instead."""
    from ..atomic import temp_path

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = temp_path(path, ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_EXTRA, 0o600)
    try:
        try:
            os.write(fd, (secrets.token_hex(32) + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
    finally:
        tmp.unlink(missing_ok=True)


# -- the proof -----------------------------------------------------------------------------------------------

def new_nonce() -> str:
    """A fresh challenge (128 random bits, hex)."""
    return secrets.token_hex(16)


def _mac(key: bytes, nonce: str, fields: dict) -> str:
    message = json.dumps([PROOF, nonce, fields["port"], fields["pid"], fields["started"], fields["key"]])
    return hmac.new(key, message.encode("utf-8"), hashlib.sha256).hexdigest()


_OWN: dict[int, str | None] = {}  # this process's start time, by pid (a fork is another process)


def answer(nonce: object, port: object, model_key: str | None) -> dict | None:
    """The server's side: its proof for the challenge `nonce` on the port it bound, or None (not a nonce
    of ours, or no secret here)."""
    if not isinstance(nonce, str) or not _NONCE.fullmatch(nonce) or isinstance(port, bool) or not isinstance(port, int):
        return None
    key = secret()
    if key is None:
        return None
    pid = os.getpid()
    if pid not in _OWN:
        _OWN[pid] = start_time(pid)
    fields = {"pid": pid, "started": _OWN[pid], "port": port, "key": model_key}
    return {**fields, "hmac": _mac(key, nonce, fields)}


def verify(proof: object, nonce: str, port: int | None) -> dict | None:
    """The client's side: the proven fields (pid, started, port, key) of a server's answer to `nonce`,
    asked on `port`, or None if it does not prove the secret."""
    if not isinstance(proof, dict) or port is None:
        return None
    fields = {name: proof.get(name) for name in ("pid", "started", "port", "key")}
    mac = proof.get("hmac")
    pid = fields["pid"]  # any pid may serve (pid 1 in a container); only signalling refuses some
    if (isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= PID_MAX or fields["port"] != port
            or not isinstance(mac, str)
            or not isinstance(fields["started"], (str, type(None))) or not isinstance(fields["key"], (str, type(None)))):
        return None
    key = secret()
    if key is None or not hmac.compare_digest(_mac(key, nonce, fields), mac):
        return None
    return fields
