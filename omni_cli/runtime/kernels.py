"""Triton kernels for the one-token decode on CUDA: matrix-vector products that read a weight once, with
what sits around them done in the same launch (uncompiled steps), and a one-token attention block as one
launch (compiled steps too).

At batch 1 a decode step is matrix-vector products, each a read of its weight. Uncompiled, each is a
cuBLAS call with its norm, gate and residual as separate kernels (an RMSNorm alone is one to seven), and
a mixture-of-experts layer's picked experts are first copied out of the expert tensor. Each kernel here
does a product together with its neighbours: the RMSNorm before it (every program recomputes the
statistic of the short input: cheaper than a launch), the SiLU gate of a fused gate/up output, the
residual after it; the experts' kernel reads the picked rows in place.

- `gemv(x, w, norm=, eps=, gate=, residual=)`: rows x [..., K] times w [N, K].T.
- `picked_gemv(x, w, idx, weights=, gate=, residual=)`: the same over the experts `idx` picks from
  w [E, N, K]; with `weights` the picks are scaled and summed in top-k order.
- `attend(qkv, q_norm, k_norm, cos, sin, keys, values, pos, span, ...)`: after the q/k/v product, the
  per-head norms, RoPE, the cache write and softmax attention over rows 0..pos, where inductor made four
  kernels and cuDNN's attention a fifth that keeps most of the GPU idle for one query (H200,
  Qwen3-Omni-30B-A3B compiled: a frame 4.45 -> 4.05 ms, a thinker step 5.9 -> 5.2 ms beside the talker).
  It is a `torch.library` op, so compiled steps launch it as it is.

The products serve the plain graphs the commands run by default (`runtime/fused.py` uses them where a
stack's matrices are small, not compiled): H200, Qwen3-Omni-30B-A3B, a frame 10.9 -> 8.9 ms and a thinker
step 11.6 -> 8.4 ms (docs/benchmarks.md); with `attend` too, 6.1 and 6.2 ms. Compiled, inductor's own
fused reductions are as fast in a step's graph (a frame's four projections 21 µs a layer against these
kernels' 23), so compiled steps use `attend` only.

Rounding follows the library's eager modules (the normed input and the gate rounded to the
activations' dtype before the product, float32 accumulation, the residual added in the activations'
dtype); the summation order differs from cuBLAS's, so a result can differ in the last bit. The block
shapes were chosen on an H200 (`_blocks`, `_attend_blocks`). Arithmetic on half-precision values is written
as float32 with explicit casts (the same rounding, and Triton's CPU interpreter, which the tests use,
computes bfloat16 products wrongly). It knows nothing of models; importing it needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NONE, NORM, GATE = 0, 1, 2  # what a kernel does to x before the product


@triton.jit
def prologue_input(x_ptr, nw_ptr, cols, K, rstd, PROLOGUE: tl.constexpr):
    """A block of the product's input, as the layer's eager modules would have made it, in float32 (the
    quantized products of runtime/quant_kernels.py take theirs from here too: NONE or GATE)."""
    mask = cols < K
    if PROLOGUE == 1:  # RMSNorm: float32 statistic, the normed value cast back, then scaled (the library's order)
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        return (w * normed).to(x_ptr.dtype.element_ty).to(tl.float32)
    if PROLOGUE == 2:  # SiLU(gate) * up over a [gate | up] row (2K long), each rounded as the eager ops round
        g = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + cols, mask=mask, other=0.0).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(x_ptr.dtype.element_ty).to(tl.float32)
        return (act * u).to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def rms_rstd(x_ptr, K, eps, BLOCK_K: tl.constexpr):
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc += x * x
    return tl.rsqrt(tl.sum(acc, axis=0) / K + eps)


@triton.jit
def _row_block(x_ptr, w_ptr, nw_ptr, rows, N, K, rstd, PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N]: rows `rows` of w (row-major [N, K]) times the prepared input."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = prologue_input(x_ptr, nw_ptr, cols, K, rstd, PROLOGUE)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                    other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def store_rows(out_ptr, res_ptr, rows, N, y, RESIDUAL: tl.constexpr):
    """y (float32) rounded to the output's dtype, plus the residual in that dtype (as the library adds)."""
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    if RESIDUAL:
        y = (tl.load(res_ptr + rows, mask=rows < N, other=0.0).to(tl.float32) + y)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, N, K, x_row, eps, PROLOGUE: tl.constexpr,
                 RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1)  # the input row (a decode step has one; the code predictor's first, two)
    x_ptr += m * x_row
    rstd = 1.0
    if PROLOGUE == 1:
        rstd = rms_rstd(x_ptr, K, eps, BLOCK_K)
    y = _row_block(x_ptr, w_ptr, nw_ptr, rows, N, K, rstd, PROLOGUE, BLOCK_N, BLOCK_K)
    store_rows(out_ptr + m * N, res_ptr + m * N, rows, N, y, RESIDUAL)


@triton.jit
def _picked_kernel(x_ptr, w_ptr, idx_ptr, rw_ptr, out_ptr, res_ptr, N, K, x_stride, TOPK: tl.constexpr,
                   PROLOGUE: tl.constexpr, SUM: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SUM:  # every pick in this program, each rounded and scaled as the library's, summed in top-k order
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for p in tl.static_range(TOPK):
            e = tl.load(idx_ptr + p).to(tl.int64)
            y = _row_block(x_ptr + p * x_stride, w_ptr + e * N * K, x_ptr, rows, N, K, 1.0, PROLOGUE, BLOCK_N,
                           BLOCK_K).to(out_ptr.dtype.element_ty).to(tl.float32)
            rw = tl.load(rw_ptr + p).to(tl.float32)
            total += (y * rw).to(out_ptr.dtype.element_ty).to(tl.float32)
        store_rows(out_ptr, res_ptr, rows, N, total, RESIDUAL)
    else:  # one pick per program row of the grid: out [TOPK, N]
        p = tl.program_id(1)
        e = tl.load(idx_ptr + p).to(tl.int64)
        y = _row_block(x_ptr + p * x_stride, w_ptr + e * N * K, x_ptr, rows, N, K, 1.0, PROLOGUE, BLOCK_N, BLOCK_K)
        store_rows(out_ptr + p * N, out_ptr, rows, N, y, False)


def _blocks(N: int, K: int, gate: bool) -> dict:
    """Rows per program, the reduction's block, warps, for Qwen3-Omni's shapes on an H200: small outputs
    take 4 rows a program so that every SM has some, larger ones 8 or 16, and a long gated input 8
    warps. From a sweep over (4, 8, 16) rows x (256, 512) x (4, 8) warps (`scripts/gemv_bench.py`) that
    read each weight from the L2 cache. The same sweep with the weights read from memory preferred 4
    rows everywhere and 8 warps for o and down, but whole replies were slower with that: a thinker step
    8.75 ms against 8.38, a frame 9.01 against 8.89 ms (two machines, whose figures without the
    kernels were within 1%)."""
    block_n = 4 if N <= 2048 else 8 if K >= 2048 else 16
    warps = 8 if gate or (N >= 4096 and K >= 2048) else 4
    return dict(BLOCK_N=block_n, BLOCK_K=512, num_warps=warps, num_stages=3)


def gemv(x: torch.Tensor, w: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0,
         gate: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Rows x [..., K] (with `gate`, [..., 2K]) times w [N, K].T: [..., N]. `norm`: RMSNorm each row
    first with that weight and `eps`; `gate`: each row is [gate | up] and the input SiLU(gate) * up;
    `residual` [..., N]: added to the result."""
    N, K = w.shape
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    blocks = _blocks(N, K, gate)
    _gemv_kernel[(triton.cdiv(N, blocks["BLOCK_N"]), x.numel() // x.shape[-1])](
        x, w, out, residual.contiguous() if residual is not None else out, norm if norm is not None else x,
        N, K, x.shape[-1], eps, PROLOGUE=NORM if norm is not None else GATE if gate else NONE,
        RESIDUAL=residual is not None, **blocks)
    return out


def picked_gemv(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, *, weights: torch.Tensor | None = None,
                gate: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """w[idx[p]] times input p for each pick p of idx [k]: x is one row [K] for every pick,
    or one row per pick [k, K] (with `gate`, [k, 2K]: SiLU(gate) * up). Returns [k, N]; with `weights`
    [k], the picks scaled and summed, [N] (+ `residual` [N])."""
    E, N, K = w.shape
    top_k = idx.numel()
    x = x.contiguous()
    x_stride = 0 if x.dim() == 1 or x.shape[0] == 1 else x.stride(0)
    blocks = _blocks(N, K, gate)
    grid: tuple[int, ...]
    if weights is None:
        out = torch.empty(top_k, N, device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(N, blocks["BLOCK_N"]), top_k)
    else:
        out = torch.empty(N, device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(N, blocks["BLOCK_N"]),)
    _picked_kernel[grid](
        x, w, idx, weights if weights is not None else x, out, residual if residual is not None else out, N, K,
        x_stride, TOPK=top_k, PROLOGUE=GATE if gate else NONE, SUM=weights is not None,
        RESIDUAL=residual is not None, **blocks)
    return out


# --- one-token attention ----------------------------------------------------------------------------

# Rows one program reads in turn. A longer span is split over programs (flash-decoding): its rows in
# parts, each with its own softmax statistics, then one program per head joins the parts: up to
# ATTEND_GROUP_FROM rows a program per query head and part of ATTEND_SPLIT_ROWS rows; past it, a program
# per key/value head and part of ATTEND_GROUP_ROWS rows for the whole group of query heads, which reads
# the rows once for the group (`_attend_group_kernel`: half-precision caches, head size >= 32; else the
# per-head parts). H200, bfloat16, µs a call (scripts/attend_bench.py --spans,
# benchmarks/results/2026-12-03-h200-attend-spans{,-grouped}.jsonl), Qwen3-Omni's thinker (32 heads / 4),
# spans 256 / 1,024 / 2,048 / 4,096 / 8,192: one program a head 6.4 / 21.5 / 41 / 81 / 160; parts of 128
# rows a head 5.7 / 7.2 / 11.5 / 18 / 33; groups in parts of 64 rows 6.7 / 7.3 / 7.7 / 9.9 / 15.8; the
# library's attention alone 10.4 / 11.2 / 11.6 / 12.5 / 15.7, beside the four kernels around it that
# this launch also does.
ATTEND_MAX_SPAN = 256
ATTEND_SPLIT_ROWS = 128
ATTEND_GROUP_FROM = 1024
ATTEND_GROUP_ROWS = 64
ATTEND_GROUPED = True  # a developer's switch (the benchmark's), the groups' kernel where it applies


@triton.jit
def _headed(row_ptr, w_ptr, lo, hi, eps, D: tl.constexpr, NORM: tl.constexpr):
    """A head's two halves (float32, each value rounded as the eager ops round it), per-head RMSNorm'd
    when NORM (Qwen3: the float32 statistic, the normed value cast back, then scaled)."""
    dt = row_ptr.dtype.element_ty
    x1 = tl.load(row_ptr + lo).to(tl.float32)
    x2 = tl.load(row_ptr + hi).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps).to(tl.float32)
        x1 = (tl.load(w_ptr + lo).to(tl.float32) * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (tl.load(w_ptr + hi).to(tl.float32) * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return x1, x2


@triton.jit
def _rotated(x1, x2, cos_ptr, sin_ptr, lo, hi, dt: tl.constexpr):
    """RoPE, rotate-half convention, rounded op by op as `fused.rotate`: x * cos + cat(-x2, x1) * sin."""
    c1 = tl.load(cos_ptr + lo).to(tl.float32)
    c2 = tl.load(cos_ptr + hi).to(tl.float32)
    s1 = tl.load(sin_ptr + lo).to(tl.float32)
    s2 = tl.load(sin_ptr + hi).to(tl.float32)
    r1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    r2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return r1, r2


@triton.jit
def _attend_rows(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos, h, first, last, span, eps, scale,
                 k_head, k_row, v_head, v_row, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                 NORM: tl.constexpr, BLOCK_L: tl.constexpr, part):
    """Query head `h`'s online softmax over cache rows first..last-1 (of rows 0..pos): (the largest
    score, the sum of exp(score - it), the exp-weighted sum of the values [D]), float32; in part 0,
    the group's first head also writes the new key and value at row `pos`."""
    g = h // (HEADS // KV_HEADS)  # the head's key/value head (grouped-query attention)
    dt = qkv_ptr.dtype.element_ty
    lo = tl.arange(0, D // 2)
    hi = lo + D // 2
    full = tl.arange(0, D)
    q1, q2 = _headed(qkv_ptr + h * D, qn_ptr, lo, hi, eps, D, NORM)
    q1, q2 = _rotated(q1, q2, cos_ptr, sin_ptr, lo, hi, dt)
    k1, k2 = _headed(qkv_ptr + (HEADS + g) * D, kn_ptr, lo, hi, eps, D, NORM)
    k1, k2 = _rotated(k1, k2, cos_ptr, sin_ptr, lo, hi, dt)
    v = tl.load(qkv_ptr + (HEADS + KV_HEADS + g) * D + full).to(tl.float32)
    k_base = k_ptr + g * k_head
    v_base = v_ptr + g * v_head
    if (part == 0) & (h % (HEADS // KV_HEADS) == 0):  # one program writes the new row; the others use it from registers
        tl.store(k_base + pos * k_row + lo, k1.to(dt))
        tl.store(k_base + pos * k_row + hi, k2.to(dt))
        tl.store(v_base + pos * v_row + full, v.to(dt))
    # Online softmax (float32 scores, as the library's attention accumulates). Every block the loop
    # takes holds a row before `last`, so its largest score is finite.
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for start in range(first, last, BLOCK_L):
        rows = start + tl.arange(0, BLOCK_L)
        old = (rows < last) & (rows != pos)  # rows written by earlier steps; row `pos` is this step's
        new = (rows == pos)[:, None]
        K1 = tl.load(k_base + rows[:, None] * k_row + lo[None, :], mask=old[:, None], other=0.0).to(tl.float32)
        K2 = tl.load(k_base + rows[:, None] * k_row + hi[None, :], mask=old[:, None], other=0.0).to(tl.float32)
        K1 = tl.where(new, k1[None, :], K1)
        K2 = tl.where(new, k2[None, :], K2)
        # float32 throughout (compiled, inductor passes `scale` as a double, which would widen the scores)
        s = ((tl.sum(K1 * q1[None, :], axis=1) + tl.sum(K2 * q2[None, :], axis=1)) * scale).to(tl.float32)
        s = tl.where(rows < last, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        shrink = tl.exp(m - m_new)
        V = tl.load(v_base + rows[:, None] * v_row + full[None, :], mask=old[:, None], other=0.0).to(tl.float32)
        V = tl.where(new, v[None, :], V)
        acc = acc * shrink + tl.sum(p[:, None] * V, axis=0)
        total = total * shrink + tl.sum(p, axis=0)
        m = m_new
    return m, total, acc


@triton.jit
def _attend_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, span, eps, scale,
                   k_head, k_row, v_head, v_row, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                   NORM: tl.constexpr, BLOCK_L: tl.constexpr):
    h = tl.program_id(0)
    pos = tl.load(pos_ptr)
    end = tl.minimum(pos + 1, span)
    m, total, acc = _attend_rows(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos, h, 0, end, span, eps,
                                 scale, k_head, k_row, v_head, v_row, HEADS, KV_HEADS, D, NORM, BLOCK_L, 0)
    tl.store(out_ptr + h * D + tl.arange(0, D), (acc / total).to(out_ptr.dtype.element_ty))


@triton.jit
def _attend_part_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos_ptr, part_ptr, span, eps, scale,
                        k_head, k_row, v_head, v_row, parts, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                        D: tl.constexpr, NORM: tl.constexpr, BLOCK_L: tl.constexpr, ROWS: tl.constexpr):
    """Part `program_id(1)` of head `program_id(0)`: rows [part * ROWS, (part + 1) * ROWS) of 0..pos, its
    statistics into part_ptr [heads, parts, D + 2] (the weighted values, then the largest score and the
    sum; a part past `pos` holds -inf and zeros, which weigh nothing when joined)."""
    h = tl.program_id(0)
    part = tl.program_id(1)
    pos = tl.load(pos_ptr)
    end = tl.minimum(pos + 1, span)
    first = part * ROWS
    last = tl.minimum(first + ROWS, end)
    m, total, acc = _attend_rows(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos, h, first, last, span,
                                 eps, scale, k_head, k_row, v_head, v_row, HEADS, KV_HEADS, D, NORM, BLOCK_L, part)
    base = part_ptr + (h * parts + part) * (D + 2)
    tl.store(base + tl.arange(0, D), acc)
    one = tl.arange(0, 1)
    tl.store(base + D + one, m)
    tl.store(base + D + 1 + one, total)


@triton.jit
def _attend_group_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos_ptr, part_ptr, span, eps, scale,
                         k_head, k_row, v_head, v_row, parts, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                         D: tl.constexpr, NORM: tl.constexpr, BLOCK_L: tl.constexpr, ROWS: tl.constexpr,
                         GP: tl.constexpr):
    """`_attend_part_kernel` for every query head of key/value head `program_id(0)` at once: the part's
    rows are read once for the group (not once per query head), the scores and the weighted values as
    products of [heads, D] by [D, rows] (the group padded to GP >= 16 rows, as `tl.dot` needs; the
    padding repeats the group's last head and is not stored). The same float32 math: the scores of
    half-precision values summed in float32, the weights kept float32 ("ieee": no TF32)."""
    g = tl.program_id(0)
    part = tl.program_id(1)
    G = HEADS // KV_HEADS
    dt = qkv_ptr.dtype.element_ty
    lo = tl.arange(0, D // 2)
    hi = lo + D // 2
    full = tl.arange(0, D)
    i = tl.arange(0, GP)
    here = i < G
    heads = g * G + tl.minimum(i, G - 1)  # the group's query heads, the padding repeating the last
    x1 = tl.load(qkv_ptr + heads[:, None] * D + lo[None, :]).to(tl.float32)
    x2 = tl.load(qkv_ptr + heads[:, None] * D + hi[None, :]).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps).to(tl.float32)
        x1 = (tl.load(qn_ptr + lo).to(tl.float32)[None, :] * (x1 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (tl.load(qn_ptr + hi).to(tl.float32)[None, :] * (x2 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    q1, q2 = _rotated(x1, x2, cos_ptr, sin_ptr, lo, hi, dt)
    q1, q2 = q1.to(dt), q2.to(dt)  # exact: `_rotated` rounds to dt
    k1, k2 = _headed(qkv_ptr + (HEADS + g) * D, kn_ptr, lo, hi, eps, D, NORM)
    k1, k2 = _rotated(k1, k2, cos_ptr, sin_ptr, lo, hi, dt)
    v = tl.load(qkv_ptr + (HEADS + KV_HEADS + g) * D + full).to(tl.float32)
    k_base = k_ptr + g * k_head
    v_base = v_ptr + g * v_head
    pos = tl.load(pos_ptr)
    if part == 0:  # the new row, written once; every program uses it from registers
        tl.store(k_base + pos * k_row + lo, k1.to(dt))
        tl.store(k_base + pos * k_row + hi, k2.to(dt))
        tl.store(v_base + pos * v_row + full, v.to(dt))
    end = tl.minimum(pos + 1, span)
    first = part * ROWS
    last = tl.minimum(first + ROWS, end)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    for start in range(first, last, BLOCK_L):
        rows = start + tl.arange(0, BLOCK_L)
        old = (rows < last) & (rows != pos)
        new = (rows == pos)[:, None]
        K1 = tl.load(k_base + rows[:, None] * k_row + lo[None, :], mask=old[:, None], other=0.0)
        K2 = tl.load(k_base + rows[:, None] * k_row + hi[None, :], mask=old[:, None], other=0.0)
        K1 = tl.where(new, k1.to(dt)[None, :], K1)
        K2 = tl.where(new, k2.to(dt)[None, :], K2)
        # float32 (compiled, inductor passes `scale` as a double)
        s = ((tl.dot(q1, tl.trans(K1)) + tl.dot(q2, tl.trans(K2))) * scale).to(tl.float32)  # [GP, BLOCK_L]
        s = tl.where((rows < last)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        shrink = tl.exp(m - m_new)
        V = tl.load(v_base + rows[:, None] * v_row + full[None, :], mask=old[:, None], other=0.0).to(tl.float32)
        V = tl.where(new, v[None, :], V)
        acc = acc * shrink[:, None] + tl.dot(p, V, input_precision="ieee")
        total = total * shrink + tl.sum(p, axis=1)
        m = m_new
    base = part_ptr + ((g * G + i) * parts + part) * (D + 2)
    tl.store(base[:, None] + full[None, :], acc, mask=here[:, None])
    tl.store(base + D, m, mask=here)
    tl.store(base + D + 1, total, mask=here)


@triton.jit
def _attend_join_kernel(part_ptr, out_ptr, parts, D: tl.constexpr, PARTS: tl.constexpr):
    """Head `program_id(0)`'s parts joined: each part's sums rescaled to the largest score of all."""
    h = tl.program_id(0)
    idx = tl.arange(0, PARTS)
    here = idx < parts
    base = part_ptr + (h * parts + idx) * (D + 2)
    m = tl.load(base + D, mask=here, other=float("-inf"))
    top = tl.max(m, axis=0)  # part 0 always holds row 0: finite
    w = tl.exp(m - top)
    total = tl.sum(tl.load(base + D + 1, mask=here, other=0.0) * w, axis=0)
    acc = tl.load(base[:, None] + tl.arange(0, D)[None, :], mask=here[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + h * D + tl.arange(0, D), out.to(out_ptr.dtype.element_ty))


ATTEND_BLOCKS = None  # (rows a block, warps) for every span: a developer's override (scripts/attend_bench.py)


def _attend_blocks(span: int) -> tuple[int, int]:
    if ATTEND_BLOCKS is not None:
        return ATTEND_BLOCKS
    # H200, bfloat16 (scripts/attend_bench.py): the code predictor's 16 rows in one block of one warp, 2.8
    # µs against 3.5 with four; the thinker's 256-row span in blocks of 128, 5.4 µs against 5.8 in 64s.
    return min(128, max(16, triton.next_power_of_2(span))), 1 if span <= 16 else 4


@torch.library.triton_op("omni_cli::attend", mutates_args={"keys", "values"})
def attend(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
           sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, span: int, eps: float,
           scale: float, heads: int) -> torch.Tensor:
    """One token's attention block after its q/k/v product, in one launch (two over a long span): the
    per-head norms (when given), RoPE, the new key and value written to the cache at `pos`, and softmax
    attention over the cache's rows 0..pos. qkv [.., (heads + 2 kv) * D] (one row), cos/sin [D] (the row
    of `pos`), keys and values [1, kv, L, D] with rows of D contiguous; returns [heads * D]. A program per
    query head reads its key/value head's rows in turn; over ATTEND_MAX_SPAN rows, a program per head (or,
    past ATTEND_GROUP_FROM, per key/value head) and part, then a program per head joins them. A `torch.library` op, so
    that a compiled step launches it as it is (inductor sees the cache writes)."""
    kv, D = keys.shape[1], keys.shape[-1]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty(heads * D, device=qkv.device, dtype=qkv.dtype)
    norms = (q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv)
    strides = (keys.stride(1), keys.stride(2), values.stride(1), values.stride(2))
    shape = dict(HEADS=heads, KV_HEADS=kv, D=D, NORM=q_norm is not None)
    if span <= ATTEND_MAX_SPAN:
        block, warps = _attend_blocks(span)
        torch.library.wrap_triton(_attend_kernel)[(heads,)](
            qkv, *norms, cos, sin, keys, values, pos, out, span, eps, scale, *strides, **shape, BLOCK_L=block,
            num_warps=warps)
        return out
    grouped = (ATTEND_GROUPED and span > ATTEND_GROUP_FROM and heads > kv and D >= 32
               and keys.dtype in (torch.bfloat16, torch.float16))
    rows = ATTEND_GROUP_ROWS if grouped else ATTEND_SPLIT_ROWS
    parts = triton.cdiv(span, rows)
    block, warps = _attend_blocks(rows)
    stats = torch.empty(heads, parts, D + 2, device=qkv.device, dtype=torch.float32)
    if grouped:  # tl.dot's operands need 16 rows and columns: the group padded, half a head >= 16
        torch.library.wrap_triton(_attend_group_kernel)[(kv, parts)](
            qkv, *norms, cos, sin, keys, values, pos, stats, span, eps, scale, *strides, parts, **shape, BLOCK_L=block,
            ROWS=rows, GP=max(16, triton.next_power_of_2(heads // kv)), num_warps=warps)
    else:
        torch.library.wrap_triton(_attend_part_kernel)[(heads, parts)](
            qkv, *norms, cos, sin, keys, values, pos, stats, span, eps, scale, *strides, parts, **shape,
            BLOCK_L=block, ROWS=rows, num_warps=warps)
    torch.library.wrap_triton(_attend_join_kernel)[(heads,)](stats, out, parts, D=D,
                                                               PARTS=triton.next_power_of_2(parts), num_warps=4)
    return out
