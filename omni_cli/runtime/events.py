"""What a turn is asked (`TurnRequest`) and what it yields (`TextDelta`, `AudioBlock`, then `Done(Reply)`).

Plain data, shared by the runtime and the API. It knows no model family: a reply's `codes` are the
talker's ids as the family makes them (one id a step for Qwen2.5-Omni, a 16-id frame for Qwen3-Omni).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # no numpy import for a client that has not received audio yet
    import numpy as np

from ..config import SamplingOptions


class TurnInterrupted(Exception):
    """Raised in a turn's event stream when another thread stopped it (`Engine.interrupt`: a server whose
    client went away); the turn's threads are stopped as for a closed stream."""


@dataclass
class TextDelta:
    text: str


@dataclass
class AudioBlock:
    pcm: np.ndarray  # float32 mono
    sample_rate: int


@dataclass
class Reply:
    text: str
    text_ids: list[int]  # reply token ids as the reference returns them (final EOS included)
    codes: list  # talker steps before the codec EOS: ints (Qwen2.5-Omni) or 16-id frames (Qwen3-Omni)
    audio: np.ndarray
    sample_rate: int
    stats: dict[str, Any]


@dataclass
class Done:
    reply: Reply


@dataclass(frozen=True)
class TurnRequest:
    input_ids: list[int]
    voice: str
    thinker: SamplingOptions
    talker: SamplingOptions
    max_text_tokens: int
    max_codes: int  # talker steps (codes, or frames)
    seed: int
    text_only: bool = False
    sink: Any = None  # an object with start/write/close/abort (audio/sinks.py), or None
    # Benchmarks: ignore text EOS and allow only audio codes, so the reply has exactly the asked lengths.
    force_lengths: bool = False
    # Record device events around every step (exact per-step GPU times and the gaps between talker steps).
    step_events: bool = False
    # Tests: run the decode loop under torch.cuda.set_sync_debug_mode("error") (any host sync raises).
    sync_debug: bool = False
    # The prompt's encoder inputs (audio features) as the family's processor makes them, or None.
    media: Any = None
