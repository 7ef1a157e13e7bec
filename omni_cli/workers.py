"""Long-lived worker threads: each runs the tasks it is given one at a time, turn after turn.

An engine keeps one worker per role (engine, producer, vocoder) instead of starting fresh threads for
every turn. CUDA libraries keep state per host thread (cuDNN's attention plans, for one): with a fresh
thread a turn rebuilt it in the middle of the prefills, which cost ~100 ms each on an H200 (time to
first text 116 ms against a 20 ms prefill). A worker's thread ends when its owner is garbage collected.

It knows nothing about turns: a task is a function that handles its own errors.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Callable

_ALL: "weakref.WeakSet[Worker]" = weakref.WeakSet()


class Task:
    """A submitted function: `join(timeout)` waits for it to end, `is_alive()` says whether it has not."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


class Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._running: Task | None = None
        # The thread holds only the queue and a weak reference, so dropping the worker ends it.
        self._thread = threading.Thread(target=_serve, args=(self._tasks, weakref.ref(self)), name=name, daemon=True)
        self._thread.start()
        weakref.finalize(self, self._tasks.put, None)
        _ALL.add(self)

    def submit(self, fn: Callable[[], None]) -> Task:
        task = Task(self.name)
        self._tasks.put((fn, task))
        return task

    @property
    def busy(self) -> bool:
        return self._running is not None or not self._tasks.empty()


def _serve(tasks: queue.SimpleQueue, owner: "weakref.ref[Worker]") -> None:
    while True:
        item = tasks.get()
        if item is None:
            return
        fn, task = item
        w = owner()
        if w is not None:
            w._running = task
        del w
        try:
            fn()
        except BaseException:  # noqa: BLE001 - tasks route their own errors; the worker must survive
            pass
        finally:
            w = owner()
            if w is not None:
                w._running = None
            del w
            task._done.set()
            del fn, task, item  # drop the turn's objects while idle


def busy_workers() -> list[str]:
    """Names of the workers that are running or holding a task (tests: nothing left running)."""
    return [w.name for w in list(_ALL) if w.busy]
