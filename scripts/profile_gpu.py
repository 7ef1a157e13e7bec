"""Where the GPU time of one reply goes: each stage timed alone, its kernels listed, then the vocoder
beside the talker, and the prefill in fresh threads. A developer's tool for the lent H200 (random
weights at true size, like omni-bench); prints the JSON report after each section (the last one is
whole). Sections can be picked: `python scripts/profile_gpu.py steps vocoder beside prefill`.

It measures device time with CUDA events (graph replays and eager calls alike) and lists the top kernels
of one call with torch.profiler. Experiments swap functions in for a while (a compiled DiT, the
prefill's attention choice) and put the engine's own back afterwards.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

from omni_cli.faces.bench import BenchTokenizer, build_model
from omni_cli.config import RuntimeOptions, SamplingOptions
from omni_cli.models.qwen2_5_omni import TALKER_SAMPLING as TALKER_DEFAULTS
from omni_cli.models.qwen2_5_omni.steps import Qwen25Steps
from omni_cli.runtime.engine import Engine
from omni_cli.runtime.sampling import select
from omni_cli.models.qwen2_5_omni import vocoder as vocoder_mod
from omni_cli.models.qwen2_5_omni.vocoder import StreamingVocoder, dit_forward

DEV = torch.device("cuda")


def device_ms(fn, n: int, warm: int = 2) -> float:
    """Mean device time of `fn` over n calls on the current stream (CUDA events around the batch)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def kernels(fn, top: int = 12) -> dict:
    """Kernel time of one call of `fn`: total, count and the top kernels by device time (µs)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us > 0 and e.device_type.name == "CUDA":
            rows.append((us, e.count, e.key[:90]))
    rows.sort(reverse=True)
    return {
        "kernel_us_total": round(sum(r[0] for r in rows), 1),
        "kernel_launches": sum(r[1] for r in rows),
        "top": [{"us": round(us, 1), "count": n, "name": name} for us, n, name in rows[:top]],
    }


def steps(engine: Engine, report: dict) -> None:
    """Decode steps alone: graph replay, the compiled step launched eagerly, sampling, prefill."""
    th, tk = engine.steps.thinker, engine.steps.talker
    th.cache.length = tk.cache.length = 100
    out = {}
    with torch.inference_mode():
        out["thinker_graph_ms"] = device_ms(lambda: th.fused.graphs(101), 100)
        out["talker_graph_ms"] = device_ms(lambda: tk.graphs(101), 200)
        out["thinker_step_eager_ms"] = device_ms(lambda: th.fused._step(256), 20)
        out["talker_step_eager_ms"] = device_ms(lambda: tk._fused_step(256), 20)
        out["talker_kernels"] = kernels(lambda: tk._fused_step(256), top=15)
        out["thinker_kernels"] = kernels(lambda: th.fused._step(256), top=10)
        logits = torch.randn(1, tk.codec_head.out_features, device=DEV)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        gen = torch.Generator(device=DEV).manual_seed(0)
        out["talker_sampling_ms"] = device_ms(lambda: select(logits, TALKER_DEFAULTS, seen, seen, gen), 200)
        out["talker_sampling_kernels"] = kernels(lambda: select(logits, TALKER_DEFAULTS, seen, seen, gen))
        big = torch.randn(1, engine.text_vocab, device=DEV)
        opts = SamplingOptions(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
        seen_t = torch.zeros_like(big, dtype=torch.bool)
        out["thinker_sampling_ms"] = device_ms(lambda: select(big, opts, seen_t, seen_t, gen), 100)
        ids = torch.randint(0, 150000, (1, 60), device=DEV)

        def prefill():
            th.prefill(ids)

        out["thinker_prefill60_ms"] = device_ms(prefill, 5)
        torch.cuda.synchronize()
        t = time.perf_counter()
        prefill()
        torch.cuda.synchronize()
        out["thinker_prefill60_wall_ms"] = 1000 * (time.perf_counter() - t)
        out["thinker_prefill60_kernels"] = kernels(prefill, top=8)
    report["steps"] = out


def _window(voc: StreamingVocoder, frames: int):
    g = torch.Generator().manual_seed(3)
    code = torch.randint(0, 8192, (1, frames // voc.repeats), generator=g).to(DEV)
    return code, voc.noise[:, :frames].clone(), voc._block_index(frames, frames).to(DEV)


def _with_forward(fn):
    """Run the vocoder's ODE with `fn` in place of `dit_forward` (the module global `_sample` calls)."""
    vocoder_mod.dit_forward = fn


def vocoder(model, report: dict) -> None:
    """One DiT window of 120 frames (48 past, 48 chunk, 24 future) and one BigVGAN span, alone.

    Windows are captured here with the plain `dit_forward` (graphs' `capturing` flag is left off) and
    experiments swap the function in; each capture is replayed once before its output is read.
    """
    spk = model.speaker_map["Chelsie"]
    out = {}
    voc = StreamingVocoder(model.token2wav, spk["cond"], spk["ref_mel"], max_codes=96, generator=0)
    code, noise, blocks = _window(voc, 120)
    args = (code, noise, blocks)
    with torch.inference_mode():
        out["dit120_eager_ms"] = device_ms(lambda: voc._sample(*args), 2, warm=1)
        graph, static_in, ref = voc._graphs._capture(voc._sample, args)
        graph.replay()
        ref = ref.clone()
        out["dit120_graph_ms"] = device_ms(graph.replay, 5)
        out["dit120_eager_kernels"] = kernels(lambda: voc._sample(*args), top=15)
        one = lambda: dit_forward(voc._plan, *_dit_args(voc, code, noise, blocks))  # noqa: E731
        out["dit_one_eval_eager_ms"] = device_ms(one, 10)

        mel = ref[:, :, :88].contiguous()
        out["bigvgan88_eager_ms"] = device_ms(lambda: voc._bigvgan(mel), 5)
        g2, _, _ = voc._graphs._capture(voc._bigvgan, (mel,))
        out["bigvgan88_graph_ms"] = device_ms(g2.replay, 10)
        out["bigvgan88_eager_kernels"] = kernels(lambda: voc._bigvgan(mel), top=10)

        # Experiment 1: the DiT evaluation compiled by inductor, then captured.
        try:
            t = time.perf_counter()
            compiled = torch.compile(dit_forward, dynamic=True)
            _with_forward(compiled)
            voc._sample(*args)
            out["dit_compile_s"] = time.perf_counter() - t
            gc, _, mel_c = voc._graphs._capture(voc._sample, args)
            gc.replay()
            out["dit120_compiled_max_abs_diff"] = (mel_c - ref).abs().max().item()
            out["dit120_compiled_graph_ms"] = device_ms(gc.replay, 5)
            out["dit120_compiled_eager_kernels"] = kernels(lambda: voc._sample(*args), top=12)
        except Exception as exc:  # noqa: BLE001 - an experiment; report and go on
            out["dit_compile_error"] = repr(exc)[:300]

        _with_forward(dit_forward)
    report["vocoder"] = out
    report["_graphs"] = (graph, g2)  # kept for the next section


def _dit_args(voc, code, noise, blocks):
    """One evaluation's arguments after the model (`dit_forward(voc._plan, ...)`): the first time point's."""
    static = voc._static_inputs(code)
    length = noise.shape[1]
    positions = torch.arange(length, device=DEV)[None, :].repeat(2, 1)
    rope = voc.dit.rotary_embed(static, positions)
    masks = vocoder_mod.attention_masks(voc.dit, blocks[None, :] - blocks[:, None], noise.dtype)
    return noise, voc._grid[0][0], static, rope, masks


def beside(engine: Engine, report: dict) -> None:
    """The steady DiT window replayed on a side stream from a thread while the talker graph replays."""
    dit_graph, _ = report.pop("_graphs")
    tk = engine.steps.talker
    tk.cache.length = 100
    out = {}
    side = torch.cuda.Stream(DEV)
    done = threading.Event()
    vt = []

    def vocoder_thread():
        with torch.cuda.stream(side):
            for _ in range(6):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(side)
                dit_graph.replay()
                b.record(side)
                b.synchronize()
                vt.append(a.elapsed_time(b))
        done.set()

    with torch.inference_mode():
        th = threading.Thread(target=vocoder_thread)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        th.start()
        n = 0
        a.record()
        while not done.is_set():
            tk.graphs(101)
            n += 1
            if n % 8 == 0:
                torch.cuda.current_stream().synchronize()  # stay close to the device, as the engine does
        b.record()
        torch.cuda.synchronize()
        th.join()
    out["talker_ms_per_step_beside_dit"] = a.elapsed_time(b) / n
    out["dit120_graph_ms_beside_talker"] = sorted(vt)[len(vt) // 2]
    out["talker_steps"] = n
    report["beside"] = out


def prefill_threads(engine: Engine, report: dict) -> None:
    """Thinker prefill wall time (synchronised) in fresh threads, with and without cuDNN's attention
    (which keeps its per-shape plans per host thread): two prompt lengths per thread."""
    th = engine.steps.thinker
    out = {}

    def one(n: int) -> float:
        ids = torch.randint(0, 150000, (1, n), device=DEV)
        torch.cuda.synchronize()
        t = time.perf_counter()
        th.prefill(ids)
        torch.cuda.synchronize()
        return round(1000 * (time.perf_counter() - t), 2)

    import contextlib

    from omni_cli.runtime import decoder

    scoped = decoder._prefill_attention
    for cudnn in (True, False):
        # The engine's own choice (no cuDNN in prefills) is switched off here to compare the two.
        decoder._prefill_attention = lambda enabled: contextlib.nullcontext()
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        times = []
        for i in range(3):
            box = []
            thread = threading.Thread(target=lambda: box.append([one(60 + i), one(60 + i), one(90 + i)]))
            with torch.inference_mode():
                thread.start()
                thread.join()
            times.append(box[0])
        out["cudnn_sdp" if cudnn else "no_cudnn_sdp"] = times  # per thread: [new length, same again, new]
    torch.backends.cuda.enable_cudnn_sdp(True)
    decoder._prefill_attention = scoped
    report["prefill_threads"] = out


def main() -> None:
    wanted = set(sys.argv[1:]) or {"steps", "vocoder", "beside", "prefill"}
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    t = time.perf_counter()
    model = build_model("qwen2.5-omni-7b", DEV, torch.bfloat16)
    engine = Engine(Qwen25Steps(model, model.speaker_map, RuntimeOptions(max_context=1024, max_codes=768, compile=True)), BenchTokenizer(),
                    eos_ids=[151645])
    if wanted != {"prefill"}:
        engine.warmup()
    report["setup_s"] = time.perf_counter() - t
    sections = (("steps", steps, engine), ("vocoder", vocoder, model), ("beside", beside, engine),
                ("prefill", prefill_threads, engine))
    for name, fn, arg in sections:
        if name in wanted and (name != "beside" or "_graphs" in report):
            t = time.perf_counter()
            try:
                fn(arg, report)
            except Exception as exc:  # noqa: BLE001 - report what ran
                report[name + "_error"] = repr(exc)[:500]
            report[name + "_s"] = time.perf_counter() - t
            print(json.dumps({k: v for k, v in report.items() if k != "_graphs"}, indent=1), flush=True)
    report.pop("_graphs", None)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
