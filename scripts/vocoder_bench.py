"""Qwen2.5-Omni's streaming vocoder alone, at true size (random weights, float32, on CUDA): how long its
first chunk and its steady chunks take, as the engine runs them. A developer's tool for the lent GPU.

    python scripts/vocoder_bench.py [--compile] [--codes 750] [--runs 3] [--json FILE] [--profile]

It builds only token2wav (the library's DiT and BigVGAN defaults are the real sizes), warms the vocoder up
as the engine does (`vocoder.capture_windows`: uncompiled, the first windows' step graphs, the rest
captured when first reached; compiled, every window), then streams utterances of `--codes` codes pushed
one at a time, as the talker hands them on, and reports each chunk's wall time (`chunk_log`), the first
chunk's and the whole utterance's. Run it with two checkouts on PYTHONPATH in turn to
compare them on one machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def build_token2wav(device: torch.device):
    from transformers import Qwen2_5OmniConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    config = Qwen2_5OmniConfig(token2wav_config={}, enable_audio_output=True).token2wav_config
    with torch.device(device):
        model = Qwen2_5OmniToken2WavModel._from_config(config, dtype=torch.float32)
    g = torch.Generator(device=device).manual_seed(0)
    dit = config.dit_config
    voice = {"cond": torch.randn(1, dit.enc_emb_dim, device=device, generator=g),
             "ref_mel": torch.randn(1, 300, dit.mel_dim, device=device, generator=g)}
    return model.eval(), voice


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _profile_first_chunk(vocoder, utterance: list[int], dev: torch.device) -> dict:
    """The first chunk (its codes pushed at once) under torch.profiler: each kernel's device time and
    count, the top 15 by time, and the sums (a graph replay's kernels are listed one by one)."""
    from torch.profiler import ProfilerActivity, profile

    voc = vocoder(len(utterance))
    first = voc.codes_for_first_audio
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.inference_mode(), profile(activities=activities) as prof:
        voc.push(utterance[:first])
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(e.name[:90], [0.0, 0])
            entry[0] += e.device_time_total / 1000
            entry[1] += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    return {"kernels": sum(n for _, n in kernels.values()),
            "device_ms": round(sum(ms for ms, _ in kernels.values()), 3),
            "top": [{"kernel": k, "ms": round(ms, 3), "count": n} for k, (ms, n) in top]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="the compiled DiT (omni-bench's, --compile)")
    ap.add_argument("--codes", type=int, default=750, help="codes an utterance (750 = 15 s)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=192, help="the steady chunk in codes (the engine's: 192)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a quick check of the script (slow)")
    ap.add_argument("--profile", action="store_true",
                    help="then the first chunk once under torch.profiler: device time by kernel (top 15) and in all")
    args = ap.parse_args()

    from omni_cli.models.weights import quiet_transformers
    from omni_cli.models.qwen2_5_omni.vocoder import StreamingVocoder, capture_windows
    from omni_cli.runtime.engine import configure_cuda

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    configure_cuda()  # TF32 matmuls for the float32 vocoder, as the engine sets them
    t = time.perf_counter()
    with quiet_transformers():  # the config's text-side ids it checks against the codec vocabulary
        model, voice = build_token2wav(dev)
    built = time.perf_counter() - t

    def vocoder(max_codes: int) -> StreamingVocoder:
        return StreamingVocoder(model, voice["cond"], voice["ref_mel"], max_codes=max_codes, generator=0,
                                codes_per_chunk=args.chunk, compiled=args.compile)

    t = time.perf_counter()
    capture_windows(model, voice["cond"], voice["ref_mel"], args.chunk, args.compile)
    sync()
    warmed = time.perf_counter() - t

    g = torch.Generator().manual_seed(1)
    utterance = torch.randint(0, 8192, (args.codes,), generator=g).tolist()
    runs = []
    for run in range(args.runs + 1):  # the first reaches the windows a warm-up leaves uncaptured
        voc = vocoder(args.codes)
        t = time.perf_counter()
        with torch.inference_mode():
            for code in utterance:
                voc.push([code])
            voc.finish()
        sync()
        runs.append({"first_chunk_ms": 1000 * voc.chunk_log[0][1],
                     "chunk_ms": [round(1000 * s, 2) for _, s in voc.chunk_log],
                     "chunk_frames": [f for f, _ in voc.chunk_log],
                     "total_ms": 1000 * (time.perf_counter() - t)})
    measured = runs[1:]
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "compiled": args.compile,
        "codes": args.codes, "steady_chunk_codes": args.chunk, "build_s": built, "warmup_s": warmed,
        "first_chunk_ms": statistics.median(r["first_chunk_ms"] for r in measured),
        # Chunks of the steady size (the last one of an utterance may be shorter), over all runs.
        "steady_chunk_ms": _median_or_none([ms for r in measured for frames, ms in zip(r["chunk_frames"], r["chunk_ms"])
                                            if frames == args.chunk * voc.repeats]),
        "utterance_ms": statistics.median(r["total_ms"] for r in measured),
        "runs": measured,
    }
    if args.profile:
        report["first_chunk_profile"] = _profile_first_chunk(vocoder, utterance, dev)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
