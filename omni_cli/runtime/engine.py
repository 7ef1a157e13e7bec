"""One turn of the conversation: thinker and talker steps interleaved, outputs streamed as they exist.

Schedule. The thinker prefills the prompt and samples reply token 0. Thinker step j feeds token j-1
(giving its reply vector R[j-1]) and samples token j. Talker step k needs R[k], so it runs right after
thinker step k+1: codec codes, and so audio, exist long before the text is finished. Once the text has
ended, the talker is fed the text-EOS embedding once, then text-pad, until it samples a codec EOS.
On a CPU, where the engine and the vocoder share the cores, the engine pauses once the talker has made
the codes the first chunk needs, until that first audio exists (`FIRST_AUDIO_HOLD`).

Threads. The engine thread issues steps and never reads a device value. Each sampled id goes through
the async output boundary (`boundary.py`) to the producer thread, which notices text EOS and codec EOS
(with a lag of at most `max_lag` steps; ids after an EOS are discarded), streams text deltas, and feeds
codes to the vocoder thread (`vocoder.py`), which hands PCM blocks to the sink's own thread
(`sink_thread.py`: one thread owns the sink from start to close). The caller's thread
just reads events. An exception in any worker travels to the caller and stops the others.

It does not know about prompts or chat templates (it gets token ids), nor about the terminal.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from .boundary import AsyncOutput
from .channel import Channel
from ..config import CODES_PER_SECOND, SAMPLE_RATE, SamplingOptions
from .kv_cache import StaticKVCache
from .sampling import mark_seen, select
from ..audio.sink_thread import SinkThread
from ..models.qwen2_5_omni.talker import Talker
from ..models.qwen2_5_omni.thinker import Thinker

AUDIO_CODE_LIMIT = 8192  # only codes below this are audio (token2wav's embedding has 8193 rows)
FIRST_AUDIO_HOLD = 1.0  # longest the engine thread waits for the first audio on a CPU (seconds)


# --- events a turn yields ---------------------------------------------------------------------
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
    codes: list[int]  # talker codes before the codec EOS
    audio: np.ndarray
    sample_rate: int
    stats: dict[str, Any]


@dataclass
class Done:
    reply: "Reply"


@dataclass(frozen=True)
class TurnRequest:
    input_ids: list[int]
    voice: str
    thinker: SamplingOptions
    talker: SamplingOptions
    max_text_tokens: int
    max_codes: int
    seed: int
    text_only: bool = False
    sink: Any = None  # an object with start/write/close/abort (sinks.py), or None
    # Benchmarks: ignore text EOS and allow only audio codes, so the reply has exactly the asked lengths.
    force_lengths: bool = False
    # Record device events around every step (exact per-step GPU times and the gaps between talker steps).
    step_events: bool = False
    # Tests: run the decode loop under torch.cuda.set_sync_debug_mode("error") (any host sync raises).
    sync_debug: bool = False


@dataclass
class _TurnState:
    """Host-side facts the producer learns and the engine reads (plain attributes: GIL-atomic)."""

    text_ids: list[int] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)
    text_end: int | None = None  # number of reply tokens once the text is known to have ended
    codes_end: int | None = None  # number of codes once the talker is known to have ended
    skipped_codes: int = 0  # non-audio codes the talker produced (kept in `codes`, not vocoded)
    times: dict[str, float] = field(default_factory=dict)
    vocoder_chunks: list[tuple[int, float]] = field(default_factory=list)  # (mel frames, seconds) per chunk


class Engine:
    """Owns the static caches and runs turns for one loaded Qwen2.5-Omni model."""

    def __init__(self, model, tokenizer, speakers: dict, *, eos_ids: list[int], max_context: int = 4096,
                 max_codes: int = 4096, max_lag: int = 4, fast_decode: bool | None = None,
                 graphs: bool = True, compile: bool | None = None, vocoder_chunk_codes: int = 192) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.speakers = speakers
        self.eos_ids = list(eos_ids)
        self.max_lag = max_lag
        self.device = next(model.thinker.parameters()).device
        dtype = next(model.thinker.parameters()).dtype
        tcfg = model.config.thinker_config.text_config
        self.thinker = Thinker(model.thinker, StaticKVCache.for_config(tcfg, max_context, device=self.device, dtype=dtype))
        self.has_talker = getattr(model, "has_talker", False)
        if self.has_talker:
            kcfg = model.config.talker_config
            cache = StaticKVCache.for_config(kcfg, max_context + max_codes + 2, device=self.device, dtype=dtype)
            self.talker = Talker(model.talker, cache)
            self.stop_codes = [self.talker.codec_pad, self.talker.codec_eos]  # the reference stops on both
            embed = model.thinker.get_input_embeddings()
            with torch.no_grad():
                ids = torch.tensor([kcfg.tts_text_end_token_id, kcfg.tts_text_pad_token_id], device=self.device)
                vecs = embed(ids)
            self.text_eos_vec, self.text_pad_vec = vecs[0].view(1, 1, -1), vecs[1].view(1, 1, -1)
        self.max_context = max_context
        self.max_codes = max_codes
        self.graphs = graphs
        # The fused fixed-shape decode step: on accelerators fewer, larger kernels and CUDA graphs; on a
        # CPU fewer, larger matmuls and less Python per step (one core, built-in model: talker
        # 3.3 -> 2.9 ms a step, thinker 1.4 -> 1.0 ms a token, real-time factor 0.23-0.27 -> 0.20-0.22).
        # Its picks equal the library layers' and transformers' (tests/test_parity.py checks both).
        if fast_decode is None:
            fast_decode = True
        self.fast_decode = fast_decode
        if self.device.type == "cuda":
            configure_cuda(float32_llm=dtype == torch.float32)
        if fast_decode:
            from .graphs import compile_wanted

            compile = compile_wanted(graphs if compile is None else compile, self.device)
            self.thinker.enable_fast_decode(graphs, compile)
            if self.has_talker:
                self.talker.enable_fast_decode(graphs, compile)
        # The vocoder's steady chunk (chunks grow 12, 24, 48, ... up to it; see vocoder.py). A DiT window
        # has a large fixed cost (36 evaluations of small kernels), so larger chunks cost less per second
        # of audio. Measured side by side on an H200 beside the 7B talker (omni-bench --schedules):
        # steady 48 codes: 111 ms a chunk, 0.130 s per second of audio, real-time factor 0.239;
        # 96: 158 ms, 0.101 s, 0.212; 192: 222 ms, 0.080 s, 0.193; first audio the same (~300-317 ms).
        # The first chunks stay small (12, 24, ...), so short replies are unaffected.
        self.vocoder_chunk_codes = vocoder_chunk_codes
        # The engine thread issues its work on a high-priority stream: when the vocoder's windows and the
        # decode steps are both waiting for the GPU, the steps' blocks are scheduled first. (Measured on
        # an H200: the vocoder's stream first instead changed no benchmark figure beyond its noise.)
        self.step_stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.text_vocab = model.thinker.lm_head.out_features
        self._lock = threading.Lock()  # one turn at a time: the caches are shared
        self.lingering: list[threading.Thread] = []

    def warmup(self) -> None:
        """Capture the CUDA graphs (decode steps for every span bucket; the vocoder's windows for every
        voice) and compile, on this thread, with nothing else running: turns only replay them."""
        if self.device.type != "cuda":
            return
        self.thinker.capture_graphs()
        if not self.has_talker:
            return
        self.talker.capture_graphs()
        self.warmup_vocoder()

    def warmup_vocoder(self) -> None:
        """Capture the vocoder's windows for the current chunk size, for every voice (after a change
        of `vocoder_chunk_codes`, call again: the windows have other lengths)."""
        if self.device.type != "cuda" or not self.has_talker or not self.graphs:
            return  # without graphs the vocoder's windows run eagerly too (a window without a graph does)
        from ..models.qwen2_5_omni.vocoder import StreamingVocoder, warmup_codes

        codes = warmup_codes(self.vocoder_chunk_codes)
        for spk in self.speakers.values():
            voc = StreamingVocoder(self.model.token2wav, spk["cond"], spk["ref_mel"], max_codes=len(codes),
                                   generator=0, codes_per_chunk=self.vocoder_chunk_codes)
            voc._graphs.capturing = True
            try:
                with torch.inference_mode():
                    voc.push(codes)
                    voc.finish()
            finally:
                voc._graphs.capturing = False
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------------------------------
    def stream(self, req: TurnRequest) -> Iterator[TextDelta | AudioBlock | Done]:
        """Run one turn; yield text deltas and audio blocks as they exist, then Done."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("a turn is already running on this model")
        try:
            while self.lingering:  # a vocoder thread still finishing an interrupted turn
                self.lingering.pop().join()
            yield from _Turn(self, req).run()
        finally:
            self._lock.release()


@dataclass
class _DecodeState:
    """Device tensors of one turn's decode loop (the engine thread's alone)."""

    ids: torch.Tensor  # [1, L] prompt ids
    gen: torch.Generator  # sampling randomness (seeded)
    eos: torch.Tensor | None = None  # text EOS ids
    seen_text: torch.Tensor | None = None  # repetition-penalty masks
    seen_codes: torch.Tensor | None = None
    no_eos: torch.Tensor | None = None  # forced lengths: text EOS banned
    suppress_codes: torch.Tensor | None = None  # codec BOS (and, forced, every non-audio id) banned
    voice_bos: torch.Tensor | None = None  # thinker embedding of the voice's text-side BOS
    first: Any = None  # the thinker prefill's output (prompt vectors for the talker prefill)
    toks: list = field(default_factory=list)  # reply token k, on the device
    replies: list = field(default_factory=list)  # R[k] = hidden + embedding of reply token k
    ended_before: list = field(default_factory=list)  # [k]: a text EOS was sampled before token k


class _Turn:
    """The threads and channels of one turn."""

    def __init__(self, engine: Engine, req: TurnRequest) -> None:
        self.e = engine
        self.req = req
        self.audio = engine.has_talker and not req.text_only
        self.n_max = req.max_text_tokens if not self.audio else max(2, req.max_text_tokens)
        self.state = _TurnState()
        self.stop = threading.Event()
        self.events: Channel = Channel(name="events")
        self.codes_ch: Channel = Channel(name="codes")
        self.boundary = AsyncOutput(engine.device, {"text": self.n_max, "code": max(1, req.max_codes)}, engine.max_lag)
        self._workers_left = 2 if self.audio else 1
        self._workers_lock = threading.Lock()
        self._pcm: list[np.ndarray] = []
        self._text_sent = ""
        self.eos_ids = [] if req.force_lengths else engine.eos_ids  # EOS ids that end the text
        self.clock = _StepClock(engine.device, req.step_events)
        self.sink: SinkThread | None = None  # the request's sink, owned by its own thread (run())
        # On a CPU the engine and vocoder threads share the same cores, so steps the talker makes
        # beyond what the first chunk needs only slow that chunk down (one core, built-in model:
        # first audio ~225 -> ~165 ms). The engine thread therefore waits, once, at `hold_at` codes
        # (set by the vocoder thread on a CPU) until the first audio exists. On an accelerator the
        # steps are only issued by the CPU and the vocoder has its own stream: no hold.
        self.first_audio = threading.Event()
        self.hold_at: int | None = None

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
                self.sink.start(SAMPLE_RATE)
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

    def _shutdown(self) -> None:
        self.stop.set()
        self.first_audio.set()  # a held engine thread goes on to see the stop
        self.boundary.cancel()
        self.codes_ch.cancel()
        self.events.cancel()

    def _fail(self, exc: BaseException) -> None:
        self.stop.set()
        self.first_audio.set()
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
                self._loop()
        except BaseException as exc:  # noqa: BLE001 - travels to the caller
            self._fail(exc)
        finally:
            self.boundary.finish()

    def _engine_stream(self):
        stream = self.e.step_stream
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.e.device))  # whatever the caller queued before
        return torch.cuda.stream(stream)

    def _loop(self) -> None:
        d = self._setup()
        mark = self.clock.start()
        first = self.e.thinker.prefill(d.ids)
        tok = select(first.logits, self.req.thinker, d.seen_text, d.no_eos, d.gen)
        mark_seen(d.seen_text, tok)
        self.boundary.push("text", 0, tok)
        self.clock.end("thinker_prefill", mark)
        self.state.times["prefill_issued"] = time.perf_counter()
        d.first, d.toks = first, [tok]
        with _sync_debug(self.req.sync_debug and self.e.device.type == "cuda"):
            self._steps(d)

    def _setup(self) -> "_DecodeState":
        """Per-turn device state, made before the first step (the only host→device copies of the turn)."""
        e, req = self.e, self.req
        dev = e.device
        d = _DecodeState(ids=torch.tensor([req.input_ids], device=dev), gen=torch.Generator(device=dev))
        d.gen.manual_seed(req.seed)
        d.eos = torch.tensor(self.eos_ids or [-1], device=dev)
        d.seen_text = torch.zeros(1, e.text_vocab, dtype=torch.bool, device=dev)
        d.seen_text[0, d.ids[0]] = True  # the penalty counts the prompt, as transformers' does
        if req.force_lengths:  # like transformers' min_new_tokens: EOS cannot be picked before the end
            d.no_eos = torch.zeros_like(d.seen_text)
            d.no_eos[0, [i for i in e.eos_ids if i < e.text_vocab]] = True
        d.ended_before = [torch.zeros(1, dtype=torch.bool, device=dev)]
        if self.audio:
            d.seen_codes = torch.zeros(1, e.talker.codec_head.out_features, dtype=torch.bool, device=dev)
            d.seen_codes[0, e.talker.prompt_ids(d.ids.shape[1])] = True
            d.suppress_codes = torch.zeros_like(d.seen_codes)
            d.suppress_codes[0, e.talker.codec_bos] = True
            if req.force_lengths:
                d.suppress_codes[0, AUDIO_CODE_LIMIT:] = True
            d.voice_bos = e.thinker.embed(torch.tensor([[e.speakers[req.voice]["bos_token"]]], device=dev))
        return d

    def _steps(self, d: "_DecodeState") -> None:
        """The hot loop: thinker step j, then talker step k as soon as its reply vector exists."""
        e, req, st, out = self.e, self.req, self.state, self.boundary
        j, k = 1, 0
        code = None
        t_thinker = t_talker = 0.0
        while not self.stop.is_set():
            if self.hold_at is not None and k >= self.hold_at:
                self.first_audio.wait(FIRST_AUDIO_HOLD)  # bounded: a chunk that never comes costs little
                self.hold_at = None
            text_end = st.text_end
            if j < self.n_max and (text_end is None or j < text_end):
                out.wait_for("text", j, self.stop)
                t = time.perf_counter()
                mark = self.clock.start()
                o = e.thinker.decode_one(d.toks[j - 1])
                d.replies.append(o.hidden + o.embeds)
                d.ended_before.append(d.ended_before[-1] | torch.isin(d.toks[j - 1], d.eos))
                tok = select(o.logits, req.thinker, d.seen_text, d.no_eos, d.gen)
                mark_seen(d.seen_text, tok)
                out.push("text", j, tok)
                self.clock.end("thinker", mark)
                d.toks.append(tok)
                j += 1
                t_thinker += time.perf_counter() - t
            thinker_finished = j >= self.n_max or (st.text_end is not None and j >= st.text_end)
            talker_finished = not self.audio or st.codes_end is not None or k >= req.max_codes
            if thinker_finished and talker_finished:
                break
            if talker_finished:
                continue
            vec = self._reply_vector(k, d)
            if vec is None:
                continue  # R[k] does not exist yet: the thinker goes first
            out.wait_for("code", k, self.stop)
            t = time.perf_counter()
            mark = self.clock.start()
            if k == 0:
                logits = e.talker.prefill(d.first.embeds, d.first.hidden, d.voice_bos, vec)
            else:
                logits = e.talker.decode_one(code, vec)
            code = select(logits, req.talker, d.seen_codes, d.suppress_codes, d.gen)
            mark_seen(d.seen_codes, code)
            out.push("code", k, code)
            self.clock.end("talker" if k else "talker_prefill", mark)
            k += 1
            t_talker += time.perf_counter() - t
            st.times["talker_last_step"] = time.perf_counter()
        st.times.update(thinker_steps=j - 1, talker_steps=k, thinker_time=t_thinker, talker_time=t_talker)

    def _reply_vector(self, k: int, d: "_DecodeState"):
        """Talker input vector k: R[k], text-EOS for the last reply token, text-pad after it."""
        e, end = self.e, self.state.text_end
        if (end is not None and k >= end) or k >= self.n_max:
            return e.text_pad_vec
        if (end is not None and k == end - 1) or k == self.n_max - 1:
            return e.text_eos_vec
        if k >= len(d.replies):
            return None
        # Host does not know yet whether the text ended: decide on the device.
        is_last = torch.isin(d.toks[k], d.eos).view(1, 1, 1)
        ended = d.ended_before[k].view(1, 1, 1)
        return torch.where(ended, e.text_pad_vec, torch.where(is_last, e.text_eos_vec, d.replies[k]))

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

    def _handle(self, kind: str, index: int, value: int) -> None:
        st = self.state
        if kind == "text":
            st.times.setdefault("first_token", time.perf_counter())
            if st.text_end is not None:
                return  # overshoot past the text's end: discarded
            st.text_ids.append(value)
            if value in self.eos_ids or index == self.n_max - 1:
                st.text_end = index + 1
            self._emit_text()
            return
        if st.codes_end is not None:
            return
        if st.text_end == 1 and st.text_ids[0] in self.eos_ids:
            st.codes_end = 0  # empty reply: nothing to say
        elif value in self.e.stop_codes:
            st.codes_end = index
        else:
            st.codes.append(value)
            if value < AUDIO_CODE_LIMIT:
                self.codes_ch.put([value])
            else:
                st.skipped_codes += 1
            if index + 1 >= self.req.max_codes:
                st.codes_end = index + 1
        if st.codes_end is not None:
            self.codes_ch.close()

    def _emit_text(self) -> None:
        text = self.e.tokenizer.decode(self.state.text_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and self.state.text_end is None:
            return  # half a UTF-8 character: wait for the rest
        if text.startswith(self._text_sent) and len(text) > len(self._text_sent):
            delta = text[len(self._text_sent):]
            self._text_sent = text
            self.state.times.setdefault("first_text", time.perf_counter())
            self.events.put(TextDelta(delta))

    # -- vocoder thread: codes → PCM → sink ------------------------------------------------------
    def _vocoder_main(self) -> None:
        from ..models.qwen2_5_omni.vocoder import StreamingVocoder, vocoder_worker

        try:
            spk = self.e.speakers[self.req.voice]
            # The seed makes a CPU generator: the noise is drawn on the CPU, as transformers' is.
            voc = StreamingVocoder(self.e.model.token2wav, spk["cond"], spk["ref_mel"],
                                   max_codes=self.req.max_codes, generator=self.req.seed,
                                   codes_per_chunk=self.e.vocoder_chunk_codes,
                                   pad_windows=None if self.e.graphs else False)  # no graphs: no padding
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)
            return
        out = _BlocksToTurn(self)
        self.state.vocoder_chunks = voc.chunk_log  # read after the turn, for the stats
        if self.e.device.type == "cpu":
            self.hold_at = voc.codes_for_first_audio
        try:
            vocoder_worker(voc, self.codes_ch, out)  # returns after close() or fail(); never raises
        finally:
            self.first_audio.set()  # no audio at all (an empty reply): nothing to hold for
        if not out.failed:
            self._worker_done()

    def _on_block(self, block: np.ndarray) -> None:
        now = time.perf_counter()
        self.state.times.setdefault("first_audio", now)
        self.first_audio.set()
        self.state.times["last_audio"] = now
        self._pcm.append(block)
        if self.sink is not None:
            self.sink.write(block)
        self.events.put(AudioBlock(block, SAMPLE_RATE))

    # -- result ----------------------------------------------------------------------------------
    def _result(self, t0: float) -> Reply:
        st = self.state
        end = time.perf_counter()
        audio = np.concatenate(self._pcm) if self._pcm else np.zeros(0, dtype=np.float32)
        seconds = len(audio) / SAMPLE_RATE
        times = st.times

        def since(key):
            return (times[key] - t0) if key in times else None

        th_steps, tk_steps = times.get("thinker_steps", 0), times.get("talker_steps", 0)
        stats = {
            "started_at": t0,  # time.perf_counter() at the turn's start; the times below are relative to it
            # The first text's path: prefill issued by the engine thread, its token read on the host by
            # the producer thread, its text handed on.
            "time_to_prefill_issued": since("prefill_issued"),
            "time_to_first_token": since("first_token"),
            "time_to_first_text": since("first_text"),
            "time_to_first_audio": since("first_audio"),
            "total_time": end - t0,
            "thinker_steps": th_steps + 1,  # + the prefill
            "talker_steps": tk_steps,
            "thinker_ms_per_token": 1000 * times.get("thinker_time", 0.0) / th_steps if th_steps else None,
            "talker_ms_per_step": 1000 * times.get("talker_time", 0.0) / tk_steps if tk_steps else None,
            "talker_last_step": since("talker_last_step"),
            "audio_seconds": seconds,
            # Made-audio time over its length: up to the last block, not the sink's play-out.
            "real_time_factor": (times.get("last_audio", end) - t0) / seconds if seconds else None,
            "text_tokens": len(st.text_ids),
            "codes": len(st.codes),
            "non_audio_codes": st.skipped_codes,
        }
        stats.update(self.clock.summary())
        chunks = [c for c in st.vocoder_chunks if c[0] > 0]
        if chunks:
            # Wall time of each chunk on the vocoder thread (its DiT window and BigVGAN span, beside
            # the decode steps), per second of audio it made final: below 1 keeps up with playback.
            frames = sum(f for f, _ in chunks)
            # "Steady": the largest chunk before the last (the last is whatever the utterance left).
            largest = max(f for f, _ in chunks[:-1]) if len(chunks) > 1 else chunks[0][0]
            steady = sorted(1000 * s for f, s in chunks[1:-1] if f == largest)
            stats["vocoder_chunks"] = len(chunks)
            stats["vocoder_first_chunk_ms"] = 1000 * chunks[0][1]
            stats["vocoder_steady_chunk_ms"] = steady[len(steady) // 2] if steady else None
            stats["vocoder_steady_chunk_codes"] = largest // 2  # two mel frames a code
            stats["vocoder_s_per_audio_s"] = sum(s for _, s in chunks) / (frames / (2 * CODES_PER_SECOND))
        text = self.e.tokenizer.decode(st.text_ids, skip_special_tokens=True)
        return Reply(text, list(st.text_ids), list(st.codes), audio, SAMPLE_RATE, stats)


def configure_cuda(float32_llm: bool = False) -> None:
    """Process-wide CUDA settings the engine relies on (call before a reference run to compare alike):
    TF32 matmuls for the float32 token2wav (its GEMMs several times faster), unless the LLMs themselves
    run in float32 (as in the GPU parity tests), which keeps them at full precision."""
    if not float32_llm:
        torch.backends.cuda.matmul.allow_tf32 = True


@contextlib.contextmanager
def _sync_debug(enabled: bool):
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _BlocksToTurn:
    """The vocoder worker's output side: each PCM block goes straight to the turn (sink + events)."""

    def __init__(self, turn: "_Turn") -> None:
        self.turn = turn
        self.failed = False

    def put(self, block: np.ndarray) -> None:
        self.turn._on_block(block)  # raises Cancelled once the caller has gone: the worker stops

    def close(self) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        self.failed = True
        self.turn._fail(exc)


class _StepClock:
    """Optional device-side timing of each step (CUDA events; perf_counter elsewhere), read after the turn."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self.marks: list[tuple[str, Any, Any]] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self):
        return self._now() if self.enabled else None

    def end(self, kind: str, start) -> None:
        if self.enabled:
            self.marks.append((kind, start, self._now()))

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else 1000 * (b - a)

    def summary(self) -> dict:
        if not self.marks:
            return {}
        if self.cuda:
            torch.cuda.synchronize()
        steps: dict[str, list[float]] = {}
        gaps = []
        for (kind, start, end), nxt in zip(self.marks, self.marks[1:] + [None]):
            steps.setdefault(kind, []).append(self._ms(start, end))
            if kind == "talker" and nxt is not None and nxt[0] == "talker":
                gaps.append(self._ms(end, nxt[1]) * 1000)  # µs the device waited between two talker steps
        out = {f"{k}_step_ms": sorted(v)[len(v) // 2] for k, v in steps.items()}  # medians
        if gaps:
            out["talker_gap_us_median"] = sorted(gaps)[len(gaps) // 2]
            out["talker_gap_us_mean"] = sum(gaps) / len(gaps)
        return out


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")
