"""The vocoder thread's body: codes from a channel in, PCM blocks out, errors carried to the consumer.

It drives any streaming vocoder with `push(codes) -> blocks`, `finish() -> blocks` and a `device`
(models/*/vocoder or code2wav), on a side stream of its own on an accelerator so it overlaps the
engine's steps. It knows nothing about models, sinks or turns.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np
import torch

from .channel import Cancelled, Channel

if TYPE_CHECKING:
    from ..models.base import Vocoder

END = None  # an item that ends the codes stream early; closing the channel is just as good


class BlockSink(Protocol):
    """Where the worker hands its PCM blocks: a `Channel`, or the turn's own receiver (turn.py)."""

    def put(self, block: np.ndarray) -> None: ...

    def close(self) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


def vocoder_worker(
    vocoder: Vocoder,
    codes: Channel,
    pcm: BlockSink,
    on_block: Callable[[np.ndarray, float], None] | None = None,
) -> None:
    """Body of the vocoder thread: lists of codes in, float32 PCM blocks out, then `pcm.close()`.

    An error (in the vocoder, or one the codes channel carries from the engine) ends `pcm` with
    `fail(exc)`, so the consumer raises it; the codes channel is cancelled so the engine stops too.
    If the consumer cancels `pcm`, the worker stops quietly and cancels `codes`.
    `on_block(block, t)` sees each block with its `time.perf_counter()` time before it is handed on.
    """

    def emit(blocks: list[np.ndarray]) -> None:
        for block in blocks:
            if on_block is not None:
                on_block(block, time.perf_counter())
            pcm.put(block)

    try:
        with _side_stream(vocoder.device):
            for item in codes:
                if item is END:
                    break
                emit(vocoder.push(item))
            emit(vocoder.finish())
        pcm.close()
    except Cancelled:
        codes.cancel()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the consumer
        codes.cancel()
        pcm.fail(exc)


def _side_stream(device: torch.device):
    """On an accelerator, run the vocoder on its own stream so it overlaps the engine's work.

    A no-op on CPU (and wherever `torch.Stream` is missing). The new stream first waits for the
    current one, so the noise and voice tensors made at construction are ready.
    """
    if device.type == "cpu" or not hasattr(torch, "Stream"):
        return contextlib.nullcontext()
    stream = torch.Stream(device=device)
    stream.wait_stream(torch.accelerator.current_stream(device))
    return stream
