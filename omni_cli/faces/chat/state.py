"""What one omni-chat session holds, declared once: `ChatRepl` (loop.py) sets it, and its parts (the
slash commands, saving and resuming) read and change it. Declarations only: no behaviour."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ...config import ReplyOptions
from ...interface import OmniAssistant
from ...limits import DEFAULT, Limits


class SessionState:
    """The attributes of a chat session (see `ChatRepl.__init__` for what each holds)."""

    assistant: OmniAssistant
    out: Any  # rich consoles: the answer, and everything else
    err: Any
    chat: Any  # prompt.Chat: the conversation (its history is the model's context)
    options: ReplyOptions
    muted: bool
    speaker: Callable[[], Any] | None
    verbose: bool
    debug: bool
    piped: bool
    failures: list[int]
    loaded_from: Path | None
    transcript: list[dict]
    attached: list
    shown: list[tuple[str, Any]]
    attachments: list[dict]
    record_options: Any
    listen_options: Any
    talk: Any
    speech: list[tuple[int, Any]]
    last_stats: dict | None
    last_playback: dict | None
    replies: int
    underruns: int
    interrupts: list[dict]
    _steps: tuple[str, float | None]

    @property
    def voice(self) -> str | None:
        return self.options.voice

    @property
    def limits(self) -> Limits:
        """The caps on what the session reads (/load, /audio, /image: limits.py): a local assistant's
        own, else the defaults (a remote one's server checks its own again)."""
        return getattr(self.assistant, "input_limits", DEFAULT)

    def say(self, message: str) -> None:
        """A line on the err console (ChatRepl's)."""
        raise NotImplementedError

    def error(self, exc: BaseException) -> None:
        """An error as one line; the session goes on (ChatRepl's)."""
        raise NotImplementedError

    def turn(self, text: str) -> None:
        """One reply (ChatRepl's)."""
        raise NotImplementedError
