"""`kernels.attend` alone on a GPU, for its launch shape: µs a call inside a CUDA graph of 100 calls, for
Qwen3-Omni-30B-A3B's three stacks (thinker 32/4 heads, talker 16/2, code predictor 16/8; head_dim 128),
over rows-a-block x warps. Prints JSON lines: `python scripts/attend_bench.py`."""

from __future__ import annotations

import json

import torch

from omni_cli.runtime import kernels

SHAPES = {"thinker": (32, 4, 256, 124), "talker": (16, 2, 256, 150), "code predictor": (16, 8, 16, 9)}


def time_us(fn, n: int = 100) -> float:
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (5 * n)


def main() -> None:
    dev, dt, D = torch.device("cuda"), torch.bfloat16, 128
    for name, (heads, kv, span, pos) in SHAPES.items():
        qkv = torch.randn((heads + 2 * kv) * D, device=dev, dtype=dt)
        w = torch.rand(D, device=dev, dtype=dt) + 0.5
        cos, sin = torch.rand(D, device=dev, dtype=dt), torch.rand(D, device=dev, dtype=dt)
        keys = torch.randn(1, kv, 1024, D, device=dev, dtype=dt)
        values = torch.randn_like(keys)
        p = torch.tensor([pos], device=dev)
        for block in (16, 32, 64, 128):
            for warps in (1, 2, 4, 8):
                kernels.ATTEND_BLOCKS = (block, warps)
                us = time_us(lambda: kernels.attend(qkv, w, w, cos, sin, keys, values, p, span, 1e-6, D ** -0.5, heads))
                print(json.dumps({"stack": name, "block": block, "warps": warps, "us": round(us, 2)}), flush=True)
        kernels.ATTEND_BLOCKS = None


if __name__ == "__main__":
    main()
