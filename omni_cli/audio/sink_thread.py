"""One thread owns a sink from `start()` to `close()` or `abort()`; everyone else sends it requests.

A sink (sinks.py) is not safe to call from two threads at once: a `WavSink.abort()` from the caller's
thread could close the file while the vocoder thread is inside `write()`. `SinkThread(sink)` runs the
whole life of the sink on its own thread. Its methods are the sink protocol and may be called from any
thread:

- `start(rate)`: the owner thread starts the sink; the caller waits and gets its error, if any.
- `write(block)`: queued (in order) for the owner thread; dropped once an abort was asked for.
- `close()`: the owner thread writes what is queued, then closes the sink (a speaker plays out); the
  caller waits and gets the first error of any request.
- `abort()`: a request the owner thread honours before any queued write: queued blocks are dropped and
  the sink is aborted there (a WAV's temp file removed, a speaker silenced). It waits a bounded time for
  that to be done, so a program that exits right after leaves nothing partial behind.

A request that fails (a full disk, a closed pipe) aborts the sink on the owner thread and is reported
once through `on_error` (the turn fails with it) and again by `close()`.

`SpeakerSink.abort()` stays callable from a signal handler directly: it only flags and stops the
PortAudio stream, so Ctrl-C silences the speaker even while the owner thread is busy.

It knows nothing about models or the engine; only the Channel and the sink protocol.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..runtime.channel import Cancelled, Channel

# How long abort() waits for the owner thread to have aborted the sink (a write blocked on a stalled
# pipe can hold it; then the caller goes on and the daemon thread finishes the abort when it can).
ABORT_WAIT = 2.0


class SinkThread:
    def __init__(self, sink: Any, on_error: Callable[[BaseException], None] | None = None,
                 name: str = "omni-sink") -> None:
        self.sink = sink
        self.on_error = on_error
        self.name = name
        self.error: BaseException | None = None
        self._requests: Channel = Channel(name="sink requests")
        self._abort = threading.Event()
        self._started = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    # -- requests (any thread) --------------------------------------------------------------------
    def start(self, sample_rate: int) -> None:
        """Start the sink on its own thread; raise here what its start() raised."""
        if self._thread is not None:
            raise RuntimeError("SinkThread.start() called twice")
        self._thread = threading.Thread(target=self._main, args=(sample_rate,), name=self.name, daemon=True)
        self._thread.start()
        self._started.wait()
        if self.error is not None:
            raise self.error

    def write(self, block: Any) -> None:
        if self._abort.is_set():
            return
        try:
            self._requests.put(block)
        except (Cancelled, RuntimeError):  # aborted or closed meanwhile: the block is not wanted
            pass

    def close(self) -> None:
        """Finish: the queued blocks, then the sink's close(), on the owner thread. Raises its error."""
        if self._thread is None:
            return
        self._requests.close()
        self._done.wait()
        if self.error is not None:
            raise self.error

    def abort(self, wait: float | None = ABORT_WAIT) -> None:
        """Ask the owner thread to abort the sink before anything queued; wait up to `wait` seconds."""
        self._abort.set()
        self._requests.cancel()  # drops the queue and wakes the owner thread
        if self._thread is None or self._thread is threading.current_thread():
            return
        self._done.wait(wait)

    @property
    def finished(self) -> bool:
        """True once the sink has been closed or aborted on its thread."""
        return self._done.is_set()

    # -- the owner thread ----------------------------------------------------------------------------
    def _main(self, sample_rate: int) -> None:
        try:
            try:
                self.sink.start(sample_rate)
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread by start()
                self.error = exc
                self._abort_sink()
                return
            finally:
                self._started.set()
            try:
                for block in self._requests:  # ends at close(), or at once after abort() (cancel)
                    if self._abort.is_set():
                        break
                    self.sink.write(block)
                if self._abort.is_set():
                    self._abort_sink()
                else:
                    self.sink.close()
            except BaseException as exc:  # noqa: BLE001 - travels to the turn and to close()
                self.error = exc
                self._abort.set()
                self._requests.cancel()
                self._abort_sink()
                if self.on_error is not None:
                    self.on_error(exc)
        finally:
            self._done.set()

    def _abort_sink(self) -> None:
        try:
            self.sink.abort()
        except Exception:  # noqa: BLE001 - aborting is best effort; the first error is what matters
            pass
