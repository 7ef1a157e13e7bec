"""Ctrl-C for tests: SIGINT to this process once the main thread is where the test means it to land.

A fixed timer lands wherever the main thread happens to be on a slow or busy machine (one once fired
while the first of three turns was still being set up, and the test failed on CI); waiting for a
condition keeps the interrupt in the step under test. After `limit` seconds it interrupts all the
same, so a run that never gets there fails instead of hanging."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable


class Interrupter(threading.Thread):
    def __init__(self, ready: Callable[[], object], delay: float, limit: float) -> None:
        super().__init__(daemon=True, name="test-interrupter")
        self.ready, self.delay, self.limit = ready, delay, limit
        self.reached = False  # whether `ready` held before the limit
        self._cancelled = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.limit
        while not self._cancelled.is_set() and time.monotonic() < deadline:
            try:
                self.reached = bool(self.ready())
            except (KeyError, IndexError, AttributeError):  # what it looks at is not there yet
                self.reached = False
            if self.reached:
                break
            time.sleep(0.005)
        if self._cancelled.wait(self.delay if self.reached else 0):
            return
        os.kill(os.getpid(), signal.SIGINT)

    def cancel(self) -> None:
        """No SIGINT after this returns (unless it was already sent)."""
        self._cancelled.set()
        self.join()


def interrupt_when(ready: Callable[[], object], delay: float = 0.05, limit: float = 60.0) -> Interrupter:
    """SIGINT `delay` seconds after `ready()` first holds (polled every 5 ms), or at `limit`."""
    thread = Interrupter(ready, delay, limit)
    thread.start()
    return thread
