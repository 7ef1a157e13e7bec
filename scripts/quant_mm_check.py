"""A quick GPU check of the prefill products (int4_mm, fp8_mm, int4_moe_mm) against dequantize-then-multiply
at true sizes, with the relative error and the time of one call (not imported by the package)."""
import time

import torch
import torch.nn.functional as F

from omni_cli.quant.formats import quantize_fp8, quantize_int4
from omni_cli.runtime import quant_kernels as qk

dev, dt = "cuda", torch.bfloat16
x = torch.randn(60, 2048, device=dev, dtype=dt)
w = torch.randn(5120, 2048, device=dev, dtype=dt) * 0.02
p4, p8 = quantize_int4(w, 128, True, dt), quantize_fp8(w, (128, 128))
for name, fn, ref in (("int4_mm", lambda: qk.int4_mm(x, p4.qweight, p4.scales, None, group_size=128), p4),
                      ("fp8_mm", lambda: qk.fp8_mm(x, p8.qweight, p8.scales, block=(128, 128)), p8)):
    y = fn()
    want = F.linear(x.float(), ref.dequantize(torch.float32))
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    print(name, "rel", ((y.float() - want).norm() / want.norm()).item(), "us", (time.perf_counter() - t) / 20 * 1e6)
E, I, H, k = 128, 768, 2048, 8
gu = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * 0.02
qs = [quantize_int4(t, 128, True, dt) for t in gu]
bank_q, bank_s = torch.stack([p.qweight for p in qs]), torch.stack([p.scales for p in qs])
ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(60)])
y = qk.int4_moe_mm(x, bank_q, bank_s, ids, group_size=128)
deq = torch.stack([p.dequantize(torch.float32) for p in qs])
want = torch.einsum("mh,mkoh->mko", x.float(), deq[ids]).reshape(60 * k, -1)
print("int4_moe_mm rel", ((y.float() - want).norm() / want.norm()).item())
