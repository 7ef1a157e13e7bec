"""What an output path names, and the one atomic writer.

`output_target(path)` says what writing `path` means, before anything is written (a sink's
constructor calls it, so a bad `-o` costs no model load):

- a regular file, or a name that does not exist yet ("regular", "new"): written to a hidden temp file
  in the same folder, fsync'd and renamed over the name at the end (`Replacement`, `atomic_write`), so
  a file that exists is always whole and an interrupted write leaves the old file (or none);
- a symbolic link: resolved, and its TARGET is the file replaced (or created, for a dangling link);
  the link itself is never replaced;
- a character device or a FIFO ("stream", e.g. /dev/null, a terminal, a named pipe): opened for
  writing as it is (no O_CREAT, no O_TRUNC) and written directly: it is not ours to replace;
- a folder, a socket or a block device: a UsageError (exit 2) naming which. A socket is not a file
  that open() can write, and a block device is a disk, never an audio file's place;
- a name for one of this process's open descriptors (/dev/stdout, /dev/stderr, /dev/fd/N,
  /proc/self/fd/N): that descriptor, duplicated and written as a stream ("stream"), whatever it is (a
  pipe, a terminal, a socket, or the file a shell redirected it to, at its offset and with its O_APPEND:
  re-opening the name instead would start a new, truncating or non-appending, description of it, and
  renaming onto the file's name would drop what a `>>` had before).

A file replaced keeps its permission bits (and its owner and group where this process may set them),
so writing over a shared file does not quietly make it private or root's; a new file gets 0o666
filtered by the umask, as open() would give it.

Files that belong together (omni-chat's /save: the transcript, its WAV, its recordings) are written
under temporary names first (`stage`), then renamed one after the other (`commit_all`, the transcript
last), so that a failure before the renames leaves every old file as it was.

A temporary that a SIGKILL or a power cut left behind (`.NAME.<16 hex digits>.part`, or `.probe`) is
removed the next time this process writes into its folder, once it is a day old and ours (our user's,
a regular file): nothing else in the folder is ever touched (`remove_stale_temporaries`).

It knows paths, file kinds, file systems and POSIX renames; nothing of audio, formats or what the bytes
are. Failures to write are OutputErrors (exit 1) of one line that names the path (`write_failure`): a
full disk is "no space left on MOUNT" (the file system's folder), a quota "disk quota exceeded on MOUNT".
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

from .errors import OutputError, UsageError

REGULAR = "regular"  # an existing regular file: replaced whole at the end
NEW = "new"  # nothing there yet (or a dangling link's target): created whole at the end
STREAM = "stream"  # a character device or FIFO: written directly, as the data comes

_O_EXTRA = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)  # a terminal opened never becomes ours


@dataclass(frozen=True)
class Target:
    """What an output path names (see `output_target`)."""

    kind: str  # REGULAR, NEW or STREAM
    # Where the bytes go: for REGULAR/NEW the file name that is replaced or created (a symlink's target,
    # resolved); for STREAM the path as given (opened, never replaced: the kernel follows its links).
    path: Path
    given: Path  # the path as the caller named it (for messages)
    what: str  # "file", "new file", "character device", "FIFO" or "file descriptor" (for messages)
    fd: int | None = None  # a STREAM that is this process's descriptor fd (/dev/stdout: 1): dup'd, not opened

    @property
    def atomic(self) -> bool:
        """Whether it is written through a temp file and a rename (REGULAR, NEW)."""
        return self.kind != STREAM


def output_target(path: str | os.PathLike) -> Target:
    """Classify `path` for writing (see the module docstring). A UsageError for a folder, a socket, a
    block device or an empty name; an OutputError for a folder that does not exist or is not a folder."""
    given = Path(path)
    if str(path) in ("", "-"):  # "-" is stdout, which the faces handle before they get here
        raise UsageError(f"bad output file name '{path}'")
    st: os.stat_result | None  # what is there (None: nothing)
    fd = descriptor_of(given)
    if fd is not None:
        try:
            st = os.fstat(fd)
        except OSError:
            raise OutputError(f"cannot write {given}: descriptor {fd} is not open") from None
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"cannot write {given}: it is a folder; give a file name in it")
        return Target(STREAM, given, given, "file descriptor", fd)
    try:
        st = os.stat(given)  # follows links, as the kernel does
    except FileNotFoundError:
        st = None
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            raise OutputError(f"cannot write {given}: {_first_non_folder(given)} is not a folder") from None
        raise write_failure(given, exc) from None
    if st is None:
        # Nothing there: a new name, or a (chain of) dangling link(s), whose final target is created.
        resolved = Path(os.path.realpath(given))
        # Messages name the folder as the caller did, unless a link led elsewhere.
        _check_folder(given, resolved.parent, given.parent if not os.path.islink(given) else resolved.parent)
        return Target(NEW, resolved, given, "new file")
    mode = st.st_mode
    if stat.S_ISREG(mode):
        resolved = Path(os.path.realpath(given))
        try:
            same = os.path.samestat(st, os.stat(resolved))
        except OSError:
            same = False
        if not same:  # a /proc magic link to a deleted file, or the like: no name to rename onto
            raise OutputError(f"cannot write {given}: it names a file that has no path of its own to replace")
        return Target(REGULAR, resolved, given, "file")
    if stat.S_ISCHR(mode):
        return Target(STREAM, given, given, "character device")
    if stat.S_ISFIFO(mode):
        return Target(STREAM, given, given, "FIFO")
    if stat.S_ISDIR(mode):
        raise UsageError(f"cannot write {given}: it is a folder; give a file name in it")
    if stat.S_ISSOCK(mode):
        raise UsageError(f"cannot write {given}: it is a socket, not a file or a pipe")
    if stat.S_ISBLK(mode):
        raise UsageError(f"cannot write {given}: it is a block device (a disk), not a file")
    raise UsageError(f"cannot write {given}: it is not a file, a pipe or a character device")


# The names Linux (and, for /dev/fd, the BSDs and macOS) give this process's own descriptors.
_DESCRIPTOR_NAMES = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
_DESCRIPTOR_PATH = re.compile(r"/(?:dev/fd|proc/self/fd|proc/(\d+)/fd)/(\d+)")


def descriptor_of(given: str | os.PathLike) -> int | None:
    """The descriptor that `given` names as this process's own (see the module docstring), else None.
    A face can ask `descriptor_of(path) == 1` to treat `-o /dev/stdout` as `-o -`."""
    if os.name != "posix":
        return None
    text = os.path.abspath(given)
    if text in _DESCRIPTOR_NAMES:
        return _DESCRIPTOR_NAMES[text]
    match = _DESCRIPTOR_PATH.fullmatch(text)
    if match is None or (match.group(1) is not None and int(match.group(1)) != os.getpid()):
        return None  # another process's descriptors are files like any other, seen through /proc
    return int(match.group(2))


def _check_folder(given: Path, folder: Path, named: Path) -> None:
    if not folder.exists():
        raise OutputError(f"cannot write {given}: folder {named} does not exist")
    if not folder.is_dir():
        raise OutputError(f"cannot write {given}: {named} is not a folder")


def _first_non_folder(path: Path) -> Path:
    """The first ancestor of `path` that exists and is not a folder (for ENOTDIR's message)."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return path.parent


def temp_path(path: Path, suffix: str = ".part") -> Path:
    """A fresh hidden name beside `path` (.NAME.<random>SUFFIX). The name is known before the file
    exists, so whoever records it first can always remove it: an interrupt that lands between creating
    the file and remembering its name cannot leave it behind."""
    return path.parent / f".{path.name}.{secrets.token_hex(8)}{suffix}"


# The names temp_path makes, and only those: a hidden name, 16 hex digits, .part or .probe.
TEMP_NAME = re.compile(r"\..+\.[0-9a-f]{16}\.(?:part|probe)")
# A temporary of ours this old is no writer's any more (a live writer touches it at each write).
STALE_SECONDS = 24 * 3600
_swept: set[str] = set()  # the folders already swept by this process: each is looked through once


def remove_stale_temporaries(folder: Path, now: float | None = None) -> list[Path]:
    """Remove the temporaries of ours in `folder` (TEMP_NAME; regular files, not links, of this user)
    last changed more than STALE_SECONDS ago, once per folder and process; the paths removed. Never
    raises: a folder that cannot be read, or a file that cannot be removed, is left as it is."""
    key = os.path.realpath(folder)
    if key in _swept and now is None:
        return []
    _swept.add(key)
    now = time.time() if now is None else now
    uid = os.getuid() if hasattr(os, "getuid") else None
    removed = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if not (entry.name.startswith(".") and TEMP_NAME.fullmatch(entry.name)):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                    if (stat.S_ISREG(st.st_mode) and (uid is None or st.st_uid == uid)
                            and now - st.st_mtime > STALE_SECONDS):
                        os.unlink(entry.path)
                        removed.append(Path(entry.path))
                except OSError:
                    continue
    except OSError:
        pass
    return removed


def write_failure(given: str | os.PathLike, exc: BaseException, verb: str = "write") -> OutputError:
    """The one-line OutputError for `exc` raised while writing `given`: "cannot write PATH: REASON"."""
    return OutputError(f"cannot {verb} {given}: {os_reason(exc, given)}")


def os_reason(exc: BaseException, path: str | os.PathLike | None = None) -> str:
    """What went wrong, in words: a full disk or an exhausted quota names the file system (its mount
    point) that holds `path`; other OSErrors their system message; anything else its text."""
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)) and path is not None:
        where = mount_point(Path(path))
        return f"no space left on {where}" if code == errno.ENOSPC else f"disk quota exceeded on {where}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


def mount_point(path: Path) -> Path:
    """The folder where the file system that holds `path` (a link: its target) is mounted (/ at worst)."""
    here = Path(os.path.realpath(path))
    while not here.exists() and here != here.parent:
        here = here.parent
    while not os.path.ismount(here) and here != here.parent:
        here = here.parent
    return here


def _create_exclusive(path: Path, mode: int) -> int:
    """Create `path` for writing and return its descriptor; an error if it exists. `mode` is filtered by
    the umask, as open() does."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | _O_EXTRA, mode)


def check_writable(target: Target) -> None:
    """An OutputError now, rather than at the end, when `target` cannot be written. For a file: a real
    probe file created and removed in its folder (os.access() says yes to root on a read-only file system).
    For a stream: its permission bits (opening a FIFO here would wait for its reader)."""
    if target.fd is not None:
        try:
            import fcntl

            readonly = fcntl.fcntl(target.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        except (ImportError, OSError):
            readonly = False
        if readonly:
            raise OutputError(f"cannot write {target.given}: descriptor {target.fd} is open for reading only")
        return
    if not target.atomic:
        if not os.access(target.path, os.W_OK):
            raise OutputError(f"cannot write {target.given}: permission denied")
        return
    probe = temp_path(target.path, ".probe")
    try:
        os.close(_create_exclusive(probe, 0o600))
    except OSError as exc:
        raise write_failure(target.given, exc) from exc
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def open_stream(target: Target) -> int:
    """Open a STREAM target for writing (a FIFO: this waits until it has a reader) and return the
    descriptor. Neither created nor truncated: it is someone else's device or pipe. A descriptor's name
    (/dev/stdout) gives a duplicate of that descriptor."""
    try:
        if target.fd is not None:
            return os.dup(target.fd)
        fd = os.open(target.path, os.O_WRONLY | getattr(os, "O_BINARY", 0) | _O_EXTRA)
    except OSError as exc:
        raise write_failure(target.given, exc) from exc
    if stat.S_ISREG(os.fstat(fd).st_mode) or stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)  # it was swapped for a file since it was classified: not written over in place
        raise OutputError(f"cannot write {target.given}: it changed from a {target.what} to a file")
    return fd


class Replacement:
    """A temp file beside an atomic target that becomes the target at `commit()`, or is removed at
    `discard()`. `create()` gives its descriptor (hand it to libsndfile, or write to it); the caller
    keeps the order create -> writes -> commit, and calls discard on any failure or interrupt (also
    after a failed commit; discard after commit does nothing). As a context manager it commits on a
    normal exit and discards on an exception. OSErrors become one-line OutputErrors."""

    def __init__(self, target: Target | str | os.PathLike) -> None:
        self.target = target if isinstance(target, Target) else output_target(target)
        if not self.target.atomic:
            raise ValueError(f"{self.target.given} is a {self.target.what}: it is written directly, not replaced")
        self.tmp: Path | None = None
        self.fd: int | None = None
        self.committed = False

    def create(self) -> int:
        """Create the temp file; its descriptor (owned by this object: commit and discard close it)."""
        path = self.target.path
        try:
            old = os.stat(path)
        except OSError:
            old = None
        remove_stale_temporaries(path.parent)
        self.tmp = temp_path(path)  # remembered before it exists: see temp_path
        try:
            # A file that replaces another gets that one's mode (set below, not filtered by the umask);
            # until then it is private, so its bytes are never more readable than the old file's.
            self.fd = _create_exclusive(self.tmp, 0o600 if old is not None else 0o666)
            if old is not None:
                _keep_owner_and_mode(self.fd, old)
        except OSError as exc:
            raise write_failure(self.target.given, exc) from exc
        return self.fd

    def commit(self) -> None:
        """fsync the temp file, close it and rename it onto the target (then fsync the folder, where
        the system allows it, so the rename itself survives a crash)."""
        if self.committed:
            return
        if self.fd is None or self.tmp is None:
            raise RuntimeError("Replacement.commit() before create()")
        try:
            os.fsync(self.fd)
            fd, self.fd = self.fd, None
            os.close(fd)
            os.replace(self.tmp, self.target.path)
        except OSError as exc:
            raise write_failure(self.target.given, exc) from exc
        self.tmp = None
        self.committed = True
        _fsync_folder(self.target.path.parent)

    def discard(self) -> None:
        """Close and remove the temp file (nothing if it was never made or is already renamed). Never raises."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        if self.tmp is not None:
            try:
                self.tmp.unlink()
            except OSError:  # never created
                pass
            self.tmp = None

    def __enter__(self) -> "Replacement":
        self.create()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.discard()
                raise
        else:
            self.discard()


def atomic_write(path: str | os.PathLike, data: bytes | str, encoding: str = "utf-8") -> Target:
    """Write `data` (str: encoded with `encoding`) to `path` as the module docstring says: a file or a
    new name (a link's target) appears whole or not at all, with its old mode kept; a character device
    or FIFO gets the bytes directly. Returns the target written."""
    target = output_target(path)
    replacement = stage(target, data, encoding)
    if replacement is not None:
        commit_all([replacement])
    return target


def stage(path: str | os.PathLike | Target, data: bytes | str, encoding: str = "utf-8") -> Replacement | None:
    """Write `data` to a temporary beside `path` and return its Replacement, not yet renamed (commit_all
    renames it; discard it on any failure). A character device or FIFO is not ours to stage: it gets the
    bytes now, and None is returned."""
    payload = data.encode(encoding) if isinstance(data, str) else bytes(data)
    target = path if isinstance(path, Target) else output_target(path)
    if not target.atomic:
        fd = open_stream(target)
        try:
            _write_all(fd, payload)
        except OSError as exc:
            raise write_failure(target.given, exc) from exc
        finally:
            os.close(fd)
        return None
    replacement = Replacement(target)
    try:
        fd = replacement.create()
        try:
            _write_all(fd, payload)
        except OSError as exc:
            raise write_failure(target.given, exc) from exc
    except BaseException:
        replacement.discard()
        raise
    return replacement


def commit_all(replacements: "Sequence[Replacement | None]") -> None:
    """Rename staged files into place in the order given (None: a stream, already written), each fsync'd
    first. A failure (or an interrupt) discards the ones not renamed yet, and is raised: put the file that
    names the others (a transcript) last, so that it never names files that did not arrive."""
    pending = [r for r in replacements if r is not None]
    try:
        for r in pending:
            r.commit()
    except BaseException:
        discard_all(pending)
        raise


def discard_all(replacements: "Sequence[Replacement | None]") -> None:
    """Discard every staged file not renamed yet (never raises)."""
    for r in replacements:
        if r is not None:
            r.discard()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _keep_owner_and_mode(fd: int, old: os.stat_result) -> None:
    if hasattr(os, "fchown"):
        try:
            os.fchown(fd, old.st_uid, old.st_gid)  # root writing a user's file; others: their own group only
        except OSError:
            pass
    # The permission bits without set-user/group-id: a rewritten file is not a program to grant them to.
    bits = stat.S_IMODE(old.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)
    if os.chmod in os.supports_fd:
        os.chmod(fd, bits)


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # Windows, or a folder that cannot be opened: the rename stands all the same
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
