"""Triton kernels for the one-token decode over quantized weights: matrix-vector products that read the
packed weight once and dequantize it in registers, block by block, never as a whole matrix.

- `int4_gemv(x, qweight, scales, zeros=, group_size=, gate=)`: rows x [..., K] times a 4-bit weight [N, K];
  with `gate`, each row is [gate | up] and the input SiLU(gate) * up (the down projection's).
- `fp8_gemv(x, weight, scale, block=)`: rows x [..., K] times an e4m3 weight [N, K] with block or
  per-channel scales.
- `int4_picked_gemv(x, qweight, scales, idx, zeros=, group_size=, weights=, gate=)`: the int4 product over the
  experts `idx` picks from a bank [E, N, K] (idx on the device: no host sync), as `kernels.picked_gemv`.
- `fp8_picked_gemv(x, weight, scale, idx, block=, weights=, gate=)`: its FP8 twin over a bank [E, N, K]
  with per-expert scales [E, ...].

The two formats share one kernel per product: a tile of the weight is dequantized by `_int4_tile` or
`_fp8_tile` (a constexpr picks), the rest is the same.

The layouts they read (the in-memory form; turning a checkpoint's layout into it is not done here):
- int4: `qweight` int32 [N, K/8], eight values along K a word, value i of a word at bits 4i..4i+3,
  unsigned 0..15. The weight is (q - z) * s with z = 8 (symmetric) or the group's zero point from `zeros`
  [N, K/g] (any integer dtype), and s from `scales` [N, K/g] (bfloat16, float16 or float32). K must be a
  multiple of 8 and of the group size g; g a multiple of 8.
- FP8: `weight` float8_e4m3fn [N, K], weight = w * s: block scales [ceil(N/bn), ceil(K/bk)] (the multiplier,
  as the block-FP8 checkpoints' `weight_scale_inv` holds it; edge blocks are partial), or per-channel
  scales [N] / [N, 1].

Rounding follows `kernels.py`: the dequantized weight is computed in float32 ((q - z) * s, or w * s) and
rounded to the activations' dtype, which is what an eager layer holding the dequantized weight in that
dtype would use; the product accumulates in float32 and is rounded once to x's dtype. The summation order
differs from cuBLAS's, so a result can differ from `F.linear` in the last bit.

What it does not know: models, checkpoint formats and their packing orders (GPTQ's, AWQ's), act-order
(`g_idx`) permutations, asymmetric FP8 or per-tensor FP8 scales. The block shapes are a guess, not tuned:
nothing here has been timed on a GPU yet. Importing it needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernels import GATE, NONE, prologue_input


@triton.jit
def _int4_tile(q_ptr, s_ptr, z_ptr, rows, k0, N, K, G, ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K]: rows `rows`, columns k0.. of the int4 weight (q_ptr [N, K/8], s_ptr and
    z_ptr [N, K/G]) as (q - z) * s; zero past the edges."""
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    KW = K // 8
    KG = K // G
    shifts = tl.arange(0, 8) * 4
    row_ok = rows[:, None] < N
    words = k0 // 8 + tl.arange(0, BLOCK_W)
    packed = tl.load(q_ptr + rows[:, None] * KW + words[None, :], mask=row_ok & (words[None, :] < KW), other=0)
    # [BLOCK_N, BLOCK_W, 8] -> [BLOCK_N, BLOCK_K]: column 8w + i is nibble i of word w
    q = tl.reshape((packed[:, :, None] >> shifts[None, None, :]) & 0xF, [BLOCK_N, BLOCK_K]).to(tl.float32)
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = row_ok & (cols[None, :] < K)
    at = rows[:, None] * KG + cols[None, :] // G
    s = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if ZEROS:
        z = tl.load(z_ptr + at, mask=mask, other=0).to(tl.float32)
    else:
        z = 8.0
    return (q - z) * s


@triton.jit
def _fp8_tile(w_ptr, s_ptr, rows, k0, N, K, BN, BK, s_row, BLOCKED: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K]: rows `rows`, columns k0.. of the e4m3 weight w_ptr [N, K] times its block
    scale (s_ptr [ceil(N/BN), s_row]) or its row's (s_ptr [N]); zero past the edges."""
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if BLOCKED:
        s = tl.load(s_ptr + (rows[:, None] // BN) * s_row + cols[None, :] // BK, mask=mask, other=0.0)
    else:  # per-channel: one multiplier a row, applied to each weight as the dequantized layer has it
        s = tl.load(s_ptr + rows, mask=rows < N, other=0.0)[:, None]
    return w * s.to(tl.float32)


@triton.jit
def _tile(q_ptr, s_ptr, z_ptr, rows, k0, N, K, G, BN, BK, s_row, dt: tl.constexpr, FP8: tl.constexpr,
          ZEROS: tl.constexpr, BLOCKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A dequantized tile of either format, rounded to the activations' dtype dt (kept as float32): the
    weight an eager layer holding it in dt would multiply with."""
    if FP8:
        w = _fp8_tile(q_ptr, s_ptr, rows, k0, N, K, BN, BK, s_row, BLOCKED, BLOCK_N, BLOCK_K)
    else:
        w = _int4_tile(q_ptr, s_ptr, z_ptr, rows, k0, N, K, G, ZEROS, BLOCK_N, BLOCK_K)
    return w.to(dt).to(tl.float32)


@triton.jit
def _rows(x_ptr, q_ptr, s_ptr, z_ptr, rows, N, K, G, BN, BK, s_row, FP8: tl.constexpr, ZEROS: tl.constexpr,
          BLOCKED: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N]: rows `rows` of the weight times the input [K] (PROLOGUE GATE: made from a
    [gate | up] row, as kernels.prologue_input makes it)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _tile(q_ptr, s_ptr, z_ptr, rows, k0, N, K, G, BN, BK, s_row, x_ptr.dtype.element_ty, FP8, ZEROS,
                  BLOCKED, BLOCK_N, BLOCK_K)
        acc += w * prologue_input(x_ptr, x_ptr, k0 + tl.arange(0, BLOCK_K), K, 0.0, PROLOGUE)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, N, K, G, BN, BK, s_row, x_row, FP8: tl.constexpr,
                 ZEROS: tl.constexpr, BLOCKED: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1)
    y = _rows(x_ptr + m * x_row, q_ptr, s_ptr, z_ptr, rows, N, K, G, BN, BK, s_row, FP8, ZEROS, BLOCKED, PROLOGUE,
              BLOCK_N, BLOCK_K)
    tl.store(out_ptr + m * N + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _picked_kernel(x_ptr, q_ptr, s_ptr, z_ptr, idx_ptr, rw_ptr, out_ptr, N, K, G, BN, BK, s_row, x_stride,
                   q_expert, s_expert, TOPK: tl.constexpr, FP8: tl.constexpr, ZEROS: tl.constexpr,
                   BLOCKED: tl.constexpr, PROLOGUE: tl.constexpr, SUM: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """q_expert / s_expert: one expert's stride in the weight bank and in its scales (and zeros)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SUM:  # each pick rounded to the output's dtype, scaled, rounded again, summed in top-k order
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for p in tl.static_range(TOPK):
            e = tl.load(idx_ptr + p).to(tl.int64)
            y = _rows(x_ptr + p * x_stride, q_ptr + e * q_expert, s_ptr + e * s_expert, z_ptr + e * s_expert, rows,
                      N, K, G, BN, BK, s_row, FP8, ZEROS, BLOCKED, PROLOGUE, BLOCK_N, BLOCK_K)
            rw = tl.load(rw_ptr + p).to(tl.float32)
            total += (y.to(out_ptr.dtype.element_ty).to(tl.float32) * rw).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=rows < N)
    else:  # one pick per program row of the grid: out [TOPK, N]
        p = tl.program_id(1)
        e = tl.load(idx_ptr + p).to(tl.int64)
        y = _rows(x_ptr + p * x_stride, q_ptr + e * q_expert, s_ptr + e * s_expert, z_ptr + e * s_expert, rows,
                  N, K, G, BN, BK, s_row, FP8, ZEROS, BLOCKED, PROLOGUE, BLOCK_N, BLOCK_K)
        tl.store(out_ptr + p * N + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


def _blocks(N: int, K: int) -> dict:
    """Rows per program and the reduction's block. Untuned (no GPU this far): the bf16 kernels' 4 rows for
    small outputs, 8 otherwise; a reduction block of 256 columns (32 packed words a row) or K if smaller."""
    block_k = min(256, max(16, triton.next_power_of_2(K)))
    return {"BLOCK_N": 4 if N <= 2048 else 8, "BLOCK_K": block_k, "num_warps": 4}


def _check_int4(K: int, group_size: int, qshape: tuple[int, ...], sshape: tuple[int, ...],
                zshape: tuple[int, ...] | None) -> None:
    if K % 8 or group_size % 8 or K % group_size:
        raise ValueError(f"int4: K={K} must be a multiple of 8 and of group_size={group_size} (itself a multiple of 8)")
    n_groups = K // group_size
    if qshape[-1] != K // 8 or sshape[-1] != n_groups or sshape[:-1] != qshape[:-1]:
        raise ValueError(f"int4: qweight {list(qshape)} and scales {list(sshape)} do not fit K={K}, "
                         f"group_size={group_size}")
    if zshape is not None and zshape != sshape:
        raise ValueError(f"int4: zeros {list(zshape)} must have the scales' shape {list(sshape)}")


def _width(x: torch.Tensor, K: int, gate: bool, kind: str) -> None:
    if x.shape[-1] != (2 * K if gate else K):
        want = f"2K={2 * K} ([gate | up])" if gate else f"K={K}"
        raise ValueError(f"{kind}: x {list(x.shape)} does not end in the weight's {want}")


def _int4_sizes(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group_size: int, gate: bool) -> tuple[int, int]:
    """(N, K) of an int4 weight [..., N, K/8] (one, or a bank of experts), its scales, zeros and input checked."""
    N, K = qweight.shape[-2], qweight.shape[-1] * 8
    _width(x, K, gate, "int4")
    _check_int4(K, group_size, tuple(qweight.shape), tuple(scales.shape),
                tuple(zeros.shape) if zeros is not None else None)
    return N, K


def _fp8_sizes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               gate: bool) -> tuple[int, int, int, int]:
    """(N, K, bn, bk) of an e4m3 weight [..., N, K] (one, or a bank of experts) and its scales [..., *]
    checked: bn = bk = 1 for per-channel scales."""
    N, K = weight.shape[-2:]
    lead = list(weight.shape[:-2])
    _width(x, K, gate, "fp8")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8: the weight is {weight.dtype}, not torch.float8_e4m3fn")
    if block is not None:
        bn, bk = block
        want = lead + [triton.cdiv(N, bn), triton.cdiv(K, bk)]
        if list(scale.shape) != want:
            raise ValueError(f"fp8: block scales {list(scale.shape)} should be {want} for {lead + [N, K]} "
                             f"in blocks {[bn, bk]}")
        return N, K, bn, bk
    if list(scale.shape) not in (lead + [N], lead + [N, 1]):
        raise ValueError(f"fp8: per-channel scales {list(scale.shape)} should be {lead + [N]} or {lead + [N, 1]}")
    return N, K, 1, 1


def _fp8_args(scale: torch.Tensor, bn: int, bk: int, block: tuple[int, int] | None) -> dict:
    """The FP8 kernels' format arguments (the int4 ones' G and zeros unused)."""
    return {"G": 1, "BN": bn, "BK": bk, "s_row": scale.shape[-1] if block is not None else 1, "FP8": True,
            "ZEROS": False, "BLOCKED": block is not None}


def _int4_args(zeros: torch.Tensor | None, group_size: int) -> dict:
    return {"G": group_size, "BN": 1, "BK": 1, "s_row": 1, "FP8": False, "ZEROS": zeros is not None,
            "BLOCKED": False}


def _pick_stride(x: torch.Tensor, top_k: int, kind: str) -> int:
    """The step between the picks' input rows: 0 for one row [K] (or [1, K]) that every pick uses."""
    if x.dim() > 1 and x.shape[0] not in (1, top_k):
        raise ValueError(f"{kind}: x {list(x.shape)} has neither one row nor one per pick ({top_k})")
    return 0 if x.dim() == 1 or x.shape[0] == 1 else x.stride(0)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
              *, group_size: int = 128, gate: bool = False) -> torch.Tensor:
    """Rows x [..., K] (with `gate`, [..., 2K]: each row [gate | up], the input SiLU(gate) * up) times the
    int4 weight qweight [N, K/8] (int32) with scales [N, K/g] and, if given, zero points zeros [N, K/g]
    (else 8: symmetric): [..., N] in x's dtype."""
    N, K = _int4_sizes(x, qweight, scales, zeros, group_size, gate)
    x = x.contiguous()
    qweight, scales = qweight.contiguous(), scales.contiguous()
    out = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    blocks = _blocks(N, K)
    _gemv_kernel[(triton.cdiv(N, blocks["BLOCK_N"]), x.numel() // x.shape[-1])](
        x, qweight, scales, zeros.contiguous() if zeros is not None else scales, out, N=N, K=K,
        x_row=x.shape[-1], PROLOGUE=GATE if gate else NONE, **_int4_args(zeros, group_size), **blocks)
    return out


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             *, block: tuple[int, int] | None = (128, 128)) -> torch.Tensor:
    """Rows x [..., K] times the float8_e4m3fn weight [N, K] dequantized as weight * scale: with `block`
    (bn, bk), scale [ceil(N/bn), ceil(K/bk)], one multiplier a block; with block=None, per-channel scale
    [N] or [N, 1]. Returns [..., N] in x's dtype."""
    N, K, bn, bk = _fp8_sizes(x, weight, scale, block, False)
    x = x.contiguous()
    weight, scale = weight.contiguous(), scale.contiguous()
    out = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    blocks = _blocks(N, K)
    _gemv_kernel[(triton.cdiv(N, blocks["BLOCK_N"]), x.numel() // K)](
        x, weight, scale, scale, out, N=N, K=K, x_row=K, PROLOGUE=NONE,
        **_fp8_args(scale, bn, bk, block), **blocks)
    return out


def _picked(x: torch.Tensor, bank: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            idx: torch.Tensor, weights: torch.Tensor | None, gate: bool, N: int, K: int, fmt: dict,
            kind: str) -> torch.Tensor:
    """The picked products' launch, either format (fmt: its kernel arguments)."""
    top_k = idx.numel()
    x = x.contiguous()
    x_stride = _pick_stride(x, top_k, kind)
    bank, scales, idx = bank.contiguous(), scales.contiguous(), idx.contiguous()
    blocks = _blocks(N, K)
    grid: tuple[int, ...]
    if weights is None:
        out = torch.empty(top_k, N, device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(N, blocks["BLOCK_N"]), top_k)
    else:
        out = torch.empty(N, device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(N, blocks["BLOCK_N"]),)
    _picked_kernel[grid](
        x, bank, scales, zeros.contiguous() if zeros is not None else scales, idx,
        weights.contiguous() if weights is not None else x, out, N=N, K=K, x_stride=x_stride,
        q_expert=bank.stride(0), s_expert=scales.stride(0), TOPK=top_k, PROLOGUE=GATE if gate else NONE,
        SUM=weights is not None, **fmt, **blocks)
    return out


def int4_picked_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor,
                     zeros: torch.Tensor | None = None, *, group_size: int = 128,
                     weights: torch.Tensor | None = None, gate: bool = False) -> torch.Tensor:
    """Expert idx[p]'s int4 weight (qweight [E, N, K/8], scales and zeros [E, N, K/g]) times input p for
    each pick p of idx [k] (read on the device): x is one row [K] for every pick, or one row per pick
    [k, K] (with `gate`, [k, 2K]: SiLU(gate) * up, the gate/up product's output). Returns [k, N]; with
    `weights` [k], the picks scaled and summed, [N]. The picks are not checked against E (that would be a
    host sync): an index out of range reads out of bounds."""
    N, K = _int4_sizes(x, qweight, scales, zeros, group_size, gate)
    return _picked(x, qweight, scales, zeros, idx, weights, gate, N, K, _int4_args(zeros, group_size),
                   "int4_picked_gemv")


def fp8_picked_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor, *,
                    block: tuple[int, int] | None = (128, 128), weights: torch.Tensor | None = None,
                    gate: bool = False) -> torch.Tensor:
    """int4_picked_gemv's FP8 twin: expert idx[p]'s e4m3 weight (weight [E, N, K]; scale [E, ceil(N/bn),
    ceil(K/bk)] with `block`, [E, N] or [E, N, 1] with block=None) times input p, the same x, `weights`
    and `gate` forms. Returns [k, N], or [N] with `weights`."""
    N, K, bn, bk = _fp8_sizes(x, weight, scale, block, gate)
    return _picked(x, weight, scale, None, idx, weights, gate, N, K, _fp8_args(scale, bn, bk, block),
                   "fp8_picked_gemv")
