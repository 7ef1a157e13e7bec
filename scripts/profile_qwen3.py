"""Where Qwen3-Omni's GPU time goes, stage by stage: a developer's tool for the lent H200 (random weights at
true size, like omni-bench). Each stage is timed alone with CUDA events: the prompt's prefills (library
layers), the thinker's decode step, the talker's step and the frame (code predictor) as graph replays and as
the same fused functions run eagerly, code2wav chunk by chunk; then the top kernels of one eager step.
Prints one JSON report: `python scripts/profile_qwen3.py [--preset NAME] [--kernels]`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from profile_gpu import device_ms, kernels  # scripts/ is on sys.path when this file runs

from omni_cli.faces.bench import BenchTokenizer
from omni_cli.models.qwen3_omni import presets
from omni_cli.models.qwen3_omni.code2wav import StreamingCode2Wav
from omni_cli.models.qwen3_omni.talker import Talker
from omni_cli.runtime.engine import Engine
from omni_cli.runtime.events import Done, TurnRequest

DEV = torch.device("cuda")


def wall_ms(fn, n: int = 5) -> float:
    """Mean wall time of fn() (which ends in a host sync or is followed by one), after one untimed call."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--kernels", action="store_true")
    args = ap.parse_args()
    report: dict = {"preset": args.preset}
    t = time.perf_counter()
    model, voices = presets.build_model(args.preset, DEV, torch.bfloat16)
    report["build_s"] = time.perf_counter() - t
    ids = presets.prompt(model, 60)
    steps = presets.steps(model, voices, max_context=1024, max_codes=256, graphs=True)
    t = time.perf_counter()
    steps.thinker.capture_graphs()
    report["capture_thinker_s"] = time.perf_counter() - t
    t = time.perf_counter()
    steps.talker.capture_graphs()
    report["capture_talker_s"] = time.perf_counter() - t
    engine = Engine(steps, BenchTokenizer(), eos_ids=[model.config.im_end_token_id])
    req = TurnRequest(ids, "Ethan", presets_thinker(), Talker.default_sampling()[0], 16, 32, seed=0,
                      force_lengths=True)
    reply = next(e.reply for e in engine.stream(req) if isinstance(e, Done))
    report["turn"] = {k: v for k, v in reply.stats.items() if isinstance(v, (int, float)) and k != "started_at"}
    th, tk = steps.thinker, steps.talker
    with torch.inference_mode():
        x = torch.tensor([ids], device=DEV)
        report["thinker_prefill_ms"] = wall_ms(lambda: th.prefill(x))
        out = th.prefill(x)
        turn = steps.talker_turn(ids, "Ethan", Talker.default_sampling()[0], None, True)
        vec = steps.reply_vector(out)
        report["talker_prefill_ms"] = wall_ms(lambda: turn.prefill(out, vec))
        span = 256
        report["thinker_step_graph_ms"] = device_ms(th.fused.graphs.graphs[span][0].replay, 50)
        report["thinker_step_eager_ms"] = device_ms(lambda: th.fused._step(span), 10)
        report["talker_step_graph_ms"] = device_ms(tk.step_graphs.graphs[span][0].replay, 50)
        report["talker_step_eager_ms"] = device_ms(lambda: tk._fused_step(span), 10)
        n = tk.predictor_cache.max_len
        report["frame_graph_ms"] = device_ms(tk.frame_graphs.graphs[n][0].replay, 50)
        report["frame_eager_ms"] = device_ms(lambda: tk._fused_frame(n), 10)
        report["race_draw_ms"] = device_ms(tk._draw, 50)
        if args.kernels:
            report["kernels_thinker_step"] = kernels(lambda: th.fused._step(span), top=30)
            report["kernels_talker_step"] = kernels(lambda: tk._fused_step(span))
            report["kernels_frame"] = kernels(lambda: tk._fused_frame(n), top=40)
    frames = torch.randint(0, 2048, (100, 16)).tolist()
    chunks = {}
    for size in (4, 8, 16, 25):
        def one(size=size):
            voc = StreamingCode2Wav(model.code2wav, max_frames=100, first_chunk=size, chunk=size)
            voc.push(frames[:size])
        chunks[size] = wall_ms(one)
    report["code2wav_first_chunk_ms"] = chunks
    voc = StreamingCode2Wav(model.code2wav, max_frames=100)
    voc.push(frames)
    report["code2wav_stream_chunks"] = [(f, round(1000 * s, 1)) for f, s in voc.chunk_log]
    report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(report, indent=1))


def presets_thinker():
    from omni_cli.config import SamplingOptions

    return SamplingOptions(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)


if __name__ == "__main__":
    main()
