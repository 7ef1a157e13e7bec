"""One thread owns a sink from start to close: every call into the sink happens on that thread, never
two at once, and an abort asked for from elsewhere (while a write is inside the sink) is honoured there,
after the write, with nothing queued written after it. Errors of a write reach the turn and close()."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from omni_cli.assistant import Assistant
from omni_cli.errors import OutputError
from omni_cli.audio.sink_thread import SinkThread
from omni_cli.audio.sinks import WavSink


class SpySink:
    """Records which thread made each call and fails the test's check if two calls overlap."""

    def __init__(self, write_delay: float = 0.0, fail_on_write: int | None = None):
        self.calls: list[tuple[str, int]] = []
        self.overlaps = 0
        self.write_delay = write_delay
        self.fail_on_write = fail_on_write
        self.writes = 0
        self._busy = threading.Lock()
        self.in_write = threading.Event()

    def _enter(self, name: str) -> None:
        if not self._busy.acquire(blocking=False):
            self.overlaps += 1
            self._busy.acquire()
        self.calls.append((name, threading.get_ident()))

    def start(self, rate):
        self._enter("start")
        self._busy.release()

    def write(self, block):
        self._enter("write")
        try:
            self.writes += 1
            if self.fail_on_write == self.writes:
                raise OutputError("disk full")
            self.in_write.set()
            time.sleep(self.write_delay)
        finally:
            self._busy.release()

    def close(self):
        self._enter("close")
        self._busy.release()

    def abort(self):
        self._enter("abort")
        self._busy.release()

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    @property
    def threads(self) -> set[int]:
        return {tid for _, tid in self.calls}


def block(n: int = 240) -> np.ndarray:
    return np.zeros(n, dtype=np.float32)


def test_every_call_runs_on_one_thread_that_is_not_the_callers():
    spy = SpySink()
    owner = SinkThread(spy)
    owner.start(24_000)
    writers = [threading.Thread(target=lambda: [owner.write(block()) for _ in range(20)]) for _ in range(3)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    owner.close()
    assert spy.names == ["start"] + ["write"] * 60 + ["close"]
    assert len(spy.threads) == 1 and threading.get_ident() not in spy.threads
    assert spy.overlaps == 0


def test_abort_during_a_write_waits_for_it_and_drops_the_queue():
    spy = SpySink(write_delay=0.3)
    owner = SinkThread(spy)
    owner.start(24_000)
    for _ in range(5):
        owner.write(block())
    assert spy.in_write.wait(5)  # the owner thread is inside the first write now
    t = time.perf_counter()
    owner.abort()
    waited = time.perf_counter() - t
    assert owner.finished  # abort() returned after the sink was aborted on its thread
    assert spy.names == ["start", "write", "abort"]  # the four queued blocks were dropped
    assert spy.overlaps == 0 and len(spy.threads) == 1
    assert waited < 1.0
    owner.write(block())  # late blocks (a lingering vocoder thread) are dropped quietly
    owner.close()  # and closing afterwards is a no-op
    assert spy.names == ["start", "write", "abort"]


def test_a_failed_write_aborts_the_sink_reports_once_and_close_raises():
    spy = SpySink(fail_on_write=2)
    errors = []
    owner = SinkThread(spy, on_error=errors.append)
    owner.start(24_000)
    for _ in range(4):
        owner.write(block())
    with pytest.raises(OutputError, match="disk full"):
        owner.close()
    assert [type(e) for e in errors] == [OutputError]
    assert spy.names == ["start", "write", "write", "abort"]


def test_a_failed_start_is_raised_on_the_callers_thread():
    class NoDevice(SpySink):
        def start(self, rate):
            raise OutputError("no device")

    spy = NoDevice()
    with pytest.raises(OutputError, match="no device"):
        SinkThread(spy).start(24_000)
    assert spy.names == ["abort"]


class SlowWavSink(WavSink):
    """A WAV file whose writes take a while, to widen the window the old code raced in."""

    def __init__(self, path):
        super().__init__(path)
        self.threads: set[int] = set()

    def start(self, rate):
        self.threads.add(threading.get_ident())
        super().start(rate)

    def write(self, block):
        self.threads.add(threading.get_ident())
        time.sleep(0.05)
        super().write(block)

    def abort(self):
        self.threads.add(threading.get_ident())
        super().abort()


@pytest.fixture(scope="module")
def assistant():
    return Assistant.load(None, device="cpu")


def test_an_interrupted_turn_aborts_the_wav_on_its_own_thread(assistant, tmp_path):
    sink = SlowWavSink(tmp_path / "reply.wav")
    events = assistant.stream("Tell me a story", greedy=True, max_text_tokens=8, max_codes=300, sink=sink)
    for event in events:
        if type(event).__name__ == "AudioBlock":
            break  # the vocoder thread keeps writing
    events.close()  # the caller's interrupt: a request to the sink's thread
    assert sink.aborted and not sink.closed
    assert len(sink.threads) == 1 and threading.get_ident() not in sink.threads
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temp file, no WAV


def test_a_completed_turn_closes_the_wav_on_its_own_thread(assistant, tmp_path):
    sink = SlowWavSink(tmp_path / "reply.wav")
    reply = assistant.say("Hello", greedy=True, max_text_tokens=4, max_codes=40, sink=sink)
    assert sink.closed and len(sink.threads) == 1 and threading.get_ident() not in sink.threads
    import soundfile as sf

    audio, rate = sf.read(tmp_path / "reply.wav", dtype="float32")
    assert rate == 24_000 and len(audio) == len(reply.audio) > 0
