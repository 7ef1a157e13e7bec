"""One turn's threads and channels: the engine thread runs the schedule, the producer thread turns
device ids into host facts, the vocoder thread turns codes into audio, the caller's thread reads events.

Threads. The engine thread issues steps (`schedule.py`) and never reads a device value. Each sampled
id goes through the async output boundary (`boundary.py`) to the producer thread, which notices text
EOS and the talker's stop (ids after either are discarded), hands text to the detokenizer
(`detokenize.py`) and codes to the vocoder thread, which hands PCM blocks to the sink's own thread
(`audio/sink_thread.py`: one thread owns the sink from start to close). An exception in any worker
travels to the caller and stops the others; closing the event iterator (Ctrl-C) stops them at once.

It knows no model family: the family's steps and vocoder come in through `ModelSteps` (models/base.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from ..audio.sink_thread import SinkThread
from .boundary import AsyncOutput
from .channel import Channel
from .detokenize import Detokenizer
from .events import AudioBlock, Done, Reply, TextDelta, TurnInterrupted, TurnRequest
from .schedule import Schedule
from .stats import StepClock, TurnState, media_stats, turn_stats
from .vocoder_worker import vocoder_worker

if TYPE_CHECKING:
    from ..models.base import Vocoder


class Turn:
    def __init__(self, engine, req: TurnRequest) -> None:
        self.e = engine
        self.steps = engine.steps
        self.req = req
        self.audio = self.steps.has_talker and not req.text_only
        self.n_max = req.max_text_tokens if not self.audio else max(2, req.max_text_tokens)
        self.state = TurnState()
        self.stop = threading.Event()
        self.events: Channel = Channel(name="events")
        self.codes_ch: Channel = Channel(name="codes")
        self.boundary = AsyncOutput(self.steps.device, {"text": (self.n_max, 1),
                                                        "code": (max(1, req.max_codes), self.steps.frame_width)},
                                    engine.max_lag)
        self._workers_left = 2 if self.audio else 1
        self._workers_lock = threading.Lock()
        self._pcm: list[np.ndarray] = []
        self.eos_ids = [] if req.force_lengths else engine.eos_ids  # EOS ids that end the text
        self.detok = Detokenizer(engine.tokenizer)
        self.clock = StepClock(self.steps.device, req.step_events)
        self.schedule = Schedule(self.steps, req, eos_ids=self.eos_ids, all_eos_ids=engine.eos_ids, n_max=self.n_max,
                                 audio=self.audio, boundary=self.boundary, state=self.state, stop=self.stop,
                                 clock=self.clock, talker_stream=engine.talker_stream if engine.overlap else None)
        self.sink: SinkThread | None = None  # the request's sink, owned by its own thread (run())

    # -- orchestration (caller's thread) ------------------------------------------------------
    def run(self) -> Iterator[TextDelta | AudioBlock | Done]:
        t0 = time.perf_counter()
        self.state.times["start"] = t0
        threads = [threading.Thread(target=self._engine_main, name="omni-engine", daemon=True),
                   threading.Thread(target=self._producer_main, name="omni-producer", daemon=True)]
        if self.audio:
            threads.append(threading.Thread(target=self._vocoder_main, name="omni-vocoder", daemon=True))
        # The sink lives on its own thread from start to close (sink_thread.py): the vocoder thread
        # only queues blocks for it, and an interrupt only asks it to abort.
        self.sink = SinkThread(self.req.sink, on_error=self._fail) if self.req.sink is not None and self.audio else None
        ok = False
        try:
            if self.sink is not None:
                self.sink.start(self.steps.sample_rate)
            for t in threads:
                t.start()
            for event in self.events:
                yield event
            ok = True
        finally:
            if not ok:
                self._shutdown()
                if self.sink is not None:
                    self.sink.abort()  # silence first: an interrupted reply stops sounding at once
            for t in (t for t in threads if t.ident is not None):  # only those that started
                # After an interrupt the vocoder may be inside a chunk; don't hold the caller for it.
                # The engine joins it before the next turn starts (`Engine.stream`). It no longer
                # touches the sink: its blocks are dropped by the aborted SinkThread.
                t.join(timeout=None if ok or t.name != "omni-vocoder" else 0.02)
                if t.is_alive():
                    self.e.lingering.append(t)
            if ok and self.sink is not None:
                self.sink.close()  # plays out / renames into place; raises what a write raised
        yield Done(self._result(t0))  # reached only when the turn completed

    def interrupt(self) -> None:
        """From another thread: the consumer's next wait for an event raises TurnInterrupted."""
        self.events.fail(TurnInterrupted("the turn was interrupted"))
        self._shutdown()

    def _shutdown(self) -> None:
        self.stop.set()
        self.schedule.first_audio.set()  # a held engine thread goes on to see the stop
        self.boundary.cancel()
        self.codes_ch.cancel()
        self.events.cancel()

    def _fail(self, exc: BaseException) -> None:
        self.stop.set()
        self.schedule.first_audio.set()
        self.boundary.cancel()
        self.codes_ch.cancel()
        self.events.fail(exc)

    def _worker_done(self) -> None:
        with self._workers_lock:
            self._workers_left -= 1
            if self._workers_left == 0:
                self.events.close()

    # -- engine thread: issue steps, never read device values ----------------------------------
    def _engine_main(self) -> None:
        try:
            with torch.inference_mode(), self._engine_stream():
                self.schedule.run()
        except BaseException as exc:  # noqa: BLE001 - travels to the caller
            self._fail(exc)
        finally:
            self.boundary.finish()

    def _engine_stream(self):
        stream = self.e.step_stream
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.steps.device))  # whatever the caller queued before
        return torch.cuda.stream(stream)

    # -- producer thread: host values, EOS bookkeeping, text deltas, code hand-off -------------
    def _producer_main(self) -> None:
        try:
            self.boundary.drain(self._handle)
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)
            return
        finally:
            self.codes_ch.close()
        self._worker_done()

    def _handle(self, kind: str, index: int, value) -> None:
        """One step's host value: a text id, or a talker step's ids (an int, or a frame's list)."""
        st = self.state
        if kind == "text":
            st.times.setdefault("first_token", time.perf_counter())
            if st.text_end is not None:
                return  # overshoot past the text's end: discarded
            st.text_ids.append(value)
            if value in self.eos_ids or index == self.n_max - 1:
                st.text_end = index + 1
            delta = self.detok.delta(st.text_ids, final=st.text_end is not None)
            if delta:
                st.times.setdefault("first_text", time.perf_counter())
                self.events.put(TextDelta(delta))
            return
        if st.codes_end is not None:
            return
        first = value[0] if isinstance(value, list) else value  # codebook 0 decides
        if st.text_end == 1 and st.text_ids[0] in self.eos_ids:
            st.codes_end = 0  # empty reply: nothing to say
        elif first in self.steps.stop_codes:
            st.codes_end = index
        else:
            st.codes.append(value)
            if first < self.steps.audio_limit:
                self.codes_ch.put([value])
            else:
                st.skipped_codes += 1
            if index + 1 >= self.req.max_codes:
                st.codes_end = index + 1
        if st.codes_end is not None:
            self.codes_ch.close()

    # -- vocoder thread: codes → PCM → sink ------------------------------------------------------
    def _vocoder_main(self) -> None:
        try:
            voc: Vocoder = self.steps.vocoder(self.req.voice, self.req.seed, self.req.max_codes)
            self.state.vocoder_chunks = voc.chunk_log  # read after the turn, for the stats
            self.state.vocoder_units_per_code = voc.log_units_per_code
            if self.steps.device.type == "cpu" or voc.quiet_first_chunk:
                self.schedule.hold_at = voc.codes_for_first_audio
        except BaseException as exc:  # noqa: BLE001 - travels to the caller
            self.schedule.first_audio.set()
            self._fail(exc)
            return
        out = _BlocksToTurn(self)
        try:
            vocoder_worker(voc, self.codes_ch, out)  # returns after close() or fail(); never raises
        finally:
            self.schedule.first_audio.set()  # no audio at all (an empty reply): nothing to hold for
        if not out.failed:
            self._worker_done()

    def _on_block(self, block: np.ndarray) -> None:
        now = time.perf_counter()
        self.state.times.setdefault("first_audio", now)
        self.schedule.first_audio.set()
        self.state.times["last_audio"] = now
        self._pcm.append(block)
        if self.sink is not None:
            self.sink.write(block)
        self.events.put(AudioBlock(block, self.steps.sample_rate))

    # -- result ----------------------------------------------------------------------------------
    def _result(self, t0: float) -> Reply:
        st = self.state
        end = time.perf_counter()
        audio = np.concatenate(self._pcm) if self._pcm else np.zeros(0, dtype=np.float32)
        rate = self.steps.sample_rate
        stats = turn_stats(st, self.clock, t0, end, len(audio) / rate)
        stats["prompt_tokens"] = len(self.req.input_ids)
        kept = self.steps.kept_context()
        stats["prefill_tokens"] = len(self.req.input_ids) - kept["found"]  # the rest was kept from the turn before
        if st.codes:  # the talker's prompt rows it found kept (its prefill ran this turn)
            stats["talker_kept_rows"] = kept.get("talker_found", 0)
        stats.update(media_stats(self.req.media))
        return Reply(self.detok.text(st.text_ids), list(st.text_ids), list(st.codes), audio, rate, stats)


class _BlocksToTurn:
    """The vocoder worker's output side: each PCM block goes straight to the turn (sink + events)."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.failed = False

    def put(self, block: np.ndarray) -> None:
        self.turn._on_block(block)  # raises Cancelled once the caller has gone: the worker stops

    def close(self) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        self.failed = True
        self.turn._fail(exc)
