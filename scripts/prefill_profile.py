"""Where a long prompt's prefill time goes on Qwen3-Omni's thinker: a developer's tool for the lent H200
(random weights at true size, like omni-bench). Times the whole eager prefill of an N-token prompt through
the library's layers (device time, CUDA events), with runtime/prompt_ops.py's experts, norms and rotary
embedding, without the rotary embedding, its experts alone, and the library's modules, lists its top
kernels (torch.profiler), then the talker's prompt of as many rows (everything on), one MoE block alone
(the router and the experts) both ways, and which experts implementation the library chose.
Prints one JSON report: `python scripts/prefill_profile.py [--preset NAME] [--tokens 2500] [--device cuda]
[--quantize int4|fp8]`
(the tiny preset on the CPU checks that it runs: `--preset tiny-qwen3 --tokens 200 --device cpu`).
Written in the fifteenth pass; first run on a GPU (an H100) in the twenty-first (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from profile_gpu import device_ms, kernels  # scripts/ is on sys.path when this file runs

from omni_cli.models.qwen3_omni import presets
from omni_cli.runtime import prompt_ops
from omni_cli.runtime.decoder import forward_layers_keeping


def timed_ms(fn, n: int, dev: torch.device) -> float:
    """Mean time of `fn` over n calls: device time (CUDA events) on a GPU, wall time elsewhere."""
    if dev.type == "cuda":
        return device_ms(fn, n)
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return 1000 * (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--tokens", type=int, default=2500)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quantize", choices=["int4", "fp8"], default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    report: dict = {"preset": args.preset, "tokens": args.tokens, "quantize": args.quantize}
    t = time.perf_counter()
    model, voices = presets.build_model(args.preset, dev, dtype, quantize=args.quantize)
    report["build_s"] = round(time.perf_counter() - t, 1)
    steps = presets.steps(model, voices, max_context=4096, max_codes=64, graphs=True, compile=False)
    th = steps.thinker
    ids = torch.tensor([presets.prompt(model, args.tokens)], device=dev)
    with torch.inference_mode():
        embeds = th.embed(ids)

        def prefill():
            th.cache.reset()
            return forward_layers_keeping(th.model, embeds, th.cache, th.accept_layer)

        # the library's modules; runtime/prompt_ops.py's routed experts; with its fused norms too; with its
        # rotary embedding too (the engine's default)
        outs = {}
        for tag, experts, norms, rope in (("_library", False, False, False), ("", True, False, False),
                                          ("_norms_too", True, True, False), ("_rope_too", True, True, True)):
            prompt_ops.EXPERTS, prompt_ops.NORMS, prompt_ops.ROPE = experts, norms, rope
            report[f"prefill_ms{tag}"] = timed_ms(prefill, 3, dev)
            outs[tag] = prefill()[0].float()
            if dev.type == "cuda":  # the kernels' device times (torch.profiler's CUDA events)
                report[f"prefill_kernels{tag}"] = kernels(prefill, top=25)
        report["experts_vs_library_max_abs"] = (outs[""] - outs["_library"]).abs().max().item()
        report["norms_too_vs_library_max_abs"] = (outs["_norms_too"] - outs["_library"]).abs().max().item()
        report["rope_too_vs_norms_too_max_abs"] = (outs["_rope_too"] - outs["_norms_too"]).abs().max().item()
        # the talker's prompt of as many rows, everything on (the engine's default)
        tk = steps.talker
        rows = torch.randn(1, args.tokens, tk.model.layers[0].self_attn.q_proj.in_features, device=dev,
                           dtype=dtype) * 0.5

        def talker_prefill():
            tk.cache.reset()
            return forward_layers_keeping(tk.model, rows, tk.cache, None)

        report["talker_prefill_ms"] = timed_ms(talker_prefill, 3, dev)
        if dev.type == "cuda":
            report["talker_prefill_kernels"] = kernels(talker_prefill, top=25)
        report["library_max_abs"] = outs["_library"].abs().max().item()
        layer = th.model.layers[0]
        x = torch.randn(1, args.tokens, embeds.shape[-1], device=dev, dtype=dtype) * 0.5

        def routed_block():
            with prompt_ops.inside():
                return layer.mlp(x)

        report["moe_block_ms"] = timed_ms(routed_block, 10, dev)
        report["moe_block_ms_library"] = timed_ms(lambda: layer.mlp(x), 10, dev)
        if dev.type == "cuda":
            report["moe_block_kernels"] = kernels(routed_block, top=15)
            report["moe_block_kernels_library"] = kernels(lambda: layer.mlp(x), top=15)
        report["experts_implementation"] = getattr(model.config.thinker_config.text_config,
                                                   "_experts_implementation", None)
    if dev.type == "cuda":
        report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
