"""A turn's measurements: host-side facts the threads record (`TurnState`), optional device timing of
each step (`StepClock`), and the `stats` dict of a `Reply` (`turn_stats`).

It knows no model family and no thread: the turn passes it what happened, it does the arithmetic.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TurnState:
    """Host-side facts the producer learns and the engine reads (plain attributes: GIL-atomic)."""

    text_ids: list[int] = field(default_factory=list)
    codes: list = field(default_factory=list)
    text_end: int | None = None  # number of reply tokens once the text is known to have ended
    codes_end: int | None = None  # number of talker steps once the talker is known to have ended
    skipped_codes: int = 0  # non-audio steps the talker produced (kept in `codes`, not vocoded)
    times: dict[str, float] = field(default_factory=dict)
    # The vocoder's chunk log, (units made final, seconds) per chunk, and its units per code.
    vocoder_chunks: list[tuple[int, float]] = field(default_factory=list)
    vocoder_units_per_code: int = 1


class StepClock:
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


class CallTimer:
    """Synchronised wall time of chosen calls inside something that does not stream (transformers'
    `generate`, benchmarked): `with timer.wrapping((obj, "attr", "name"), ...):` replaces each `obj.attr`
    by a timed wrapper and puts the original back after; `times[name]` sums its calls' seconds and
    `calls[name]` counts them. The device is synchronised around each call, so the times are the work's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.sync()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t
            self.calls[name] = self.calls.get(name, 0) + 1
            return out

        return timed

    @contextlib.contextmanager
    def wrapping(self, *targets: tuple[object, str, str]):
        originals = [(obj, attr, getattr(obj, attr)) for obj, attr, _name in targets]
        for obj, attr, name in targets:
            setattr(obj, attr, self.wrap(name, getattr(obj, attr)))
        try:
            yield self
        finally:
            for obj, attr, fn in originals:
                setattr(obj, attr, fn)


def turn_stats(st: TurnState, clock: StepClock, t0: float, end: float, audio_seconds: float) -> dict:
    """The `Reply.stats` of a finished turn (times in seconds from the turn's start unless named ms)."""
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
        "audio_seconds": audio_seconds,
        # Made-audio time over its length: up to the last block, not the sink's play-out.
        "real_time_factor": (times.get("last_audio", end) - t0) / audio_seconds if audio_seconds else None,
        "text_tokens": len(st.text_ids),
        "codes": len(st.codes),
        "non_audio_codes": st.skipped_codes,
    }
    stats.update(clock.summary())
    chunks = [c for c in st.vocoder_chunks if c[0] > 0]
    if chunks:
        # Wall time of each chunk on the vocoder thread (beside the decode steps), per second of audio
        # it made final: below 1 keeps up with playback.
        # "Steady": the largest chunk before the last (the last is whatever the utterance left).
        largest = max(f for f, _ in chunks[:-1]) if len(chunks) > 1 else chunks[0][0]
        steady = sorted(1000 * s for f, s in chunks[1:-1] if f == largest)
        stats["vocoder_chunks"] = len(chunks)
        stats["vocoder_first_chunk_ms"] = 1000 * chunks[0][1]
        stats["vocoder_steady_chunk_ms"] = steady[len(steady) // 2] if steady else None
        stats["vocoder_steady_chunk_codes"] = largest // st.vocoder_units_per_code
        stats["vocoder_s_per_audio_s"] = sum(s for _, s in chunks) / audio_seconds if audio_seconds else None
    return stats


class PhaseTimer:
    """Seconds per named phase of a warm-up (`with timer("capture the thinker's graphs"): ...`), device
    work included (synchronised at each phase's end)."""

    def __init__(self, device) -> None:
        self.device = device
        self.phases: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":  # this thread's stream (the work on others joins it): a warm-up
                torch.cuda.current_stream(self.device).synchronize()  # beside replies must not wait on theirs
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t


@contextlib.contextmanager
def encoder_timer(media: dict, device, kind: str = "audio"):
    """Time an encoder's run inside a prefill without a host sync: CUDA events (read when the turn's
    stats are made), perf_counter on a CPU. Kept in the request's `media` as "encoder_time" (audio) or
    "image_encoder_time"."""
    cuda = device.type == "cuda"
    start: "torch.cuda.Event | float"
    end: "torch.cuda.Event | float"
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        start = time.perf_counter()
    yield
    if cuda:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
    else:
        end = time.perf_counter()
    key = "encoder_time" if kind == "audio" else f"{kind}_encoder_time"
    media[key] = media.get(key, []) + [(start, end)]


def media_stats(media: dict | None) -> dict:
    """What a reply's stats say about its input media: seconds of audio heard, the encoders' ms."""
    if not media:
        return {}
    out = {}
    if media.get("audio_seconds"):
        out["audio_in_seconds"] = float(media["audio_seconds"])
    if media.get("images"):
        out["images_in"] = int(media["images"])
    for key, name in (("encoder_time", "audio_encoder_ms"), ("image_encoder_time", "image_encoder_ms")):
        spans = media.get(key) or []
        if spans and isinstance(spans[0][0], float):
            out[name] = sum(1000 * (b - a) for a, b in spans)
        elif spans:
            torch.cuda.synchronize()
            out[name] = sum(a.elapsed_time(b) for a, b in spans)
    return out


def timed_warmup(device, phases) -> dict | None:
    """Run a family's warm-up `phases` ((name, function) pairs, in order) on an accelerator and return the
    seconds each took; nothing to do on a CPU (None)."""
    if device.type == "cpu":
        return None
    timer = PhaseTimer(device)
    for name, run in phases:
        with timer(name):
            run()
    return timer.phases
