"""A Triton kernel for a prompt's rotary position embedding (runtime/prompt_ops.py): q or k rotated by a
row's cos and sin in one launch that reads each value once. The library's form, q * cos + rotate_half(q) *
sin, is five kernels a tensor (the halves concatenated, a negation, two broadcast products, a sum; H100,
Qwen3-Omni, a 2,500-token prompt: ~8.6 ms of the thinker prefill's ~61 ms of kernels, q and k of 48 layers).

- `rope(x, cos, sin)`: x [B, H, L, D] (any strides with the last dimension contiguous: the library's q and k
  are transposed views), cos and sin [B, L, D] -> x * cos + rotate_half(x) * sin, [B, H, L, D] laid out as
  [B, L, H, D] in memory (the layout of the transposed view the library's element-wise ops keep).

Rounding is the library's in bfloat16 and float16: each product rounded to the dtype, then their sum
rounded (in float32 the same arithmetic). Through Triton's interpreter (the CPU tests) that gives the
library's values exactly. Compiled for an H100 with Triton's default options it did not (an exact-equality
test failed there, twenty-second pass): the compiler turned the float32 arithmetic and its casts into
bfloat16 instructions and fused a product into the sum (`fma.rn.bf16`). `LAUNCH` turns fusion off; the
compiled code then has one rounded bfloat16 product and one rounded sum each, as torch's ops (read on
this CPU by tests/test_prompt_ops.py), and on an H100 every value equals the library's (tests/test_gpu.py,
2,500 rows at true widths, twenty-third pass).
Arithmetic is written in float32 with explicit casts (Triton's CPU interpreter computes half-precision
products wrongly). It knows nothing of models
or of how cos and sin were made (Qwen3-Omni's interleaved M-RoPE makes them before the layers); importing it
needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# No product fused into a sum: with Triton's default, compiled for an H100, a product and the sum became one
# fused multiply-add (fma.rn.bf16, one rounding where torch's ops make two), and the values differed from
# the library's. Without it each is one rounded bfloat16 operation, as torch's (tests/test_prompt_ops.py
# reads the compiled code).
LAUNCH = {"enable_fp_fusion": False}


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, L, sxb, sxh, sxl, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * L + l
    b, pos = row // L, row % L
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    ok_d = cols < HALF
    ok = (heads[:, None] < H) & ok_d[None, :]
    dt = out_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + row * 2 * HALF + cols, mask=ok_d, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + row * 2 * HALF + HALF + cols, mask=ok_d, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + row * 2 * HALF + cols, mask=ok_d, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + row * 2 * HALF + HALF + cols, mask=ok_d, other=0.0).to(tl.float32)[None, :]
    at = x_ptr + b * sxb + pos * sxl + heads.to(tl.int64)[:, None] * sxh + cols[None, :]
    x1 = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
    # rotate_half(x) = [-x2, x1]; every product rounded to the dtype before the sum, as torch's ops round
    lo = (x1 * c1).to(dt).to(tl.float32) + (-(x2 * s1).to(dt).to(tl.float32))
    hi = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    out = out_ptr + row * H * 2 * HALF + heads.to(tl.int64)[:, None] * 2 * HALF + cols[None, :]  # [B, L, H, D]
    tl.store(out, lo.to(dt), mask=ok)
    tl.store(out + HALF, hi.to(dt), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [B, H, L, D] (last dimension contiguous) and cos, sin [B, L, D]
    (contiguous, x's dtype): [B, H, L, D], stored as [B, L, H, D]."""
    B, H, L, D = x.shape
    if D % 2 or x.stride(-1) != 1 or cos.shape != (B, L, D) or sin.shape != (B, L, D):
        raise ValueError(f"rope: x {list(x.shape)} (strides {x.stride()}) and cos {list(cos.shape)}, "
                         f"sin {list(sin.shape)} do not fit")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(B, L, H, D, device=x.device, dtype=x.dtype)
    if B * L * H:
        block_h = min(triton.next_power_of_2(H), 16)
        _rope_kernel[(B * L, triton.cdiv(H, block_h))](
            x, cos, sin, out, H, L, x.stride(0), x.stride(1), x.stride(2), HALF=D // 2, BLOCK_H=block_h,
            BLOCK_D=triton.next_power_of_2(D // 2), **LAUNCH)
    return out.transpose(1, 2)
