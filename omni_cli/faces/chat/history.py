"""omni-chat's input history on disk and its prompt_toolkit session (history, Ctrl-T for /listen).

The history file lives in the user's data folder unless `--no-history` or OMNI_NOHISTORY=1 (as
OLLAMA_NOHISTORY). One that cannot be written, when the session starts or at any line later (a full
disk, a read-only folder, a file removed), is one warning and the history lasts the session: the
session never stops for it (prompt_toolkit's FileHistory raised inside its event loop, and the chat
waited for "Press ENTER" at its first message). Only a regular file is read as history (a device
such as /dev/zero would be read forever), and only its last HISTORY_BYTES.
prompt_toolkit is imported when a session is made.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

from ...config import env_flag
from ...paths import default_history_file  # noqa: F401 - the faces find it here

# Turns the chat's history file off when set to anything but "" or "0" (like OLLAMA_NOHISTORY).
NO_HISTORY_ENV = "OMNI_NOHISTORY"


def history_disabled_by_env() -> bool:
    return env_flag(NO_HISTORY_ENV)


# The most of a history file that is read when a session starts (its newest lines): ~50,000 typed lines.
HISTORY_BYTES = 4 << 20


def make_history(path: Path | None, warn: Callable[[str], None]):
    """The input history at `path` (its folder made), or in-memory history if None or unusable; a
    failure to write it later is one warning (`warn`) and the session goes on."""
    from prompt_toolkit.history import InMemoryHistory

    if path is None:
        return InMemoryHistory()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise OSError(0, "it is not a regular file")
    except OSError as exc:
        warn(_cannot_keep(path, exc))
        return InMemoryHistory()
    return _history_class()(path, warn)


def _cannot_keep(path: Path, exc: OSError) -> str:
    from ...atomic import os_reason

    return f"warning: cannot keep the input history in {path} ({os_reason(exc, path)}); it lasts this session only"


def _history_class():
    """FileHistory that never raises (made here: prompt_toolkit is imported only when a session is)."""
    from prompt_toolkit.history import FileHistory

    class KeptHistory(FileHistory):
        """A FileHistory whose write failures are one warning, after which it keeps the lines in memory
        only; it reads at most the file's last HISTORY_BYTES."""

        def __init__(self, path: Path, warn: Callable[[str], None]) -> None:
            super().__init__(str(path))
            self.path = path
            self.warn = warn
            self.failed = False

        def store_string(self, string: str) -> None:
            if self.failed:
                return  # append_string has kept it in memory already
            try:
                super().store_string(string)
            except OSError as exc:
                self.failed = True
                self.warn(_cannot_keep(self.path, exc))

        def load_history_strings(self):
            try:
                return list(_read_history(self.path))
            except OSError as exc:
                self.failed = True
                self.warn(_cannot_keep(self.path, exc))
                return []

    return KeptHistory


def _read_history(path: Path):
    """The entries of prompt_toolkit's history file format, newest first, from its last HISTORY_BYTES."""
    with open(path, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return []
        size = os.fstat(f.fileno()).st_size
        if size > HISTORY_BYTES:
            f.seek(size - HISTORY_BYTES)
            f.readline()  # the rest of a line cut in two
        data = f.read(HISTORY_BYTES)
    strings: list[str] = []
    lines: list[str] = []
    for raw in data.splitlines(keepends=True):
        line = raw.decode("utf-8", errors="replace")
        if line.startswith("+"):
            lines.append(line[1:])
        else:
            if lines:
                strings.append("".join(lines)[:-1])
            lines = []
    if lines:
        strings.append("".join(lines)[:-1])
    return reversed(strings)


def make_session(history, input=None, output=None):
    """The prompt_toolkit session of omni-chat: `>>> ` prompts, history, Ctrl-C / Ctrl-D as usual, and
    Ctrl-T on an empty line for /listen (speak instead of typing)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("c-t")
    def _listen(event) -> None:
        buffer = event.app.current_buffer
        if not buffer.text.strip():
            buffer.text = "/listen"
            buffer.validate_and_handle()

    return PromptSession(history=history, input=input, output=output, enable_history_search=False,
                         mouse_support=False, complete_while_typing=False, key_bindings=keys)

