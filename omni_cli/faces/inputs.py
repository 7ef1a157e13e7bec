"""What a command is given to say: the prompt (argument, piped stdin, `-f FILE`) and its media
(`--audio`, `--image`), read and checked before anything is loaded.

Text must be UTF-8 (a one-line usage error names the first bad byte); media are read by `media.py`
(numpy, soundfile, Pillow: imported only when there are some). Every read is bounded by `Limits`
(limits.py): `-f FILE` must be a regular file (a FIFO or a device is refused at once; `-f -` is stdin)
of at most `prompt_file_bytes`, piped stdin is read up to that many bytes, `--audio -` up to
`attachment_bytes`. It knows nothing of models.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UsageError
from ..limits import DEFAULT, Limits, read_bounded, read_regular_file
from .console import isatty


def read_stdin(terminal_too: bool = False, limits: Limits = DEFAULT) -> str | None:
    """Piped stdin as text (at most `limits.prompt_file_bytes`: `< /dev/zero` is refused, not read until
    memory runs out); None when stdin is closed or absent, or a terminal (unless `terminal_too`: `-f -`
    reads what is typed, up to Ctrl-D)."""
    stdin = sys.stdin
    if stdin is None or (isatty(stdin) and not terminal_too):
        return None
    try:
        # A text stream (a test's StringIO) is bounded in characters, a real stdin in bytes.
        data = read_bounded(stdin.buffer if hasattr(stdin, "buffer") else stdin, limits.prompt_file_bytes, "stdin")
    except (OSError, ValueError):  # a closed descriptor
        return None
    return data if isinstance(data, str) else _utf8(data, "stdin")


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = data[exc.start]
        raise UsageError(
            f"{what} is not UTF-8 text (byte 0x{bad:02x} at offset {exc.start}): convert it first, "
            "e.g. iconv -f latin1 -t utf-8"
        ) from exc


def read_prompt_file(name: str, limits: Limits = DEFAULT) -> str:
    """The text of `-f FILE` (`-` = stdin, a terminal included); a one-line UsageError if unreadable, not
    a regular file, or over `limits.prompt_file_bytes` (checked before it is read)."""
    if name == "-":
        return read_stdin(terminal_too=True, limits=limits) or ""
    try:
        data = read_regular_file(Path(name).expanduser(), limits.prompt_file_bytes, "the prompt file", name)
    except OSError as exc:
        raise UsageError(f"cannot read the prompt file {name}: {(exc.strerror or str(exc)).lower()}") from None
    return _utf8(data, f"the prompt file {name}")


def gather_prompt(argument: str | None, file: str | None = None, optional: bool = False,
                  limits: Limits = DEFAULT) -> str:
    """Piped stdin (or `-f FILE` instead) first, then the argument (like llm); a usage error if there
    is nothing to say, unless `optional` (audio or an image says it): then ""."""
    first = read_prompt_file(file, limits) if file is not None else read_stdin(limits=limits)
    parts = [p.strip() for p in (first, argument) if p is not None and p.strip()]
    if parts or optional:
        return "\n".join(parts)
    if file is not None and argument is None:
        raise UsageError(f"empty prompt: {'stdin' if file == '-' else f'the prompt file {file}'} holds no text")
    if argument is None and not first:
        raise UsageError('no prompt: give one, e.g. omni-say "Hello", or pipe text in: echo Hello | omni-say')
    raise UsageError('empty prompt: say something, e.g. omni-say "Hello"')


def read_images(names: list[str], limits: Limits = DEFAULT) -> list:
    """`--image` files, read and checked (media.py, which imports numpy, only when there are some)."""
    if not names:
        return []
    from ..media import read_image

    return [read_image(name, limits=limits) for name in names]


def read_clips(names: list[str], limits: Limits = DEFAULT) -> list:
    """`--audio` files (`-`: stdin's bytes) read and checked before the model loads."""
    if not names:
        return []
    from ..media import read_audio

    if names.count("-") > 1:
        raise UsageError("--audio - (stdin) can be given once")
    clips = []
    for name in names:
        if name == "-":
            stdin = sys.stdin.buffer if sys.stdin is not None and hasattr(sys.stdin, "buffer") else None
            data = read_bounded(stdin, limits.attachment_bytes, "--audio - (stdin)") if stdin is not None else b""
            clips.append(read_audio(data, "stdin", limits))
        else:
            clips.append(read_audio(name, limits=limits))
    return clips

