"""What a face may use of an assistant, local (`assistant.Assistant`) or remote (`api.client.RemoteAssistant`):
the one declared surface, so that the faces never probe with getattr nor reach into an engine.

- `OmniAssistant`: the Protocol both assistants (and the tests' fake) implement: what the model offers
  (`model_info`), and `stream` / `say` / `conversation` / `interrupt` / `close` / `warm_up`.
- `ModelInfo`: a frozen description of the model as the faces show it (/show, --verbose, the banner).
- `TurnStats`: what one reply's `stats` holds, named and typed (the engine and the server fill the dict;
  `TurnStats.of(stats)` reads it), so that the faces and the protocol agree on its keys in one place.

It imports neither torch nor numpy; a type checker (mypy, in `.ci/run`) holds the assistants to it
(`assistant.py` and `api/client.py` each state that their class is an `OmniAssistant`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Generator, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .config import ReplyOptions


@dataclass(frozen=True)
class ModelInfo:
    """The model behind an assistant, as a person is told about it."""

    # Short display name: the hub id or the folder's name (a server: its model id).
    name: str
    # The family's title ("Qwen2.5-Omni", "Qwen3-Omni"); None where a server does not say.
    title: str | None = None
    # Where it runs: the device ("cuda:0", "cpu") of a local model, the URL of a server.
    where: str | None = None
    # A built-in random-weight model (gibberish and noise).
    is_demo: bool = False
    # Whether it speaks (has a talker); its voices and the default one.
    has_audio: bool = True
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    # The system prompt a conversation gets when none is given, and whether the talker speaks reliably
    # only under it (Qwen2.5-Omni).
    default_system: str = ""
    speaks_only_under_default_system: bool = False
    # PCM rate of the speech, and what the talker's steps are called and how many make a second
    # ("codes", 50.0 for Qwen2.5-Omni; "frames", 12.5 for Qwen3-Omni; None where it is not said).
    sample_rate: int = 24_000
    step_unit: str = "codes"
    steps_per_second: float | None = None
    # A reply's caps when it asks for none: text tokens and talker steps; and the most steps a reply may
    # ask for in this session (what the caches were sized for). None where it is not said.
    default_text_tokens: int | None = None
    default_steps: int | None = None
    max_steps: int | None = None
    # Tokens of conversation a request keeps.
    max_context: int | None = None
    # The thinker's sampling when a reply sets none (the checkpoint's generation_config): name -> value,
    # and whether it samples at all; empty where it is not said.
    text_sampling: dict[str, float] = field(default_factory=dict)
    text_samples: bool = True


@runtime_checkable
class OmniAssistant(Protocol):
    """What the faces use of an assistant, local or remote (see the module docstring)."""

    name: str
    is_demo: bool
    # Where the start-up's time went (`--verbose`): phase -> seconds, in order; the faces may add to it.
    startup: dict[str, float]

    # The server's URL for a remote assistant; None for a model loaded in this process (read-only: each
    # assistant's own type is narrower).
    @property
    def url(self) -> str | None: ...

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def voices(self) -> list[str]: ...

    @property
    def default_voice(self) -> str | None: ...

    @property
    def has_audio(self) -> bool: ...

    @property
    def sample_rate(self) -> int: ...

    @property
    def default_system(self) -> str: ...

    # What the talker's steps are called and how many make a second; ("codes", None) from a server that
    # does not say.
    @property
    def speech_steps(self) -> tuple[str, float | None]: ...

    @property
    def speaks_only_under_default_system(self) -> bool: ...

    # A generator: the faces `close()` it when they stop reading (Ctrl-C), which stops the reply at once.
    def stream(self, prompt: str, options: "ReplyOptions | None" = None,
               **kwargs: Any) -> Generator[Any, None, None]: ...

    def say(self, prompt: str, options: "ReplyOptions | None" = None, **kwargs: Any) -> Any: ...

    def conversation(self, system: str | None = None) -> Any: ...

    def interrupt(self) -> None: ...

    def close(self) -> None: ...

    def warm_up(self, background: bool = False) -> Any: ...


@dataclass(frozen=True)
class TurnStats:
    """One reply's figures (seconds unless named otherwise; None where not measured). `Reply.stats` is a
    dict with these keys (and, through a server, `server_*` copies of the server's own times)."""

    # time.perf_counter() when the turn (or, through a server, the request) began: the times below count
    # from it.
    started_at: float | None = None
    time_to_first_text: float | None = None
    time_to_first_audio: float | None = None
    # The whole turn, and when the last audio block was handed on (generation time, not playback).
    total_time: float | None = None
    audio_done: float | None = None
    audio_seconds: float = 0.0
    text_tokens: int = 0
    codes: int = 0
    thinker_ms_per_token: float | None = None
    talker_ms_per_step: float | None = None
    images_in: int = 0
    image_encoder_ms: float | None = None
    audio_in_seconds: float = 0.0
    audio_encoder_ms: float | None = None
    # Through a server: its own time to the first audio (the rest of the wait is HTTP, queue, prompt).
    server_time_to_first_audio: float | None = None
    dropped_exchanges: int = 0

    @classmethod
    def of(cls, stats: dict | None) -> "TurnStats":
        """The figures of a `Reply.stats` dict (keys it does not know are left out)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (stats or {}).items() if k in known and v is not None})

    def real_time_factor(self) -> float | None:
        """Generation time over the audio's length (below 1: faster than it plays)."""
        made_in = self.audio_done if self.audio_done is not None else self.total_time
        return made_in / self.audio_seconds if self.audio_seconds and made_in is not None else None
