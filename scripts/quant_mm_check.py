"""GPU check of the prefill products against dequantize-then-multiply at true sizes (relative error), and
their time against the alternative of dequantizing the whole weight and calling cuBLAS (CUDA-graph
replays, scripts/quant_gpu.py's timer). Not imported by the package."""
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "scripts")
from quant_gpu import _graph_time  # noqa: E402

from omni_cli.quant.formats import PackedWeight, quantize_fp8, quantize_int4  # noqa: E402
from omni_cli.runtime import quant_kernels as qk  # noqa: E402

dev, dt = "cuda", torch.bfloat16
x = torch.randn(60, 2048, device=dev, dtype=dt)
w = torch.randn(5120, 2048, device=dev, dtype=dt) * 0.02
p4, p8 = quantize_int4(w, 128, True, dt), quantize_fp8(w, (128, 128))
for name, fn, ref in (("int4_mm", lambda: qk.int4_mm(x, p4.qweight, p4.scales, None, group_size=128), p4),
                      ("fp8_mm", lambda: qk.fp8_mm(x, p8.qweight, p8.scales, block=(128, 128)), p8)):
    want = F.linear(x.float(), ref.dequantize(torch.float32))
    rel = ((fn().float() - want).norm() / want.norm()).item()
    print(name, "rel", rel, "us", _graph_time(fn, calls=10) * 1e6,
          "dequantize+F.linear us", _graph_time(lambda: F.linear(x, ref.dequantize(dt)), calls=10) * 1e6,
          "bf16 F.linear us", _graph_time(lambda: F.linear(x, w), calls=10) * 1e6)
E, I, H, k = 128, 768, 2048, 8
gu = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * 0.02
qs = [quantize_int4(t, 128, True, dt) for t in gu]
bank = PackedWeight(qs[0].spec, qs[0].shape, torch.stack([p.qweight for p in qs]), torch.stack([p.scales for p in qs]))
ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(60)])
y = qk.int4_moe_mm(x, bank.qweight, bank.scales, ids, group_size=128)
deq = bank.dequantize(torch.float32)
want = torch.einsum("mh,mkoh->mko", x.float(), deq[ids]).reshape(60 * k, -1)
print("int4_moe_mm rel", ((y.float() - want).norm() / want.norm()).item(),
      "us", _graph_time(lambda: qk.int4_moe_mm(x, bank.qweight, bank.scales, ids, group_size=128), calls=10) * 1e6,
      "dequantizing the whole bank alone us", _graph_time(lambda: bank.dequantize(dt), calls=3) * 1e6)

if "sweep" in sys.argv:  # the prefill tiles: int4_mm and int4_moe_mm over BLOCK_M x BLOCK_N x warps
    for name, fn in (("int4_mm", lambda: qk.int4_mm(x, p4.qweight, p4.scales, None, group_size=128)),
                     ("int4_moe_mm", lambda: qk.int4_moe_mm(x, bank.qweight, bank.scales, ids, group_size=128))):
        best = None
        for bm in (16, 32, 64):
            for bn in (32, 64, 128):
                for warps in (4, 8):
                    qk.MM_BLOCKS = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "num_warps": warps}
                    try:
                        us = _graph_time(fn, calls=5, repeats=3) * 1e6
                    except Exception as exc:
                        print(name, bm, bn, warps, type(exc).__name__)
                        continue
                    if best is None or us < best[0]:
                        best = (us, bm, bn, warps)
        qk.MM_BLOCKS = None
        print(name, "best us %.1f BLOCK_M %d BLOCK_N %d warps %d" % best)
