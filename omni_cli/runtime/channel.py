"""The one cross-thread queue of omni_cli: a small bounded FIFO with an end marker and error transport.

Producers `put()` items and finish with `close()` (normal end) or `fail(exc)` (the worker died: the
exception travels to the consumer as a value and is raised there, never swallowed). Consumers iterate
(`for item in ch`) or call `get()`. `cancel()` is for the consumer side: it wakes a producer blocked on
a full channel and makes every later `put()` raise `Cancelled`, so a worker thread can unwind.

It knows nothing about torch, audio or models; it is a thin layer over `threading.Condition`.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class Cancelled(Exception):
    """Raised in a producer when the consumer gave up on the channel (interrupt, error elsewhere)."""


class Closed(Exception):
    """Raised by `get()` once the channel is closed and drained."""


class Channel(Generic[T]):
    def __init__(self, maxsize: int = 0, name: str = "channel") -> None:
        # maxsize 0 means unbounded; a bound gives back-pressure to a producer that runs ahead.
        self.maxsize = maxsize
        self.name = name
        self._items: collections.deque[T] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._cancelled = False

    # -- producer side -------------------------------------------------------------------------
    def put(self, item: T) -> None:
        with self._cond:
            while self.maxsize and len(self._items) >= self.maxsize and not self._cancelled:
                self._cond.wait()
            if self._cancelled:
                raise Cancelled(self.name)
            if self._closed:
                raise RuntimeError(f"put() on closed {self.name}")
            self._items.append(item)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """End the channel with an error; the consumer raises `exc` after draining earlier items."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._closed = True
            self._cond.notify_all()

    # -- consumer side -------------------------------------------------------------------------
    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._items.clear()
            self._cond.notify_all()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def get(self, timeout: float | None = None) -> T:
        """Next item; raises the producer's error, `Closed` at the end, `TimeoutError` on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self._closed or self._cancelled, timeout):
                raise TimeoutError(self.name)
            if self._items:
                item = self._items.popleft()
                self._cond.notify_all()
                return item
            if self._error is not None:
                raise self._error
            raise Closed(self.name)

    def get_nowait(self) -> T | None:
        """An item if one is ready, else None; raises like `get()` at the end."""
        with self._cond:
            if self._items:
                item = self._items.popleft()
                self._cond.notify_all()
                return item
            if self._closed or self._cancelled:
                if self._error is not None:
                    raise self._error
                raise Closed(self.name)
            return None

    def __iter__(self) -> Iterator[T]:
        while True:
            try:
                yield self.get()
            except Closed:
                return
