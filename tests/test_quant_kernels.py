"""runtime/quant_kernels.py on a CPU, through Triton's interpreter: each kernel against dequantize-then-
multiply, with the dequantization written here independently (plain torch, explicit shifts), so a wrong
bit order, zero point, group or block index in the kernels shows as a large error.

Two bounds: against the reference that rounds the dequantized weight to the activations' dtype (what the
kernels promise: a layer holding that weight), at most 1 unit in the last place of float16; against the
exact float32 product of the dequantized weight, a relative error (Frobenius) under 2e-3 with float16
inputs (measured about 3e-4: the float16 roundings of the weight and of the output). float16,
not bfloat16: the interpreter rounds casts to bfloat16 toward zero (see tests/test_kernels.py).

Triton is not a dependency of the CPU package; CI (.ci/run) installs it, and there a missing triton
fails these tests instead of skipping them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from interpreted import DT, kernel_module, ulps


@pytest.fixture(scope="module")
def qk():
    return kernel_module("omni_cli.runtime.quant_kernels")


# --- the reference, independent of the module --------------------------------------------------------

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [..., K] of 0..15 -> int32 [..., K/8]: value i of each group of eight at bits 4i..4i+3."""
    q = q.to(torch.int64)
    word = torch.zeros(*q.shape[:-1], q.shape[-1] // 8, dtype=torch.int64)
    for i in range(8):
        word |= q[..., i::8] << (4 * i)
    word = torch.where(word >= 2**31, word - 2**32, word)  # the same 32 bits as a signed int32
    return word.to(torch.int32)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:
    """float32 [..., K]: (q - zero) * scale, q unpacked nibble by nibble with explicit shifts."""
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    nibbles = [(words >> (4 * i)) & 0xF for i in range(8)]
    q = torch.stack(nibbles, dim=-1).flatten(-2).double()  # column 8w + i = nibble i of word w
    zero = zeros.double() if zeros is not None else torch.full_like(scales, 8, dtype=torch.float64)
    zero = zero.repeat_interleave(group_size, dim=-1)
    scale = scales.double().repeat_interleave(group_size, dim=-1)
    return ((q - zero) * scale).float()


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [N, K]: weight * scale, block scales expanded over their (bn, bk) tiles (the edges cut)."""
    N, K = weight.shape
    if block is None:
        return weight.float() * scale.reshape(N, 1).float()
    bn, bk = block
    full = scale.float().repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:N, :K]
    return weight.float() * full


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An eager layer holding the dequantized weight in x's dtype: float32 product, rounded once."""
    return F.linear(x.float(), w.to(x.dtype).float()).to(x.dtype)


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The decode kernels' reference: the float32 product with the dequantized weight as it is (not rounded
    to x's dtype first), rounded once. Their fast path applies a group's or block's scale to the partial
    sum (runtime/quant_kernels.py `_rows`), which is this product up to float32 summation order."""
    return F.linear(x.float(), w.float()).to(x.dtype)


def random_int4(N: int, K: int, g: int, zeros: bool, zdtype=torch.uint8, sdtype=DT):
    q = torch.randint(0, 16, (N, K))
    scales = (torch.rand(N, K // g) * 0.02 + 0.005).to(sdtype)
    z = torch.randint(0, 16, (N, K // g)).to(zdtype) if zeros else None
    return pack_int4(q), scales, z


# --- tests ---------------------------------------------------------------------------------------------

def test_the_reference_reads_value_i_at_bits_4i():
    word = torch.tensor([[0x76543210, 0x0FEDCBA9, -0x0FEDCBA1]], dtype=torch.int64).to(torch.int32)
    q = dequantize_int4(word, torch.ones(1, 3), torch.zeros(1, 3), 8)
    assert q[0, :8].tolist() == list(range(8))
    assert q[0, 8:16].tolist() == [9, 10, 11, 12, 13, 14, 15, 0]
    assert q[0, 16:].tolist() == [15, 5, 4, 3, 2, 1, 0, 15]  # 0xF012345F: the sign bit is nibble 7
    values = torch.randint(0, 16, (3, 64))
    assert torch.equal(dequantize_int4(pack_int4(values), torch.ones(3, 2), torch.zeros(3, 2), 32), values.float())


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("N,K,g", [(64, 256, 32), (40, 320, 64), (72, 384, 128)])  # K past a 256 block
def test_int4_symmetric_is_dequantize_then_multiply(qk, rows, N, K, g):
    torch.manual_seed(N + K + rows)
    qweight, scales, _ = random_int4(N, K, g, zeros=False)
    x = torch.randn(rows, K, dtype=DT)
    w = dequantize_int4(qweight, scales, None, g)
    y = qk.int4_gemv(x, qweight, scales, group_size=g)
    assert y.shape == (rows, N) and y.dtype == DT
    assert ulps(y, exact(x, w)) <= 1
    assert rel(y, x.float() @ w.T) < 2e-3
    # A zero point of 7 instead of 8 is far off: the kernel really subtracts 8.
    assert rel(y, x.float() @ dequantize_int4(qweight, scales, torch.full_like(scales, 7), g).T) > 0.02
    if rows == 2 and N == 64:  # a single row [K]
        assert torch.equal(qk.int4_gemv(x[0], qweight, scales, group_size=g), y[0])


@pytest.mark.parametrize("zdtype,sdtype",
                         [(torch.uint8, DT), (torch.int32, torch.float32), (torch.uint8, torch.bfloat16)])
def test_int4_with_zero_points(qk, zdtype, sdtype):
    torch.manual_seed(3)
    N, K, g = 72, 320, 32
    qweight, scales, zeros = random_int4(N, K, g, zeros=True, zdtype=zdtype, sdtype=sdtype)
    x = torch.randn(2, K, dtype=DT)
    w = dequantize_int4(qweight, scales, zeros, g)
    y = qk.int4_gemv(x, qweight, scales, zeros, group_size=g)
    assert ulps(y, exact(x, w)) <= 1
    assert rel(y, x.float() @ w.T) < 2e-3
    assert rel(y, x.float() @ dequantize_int4(qweight, scales, None, g).T) > 0.1  # the zeros are used


@pytest.mark.parametrize("rows", [1, 2])
def test_int4_gate_is_silu_gate_times_up_then_the_product(qk, rows):
    torch.manual_seed(6 + rows)
    N, K, g = 40, 320, 64
    qweight, scales, zeros = random_int4(N, K, g, zeros=True)
    gate_up = torch.randn(rows, 2 * K, dtype=DT)
    w = dequantize_int4(qweight, scales, zeros, g)
    y = qk.int4_gemv(gate_up, qweight, scales, zeros, group_size=g, gate=True)
    assert ulps(y, exact(F.silu(gate_up[:, :K]) * gate_up[:, K:], w)) <= 1
    assert ulps(y, exact(gate_up[:, K:], w)) > 8  # the gate is really applied


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The library's RMSNorm, in its order: float32 statistic, the normed value cast back, then scaled."""
    x32 = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32.to(x.dtype).float()).to(x.dtype)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_does_the_norm_and_the_residual_in_its_launch(qk, fmt, rows):
    """A plain step's packed layer: RMSNorm, product and residual in one launch, each rounded as the eager
    ops round (the norm's output and the product in the activations' dtype, then the residual added)."""
    torch.manual_seed(11 + rows)
    N, K, eps = 72, 320, 1e-6
    if fmt == "int4":
        qweight, scales, zeros = random_int4(N, K, 64, zeros=True)
        w = dequantize_int4(qweight, scales, zeros, 64)
        run = lambda x, **kw: qk.int4_gemv(x, qweight, scales, zeros, group_size=64, **kw)  # noqa: E731
    else:
        weight, scale = random_fp8(N, K, (64, 64))
        w = dequantize_fp8(weight, scale, (64, 64))
        run = lambda x, **kw: qk.fp8_gemv(x, weight, scale, block=(64, 64), **kw)  # noqa: E731
    x = torch.randn(rows, K, dtype=DT) * 3
    norm_w = (torch.rand(K) + 0.5).to(DT)
    residual = torch.randn(rows, N, dtype=DT)
    normed = exact(rms_normed(x, norm_w, eps), w)
    assert ulps(run(x, norm=norm_w, eps=eps), normed) <= 1
    assert ulps(run(x, norm=norm_w, eps=eps), exact(x * norm_w, w)) > 8  # the statistic is applied
    # the residual added to the product rounded to DT, as the eager add does: bit for bit the two steps
    # (ulps against `exact` would count one unit of the product as several of a sum that cancels)
    for kw in ({"norm": norm_w, "eps": eps}, {}):
        assert torch.equal(run(x, residual=residual, **kw), (run(x, **kw).float() + residual.float()).to(DT))
    if fmt == "fp8":
        gate_up = torch.randn(rows, 2 * K, dtype=DT)
        acts = (F.silu(gate_up[:, :K]) * gate_up[:, K:])
        assert ulps(run(gate_up, gate=True), exact(acts, w)) <= 1
    with pytest.raises(ValueError, match="residual"):
        run(x, residual=residual[..., :-1])


def test_int4_in_float32(qk):
    torch.manual_seed(4)
    N, K, g = 64, 128, 64
    qweight, scales, zeros = random_int4(N, K, g, zeros=True, sdtype=torch.float32)
    x = torch.randn(1, K)
    ref = x.double() @ dequantize_int4(qweight, scales, zeros, g).double().T
    y = qk.int4_gemv(x, qweight, scales, zeros, group_size=g)
    assert y.dtype == torch.float32
    assert rel(y, ref) < 1e-5


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("N,K,block", [(136, 320, (128, 128)), (96, 160, (64, 32)), (64, 192, None)])
@pytest.mark.parametrize("width", [512, 64])  # an iteration over whole block columns, or inside one
def test_fp8_is_dequantize_then_multiply(qk, monkeypatch, rows, N, K, block, width):
    monkeypatch.setitem(qk.DECODE_BLOCKS["fp8"], "small", (4, width, 4))
    torch.manual_seed(N + rows)
    weight = (torch.randn(N, K) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if block is None:
        scale = torch.rand(N) * 1e-3 + 1e-4
    else:
        scale = torch.rand(-(-N // block[0]), -(-K // block[1])) * 1e-3 + 1e-4
    x = torch.randn(rows, K, dtype=DT)
    w = dequantize_fp8(weight, scale, block)
    y = qk.fp8_gemv(x, weight, scale, block=block)
    assert y.shape == (rows, N) and y.dtype == DT
    assert ulps(y, exact(x, w)) <= 1
    assert rel(y, x.float() @ w.T) < 2e-3
    if block is None:
        assert torch.equal(qk.fp8_gemv(x, weight, scale[:, None], block=None), y)  # [N, 1] reads as [N]
    else:  # one mean multiplier in place of the blocks' own is far off: each block reads its scale
        assert rel(y, x.float() @ (weight.float() * scale.float().mean()).T) > 0.05


@pytest.mark.parametrize("per_pick", [False, True])
def test_int4_picked_gemv_reads_the_picked_experts(qk, per_pick):
    torch.manual_seed(5)
    E, N, K, g, k = 5, 24, 128, 32, 3
    qweight, scales, zeros = random_int4(E * N, K, g, zeros=True)
    qweight, scales, zeros = qweight.view(E, N, -1), scales.view(E, N, -1), zeros.view(E, N, -1)
    idx = torch.tensor([4, 0, 2])
    x = torch.randn(k, K, dtype=DT) if per_pick else torch.randn(K, dtype=DT)
    xs = x if per_pick else x.expand(k, K)
    per = [exact(xs[p], dequantize_int4(qweight[e], scales[e], zeros[e], g)) for p, e in enumerate(idx.tolist())]
    y = qk.int4_picked_gemv(x, qweight, scales, idx, zeros, group_size=g)
    assert y.shape == (k, N)
    assert ulps(y, torch.stack(per)) <= 1
    weight = torch.softmax(torch.randn(k), -1).to(DT)
    total = torch.zeros(N)
    for p in range(k):  # each pick rounded, scaled and rounded, summed in top-k order (as kernels.picked_gemv)
        total += (per[p].float() * weight[p].float()).to(DT).float()
    summed = qk.int4_picked_gemv(x, qweight, scales, idx, zeros, group_size=g, weights=weight)
    assert summed.shape == (N,)
    assert ulps(summed, total.to(DT)) <= 1
    mispaired = (torch.stack(per[::-1]).float() * weight[:, None].float()).sum(0).to(DT)
    assert ulps(summed, mispaired) > 8  # each weight scales its own pick
    # The down projection's form: the gate/up output [k, 2K] in, SiLU(gate) * up taken per pick.
    gate_up = torch.randn(k, 2 * K, dtype=DT)
    acts = F.silu(gate_up[:, :K]) * gate_up[:, K:]
    down = torch.stack([exact(acts[p], dequantize_int4(qweight[e], scales[e], zeros[e], g))
                        for p, e in enumerate(idx.tolist())])
    assert ulps(qk.int4_picked_gemv(gate_up, qweight, scales, idx, zeros, group_size=g, gate=True), down) <= 1


def test_shapes_that_do_not_fit_are_refused(qk):
    qweight, scales, zeros = random_int4(16, 64, 32, zeros=True)
    x = torch.randn(64, dtype=DT)
    with pytest.raises(ValueError, match="group_size"):
        qk.int4_gemv(x, qweight, scales, group_size=64)
    with pytest.raises(ValueError, match="multiple of 8"):
        qk.int4_gemv(x, qweight, scales, group_size=12)
    with pytest.raises(ValueError, match="K=64"):
        qk.int4_gemv(torch.randn(60, dtype=DT), qweight, scales, group_size=32)
    with pytest.raises(ValueError, match=r"2K=128 \(\[gate"):
        qk.int4_gemv(x, qweight, scales, group_size=32, gate=True)
    with pytest.raises(ValueError, match="zeros"):
        qk.int4_gemv(x, qweight, scales, zeros[:, :1], group_size=32)
    w8 = torch.randn(16, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block scales"):
        qk.fp8_gemv(x, w8, torch.ones(1, 2), block=(8, 64))
    with pytest.raises(ValueError, match="per-channel"):
        qk.fp8_gemv(x, w8, torch.ones(8), block=None)


@pytest.mark.parametrize("how", ["int4 symmetric g32", "int4 zero points g64", "int4 per channel", "fp8 blocks",
                                 "fp8 per channel"])
def test_the_formats_weights_go_into_the_kernels_as_they_are(qk, how):
    """omni_cli.quant.formats' canonical layout is the kernels' layout: a weight quantized there multiplies
    here as its own `dequantize()` does (the two were written apart: this ties them)."""
    from omni_cli.quant import formats

    torch.manual_seed(len(how))
    N, K = 48, 256
    w = torch.randn(N, K) * 0.02
    x = torch.randn(2, K, dtype=DT)
    if how.startswith("int4"):
        group = {"g32": 32, "g64": 64}.get(how.split()[-1])
        packed = formats.quantize_int4(w, group_size=group, symmetric="symmetric" in how, scale_dtype=torch.float16)
        y = qk.int4_gemv(x, packed.qweight, packed.scales, packed.zeros, group_size=group or K)
    else:
        block = (32, 64) if "blocks" in how else None
        packed = formats.quantize_fp8(w, block=block, scale_dtype=torch.float32)
        y = qk.fp8_gemv(x, packed.qweight, packed.scales, block=block)
    reference = packed.dequantize(torch.float32)
    assert ulps(y, exact(x, reference)) <= 1
    assert rel(y, x.float() @ reference.T) < 2e-3


# --- the experts' FP8 product, the prefill products ----------------------------------------------------

def random_fp8(N: int, K: int, block: tuple[int, int] | None, lead: tuple[int, ...] = ()):
    weight = (torch.randn(*lead, N, K) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows, cols = (N, None) if block is None else (-(-N // block[0]), -(-K // block[1]))
    scale = torch.rand(*lead, rows, *(() if cols is None else (cols,))) * 1e-3 + 1e-4
    return weight, scale


def int4_bank(E: int, N: int, K: int, g: int):
    qweight, scales, zeros = random_int4(E * N, K, g, zeros=True)
    bank = qweight.view(E, N, -1), scales.view(E, N, -1), zeros.view(E, N, -1)
    return bank, [dequantize_int4(bank[0][e], bank[1][e], bank[2][e], g) for e in range(E)]


@pytest.mark.parametrize("block,per_pick", [((32, 64), False), (None, True)])
def test_fp8_picked_gemv_reads_the_picked_experts(qk, block, per_pick):
    torch.manual_seed(8)
    E, N, K, k = 4, 40, 96, 3
    weight, scale = random_fp8(N, K, block, lead=(E,))
    w = [dequantize_fp8(weight[e], scale[e], block) for e in range(E)]
    idx = torch.tensor([3, 0, 2])
    x = torch.randn(k, K, dtype=DT) if per_pick else torch.randn(K, dtype=DT)
    xs = x if per_pick else x.expand(k, K)
    per = [exact(xs[p], w[e]) for p, e in enumerate(idx.tolist())]
    y = qk.fp8_picked_gemv(x, weight, scale, idx, block=block)
    assert y.shape == (k, N) and ulps(y, torch.stack(per)) <= 1
    weights = torch.softmax(torch.randn(k), -1).to(DT)
    total = sum((per[p].float() * weights[p].float()).to(DT).float() for p in range(k))
    summed = qk.fp8_picked_gemv(x, weight, scale, idx, block=block, weights=weights)
    assert summed.shape == (N,) and ulps(summed, total.to(DT)) <= 1
    assert ulps(summed, (torch.stack(per[::-1]).float() * weights[:, None].float()).sum(0).to(DT)) > 8
    gate_up = torch.randn(k, 2 * K, dtype=DT)
    acts = F.silu(gate_up[:, :K]) * gate_up[:, K:]
    down = torch.stack([exact(acts[p], w[e]) for p, e in enumerate(idx.tolist())])
    assert ulps(qk.fp8_picked_gemv(gate_up, weight, scale, idx, block=block, gate=True), down) <= 1
    if block is None:  # [E, N, 1] reads as [E, N]
        assert torch.equal(qk.fp8_picked_gemv(x, weight, scale[..., None], idx, block=None), y)


# partial row, column and K tiles; a group of 24 is no power of two: its scales are looked up per weight
# 130 rows: past DEQUANTIZE_ROWS, the whole weight dequantized and the library's product
@pytest.mark.parametrize("M,N,K,g", [(5, 72, 192, 64), (70, 40, 160, 32), (9, 40, 192, 24), (130, 40, 192, 64)])
@pytest.mark.parametrize("tile", ["joined", "planes"])
def test_int4_mm_is_dequantize_then_multiply(qk, monkeypatch, M, N, K, g, tile):
    monkeypatch.setattr(qk, "INT4_TILE", tile)
    if M >= qk.DEQUANTIZE_ROWS:  # the tile kernel is not launched: the whole weight is dequantized instead
        monkeypatch.setattr(qk, "_mm_kernel", None)
    torch.manual_seed(M)
    qweight, scales, zeros = random_int4(N, K, g, zeros=M > 8)
    x = torch.randn(M, K, dtype=DT)
    w = dequantize_int4(qweight, scales, zeros, g)
    y = qk.int4_mm(x, qweight, scales, zeros, group_size=g)
    assert y.shape == (M, N) and y.dtype == DT
    assert ulps(y, layer(x, w)) <= 1
    assert rel(y, x.float() @ w.T) < 2e-3


@pytest.mark.parametrize("M,N,K,block", [(5, 136, 160, (128, 128)), (40, 72, 192, (32, 64)), (24, 48, 96, None),
                                         (12, 40, 120, (16, 24)),  # 24 wide: scales looked up per weight
                                         (130, 72, 192, (32, 64))])  # past DEQUANTIZE_ROWS
def test_fp8_mm_is_dequantize_then_multiply(qk, M, N, K, block):
    torch.manual_seed(M)
    weight, scale = random_fp8(N, K, block)
    x = torch.randn(M, K, dtype=DT)
    w = dequantize_fp8(weight, scale, block)
    y = qk.fp8_mm(x, weight, scale, block=block)
    assert y.shape == (M, N) and ulps(y, layer(x, w)) <= 1
    assert rel(y, x.float() @ w.T) < 2e-3


@pytest.mark.parametrize("g", [64, 24])
def test_the_whole_weight_dequantized_in_one_launch_is_the_reference_rounded(qk, g):
    torch.manual_seed(g)
    qweight, scales, zeros = random_int4(72, 192, g, zeros=True)
    want = dequantize_int4(qweight, scales, zeros, g).to(DT)
    assert torch.equal(qk.int4_dequantize(qweight, scales, zeros, group_size=g, dtype=DT), want)
    weight, scale = random_fp8(72, 192, (32, 64))
    assert torch.equal(qk.fp8_dequantize(weight, scale, block=(32, 64), dtype=DT),
                       dequantize_fp8(weight, scale, (32, 64)).to(DT))


def test_mm_in_float32_multiplies_in_float32(qk):
    """float32 activations stay float32 through the tile product. The interpreter multiplies in float32 whatever
    tl.dot's input_precision says, so this cannot see TF32 (a GPU would): it checks the rest of the path."""
    torch.manual_seed(9)
    qweight, scales, zeros = random_int4(48, 128, 64, zeros=True, sdtype=torch.float32)
    x = torch.randn(17, 128)
    ref = x.double() @ dequantize_int4(qweight, scales, zeros, 64).double().T
    y = qk.int4_mm(x, qweight, scales, zeros, group_size=64)
    assert y.dtype == torch.float32 and rel(y, ref) < 1e-6


# --- the grouped experts' product ----------------------------------------------------------------------

def skewed_ids(M: int, k: int, E: int) -> torch.Tensor:
    """Each token's k distinct experts: expert 0 in every token (more picks than one tile holds), the last
    expert in none (an expert with no tile)."""
    rest = torch.stack([torch.randperm(E - 2)[: k - 1] + 1 for _ in range(M)])
    return torch.cat([torch.zeros(M, 1, dtype=torch.int64), rest], 1)


def test_the_moe_plan_puts_every_pick_once_in_its_experts_tiles(qk):
    torch.manual_seed(10)
    M, k, E, bm = 37, 3, 6, 16
    ids = skewed_ids(M, k, E)
    slots, tile_expert = qk._moe_plan(ids, E, bm)
    P = M * k
    assert tile_expert.numel() == min(P, (P + E * (bm - 1)) // bm) and slots.numel() == tile_expert.numel() * bm
    tiles = slots.view(-1, bm).long()
    flat = ids.flatten()
    real = tiles < P
    assert sorted(tiles[real].tolist()) == list(range(P))  # each pick once
    for t, e in enumerate(tile_expert.tolist()):
        if e < 0:
            assert not real[t].any()
        else:  # one expert a tile, its picks in pick order, the padding at the end
            picks = tiles[t][real[t]]
            assert (flat[picks] == e).all() and picks.tolist() == sorted(picks.tolist())
            assert real[t].tolist() == sorted(real[t].tolist(), reverse=True)
    used = [e for e in tile_expert.tolist() if e >= 0]
    assert used == sorted(used) and used.count(0) == -(-M // bm) and E - 1 not in used


def moe_reference(x: torch.Tensor, w: list[torch.Tensor], ids: torch.Tensor, gate: bool) -> torch.Tensor:
    M, k = ids.shape
    K = w[0].shape[1]
    rows = x.repeat_interleave(k, 0) if x.shape[0] == M else x
    if gate:
        rows = F.silu(rows[:, :K]) * rows[:, K:]
    return torch.stack([layer(rows[p], w[e]) for p, e in enumerate(ids.flatten().tolist())])


@pytest.mark.parametrize("form", ["per token", "per pick, gate"])
def test_int4_moe_mm_is_each_picks_own_product(qk, form):
    torch.manual_seed(11)
    M, k, E, N, K, g = 20, 2, 5, 72, 128, 32
    (qweight, scales, zeros), w = int4_bank(E, N, K, g)
    ids = skewed_ids(M, k, E)
    gate = "gate" in form
    x = torch.randn(M, K, dtype=DT) if form == "per token" else torch.randn(M * k, 2 * K, dtype=DT)
    y = qk.int4_moe_mm(x, qweight, scales, ids, zeros, group_size=g, gate=gate)
    assert y.shape == (M * k, N) and y.dtype == DT
    assert ulps(y, moe_reference(x, w, ids, gate)) <= 1


@pytest.mark.parametrize("block", [(32, 64), None])
def test_fp8_moe_mm_is_each_picks_own_product(qk, block):
    torch.manual_seed(12)
    M, k, E, N, K = 19, 2, 4, 40, 96
    weight, scale = random_fp8(N, K, block, lead=(E,))
    w = [dequantize_fp8(weight[e], scale[e], block) for e in range(E)]
    ids = skewed_ids(M, k, E)
    x = torch.randn(M * k, K, dtype=DT)
    y = qk.fp8_moe_mm(x, weight, scale, ids, block=block)
    assert y.shape == (M * k, N) and ulps(y, moe_reference(x, w, ids, False)) <= 1


def test_the_new_products_refuse_shapes_that_do_not_fit(qk):
    E, N, K = 3, 16, 64
    w8, s8 = random_fp8(N, K, (8, 32), lead=(E,))
    x = torch.randn(K, dtype=DT)
    idx = torch.tensor([0, 2])
    with pytest.raises(ValueError, match="one per pick"):
        qk.fp8_picked_gemv(torch.randn(3, K, dtype=DT), w8, s8, idx, block=(8, 32))
    with pytest.raises(ValueError, match=r"block scales \[3, 1, 2\] should be \[3, 2, 2\]"):
        qk.fp8_picked_gemv(x, w8, s8[:, :1], idx, block=(8, 32))
    with pytest.raises(ValueError, match=r"per-channel scales .* should be \[3, 16\]"):
        qk.fp8_picked_gemv(x, w8, torch.ones(E, 8), idx, block=None)
    with pytest.raises(ValueError, match=r"2K=128 \(\[gate"):
        qk.fp8_picked_gemv(x, w8, s8, idx, block=(8, 32), gate=True)
    with pytest.raises(ValueError, match=r"is not \[M, K\]"):
        qk.fp8_mm(x, w8[0], s8[0], block=(8, 32))
    (qweight, scales, zeros), _ = int4_bank(E, N, K, 32)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2]])
    with pytest.raises(ValueError, match=r"ids \[6\] is not \[M, k\]"):
        qk.int4_moe_mm(torch.randn(3, K, dtype=DT), qweight, scales, ids.flatten(), zeros, group_size=32)
    with pytest.raises(ValueError, match=r"neither one row per token \(3\) nor one per pick \(6\)"):
        qk.int4_moe_mm(torch.randn(4, K, dtype=DT), qweight, scales, ids, zeros, group_size=32)
    with pytest.raises(ValueError, match="zeros"):
        qk.int4_moe_mm(torch.randn(3, K, dtype=DT), qweight, scales, ids, zeros[:1], group_size=32)


def test_fp8_blocks_that_do_not_line_up_with_the_kernels_take_the_tile_path(qk):
    """FP8 blocks 24 columns wide (not a power of two): the decode kernel dequantizes each weight, rounded to
    x's dtype, as an eager layer holding it would (`_rows`' SCALE_BLOCK -1), so it matches that layer."""
    torch.manual_seed(9)
    N, K, block = 40, 192, (16, 24)
    weight = (torch.randn(N, K) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-N // block[0]), -(-K // block[1])) * 1e-3 + 1e-4
    x = torch.randn(2, K, dtype=DT)
    assert qk._blocks(N, K, qk._fp8_args(scale, *block, block))["SCALE_BLOCK"] == -1
    assert ulps(qk.fp8_gemv(x, weight, scale, block=block), layer(x, dequantize_fp8(weight, scale, block))) <= 1


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_packed_experts_grouped_path_is_their_dequantized_loop(qk, kind, monkeypatch):
    """quant/experts.py's CUDA path (one `moe_plan` for both products, the picks weighted and summed in
    one launch) through the interpreter: the loop over each picked expert's dequantized weights."""
    from omni_cli.quant import experts as experts_mod
    from omni_cli.quant.formats import QuantSpec

    torch.manual_seed(13)
    E, H, I, M, k = 5, 64, 32, 11, 2
    spec = QuantSpec("int4", group_size=32) if kind == "int4" else QuantSpec("fp8", block=(16, 32))
    library = type("Experts", (torch.nn.Module,), {})()
    library.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H) * 0.2)
    library.down_proj = torch.nn.Parameter(torch.randn(E, H, I) * 0.2)
    library.act_fn = torch.nn.SiLU()
    packed = experts_mod.QuantExperts.from_experts(library, spec)
    x = torch.randn(M, H, dtype=DT)
    ids = skewed_ids(M, k, E)
    w = torch.softmax(torch.randn(M, k), -1).to(DT)
    want = packed(x, ids, w)  # the CPU loop: each picked expert dequantized alone
    monkeypatch.setattr(experts_mod, "_kernels_for", lambda x: qk)
    got = packed(x, ids, w)
    assert ulps(got, want) <= 4
    assert ulps(got, packed(x, ids.flip(0), w)) > 8  # a different routing is far off
