"""SDPA's backends side by side for a prompt's causal attention at Qwen-Omni's widths (GPU only): each backend
timed in a CUDA graph (scripts/quant_gpu.py's timer), and whether it captures at all.

    python scripts/attn_backends.py [--rows 2560 512 64] [--heads 32] [--kv-heads 4] [--dim 128]

Prints one JSON line per (rows, backend): µs a call (median of 20 graph replays of 10 calls), the largest
difference from the math backend in float32, and `error` where the backend refused or failed to capture.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from quant_gpu import _graph_time  # scripts/ is on sys.path when this file runs; its CUDA-graph timer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[2560, 512, 64])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args()
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for rows in args.rows:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, args.heads, rows, args.dim, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, args.kv_heads, rows, args.dim, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        rep = args.heads // args.kv_heads
        k2, v2 = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        with sdpa_kernel(SDPBackend.MATH):
            want = F.scaled_dot_product_attention(q.float(), k2.float(), v2.float(), is_causal=True)
        for name, backend in backends.items():
            for gqa in (False, True):
                row = {"rows": rows, "backend": name, "enable_gqa": gqa}
                kk, vv = (k, v) if gqa else (k2, v2)

                def call():
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)

                try:
                    got = call()
                    row["max_abs_vs_math"] = float((got.float() - want).abs().max())
                    row["us"] = round(_graph_time(call, calls=10, repeats=20) * 1e6, 1)
                except Exception as exc:  # noqa: BLE001 - a refusal is a result here
                    row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
