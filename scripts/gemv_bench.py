"""Qwen3-Omni's one-token matrix-vector products, timed three ways on one GPU: what the compiled steps
do now (inductor's reduction, `runtime/fused.py`'s `linear(as_sum=True)` with its norm or gate fused),
cuBLAS (`F.linear`), and the Triton kernels of `runtime/kernels.py` over a few block shapes.

Usage (CUDA only): python scripts/gemv_bench.py [--json FILE]

The Triton figure is the best of a sweep of block shapes (`CONFIGS`); kernels.py's `_blocks` keeps the
best ones it found on an H200.

Each case is timed as a CUDA graph of 100 calls (so the figure holds the launch gaps a step's graph
has, not the host's launch cost), replayed 20 times; the calls cycle through copies of the weight that
together are 4x the L2 cache, so each reads its weight from memory as a step does (one copy read again
and again stays in the 50 MB L2 and looks up to 1.6x faster). It prints µs per call and the weight's
TB/s; each result is checked against a float32 reference first. It does not run a model.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from omni_cli.runtime import fused, kernels  # noqa: E402
from omni_cli.runtime.kernels import gemv, picked_gemv  # noqa: E402

DEV, DT = "cuda", torch.bfloat16
EPS = 1e-6
CONFIGS = [(bn, bk, nw) for bn in (4, 8, 16) for bk in (256, 512) for nw in (4, 8)]


def blocks(bn, bk, nw):
    """Every kernel launched after this uses these blocks (kernels._blocks, patched for the sweep)."""
    kernels._blocks = lambda N, K, gate: dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=3)


L2_BYTES = 50 << 20


def copies_of(w: torch.Tensor) -> list[torch.Tensor]:
    """w and clones of it, 4x the L2 cache together."""
    n = max(1, -(-4 * L2_BYTES // (w.numel() * w.element_size())))
    return [w] + [w.clone() for _ in range(n - 1)]


def timed(fn, weights: list, calls=100, replays=20) -> float:
    """µs per `fn(weight)` call, the calls cycling through `weights`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in weights[:3]:
            fn(w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(weights[i % len(weights)])
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / (calls * replays)


def dense_cases():
    """(name, N, K, prologue): the code predictor's and the thinker's dense projections."""
    return [("predictor q/k/v (+norm)", 4096, 1024, "norm"), ("predictor o (+residual)", 1024, 2048, "res"),
            ("predictor gate/up (+norm)", 6144, 1024, "norm"), ("predictor down (+gate, residual)", 1024, 3072, "gate"),
            ("talker q/k/v (+norm)", 2560, 1024, "norm"), ("thinker q/k/v (+norm)", 5120, 2048, "norm"),
            ("thinker o (+residual)", 2048, 4096, "res")]


def reference(x, w, nw, res, kind):
    if kind == "norm":
        xin = fused.rms_norm(x, nw, EPS)
    elif kind == "gate":
        xin = fused.gated(x)
    else:
        xin = x
    y = F.linear(xin.float(), w.float()).to(DT)
    return res + y if kind in ("gate", "res") else y


def run_dense(results):
    for name, N, K, kind in dense_cases():
        torch.manual_seed(0)
        w = torch.randn(N, K, device=DEV, dtype=DT) * 0.02
        x = torch.randn(1, 2 * K if kind == "gate" else K, device=DEV, dtype=DT)
        nw = torch.rand(K, device=DEV, dtype=DT) + 0.5
        res = torch.randn(1, N, device=DEV, dtype=DT)
        ref = reference(x, w, nw, res, kind)
        mb = N * K * 2 / 1e6

        def eager_fn(as_sum):
            def f(x, w, nw, res):
                xin = fused.rms_norm(x, nw, EPS) if kind == "norm" else fused.gated(x) if kind == "gate" else x
                y = fused.linear(xin, w, as_sum=as_sum)
                return res + y if kind in ("gate", "res") else y
            return f

        row = {"case": name, "N": N, "K": K, "MB": mb}
        ws = copies_of(w)
        comp = torch.compile(eager_fn(True), fullgraph=True)
        for label, fn in (("inductor", comp), ("cublas", eager_fn(False))):
            out = fn(x, w, nw, res)
            row[label + "_err"] = (out.float() - ref.float()).abs().max().item()
            row[label + "_us"] = timed(lambda w_: fn(x, w_, nw, res), ws)
        if kind == "norm":
            call = lambda w_: gemv(x, w_, norm=nw, eps=EPS)  # noqa: E731
        elif kind == "gate":
            call = lambda w_: gemv(x, w_, gate=True, residual=res)  # noqa: E731
        else:
            call = lambda w_: gemv(x, w_, residual=res)  # noqa: E731
        best = None
        for bn, bk, nwarps in CONFIGS:
            blocks(bn, bk, nwarps)
            err = (call(w).float() - ref.float()).abs().max().item()
            us = timed(call, ws)
            if best is None or us < best[0]:
                best = (us, (bn, bk, nwarps), err)
        row.update(triton_us=best[0], triton_config=best[1], triton_err=best[2])
        results.append(row)
        print(f"{name:34s} {mb:6.1f} MB  inductor {row['inductor_us']:6.2f} µs  cublas {row['cublas_us']:6.2f} µs  "
              f"triton {best[0]:6.2f} µs {best[1]} ({mb / best[0]:.2f} TB/s)  "
              f"err {row['inductor_err']:.3g}/{row['cublas_err']:.3g}/{best[2]:.3g}", flush=True)


def run_experts(results):
    """The thinker's routed experts: 8 of 128, gate/up [1536, 2048] then down [2048, 768] summed."""
    E, H, I, k = 128, 2048, 768, 8
    torch.manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, device=DEV, dtype=DT) * 0.02
    down = torch.randn(E, H, I, device=DEV, dtype=DT) * 0.02
    x = torch.randn(1, H, device=DEV, dtype=DT)
    idx = torch.randperm(E, device=DEV)[:k].view(1, k)
    rw = torch.softmax(torch.randn(1, k, device=DEV), -1).to(DT)
    res = torch.randn(1, H, device=DEV, dtype=DT)

    def ours(x, idx, rw):
        h = fused.gated(fused.picked_matvec(gate_up, idx, x.unsqueeze(1)))
        return res + (fused.picked_matvec(down, idx, h) * rw.unsqueeze(-1)).sum(dim=1)

    ref = ours(x, idx, rw)
    comp = torch.compile(ours, fullgraph=True)
    row = {"case": "thinker experts (8 picks)", "MB": k * 3 * I * H * 2 / 1e6}
    out = comp(x, idx, rw)
    row["inductor_err"] = (out.float() - ref.float()).abs().max().item()
    # The picks differ from call to call (as from layer to layer): 128 experts, 6 GB, are never in L2.
    picks = [torch.randperm(E, device=DEV)[:k].view(1, k) for _ in range(16)]
    row["inductor_us"] = timed(lambda i: comp(x, i, rw), picks)
    row["cublas_us"] = timed(lambda i: ours(x, i, rw), picks)
    best = None
    for bn, bk, nwarps in CONFIGS:
        blocks(bn, bk, nwarps)

        def call(i):
            h = picked_gemv(x[0], gate_up, i[0])
            return picked_gemv(h, down, i[0], weights=rw[0], gate=True, residual=res[0])

        err = (call(idx).float() - ref[0].float()).abs().max().item()
        us = timed(call, picks)
        if best is None or us < best[0]:
            best = (us, (bn, bk, nwarps), err)
    row.update(triton_us=best[0], triton_config=best[1], triton_err=best[2])
    results.append(row)
    print(f"{row['case']:34s} {row['MB']:6.1f} MB  inductor {row['inductor_us']:6.2f} µs  eager {row['cublas_us']:6.2f} µs  "
          f"triton {best[0]:6.2f} µs {best[1]}  err {row['inductor_err']:.3g}/{best[2]:.3g}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    with torch.inference_mode():
        run_dense(results)
        run_experts(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
