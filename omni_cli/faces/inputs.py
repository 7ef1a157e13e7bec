"""What a command is given to say: the prompt (argument, piped stdin, `-f FILE`) and its media
(`--audio`, `--image`), read and checked before anything is loaded.

Text must be UTF-8 (a one-line usage error names the first bad byte); media are read by `media.py`
(numpy, soundfile, Pillow: imported only when there are some). It knows nothing of models.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UsageError
from .console import isatty


def read_stdin(terminal_too: bool = False) -> str | None:
    """Piped stdin as text; None when stdin is closed or absent, or a terminal (unless `terminal_too`:
    `-f -` reads what is typed, up to Ctrl-D)."""
    stdin = sys.stdin
    if stdin is None or (isatty(stdin) and not terminal_too):
        return None
    try:
        data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read()
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


def read_prompt_file(name: str) -> str:
    """The text of `-f FILE` (`-` = stdin, a terminal included); a one-line UsageError if unreadable."""
    if name == "-":
        return read_stdin(terminal_too=True) or ""
    try:
        data = Path(name).expanduser().read_bytes()
    except IsADirectoryError:
        raise UsageError(f"cannot read the prompt file {name}: it is a folder") from None
    except OSError as exc:
        raise UsageError(f"cannot read the prompt file {name}: {(exc.strerror or str(exc)).lower()}") from None
    return _utf8(data, f"the prompt file {name}")


def gather_prompt(argument: str | None, file: str | None = None, optional: bool = False) -> str:
    """Piped stdin (or `-f FILE` instead) first, then the argument (like llm); a usage error if there
    is nothing to say, unless `optional` (audio or an image says it): then ""."""
    first = read_prompt_file(file) if file is not None else read_stdin()
    parts = [p.strip() for p in (first, argument) if p is not None and p.strip()]
    if parts or optional:
        return "\n".join(parts)
    if file is not None and argument is None:
        raise UsageError(f"empty prompt: {'stdin' if file == '-' else f'the prompt file {file}'} holds no text")
    if argument is None and not first:
        raise UsageError('no prompt: give one, e.g. omni-say "Hello", or pipe text in: echo Hello | omni-say')
    raise UsageError('empty prompt: say something, e.g. omni-say "Hello"')


def read_images(names: list[str]) -> list:
    """`--image` files, read and checked (media.py, which imports numpy, only when there are some)."""
    if not names:
        return []
    from ..media import read_image

    return [read_image(name) for name in names]


def read_clips(names: list[str]) -> list:
    """`--audio` files (`-`: stdin's bytes) read and checked before the model loads."""
    if not names:
        return []
    from ..media import read_audio

    if names.count("-") > 1:
        raise UsageError("--audio - (stdin) can be given once")
    clips = []
    for name in names:
        if name == "-":
            data = sys.stdin.buffer.read() if sys.stdin is not None and hasattr(sys.stdin, "buffer") else b""
            clips.append(read_audio(data, "stdin"))
        else:
            clips.append(read_audio(name))
    return clips

