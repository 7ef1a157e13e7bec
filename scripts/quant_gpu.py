"""Issue 30's GPU figures that are not omni-bench's: the packed kernels against dequantize-then-multiply and
against the bf16 products (time per call, effective bandwidth), and the error round-to-nearest adds on
random weights at true size (per-layer relative error; the thinker's logits over a 64-token greedy reply,
bf16 against int4 / FP8, teacher-forced on the same ids).

    python3 scripts/quant_gpu.py kernels            > kernels.json
    python3 scripts/quant_gpu.py error PRESET KIND  > error.json   (KIND: int4 | fp8)

Times are CUDA-graph replays of 50 calls (no launch overhead from Python), median of 5. Not imported by the
package; needs a CUDA GPU and triton.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _graph_time(fn, calls: int = 50, repeats: int = 5) -> float:
    """Seconds per call of `fn()`, from CUDA-graph replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kernels() -> dict:
    from omni_cli.quant.formats import quantize_fp8, quantize_int4
    from omni_cli.runtime import kernels as bf16k
    from omni_cli.runtime import quant_kernels as qk

    import importlib
    import os

    before = importlib.import_module("_qk_before") if os.path.exists("scripts/_qk_before.py") else None
    dev, dt = torch.device("cuda"), torch.bfloat16
    out = {"device": torch.cuda.get_device_name(), "matvec": [], "picked": []}
    shapes = {  # (N, K): Qwen3-Omni thinker q|k|v and o, its talker's; Qwen2.5-Omni-7B's
        "qwen3 thinker qkv": (5120, 2048), "qwen3 thinker o": (2048, 4096),
        "qwen25-7b qkv": (4608, 3584), "qwen25-7b gate_up": (37888, 3584), "qwen25-7b down": (3584, 18944),
    }
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        x = torch.randn(1, k, device=dev, dtype=dt)
        p4 = quantize_int4(w, 128, True, dt)
        p8 = quantize_fp8(w, (128, 128), torch.float32)
        ref4 = F.linear(x.float(), p4.dequantize(torch.float32))
        ref8 = F.linear(x.float(), p8.dequantize(torch.float32))
        y4 = qk.int4_gemv(x, p4.qweight, p4.scales, None, group_size=128)
        y8 = qk.fp8_gemv(x, p8.qweight, p8.scales, block=(128, 128))
        row = {"name": name, "N": n, "K": k,
               "bf16_F.linear_us": _graph_time(lambda: F.linear(x, w)) * 1e6,
               "bf16_kernel_us": _graph_time(lambda: bf16k.gemv(x, w)) * 1e6,
               "int4_us": _graph_time(lambda: qk.int4_gemv(x, p4.qweight, p4.scales, None, group_size=128)) * 1e6,
               "fp8_us": _graph_time(lambda: qk.fp8_gemv(x, p8.qweight, p8.scales, block=(128, 128))) * 1e6,
               "int4_rel_err_vs_dequant": _rel(y4, ref4), "fp8_rel_err_vs_dequant": _rel(y8, ref8),
               "bytes_bf16": w.numel() * 2, "bytes_int4": p4.nbytes, "bytes_fp8": p8.nbytes}
        if before is not None:  # an earlier quant_kernels.py beside (scripts/_qk_before.py, copied by hand)
            row["int4_before_us"] = _graph_time(lambda: before.int4_gemv(x, p4.qweight, p4.scales, None, group_size=128)) * 1e6
            row["fp8_before_us"] = _graph_time(lambda: before.fp8_gemv(x, p8.qweight, p8.scales, block=(128, 128))) * 1e6
        row["int4_GBps"] = p4.nbytes / row["int4_us"] / 1e3
        row["bf16_GBps"] = w.numel() * 2 / min(row["bf16_F.linear_us"], row["bf16_kernel_us"]) / 1e3
        out["matvec"].append(row)
        print(json.dumps(row), file=sys.stderr)
    banks = {"qwen3 thinker experts": (128, 8, 768, 2048), "qwen3 talker experts": (128, 6, 768, 1024)}
    for name, (e, top, inter, h) in banks.items():
        gu = torch.randn(e, 2 * inter, h, device=dev, dtype=dt) * 0.02
        dn = torch.randn(e, h, inter, device=dev, dtype=dt) * 0.02
        x = torch.randn(h, device=dev, dtype=dt)
        idx = torch.randperm(e, device=dev)[:top]
        rw = torch.rand(top, device=dev, dtype=dt)
        q_gu = [quantize_int4(t, 128, True, dt) for t in gu]
        q_dn = [quantize_int4(t, 128, True, dt) for t in dn]
        gq, gs = torch.stack([p.qweight for p in q_gu]), torch.stack([p.scales for p in q_gu])
        dq, ds = torch.stack([p.qweight for p in q_dn]), torch.stack([p.scales for p in q_dn])

        def bf16_moe():
            h1 = bf16k.picked_gemv(x, gu, idx)
            return bf16k.picked_gemv(h1, dn, idx, weights=rw, gate=True)

        def int4_moe():
            h1 = qk.int4_picked_gemv(x, gq, gs, idx, group_size=128)
            return qk.int4_picked_gemv(h1, dq, ds, idx, group_size=128, weights=rw, gate=True)

        deq_gu = torch.stack([q_gu[i].dequantize(torch.float32) for i in idx.tolist()])
        deq_dn = torch.stack([q_dn[i].dequantize(torch.float32) for i in idx.tolist()])
        h1 = (deq_gu @ x.float()).to(dt).float()
        gate, up = h1.chunk(2, -1)
        want = ((deq_dn @ (F.silu(gate) * up).to(dt).float().unsqueeze(-1)).squeeze(-1) * rw.float()[:, None]).sum(0)
        row = {"name": name, "experts": e, "top_k": top, "bf16_us": _graph_time(bf16_moe) * 1e6,
               "int4_us": _graph_time(int4_moe) * 1e6, "int4_rel_err_vs_dequant": _rel(int4_moe(), want)}
        if before is not None:
            row["int4_before_us"] = _graph_time(lambda: before.int4_picked_gemv(
                before.int4_picked_gemv(x, gq, gs, idx, group_size=128), dq, ds, idx, group_size=128, weights=rw,
                gate=True)) * 1e6
        if hasattr(qk, "fp8_picked_gemv"):
            p8_gu = [quantize_fp8(t, (128, 128)) for t in gu]
            p8_dn = [quantize_fp8(t, (128, 128)) for t in dn]
            fq, fs = torch.stack([p.qweight for p in p8_gu]), torch.stack([p.scales for p in p8_gu])
            eq, es = torch.stack([p.qweight for p in p8_dn]), torch.stack([p.scales for p in p8_dn])

            def fp8_moe():
                h1 = qk.fp8_picked_gemv(x, fq, fs, idx, block=(128, 128))
                return qk.fp8_picked_gemv(h1, eq, es, idx, block=(128, 128), weights=rw, gate=True)

            row["fp8_us"] = _graph_time(fp8_moe) * 1e6
        out["picked"].append(row)
        print(json.dumps(row), file=sys.stderr)
    return out


def sweep() -> dict:
    """The decode kernels' blocks: every (BLOCK_N, BLOCK_K, warps) for each use of `DECODE_BLOCKS` (one
    weight by output size, picked experts, summed experts), int4 g128 and FP8 128x128, on the true shapes;
    the best config of a use is the one with the least total time over its shapes."""
    from omni_cli.quant.formats import quantize_fp8, quantize_int4
    from omni_cli.runtime import quant_kernels as qk

    dev, dt = torch.device("cuda"), torch.bfloat16
    saved = {kind: dict(table) for kind, table in qk.DECODE_BLOCKS.items()}
    uses = {"small": [(2048, 4096), (1024, 2048)], "large": [(5120, 2048), (4608, 3584), (3584, 18944)], "huge": [(37888, 3584)],
            "picked": [(128, 8, 1536, 2048), (128, 6, 1536, 1024)], "summed": [(128, 8, 2048, 768), (128, 6, 1024, 768)]}
    results = []
    for kind in ("int4", "fp8"):
        for use, shapes in uses.items():
            calls = []
            for shape in shapes:
                n, k = shape[-2:]
                e, top = (shape[0], shape[1]) if len(shape) == 4 else (None, None)
                w = torch.randn(*((e,) if e else ()), n, k, device=dev, dtype=dt) * 0.02
                packs = [quantize_int4(t, 128, True, dt) if kind == "int4" else quantize_fp8(t, (128, 128))
                         for t in (w if e else [w])]
                q, sc = torch.stack([p.qweight for p in packs]), torch.stack([p.scales for p in packs])
                if not e:
                    q, sc = q[0], sc[0]
                    x = torch.randn(1, k, device=dev, dtype=dt)
                    fn = (lambda x=x, q=q, sc=sc: qk.int4_gemv(x, q, sc, None, group_size=128)) if kind == "int4" \
                        else (lambda x=x, q=q, sc=sc: qk.fp8_gemv(x, q, sc, block=(128, 128)))
                else:
                    idx = torch.randperm(e, device=dev)[:top]
                    summed = use == "summed"
                    x = torch.randn(top, 2 * k, device=dev, dtype=dt) if summed else torch.randn(k, device=dev, dtype=dt)
                    rw = torch.rand(top, device=dev, dtype=dt) if summed else None
                    if kind == "int4":
                        fn = (lambda x=x, q=q, sc=sc, idx=idx, rw=rw, g=summed:
                              qk.int4_picked_gemv(x, q, sc, idx, group_size=128, weights=rw, gate=g))
                    else:
                        fn = (lambda x=x, q=q, sc=sc, idx=idx, rw=rw, g=summed:
                              qk.fp8_picked_gemv(x, q, sc, idx, block=(128, 128), weights=rw, gate=g))
                calls.append((shape, fn, sum(p.nbytes for p in packs) * ((top / e) if e else 1)))
                del w
            table = {}
            for bn in (2, 4, 8, 16):
                for bk in (512, 1024, 2048):
                    for warps in (4, 8):
                        qk.DECODE_BLOCKS[kind][use] = (bn, bk, warps)
                        try:
                            table[(bn, bk, warps)] = [_graph_time(fn, calls=20, repeats=3) * 1e6 for _, fn, _ in calls]
                        except Exception as exc:  # a config that does not compile (registers)
                            print(f"{kind} {use} {bn},{bk},{warps}: {type(exc).__name__}", file=sys.stderr)
            qk.DECODE_BLOCKS[kind][use] = saved[kind][use]
            before = table.get(tuple(saved[kind][use]))
            best = min(table, key=lambda c: sum(table[c]))
            row = {"kind": kind, "use": use, "best": list(best), "best_us": table[best],
                   "before": list(saved[kind][use]), "before_us": before,
                   "GBps_best": [nb / us / 1e3 for (_, _, nb), us in zip(calls, table[best])],
                   "shapes": [list(c[0]) for c in calls],
                   "per_shape_best": [min(table, key=lambda c: table[c][i]) for i in range(len(calls))]}
            results.append(row)
            print(json.dumps(row), file=sys.stderr)
    return {"sweep": results}


def error(preset: str, kind: str) -> dict:
    """Per-layer relative error of packing, and the thinker's logits bf16 vs packed over a 64-token reply."""
    from omni_cli.faces import bench
    from omni_cli.quant.apply import decoder_layers, quantize_layer, spec_for, Packed
    from omni_cli.quant.linear import QuantLinear
    from omni_cli.quant.experts import QuantExperts

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run on the tiny presets
    t0 = time.perf_counter()
    model = bench.build_model(preset, dev, torch.bfloat16)
    fam = bench.family_of(preset)
    prompt = torch.tensor([fam.prompt(model, 60)], device=dev)
    thinker = model.thinker
    with torch.no_grad():
        ids = thinker.generate(input_ids=prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        base = thinker(input_ids=ids).logits[0, prompt.shape[1] - 1:-1].float()
    spec = spec_for(kind, next(model.parameters()).dtype, group_size=16 if preset.startswith("tiny") else None)
    per_layer = []
    done = Packed()
    for name, layer in decoder_layers(model):
        before = {n: p.detach().clone() for n, p in layer.named_parameters() if p.dim() >= 2}
        with torch.no_grad():
            quantize_layer(layer, spec, done)
        errs = []
        for n, sub in layer.named_modules():
            if isinstance(sub, QuantLinear):
                errs.append(_rel(sub.packed.dequantize(torch.float32), before[f"{n}.weight"]))
            elif isinstance(sub, QuantExperts):
                errs.append(_rel(sub.bank("gate_up").dequantize(torch.float32), before[f"{n}.gate_up_proj"]))
                errs.append(_rel(sub.bank("down").dequantize(torch.float32), before[f"{n}.down_proj"]))
        per_layer.append({"layer": name, "rel_err_mean": statistics.mean(errs), "rel_err_max": max(errs)})
        del before
    with torch.no_grad():
        packed = thinker(input_ids=ids).logits[0, prompt.shape[1] - 1:-1].float()
    rel = ((packed - base).norm(dim=-1) / base.norm(dim=-1))
    kl = F.kl_div(packed.log_softmax(-1), base.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return {"preset": preset, "kind": kind, "spec": str(spec), "seconds": time.perf_counter() - t0,
            "bytes_before": done.bytes_before, "bytes_after": done.bytes_after,
            "layer_rel_err_mean": statistics.mean(r["rel_err_mean"] for r in per_layer),
            "layer_rel_err_max": max(r["rel_err_max"] for r in per_layer),
            "logits_rel_err_mean": rel.mean().item(), "logits_rel_err_max": rel.max().item(),
            "top1_agreement": (packed.argmax(-1) == base.argmax(-1)).float().mean().item(),
            "kl_mean": kl.mean().item(), "reply_tokens": int(ids.shape[1] - prompt.shape[1]),
            "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None, "per_layer": per_layer}


if __name__ == "__main__":
    what = sys.argv[1]
    result = {"kernels": kernels, "sweep": sweep}[what]() if what in ("kernels", "sweep") else error(*sys.argv[2:4])
    print(json.dumps(result, indent=1))
