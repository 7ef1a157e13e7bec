"""omni-chat's input history on disk and its prompt_toolkit session (history, Ctrl-T for /listen).

The history file lives in the user's data folder unless `--no-history` or OMNI_NOHISTORY=1 (as
OLLAMA_NOHISTORY); one that cannot be written is a warning and the history lasts the session.
prompt_toolkit is imported when a session is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ...config import env_flag
from ...paths import default_history_file  # noqa: F401 - the faces find it here

# Turns the chat's history file off when set to anything but "" or "0" (like OLLAMA_NOHISTORY).
NO_HISTORY_ENV = "OMNI_NOHISTORY"


def history_disabled_by_env() -> bool:
    return env_flag(NO_HISTORY_ENV)


def make_history(path: Path | None, warn: Callable[[str], None]):
    """A prompt_toolkit FileHistory at `path` (its folder made), or in-memory history if None or unusable."""
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    if path is None:
        return InMemoryHistory()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        warn(f"warning: cannot keep the input history in {path} ({exc.strerror or exc}); it lasts this session only")
        return InMemoryHistory()
    return FileHistory(str(path))


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

