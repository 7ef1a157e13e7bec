"""What one input may cost: the caps every face and the server check *before* the expensive step
(parsing a body, tokenizing a prompt, decoding audio or an image, reading a file), so that no input,
hostile or careless, can hold the one engine for long or take the machine's memory.

`Limits` is frozen and has a documented default for each cap; omni-serve's flags and the commands' flags
build one (faces/options.py), and the server, the prompt builder and the media readers are given it. A
refusal is a `LimitError` (a UsageError: a one-line error and exit 2 in a face, a 400 or 413 through the
API), said in words a user can act on.

Files given as input (`-f`, `--load`, `/load`, `--image`, `--audio`, `/image`, `/audio`, a transcript's
attachments) are read here only, by `open_regular_file` and `read_regular_file`: only a regular file (or a
link to one) is read, its size checked with fstat before a byte is read, and at most the cap plus one
byte read (a file that grows while it is read). A FIFO, a device (/dev/zero), a socket or a folder is
refused at once: it is opened with O_NONBLOCK, so that opening a FIFO never waits for a writer.

It knows nothing of models, terminals or HTTP, and imports no torch.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import IO, Any, BinaryIO

from .errors import UsageError

MiB = 1 << 20


class LimitError(UsageError):
    """An input over one of the caps; `status` is the HTTP status the API answers with (413: the body)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class Limits:
    """The caps, each with the reason for its default."""

    # A request body's bytes, read before any parsing (base64 media included: 16 MiB holds a 4-minute
    # WAV at 24 kHz PCM16, a 6-minute one at 16 kHz, far more in FLAC or Opus). Over it: 413. Parsing the
    # JSON holds Python's GIL in one call, about 1.4 ms a MiB, so this cap also bounds how long the
    # server's event loop (its /health) can wait: measured 27-37 ms at most with a 15.8 MB image body.
    body_bytes: int = 16 * MiB
    # How deeply a request's JSON may nest (OpenAI's bodies nest 5 levels; Python's parser recurses).
    json_depth: int = 32
    # A prompt longer than the context (tokens) times this many characters cannot fit whatever it
    # tokenizes to, so it is refused (and older turns dropped) without tokenizing it; no tokenizer of
    # these models makes a token of more than this many characters of ordinary text.
    chars_per_token: int = 16
    # One audio clip's length, read from its header before decoding (the encoders take 30 s windows;
    # a 10-minute clip is ~20 windows).
    audio_seconds: float = 600.0
    # One image's pixels, read from its header before decoding (the processor shrinks any image to
    # ~1 MP anyway; 40 MP is a large phone photo).
    image_pixels: int = 40_000_000
    # A transcript file (`/load`, `--load`) and a prompt file (`-f`): text, not a dump.
    transcript_bytes: int = 16 * MiB
    prompt_file_bytes: int = 16 * MiB
    # One attachment file (`--image`, `--audio`, `/image`, `/audio`) before it is decoded.
    attachment_bytes: int = 256 * MiB
    # omni-serve's connections (api/connections.py, api/server.py): a client that has not sent a whole
    # request head this long after connecting (or after its last reply) is dropped, so idle sockets cannot
    # pile up; a body may pause this long between two pieces, and take this long in all (16 MiB at the
    # default cap in 120 s is ~0.14 MB/s), else a 408.
    header_seconds: float = 10.0
    body_stall_seconds: float = 10.0
    body_seconds: float = 120.0
    # Connections open at once; a new one beyond it closes the oldest idle one (no request under way), so
    # that idle sockets can never lock out the user's own commands nor use up the process's open files.
    connections: int = 64
    # /v1/realtime (api/realtime.py): one client event's bytes, checked before it is parsed (4 MiB of base64
    # is ~87 s of 24 kHz PCM16; OpenAI's own cap is 15 MiB, clients append 20-100 ms at a time). An event
    # over it is an `error` event and the session goes on; a WebSocket message over `body_bytes` is more
    # than the socket reads (it closes the connection, code 1009) and never reaches the session.
    realtime_event_bytes: int = 4 * MiB
    # Seconds of audio the input buffer holds before a commit (or the end of a turn with server VAD): an
    # append past it is refused. 2 minutes at 24 kHz float32 is 11.5 MB a session.
    realtime_buffer_seconds: float = 120.0
    # Realtime sessions open at once (each holds a buffer, a VAD and a conversation); one more is a 503.
    realtime_sessions: int = 8

    def prompt_chars(self, context_tokens: int) -> int:
        """The most characters a prompt may have when `context_tokens` tokens are left for it."""
        return max(0, int(context_tokens)) * self.chars_per_token


DEFAULT = Limits()


def size_text(n: float) -> str:
    """A byte count as a person reads it (what the messages say)."""
    for unit, size in (("GB", 1 << 30), ("MB", MiB), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular_file(path: str | os.PathLike, max_bytes: int, what: str, label: str | None = None) -> BinaryIO:
    """`path` opened for reading (binary), once it is known to be a regular file of at most `max_bytes`.

    `what` names it in the one-line errors ("the prompt file", "the transcript"): a UsageError for
    anything but a regular file (a link is followed: a link to a FIFO is refused as the FIFO is), a
    `LimitError` for a file over the cap. An OSError from opening (no such file, no permission) is the
    caller's to word. `label`: the name the messages give it (the path as given; default `path`). The
    file is opened with O_NONBLOCK so that a FIFO without a writer does not block
    the open; a regular file reads the same either way."""
    name = os.fspath(path)
    label = name if label is None else label
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(name, flags)
    except OSError:
        if _is_socket(name):  # opening a Unix socket fails (ENXIO): say what it is, not "no such device"
            raise UsageError(f"{what} {label} is a socket, not a file: give a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{what} {label} is {_kind(info.st_mode)}, not a file: give a regular file")
        if info.st_size > max_bytes:
            raise LimitError(f"{what} {label} is {size_text(info.st_size)}, more than the {size_text(max_bytes)} "
                             "this reads")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _is_socket(name: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(name).st_mode)
    except OSError:
        return False


def read_regular_file(path: str | os.PathLike, max_bytes: int, what: str, label: str | None = None) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them (`open_regular_file`'s checks
    and errors; a file that grows past the cap while it is read is a `LimitError` too)."""
    with open_regular_file(path, max_bytes, what, label) as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise LimitError(f"{what} {os.fspath(path) if label is None else label} grew past the {size_text(max_bytes)} this reads while it was read")
    return data


def read_bounded(stream: IO, max_bytes: int, what: str) -> Any:
    """At most `max_bytes` from a stream that has no size to check first (stdin); a `LimitError` if
    there is more (`omni-say < /dev/zero` stops after the cap plus one byte). A text stream gives str,
    bounded in characters."""
    data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise LimitError(f"{what} holds more than the {size_text(max_bytes)} this reads")
    return data
