"""GPU check of the prefill products against dequantize-then-multiply at true sizes (relative error), and
their time beside the bf16 product and beside the alternative of dequantizing the whole weight and calling
cuBLAS (CUDA-graph replays, scripts/quant_gpu.py's timer); with `sweep`, their tiles. Where a module
`scripts/_qk_before.py` exists (an earlier quant_kernels.py, copied there by hand), its products are timed
beside. One JSON line a measurement on stdout. Not imported by the package.

    python3 scripts/quant_mm_check.py [sweep]    (all products; sweep: their tiles)
    python3 scripts/quant_mm_check.py moe        (the experts' products only, tiles x warps x stages)
"""
import importlib
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "scripts")
from quant_gpu import _graph_time  # noqa: E402

from omni_cli.quant.formats import quantize_fp8, quantize_int4  # noqa: E402
from omni_cli.runtime import quant_kernels as qk  # noqa: E402

before = importlib.import_module("_qk_before") if os.path.exists("scripts/_qk_before.py") else None
dev, dt = "cuda", torch.bfloat16


def rel(y, want):
    return ((y.float() - want).norm() / want.norm()).item()


def products(mod, p4, p8):
    return {"int4_mm": lambda x: mod.int4_mm(x, p4.qweight, p4.scales, None, group_size=128),
            "fp8_mm": lambda x: mod.fp8_mm(x, p8.qweight, p8.scales, block=(128, 128))}


ONLY_MOE = "moe" in sys.argv  # only the experts' products, with a sweep of their tiles and pipeline stages
for M in () if ONLY_MOE else (60, 512):
    for shape_name, (n, k) in {"qwen3 qkv": (5120, 2048), "qwen3 o": (2048, 4096),
                               "7b gate_up": (37888, 3584)}.items():
        x = torch.randn(M, k, device=dev, dtype=dt)
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        p4, p8 = quantize_int4(w, 128, True, dt), quantize_fp8(w, (128, 128))
        row = {"M": M, "shape": shape_name, "bf16_us": _graph_time(lambda: F.linear(x, w), calls=10) * 1e6}
        for name, fn in products(qk, p4, p8).items():
            ref = p4 if name == "int4_mm" else p8
            row[f"{name}_rel"] = rel(fn(x), F.linear(x.float(), ref.dequantize(torch.float32)))
            row[f"{name}_us"] = _graph_time(lambda: fn(x), calls=10) * 1e6  # the default path for M rows
            saved = qk.DEQUANTIZE_ROWS, qk.INT4_TILE
            qk.DEQUANTIZE_ROWS = 1 << 30  # the tile kernels at any M
            for tile in ("joined", "planes") if name == "int4_mm" else ("tile",):
                qk.INT4_TILE = tile if tile != "tile" else saved[1]
                row[f"{name}_{tile}_us"] = _graph_time(lambda: fn(x), calls=10) * 1e6
                row[f"{name}_{tile}_rel"] = rel(fn(x), F.linear(x.float(), ref.dequantize(torch.float32)))
            qk.DEQUANTIZE_ROWS = 1
            row[f"{name}_dequantized_us"] = _graph_time(lambda: fn(x), calls=10) * 1e6
            qk.DEQUANTIZE_ROWS, qk.INT4_TILE = saved
            row[f"{name}_dequantize_then_cublas_us"] = _graph_time(lambda: F.linear(x, ref.dequantize(dt)), calls=5) * 1e6
            if before is not None:
                old = products(before, p4, p8)[name]
                row[f"{name}_before_us"] = _graph_time(lambda: old(x), calls=10) * 1e6
        print(json.dumps(row), flush=True)
        del w, p4, p8

E, I, H, k = 128, 768, 2048, 8
gu = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * 0.02
banks = {}
for kind in ("int4", "fp8"):
    qs = [quantize_int4(t, 128, True, dt) if kind == "int4" else quantize_fp8(t, (128, 128)) for t in gu]
    banks[kind] = (torch.stack([p.qweight for p in qs]), torch.stack([p.scales for p in qs]),
                   torch.stack([p.dequantize(torch.float32) for p in qs]))
    del qs


def moe(mod, kind, x, ids):
    q, s, _ = banks[kind]
    if kind == "int4":
        return mod.int4_moe_mm(x, q, s, ids, group_size=128)
    return mod.fp8_moe_mm(x, q, s, ids, block=(128, 128))


for M in (60, 512):
    x = torch.randn(M, H, device=dev, dtype=dt)
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(M)])
    for kind in ("int4", "fp8"):
        deq = banks[kind][2]
        want = torch.einsum("mh,mkoh->mko", x.float(), deq[ids]).reshape(M * k, -1)
        row = {"M": M, "shape": "qwen3 experts gate_up", "kind": kind, "rel": rel(moe(qk, kind, x, ids), want),
               "us": _graph_time(lambda: moe(qk, kind, x, ids), calls=10) * 1e6}
        if kind == "int4":
            saved = qk.INT4_TILE
            qk.INT4_TILE = "planes"
            row["planes_us"] = _graph_time(lambda: moe(qk, kind, x, ids), calls=10) * 1e6
            row["planes_rel"] = rel(moe(qk, kind, x, ids), want)
            qk.INT4_TILE = saved
        if before is not None:
            row["before_us"] = _graph_time(lambda: moe(before, kind, x, ids), calls=10) * 1e6
        print(json.dumps(row), flush=True)

if ONLY_MOE:  # BLOCK_N x warps x num_stages for the grouped products, 60 tokens (BLOCK_M from the picks)
    x = torch.randn(60, H, device=dev, dtype=dt)
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(60)])
    for kind in ("int4", "fp8"):
        table = {}
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3, 4):
                    qk.MM_BLOCKS = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
                    try:
                        table[(bn, warps, stages)] = _graph_time(lambda: moe(qk, kind, x, ids), calls=5, repeats=3) * 1e6
                    except Exception as exc:
                        print(kind, bn, warps, stages, type(exc).__name__, file=sys.stderr)
        qk.MM_BLOCKS = None
        best = min(table, key=table.get)
        print(json.dumps({"moe_sweep": kind, "best (BLOCK_N, warps, stages)": list(best), "best_us": table[best],
                          "default_us": _graph_time(lambda: moe(qk, kind, x, ids), calls=5, repeats=3) * 1e6,
                          "table": {str(c): round(t, 1) for c, t in table.items()}}), flush=True)

if "sweep" in sys.argv:  # the prefill tiles over BLOCK_M x BLOCK_N x warps (BLOCK_K: `_mm_blocks`' choice)
    x = torch.randn(60, 2048, device=dev, dtype=dt)
    w = torch.randn(5120, 2048, device=dev, dtype=dt) * 0.02
    p4, p8 = quantize_int4(w, 128, True, dt), quantize_fp8(w, (128, 128))
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(60)])
    qk.DEQUANTIZE_ROWS = 1 << 30
    cases = dict(products(qk, p4, p8))
    cases["int4_moe_mm"] = lambda x: moe(qk, "int4", x, ids)
    cases["fp8_moe_mm"] = lambda x: moe(qk, "fp8", x, ids)
    for name, fn in cases.items():
        table = {}
        for bm in (16, 32, 64):
            for bn in (16, 32, 64, 128):
                for warps in (4, 8):
                    qk.MM_BLOCKS = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps}
                    try:
                        table[(bm, bn, warps)] = _graph_time(lambda: fn(x), calls=5, repeats=3) * 1e6
                    except Exception as exc:
                        print(name, bm, bn, warps, type(exc).__name__, file=sys.stderr)
        qk.MM_BLOCKS = None
        best = min(table, key=table.get)
        print(json.dumps({"sweep": name, "best": list(best), "best_us": table[best],
                          "default_us": _graph_time(lambda: fn(x), calls=5, repeats=3) * 1e6}), flush=True)
