"""The async output boundary: device-side step outputs → host, off the critical path.

After a step, the engine hands its sampled id (a device tensor) to `AsyncOutput.push`. On CUDA/NPU the
value is copied device→host into pinned memory on a side stream and an event is recorded: the engine
never waits for it. On CPU it is a plain copy. A background *producer* thread (`drain`) waits on those
events in order, reads the host values, and calls the turn's handler (EOS bookkeeping, text deltas, code
chunks). The engine learns about stops through host-side counters the producer updates, with a lag
bounded by `max_lag` steps (`wait_for`): the device never idles, and the host never runs far ahead.

It knows nothing about models: only ids, indexes, streams and events.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from .channel import Channel


class AsyncOutput:
    def __init__(self, device: torch.device, capacity: dict[str, int | tuple[int, int]], max_lag: int = 4) -> None:
        """`capacity`: per kind of ids, the number of steps, or (steps, ids a step) when a step samples
        several ids at once (a Qwen3-Omni talker frame: 16); the handler then gets a list per step."""
        self.device = device
        self.accelerated = device.type not in ("cpu", "meta")
        pin = self.accelerated and device.type == "cuda"
        shapes = {k: (v, 1) if isinstance(v, int) else tuple(v) for k, v in capacity.items()}
        self.width = {k: w for k, (_n, w) in shapes.items()}
        # One host slot per future step, per stream of ids ("text", "code").
        self.host = {k: torch.zeros(n, w, dtype=torch.long, pin_memory=pin) for k, (n, w) in shapes.items()}
        self.stream = torch.Stream(device=device) if self.accelerated else None
        self.pending: Channel = Channel(name="boundary")
        self.max_lag = max_lag
        self._done = {k: -1 for k in capacity}  # highest index the producer has handled, per kind
        self._cond = threading.Condition()
        self.failed: BaseException | None = None

    # -- engine side (hot loop: no host sync) ---------------------------------------------------
    def push(self, kind: str, index: int, value: torch.Tensor) -> None:
        """Queue the copy of `value` ([1] long on device, or [width]) into host slot `index` of `kind`."""
        slot = self.host[kind][index]
        if self.stream is None:
            slot.copy_(value)
            self.pending.put((kind, index, None))
            return
        # The side stream waits for the step that produced `value`, then copies; the event tells the
        # producer when the host slot holds it. record_stream keeps the allocator from reusing `value`.
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        with self.stream:  # torch.Stream is a context manager that makes itself current
            slot.copy_(value, non_blocking=True)
            event = torch.Event(device=self.device)
            event.record(self.stream)
        value.record_stream(self.stream)
        self.pending.put((kind, index, event))

    def wait_for(self, kind: str, index: int, stop: threading.Event | None = None) -> None:
        """Block until the producer has handled `kind` up to `index - max_lag` (the bounded lag)."""
        target = index - self.max_lag
        if target < 0:
            return
        with self._cond:
            self._cond.wait_for(lambda: self._done[kind] >= target or self.failed is not None or (stop is not None and stop.is_set()))

    def finish(self) -> None:
        self.pending.close()

    def cancel(self) -> None:
        """Stop: drop what is pending and wake an engine thread blocked in `wait_for`."""
        self.pending.cancel()
        self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- producer side --------------------------------------------------------------------------
    def drain(self, handle: Callable[[str, int, int], None]) -> None:
        """Producer thread body: for each pushed step, wait for its copy and call handle(kind, index, id)
        (an int, or a list of `width` ids)."""
        try:
            for kind, index, event in self.pending:
                if event is not None:
                    event.synchronize()
                row = self.host[kind][index]
                handle(kind, index, int(row[0]) if self.width[kind] == 1 else row.tolist())
                with self._cond:
                    self._done[kind] = index
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - travels to the caller through `failed`
            with self._cond:
                self.failed = exc
            self.pending.cancel()
            raise
        finally:
            self._wake()  # an engine thread waiting on progress must re-check its stop flag
