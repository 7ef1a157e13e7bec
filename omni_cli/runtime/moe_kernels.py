"""Triton kernels for what sits between a prompt's grouped expert products (runtime/prompt_ops.py): the
SiLU gate of the gate/up product's rows, and each token's picks weighted, taken back out of expert order
and summed. Each is one launch reading its input once; the library's torch ops made several elementwise
kernels of them, over strided halves and a copy of every pick's row (H100, Qwen3-Omni, a 2,500-token
prompt: ~0.9 ms a layer beside 0.56 ms of grouped products; ~0.2 ms with these and the sort).

- `silu_mul(h)`: rows h [P, 2I] = [gate | up] -> SiLU(gate) * up [P, I].
- `weighted_sum(y, weights, rows=None)`: out[t] = sum_j weights[t, j] * y[rows[t*k + j]] ([T, H], y [P, H],
  weights [T, k]; rows None: y in pick order, row t*k + j).
- `expert_order(ids, num_experts)`: the picks sorted by expert (torch's stable sort, no kernel of ours),
  which both prompt_ops.routed and quant_kernels' packed plan start from.

Rounding is the library's: SiLU rounded to the activations' dtype before the product with up; each pick's
weighted row rounded to that dtype, the k of a token summed in float32 in pick order and rounded once.
Arithmetic is written in float32 with explicit casts (Triton's CPU interpreter, which the tests use,
computes half-precision products wrongly). It knows nothing of models or routing; importing it needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns a program: a row of Qwen3-Omni's (768, 2048) in one or two programs


@triton.jit
def _silu_mul_kernel(h_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    gate = tl.load(h_ptr + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (silu * up).to(dt), mask=ok)


@triton.jit
def _weighted_sum_kernel(y_ptr, w_ptr, rows_ptr, out_ptr, H, TOPK: tl.constexpr, INDEXED: tl.constexpr,
                         BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pick = t * TOPK + j
        row = tl.load(rows_ptr + pick).to(tl.int64) if INDEXED else pick
        w = tl.load(w_ptr + pick).to(tl.float32)
        y = tl.load(y_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        acc += (y * w).to(dt).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(dt), mask=ok)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of rows h [P, 2I] ([gate | up], contiguous): [P, I] in h's dtype."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"silu_mul: h {list(h.shape)} is not [P, 2I]")
    h = h.contiguous()
    P, I = h.shape[0], h.shape[1] // 2
    out = torch.empty(P, I, device=h.device, dtype=h.dtype)
    if P:
        _silu_mul_kernel[(P, triton.cdiv(I, BLOCK))](h, out, I, BLOCK=BLOCK)
    return out


def expert_order(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The flat picks `ids` [P] (expert ids) in expert order, an expert's own in pick order (a stable sort).
    Sorted as one-byte keys where the experts number 256 or fewer: a radix sort of one pass, not the int64
    ids' eight (an H100, a 2,500-token Qwen3-Omni prompt: 384 sort launches, 2.2 ms); the same order."""
    return torch.argsort(ids.to(torch.uint8 if num_experts <= 256 else torch.int32), stable=True)


def weighted_sum(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's k picks weighted and summed: out[t] = sum_j weights[t, j] * y[rows[t*k + j]], [T, H] in
    y's dtype (weights [T, k]; y [P, H] with P = T * k; rows [P] integer, or None for y in pick order)."""
    if weights.dim() != 2 or y.dim() != 2 or y.shape[0] != weights.numel():
        raise ValueError(f"weighted_sum: y {list(y.shape)} is not one row per pick of weights {list(weights.shape)}")
    T, k = weights.shape
    H = y.shape[1]
    y, weights = y.contiguous(), weights.contiguous()
    out = torch.empty(T, H, device=y.device, dtype=y.dtype)
    if T:
        _weighted_sum_kernel[(T, triton.cdiv(H, BLOCK))](
            y, weights, rows.contiguous() if rows is not None else weights, out, H, TOPK=k, INDEXED=rows is not None,
            BLOCK=BLOCK)
    return out
