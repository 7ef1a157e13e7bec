"""`kernels.attend` alone on a GPU, for its launch shape: µs a call inside a CUDA graph of 100 calls, for
Qwen3-Omni-30B-A3B's three stacks (thinker 32/4 heads, talker 16/2, code predictor 16/8; head_dim 128),
over rows-a-block x warps. Prints JSON lines: `python scripts/attend_bench.py`.

`--spans`: over spans 256..8192 for those stacks and Qwen2.5-Omni-7B's (thinker 28/4, talker 12/4), the
library's attention (a mask over the span, as the steps call it) beside the kernel, one program a head
and split into parts of 64, 128 and 256 rows (`ATTEND_MAX_SPAN`, `ATTEND_SPLIT_ROWS`), a program a query
head (split_) or a key/value head's group (group_, `ATTEND_GROUPED`)."""

from __future__ import annotations

import json
import sys

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


SPAN_SHAPES = {"qwen3 thinker": (32, 4, 128), "qwen3 talker": (16, 2, 128), "7b thinker": (28, 4, 128),
               "7b talker": (12, 4, 128)}


def spans() -> None:
    import torch.nn.functional as F

    dev, dt = torch.device("cuda"), torch.bfloat16
    for name, (heads, kv, D) in SPAN_SHAPES.items():
        for span in (256, 512, 1024, 2048, 4096, 8192):
            qkv = torch.randn((heads + 2 * kv) * D, device=dev, dtype=dt)
            cos, sin = torch.rand(D, device=dev, dtype=dt), torch.rand(D, device=dev, dtype=dt)
            keys = torch.randn(1, kv, span, D, device=dev, dtype=dt)
            values = torch.randn_like(keys)
            p = torch.tensor([span - 3], device=dev)
            q = torch.randn(1, heads, 1, D, device=dev, dtype=dt)
            valid = (torch.arange(span, device=dev) <= span - 3).view(1, 1, 1, span)
            row = {"stack": name, "span": span, "library_us": round(time_us(lambda: F.scaled_dot_product_attention(
                q, keys, values, attn_mask=valid, enable_gqa=True)), 2)}
            kernels.ATTEND_MAX_SPAN = 1 << 20
            row["one_program_us"] = round(time_us(lambda: kernels.attend(qkv, None, None, cos, sin, keys, values, p,
                                                                         span, 1e-6, D ** -0.5, heads)), 2)
            kernels.ATTEND_MAX_SPAN = 0
            for rows in (64, 128, 256):
                kernels.ATTEND_SPLIT_ROWS = rows
                for grouped, key in ((False, "split"), (True, "group")):
                    kernels.ATTEND_GROUPED = grouped
                    row[f"{key}_{rows}_us"] = round(time_us(lambda: kernels.attend(
                        qkv, None, None, cos, sin, keys, values, p, span, 1e-6, D ** -0.5, heads)), 2)
            print(json.dumps(row), flush=True)
    kernels.ATTEND_MAX_SPAN, kernels.ATTEND_SPLIT_ROWS, kernels.ATTEND_GROUPED = 256, 128, True


if __name__ == "__main__":
    spans() if "--spans" in sys.argv[1:] else main()
