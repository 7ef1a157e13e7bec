"""Triton kernels over quantized weights that dequantize the packed weight in registers, tile by tile,
never as a whole matrix: matrix-vector products for the one-token decode (read the weight once) and
tl.dot products for a prefill's many rows (each weight tile dequantized once for up to 64 rows).

Decode (batch 1):
- `int4_gemv(x, qweight, scales, zeros=, group_size=, gate=)`: rows x [..., K] times a 4-bit weight [N, K];
  with `gate`, each row is [gate | up] and the input SiLU(gate) * up (the down projection's).
- `fp8_gemv(x, weight, scale, block=)`: rows x [..., K] times an e4m3 weight [N, K] with block or
  per-channel scales.
- `int4_picked_gemv(x, qweight, scales, idx, zeros=, group_size=, weights=, gate=)` and
  `fp8_picked_gemv(x, weight, scale, idx, block=, weights=, gate=)`: the product over the experts `idx`
  picks from a bank [E, N, K] (idx on the device: no host sync), as `kernels.picked_gemv`.

Prefill:
- `int4_mm(x, qweight, scales, zeros=, group_size=)`, `fp8_mm(x, weight, scale, block=)`: x [M, K] -> [M, N].
- `int4_moe_mm(x, qweight_bank, scales_bank, ids, zeros_bank=, group_size=, gate=)` and
  `fp8_moe_mm(x, weight_bank, scale_bank, ids, block=, gate=)`: every token's picked experts (ids [M, k])
  in one launch, -> [M*k, N] in pick order, unweighted. The picks are sorted by expert on the device
  (`_moe_plan`, torch ops, no host sync) and each expert's run padded to whole row tiles, so a tile
  reads one expert's weight; the number of tiles is bounded on the host by M*k + E*(BLOCK_M - 1) rows,
  which fixes every shape for a fixed M (CUDA graphs). The idea is vLLM's moe_align_block_size.

The two formats share one kernel per product (a constexpr picks the format's code inside): int4 by its
packed words' nibble planes (`_int4_rows`, `_int4_planes`), FP8 by tiles (`_fp8_rows`, `_fp8_tile`). An expert bank is the single weight's layout with
a leading E, on the weight and on its scales (and zeros).

The layouts they read (the in-memory form of omni_cli.quant.formats; a checkpoint's layout is turned into
it there, not here):
- int4: `qweight` int32 [N, K/8], eight values along K a word, value i of a word at bits 4i..4i+3,
  unsigned 0..15. The weight is (q - z) * s with z = 8 (symmetric) or the group's zero point from `zeros`
  [N, K/g] (any integer dtype), and s from `scales` [N, K/g] (bfloat16, float16 or float32). K must be a
  multiple of 8 and of the group size g; g a multiple of 8.
- FP8: `weight` float8_e4m3fn [N, K], weight = w * s: block scales [ceil(N/bn), ceil(K/bk)] (the multiplier,
  as the block-FP8 checkpoints' `weight_scale_inv` holds it; edge blocks are partial), or per-channel
  scales [N] / [N, 1].

Rounding. The decode kernels, where the scales line up with their blocks (a power-of-two group size or
FP8 block width, or one scale a row: every checkpoint here), apply each group's or block's scale to a
partial sum (`_rows`): the result is the exact product of the dequantized weight, accumulated in float32
and rounded once to x's dtype (tests: within 1 ulp of that). Elsewhere, and in the tl.dot products, a
tile's weights are computed in float32 and rounded to the activations' dtype first, as an eager layer
holding the dequantized weight in that dtype would (within 1 ulp of that layer; the tl.dot products in
float32 for float32 activations too, not TF32). The two differ by the weights' rounding (relative 2e-3 in
float16). The summation order differs from cuBLAS's.

What it does not know: models, checkpoint formats and their packing orders (GPTQ's, AWQ's), act-order
(`g_idx`) permutations, asymmetric FP8 or per-tensor FP8 scales; the MoE products do not weight or sum
the picks, and expert ids are not checked against E (that would be a host sync). The tl.dot products
dequantize with the activations' dtype, not FP8 or int8 tensor-core inputs. The decode blocks
(`DECODE_BLOCKS`) come from a sweep on an H200; the prefill tiles are untuned.
Importing it needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_cli.runtime.kernels import GATE, NONE, prologue_input

MAGIC: tl.constexpr = tl.constexpr(8388608.0)  # 2**23: a float32 whose mantissa's low bits are an integer
MAGIC_BITS: tl.constexpr = tl.constexpr(0x4B000000)  # its bits


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
def _rows(x_ptr, q_ptr, s_ptr, z_ptr, rows, N, K, G, BN, BK, s_row, FP8: tl.constexpr, ZEROS: tl.constexpr,
          BLOCKED: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          SCALE_BLOCK: tl.constexpr = -1):
    """float32 [BLOCK_N]: rows `rows` of the weight times the input [K] (PROLOGUE GATE: made from a
    [gate | up] row, as kernels.prologue_input makes it).

    SCALE_BLOCK >= 0 (the decode kernels' fast path; `_blocks` picks it): the scales are applied to partial
    sums, not to each weight (`_int4_rows`, `_fp8_rows`): the exact product of the dequantized weight,
    rounded once. -1 (FP8 only: int4's scales always line up with its packed words): each weight dequantized
    and rounded to the activations' dtype first, as an eager layer holding it would (`_fp8_tile`), where
    an FP8 block width does not line up with BLOCK_K."""
    if SCALE_BLOCK < 0:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # rounded to the activations' dtype, as the weight an eager layer holding it would multiply with
            w = _fp8_tile(q_ptr, s_ptr, rows, k0, N, K, BN, BK, s_row, BLOCKED, BLOCK_N, BLOCK_K)
            x = prologue_input(x_ptr, x_ptr, k0 + tl.arange(0, BLOCK_K), K, 0.0, PROLOGUE)
            acc += w.to(x_ptr.dtype.element_ty).to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
    elif FP8:
        y = _fp8_rows(x_ptr, q_ptr, s_ptr, rows, N, K, BN, BK, s_row, BLOCKED, PROLOGUE, BLOCK_N, BLOCK_K)
    else:
        y = _int4_rows(x_ptr, q_ptr, s_ptr, z_ptr, rows, N, K, G, ZEROS, PROLOGUE, BLOCK_N, BLOCK_K)
    return y


@triton.jit
def _int4_rows(x_ptr, q_ptr, s_ptr, z_ptr, rows, N, K, G, ZEROS: tl.constexpr, PROLOGUE: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_rows`' fast int4 path. A packed word holds 8 consecutive inputs of one group, so per word
    sum((q - z) s x) = s sum((q - z) x): nibble j of every word of the block is one 2-D operation (shift,
    mask-and-or, subtract, multiply-add) against the inputs 8w + j, and the word's scale applied once. Dequantizing each weight first ((q - z) * s looked up per weight, rounded) and splitting
    words through a 3-D reshape left the kernel at a tenth of the memory's bandwidth (H200, Qwen2.5-7B's
    matrices: 0.33-0.48 TB/s of int4)."""
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    KW = K // 8
    KG = K // G
    row_ok = rows[:, None] < N
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        words = k0 // 8 + tl.arange(0, BLOCK_W)
        ok = row_ok & (words[None, :] < KW)
        packed = tl.load(q_ptr + rows[:, None] * KW + words[None, :], mask=ok, other=0)
        at = rows[:, None] * KG + (words * 8 // G)[None, :]
        sc = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
        if ZEROS:
            offset = tl.load(z_ptr + at, mask=ok, other=0).to(tl.float32) + MAGIC
        else:
            offset = 8.0 + MAGIC
        qx = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(8):
            xj = prologue_input(x_ptr, x_ptr, words * 8 + j, K, 0.0, PROLOGUE)  # [BLOCK_W], 0 past K
            # code u as the float 2**23 + u (its bits OR-ed into 2**23's mantissa): an exact subtraction
            # then gives u - z, where an int-to-float conversion runs at a quarter of the FP32 rate
            f = (((packed >> (4 * j)) & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True)
            qx += (f - offset) * xj[None, :]
        acc += qx * sc
    return tl.sum(acc, axis=1)


@triton.jit
def _fp8_rows(x_ptr, w_ptr, s_ptr, rows, N, K, BN, BK, s_row, BLOCKED: tl.constexpr, PROLOGUE: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_rows`' fast FP8 path: one scale a row for the whole block of columns (a block column's, BK being a
    multiple of BLOCK_K, or the row's), looked up once a row and iteration instead of once a weight."""
    row_ok = rows < N
    if not BLOCKED:
        s_rows = tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < K),
                    other=0.0).to(tl.float32)
        if BLOCKED:
            s_rows = tl.load(s_ptr + (rows // BN) * s_row + k0 // BK, mask=row_ok, other=0.0).to(tl.float32)
        acc += w * s_rows[:, None] * prologue_input(x_ptr, x_ptr, cols, K, 0.0, PROLOGUE)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, N, K, G, BN, BK, s_row, x_row, FP8: tl.constexpr,
                 ZEROS: tl.constexpr, BLOCKED: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1)
    y = _rows(x_ptr + m * x_row, q_ptr, s_ptr, z_ptr, rows, N, K, G, BN, BK, s_row, FP8, ZEROS, BLOCKED, PROLOGUE,
              BLOCK_N, BLOCK_K, SCALE_BLOCK)
    tl.store(out_ptr + m * N + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _picked_kernel(x_ptr, q_ptr, s_ptr, z_ptr, idx_ptr, rw_ptr, out_ptr, N, K, G, BN, BK, s_row, x_stride,
                   q_expert, s_expert, TOPK: tl.constexpr, FP8: tl.constexpr, ZEROS: tl.constexpr,
                   BLOCKED: tl.constexpr, PROLOGUE: tl.constexpr, SUM: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """q_expert / s_expert: one expert's stride in the weight bank and in its scales (and zeros)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SUM:  # each pick rounded to the output's dtype, scaled, rounded again, summed in top-k order
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for p in tl.static_range(TOPK):
            e = tl.load(idx_ptr + p).to(tl.int64)
            y = _rows(x_ptr + p * x_stride, q_ptr + e * q_expert, s_ptr + e * s_expert, z_ptr + e * s_expert, rows,
                      N, K, G, BN, BK, s_row, FP8, ZEROS, BLOCKED, PROLOGUE, BLOCK_N, BLOCK_K, SCALE_BLOCK)
            rw = tl.load(rw_ptr + p).to(tl.float32)
            total += (y.to(out_ptr.dtype.element_ty).to(tl.float32) * rw).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=rows < N)
    else:  # one pick per program row of the grid: out [TOPK, N]
        p = tl.program_id(1)
        e = tl.load(idx_ptr + p).to(tl.int64)
        y = _rows(x_ptr + p * x_stride, q_ptr + e * q_expert, s_ptr + e * s_expert, z_ptr + e * s_expert, rows,
                  N, K, G, BN, BK, s_row, FP8, ZEROS, BLOCKED, PROLOGUE, BLOCK_N, BLOCK_K, SCALE_BLOCK)
        tl.store(out_ptr + p * N + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _int4_planes(x_rows, q_ptr, s_ptr, z_ptr, cols_n, k0, N, K, G, acc, dt: tl.constexpr, ZEROS: tl.constexpr,
                 PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + the inputs' columns k0.. times the int4 weight's, as eight products of K = BLOCK_K / 8: product j
    takes nibble j of every word ((q - z) * s of each weight, rounded to dt, as `_tile` makes it) against
    the input columns 8w + j. A sum's order is free, so no [N, K] tile is ever assembled: splitting the
    words into columns through a 3-D reshape cost the product ten times FP8's (H200, 60 x 2048 x 5120:
    2.1 ms against 0.22)."""
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    KW = K // 8
    KG = K // G
    words = k0 // 8 + tl.arange(0, BLOCK_W)
    ok = (cols_n[:, None] < N) & (words[None, :] < KW)
    packed = tl.load(q_ptr + cols_n[:, None] * KW + words[None, :], mask=ok, other=0)
    at = cols_n[:, None] * KG + (words * 8 // G)[None, :]
    sc = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
    if ZEROS:
        z = tl.load(z_ptr + at, mask=ok, other=0).to(tl.float32)
    else:
        z = 8.0
    for j in tl.static_range(8):
        a = prologue_input(x_rows, x_rows, (words * 8 + j)[None, :], K, 0.0, PROLOGUE).to(dt)  # [BLOCK_M, BLOCK_W]
        w = ((((packed >> (4 * j)) & 0xF).to(tl.float32) - z) * sc).to(dt)  # [BLOCK_N, BLOCK_W]
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    return acc


@triton.jit
def _mm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, slots_ptr, tile_e_ptr, out_ptr, M, N, K, G, BN, BK, s_row, x_row,
               x_per, q_expert, s_expert, FP8: tl.constexpr, ZEROS: tl.constexpr, BLOCKED: tl.constexpr,
               PROLOGUE: tl.constexpr, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] tile of out [M, N]: input rows times weight tiles dequantized in registers, through
    tl.dot. GROUPED: the tile's output rows are picks slots_ptr[tile] (M = padding) of the one expert
    tile_e_ptr[tile] (-1: an unused tile, which reads nothing), and pick p's input is row p // x_per."""
    t = tl.program_id(0)
    cols_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if GROUPED:
        picks = tl.load(slots_ptr + t * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        e = tl.load(tile_e_ptr + t).to(tl.int64)
        k_end = tl.where(e >= 0, K, 0)  # a loop of no steps, not an early return: one path for every tile
        e = tl.maximum(e, 0)
    else:
        picks = t * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        e = 0
        k_end = K
    ok = picks < M
    x_rows = x_ptr + tl.where(ok, picks // x_per, 0)[:, None] * x_row  # padding reads row 0, stores nothing
    q_ptr += e * q_expert
    s_ptr += e * s_expert
    z_ptr += e * s_expert
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        if FP8:
            cols = (k0 + tl.arange(0, BLOCK_K))[None, :]
            a = prologue_input(x_rows, x_rows, cols, K, 0.0, PROLOGUE).to(dt)
            w = _fp8_tile(q_ptr, s_ptr, cols_n, k0, N, K, BN, BK, s_row, BLOCKED, BLOCK_N, BLOCK_K).to(dt)
            # "ieee": float32 activations multiply in float32, not TF32 (half-precision ones are unaffected)
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = _int4_planes(x_rows, q_ptr, s_ptr, z_ptr, cols_n, k0, N, K, G, acc, dt, ZEROS, PROLOGUE, BLOCK_N,
                               BLOCK_K)
    mask = ok[:, None] & (cols_n[None, :] < N)
    tl.store(out_ptr + picks[:, None] * N + cols_n[None, :], acc.to(dt), mask=mask)


# The decode kernels' blocks (rows a program, columns an iteration, warps), by output size: set from a
# sweep on an H200 (scripts/quant_gpu.py kernels); a script may replace it to sweep again.
DECODE_BLOCKS = {"small": (4, 512, 8), "large": (16, 512, 4)}  # N <= 2048, N > 2048


def _blocks(N: int, K: int, fmt: dict | None = None) -> dict:
    """The decode kernels' launch constants: `DECODE_BLOCKS`' for the output size, BLOCK_K no wider than K
    needs, and the fast path's SCALE_BLOCK (`_rows`) where the format's scales line up with the blocks."""
    block_n, block_k, warps = DECODE_BLOCKS["small" if N <= 2048 else "large"]
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    blocks = {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "SCALE_BLOCK": -1}
    if fmt is None:
        return blocks
    if fmt["FP8"]:
        if not fmt["BLOCKED"]:
            blocks["SCALE_BLOCK"] = 0
        elif _power_of_two(fmt["BK"]) and fmt["BK"] >= 16:
            blocks["BLOCK_K"] = min(block_k, fmt["BK"])  # a block column holds whole iterations
            blocks["SCALE_BLOCK"] = fmt["BK"]
        return blocks
    blocks["SCALE_BLOCK"] = 0  # int4: any group size (a multiple of 8) lines up with the packed words
    return blocks


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _mm_blocks(rows_a_tile: int, fp8: bool, grouped: bool = False) -> dict:
    """A product's tile. int4: 16 rows x 128 outputs x 128 inputs (swept on an H200 for a 60-token prompt);
    FP8: BLOCK_M from the rows a tile can fill (16, tl.dot's least, up to 64), 64 x 64 for the weight's
    (untuned)."""
    if MM_BLOCKS is not None:  # a sweep's (scripts/quant_mm_check.py)
        return dict(MM_BLOCKS)
    if not fp8:  # the H200 sweep's best, 60 rows: int4_mm 105 -> 70 us (5120 x 2048), int4_moe_mm 442 -> 382
        # us (128 experts, 8 picked); BLOCK_K 128: the eight nibble products need K = 128 / 8 >= 16
        return {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4 if grouped else 8}
    block_m = min(64, max(16, triton.next_power_of_2(rows_a_tile)))
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}


MM_BLOCKS: dict | None = None  # replaces `_mm_blocks`' choice where set (a sweep)


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
    fmt = _int4_args(zeros, group_size)
    blocks = _blocks(N, K, fmt)
    _gemv_kernel[(triton.cdiv(N, blocks["BLOCK_N"]), x.numel() // x.shape[-1])](
        x, qweight, scales, zeros.contiguous() if zeros is not None else scales, out, N=N, K=K,
        x_row=x.shape[-1], PROLOGUE=GATE if gate else NONE, **fmt, **blocks)
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
    fmt = _fp8_args(scale, bn, bk, block)
    blocks = _blocks(N, K, fmt)
    _gemv_kernel[(triton.cdiv(N, blocks["BLOCK_N"]), x.numel() // K)](
        x, weight, scale, scale, out, N=N, K=K, x_row=K, PROLOGUE=NONE, **fmt, **blocks)
    return out


def _picked(x: torch.Tensor, bank: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            idx: torch.Tensor, weights: torch.Tensor | None, gate: bool, N: int, K: int, fmt: dict,
            kind: str) -> torch.Tensor:
    """The picked products' launch, either format (fmt: its kernel arguments)."""
    top_k = idx.numel()
    x = x.contiguous()
    x_stride = _pick_stride(x, top_k, kind)
    bank, scales, idx = bank.contiguous(), scales.contiguous(), idx.contiguous()
    blocks = _blocks(N, K, fmt)
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


# --- prefill: many rows a product, through tl.dot ----------------------------------------------------

def _mm(x: torch.Tensor, bank: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, N: int,
        K: int, fmt: dict) -> torch.Tensor:
    """x [M, K] times one weight, either format."""
    if x.dim() != 2:
        raise ValueError(f"{'fp8' if fmt['FP8'] else 'int4'}_mm: x {list(x.shape)} is not [M, K]")
    x, bank, scales = x.contiguous(), bank.contiguous(), scales.contiguous()
    M = x.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    blocks = _mm_blocks(M, fmt["FP8"])
    _mm_kernel[(triton.cdiv(M, blocks["BLOCK_M"]), triton.cdiv(N, blocks["BLOCK_N"]))](
        x, bank, scales, zeros.contiguous() if zeros is not None else scales, x, x, out, M=M, N=N, K=K,
        x_row=x.stride(0), x_per=1, q_expert=0, s_expert=0, PROLOGUE=NONE, GROUPED=False, **fmt, **blocks)
    return out


def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
            *, group_size: int = 128) -> torch.Tensor:
    """x [M, K] times the int4 weight (int4_gemv's layout): [M, N] in x's dtype, for a prefill's many
    rows. Each program dequantizes its [64, 64] weight tiles in registers, once for up to 64 rows."""
    N, K = _int4_sizes(x, qweight, scales, zeros, group_size, False)
    return _mm(x, qweight, scales, zeros, N, K, _int4_args(zeros, group_size))


def fp8_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           *, block: tuple[int, int] | None = (128, 128)) -> torch.Tensor:
    """x [M, K] times the e4m3 weight (fp8_gemv's layout and scales): [M, N] in x's dtype."""
    N, K, bn, bk = _fp8_sizes(x, weight, scale, block, False)
    return _mm(x, weight, scale, None, N, K, _fp8_args(scale, bn, bk, block))


def _moe_plan(ids: torch.Tensor, E: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The picks sorted by expert, on the device and with no host sync, each expert's run padded to whole
    tiles of block_m: (slots int32 [T * block_m], each a pick's index in ids' row-major order or P = ids.numel()
    for padding; tile_expert int32 [T], each tile's expert or -1 past the last used tile). T is fixed by
    (P, E, block_m) alone, so the shapes are fixed for fixed M (CUDA graphs): every used tile holds a pick,
    so T <= P, and expert e's run takes ceil(c_e / block_m) tiles, so T <= (P + E * (block_m - 1)) / block_m."""
    flat = ids.reshape(-1).long()  # scatter_add_ indexes with int64
    P = flat.numel()
    T = min(P, (P + E * (block_m - 1)) // block_m)
    dev = flat.device
    # scatter_add_, not bincount: bincount on CUDA reads the largest id back to size its output (a host sync)
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    tile_expert = torch.searchsorted(tile_end, torch.arange(T, device=dev), right=True)
    tile_expert = torch.where(tile_expert < E, tile_expert, -1).to(torch.int32)
    order = torch.argsort(flat, stable=True)  # the picks in expert order (stable: an expert's in pick order)
    by_expert = flat[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[by_expert]  # a pick's place in its run
    slots = torch.full((T * block_m,), P, dtype=torch.int32, device=dev)
    slots[(tile_end - tiles)[by_expert] * block_m + rank] = order.to(torch.int32)
    return slots, tile_expert


def _moe_mm(x: torch.Tensor, bank: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            ids: torch.Tensor, gate: bool, N: int, K: int, fmt: dict, kind: str) -> torch.Tensor:
    """The grouped product's launch, either format: one program per (tile of one expert's picks, 64 outputs)."""
    if ids.dim() != 2:
        raise ValueError(f"{kind}: ids {list(ids.shape)} is not [M, k] (each token's picked experts)")
    M, top_k = ids.shape
    if x.dim() != 2 or x.shape[0] not in (M, M * top_k):
        raise ValueError(f"{kind}: x {list(x.shape)} has neither one row per token ({M}) nor one per pick "
                         f"({M * top_k})")
    E = bank.shape[0]
    x, bank, scales = x.contiguous(), bank.contiguous(), scales.contiguous()
    P = M * top_k
    out = torch.empty(P, N, device=x.device, dtype=x.dtype)
    if P == 0:
        return out
    blocks = _mm_blocks(P // E, fmt["FP8"], grouped=True)  # a tile holds one expert's picks: about P / E of them
    slots, tile_expert = _moe_plan(ids, E, blocks["BLOCK_M"])
    _mm_kernel[(tile_expert.numel(), triton.cdiv(N, blocks["BLOCK_N"]))](
        x, bank, scales, zeros.contiguous() if zeros is not None else scales, slots, tile_expert, out, M=P, N=N,
        K=K, x_row=x.stride(0), x_per=top_k if x.shape[0] != P else 1, q_expert=bank.stride(0),
        s_expert=scales.stride(0), PROLOGUE=GATE if gate else NONE, GROUPED=True, **fmt, **blocks)
    return out


def int4_moe_mm(x: torch.Tensor, qweight_bank: torch.Tensor, scales_bank: torch.Tensor, ids: torch.Tensor,
                zeros_bank: torch.Tensor | None = None, *, group_size: int = 128, gate: bool = False) -> torch.Tensor:
    """A prefill's experts in one launch: pick (m, j) multiplies expert ids[m, j]'s int4 weight (qweight_bank
    [E, N, K/8], scales_bank and zeros_bank [E, N, K/g]) by token m's row of x [M, K] (the gate/up
    product) or by its own row of x [M*k, K] (with `gate`, [M*k, 2K] and the input SiLU(gate) * up: the
    down product). Returns [M*k, N] in pick order (row-major over ids), unweighted: the caller weights and
    sums. ids [M, k] stays on the device; ids out of range are not checked (a host sync)."""
    N, K = _int4_sizes(x, qweight_bank, scales_bank, zeros_bank, group_size, gate)
    return _moe_mm(x, qweight_bank, scales_bank, zeros_bank, ids, gate, N, K, _int4_args(zeros_bank, group_size),
                   "int4_moe_mm")


def fp8_moe_mm(x: torch.Tensor, weight_bank: torch.Tensor, scale_bank: torch.Tensor, ids: torch.Tensor, *,
               block: tuple[int, int] | None = (128, 128), gate: bool = False) -> torch.Tensor:
    """int4_moe_mm's FP8 twin over weight_bank [E, N, K] (e4m3) with scale_bank [E, ceil(N/bn), ceil(K/bk)]
    (`block`) or [E, N] / [E, N, 1] (block=None)."""
    N, K, bn, bk = _fp8_sizes(x, weight_bank, scale_bank, block, gate)
    return _moe_mm(x, weight_bank, scale_bank, None, ids, gate, N, K, _fp8_args(scale_bank, bn, bk, block),
                   "fp8_moe_mm")
