"""Packed weights in memory: one canonical layout per kind, quantized round-to-nearest, unpacked from the
on-disk layouts of the checkpoints people download, and dequantized back (the reference every kernel is
tested against).

The canonical layout (a weight W of nn.Linear's shape [N, K]: N outputs, K inputs), chosen for a batch-1
matrix-vector kernel that walks one output row along K:

- int4: `qweight` int32 [N, ceil(K/8)], word c of row n holding W[n, 8c + j] in bits 4j..4j+3 (j = 0..7,
  little end first) as an unsigned code u in 0..15; `scales` [N, K/g] (g = K for one scale per output
  channel) in the checkpoint's scale dtype; `zeros` uint8 [N, K/g] or None (symmetric: zero point 8).
  W[n, k] = (u - z) * s of k's group. (This is compressed-tensors' `pack-quantized` layout for 4 bits, so
  those tensors are taken as they are; GPTQ's is its transpose.)
- fp8: `qweight` float8_e4m3fn [N, K]; `scales` [N, 1] (per output channel) or one per block of
  `spec.block` = (rows, cols), [ceil(N/rows), ceil(K/cols)]. W = q * s (a block FP8 checkpoint's
  `weight_scale_inv` is this multiplier, despite its name).

Facts on the on-disk layouts, read from the formats' own code (compressed-tensors 0.20's pack_quantized
compressor and forward.py; AutoAWQ's / gptqmodel's pack and unpack helpers; transformers' fine-grained FP8):
GPTQ `qweight` int32 [K/8, N] packs 8 rows of K per word, nibble j = row 8r+j; `qzeros` int32 [K/g, N/8]
packs along N; `scales` [K/g, N]; `g_idx` [K] is each input row's group; the v1 format ("gptq") stores
each zero point minus one, v2 ("gptq_v2") stores it as is. AWQ GEMM `qweight` int32 [K, N/8] packs along N
with nibble i holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; `qzeros` [K/g, N/8] likewise, zero points as
they are; `scales` [K/g, N]. compressed-tensors stores signed codes q in -8..7 as q + 8, element i of a
row at bit 4i; its zero point is signed as well and packed along N (dim 0): [ceil(N/8), K/g].

What it does not know: which layers are quantized or how a checkpoint names them (the loader), kernels,
act-order GPTQ (a g_idx other than k // g is refused), bit widths other than 4 (int) and 8 (e4m3),
e5m2, NVFP4/MXFP4, and activation quantization (activations stay in the model's dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import ModelError

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SYMMETRIC_ZERO = 8  # the zero point of a symmetric int4 code (codes 0..15 stand for -8..7)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds column 8c + AWQ_ORDER[i]


@dataclass(frozen=True)
class QuantSpec:
    """What a packed weight is, without its tensors."""

    kind: Literal["int4", "fp8"]  # 4-bit integer codes with group scales, or float8 e4m3 with scales
    group_size: int | None = None  # int4: inputs sharing one scale (a divisor of K); None: one per output row
    symmetric: bool = True  # int4: zero point fixed at 8; False: a zero point per group. fp8: always True
    block: tuple[int, int] | None = None  # fp8: (rows, cols) of a block sharing a scale; None: one per row
    scale_dtype: str = "float32"  # the torch dtype the scales are kept in, by name ("bfloat16", ...)

    def __post_init__(self) -> None:
        if self.kind not in ("int4", "fp8"):
            raise ValueError(f"unknown kind {self.kind!r}")
        if self.kind == "int4" and self.block is not None:
            raise ValueError("int4 has group scales, not blocks")
        if self.kind == "fp8" and (self.group_size is not None or not self.symmetric):
            raise ValueError("fp8 has per-row or per-block scales and no zero point")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"group size {self.group_size} is not positive")


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight of shape [N, K] in the canonical layout (see the module's docstring)."""

    spec: QuantSpec
    shape: tuple[int, int]  # (N, K): nn.Linear's (out_features, in_features)
    qweight: torch.Tensor  # int4: int32 [N, ceil(K/8)]; fp8: float8_e4m3fn [N, K]
    scales: torch.Tensor  # int4: [N, K/g]; fp8: [N, 1] or [ceil(N/rows), ceil(K/cols)]
    zeros: torch.Tensor | None = None  # int4 with zero points: uint8 [N, K/g]; else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed tensors together."""
        tensors = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def _fail(what: str) -> ModelError:
    return ModelError(f"quantized weight: {what}")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- int4 packing ---------------------------------------------------------------------------------------


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., K] -> int32 [..., ceil(K/8)], eight a word along the last dim, element 8c + j in
    bits 4j..4j+3 (the last word padded with zeros)."""
    k = codes.shape[-1]
    padded = torch.nn.functional.pad(codes.to(torch.int64), (0, (-k) % 8))
    words = padded.reshape(*codes.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    value = ((words & 0xF) << shifts).sum(-1)
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


def unpack_int4(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """int32 [..., W] -> codes uint8 [..., 8W] (or the first k): the inverse of `pack_int4`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    codes = ((packed.to(torch.int64)[..., None] & 0xFFFFFFFF) >> shifts) & 0xF
    codes = codes.reshape(*packed.shape[:-1], -1).to(torch.uint8)
    return codes if k is None else codes[..., :k]


def pack_int4_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., K] -> uint8 [..., ceil(K/2)], two a byte: element 2c in the low nibble."""
    k = codes.shape[-1]
    padded = torch.nn.functional.pad(codes.to(torch.uint8), (0, k % 2))
    pairs = padded.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_int4_bytes(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """uint8 [..., W] -> codes uint8 [..., 2W] (or the first k): the inverse of `pack_int4_bytes`."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    return codes if k is None else codes[..., :k]


# --- quantize (round to nearest) ------------------------------------------------------------------------


def quantize_int4(weight: torch.Tensor, group_size: int | None = 128, symmetric: bool = True,
                  scale_dtype: torch.dtype = torch.float32) -> PackedWeight:
    """Round-to-nearest int4 of a float [N, K]: per group of `group_size` inputs (None: the whole row).
    Symmetric: s = max|w| / 7.5, codes round(w/s) + 8 clipped to 0..15 (the convention of GPTQ and of
    compressed-tensors). With zero points: s = (max - min) / 15 over a range that holds 0,
    z = round(-min / s), codes round(w/s) + z clipped. Each value is then within s/2 of its dequantized
    value, s being the scale as stored (rounded to `scale_dtype`), save where that rounding made s smaller
    than exact: there the clipped end is off by up to s/2 plus the rounding's share."""
    if weight.dim() != 2:
        raise ValueError(f"a weight is [N, K], not {tuple(weight.shape)}")
    n, k = weight.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"group size {g} does not divide K = {k}")
    w = weight.float().reshape(n, k // g, g)
    if symmetric:
        scale = w.abs().amax(-1) / 7.5
    else:
        low = w.amin(-1).clamp(max=0)
        scale = (w.amax(-1).clamp(min=0) - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype)
    s = scale.float()
    if symmetric:
        zero = torch.full_like(s, SYMMETRIC_ZERO)
    else:
        zero = torch.round(-low / s).clamp(0, 15)
    codes = (torch.round(w / s[..., None]) + zero[..., None]).clamp(0, 15).reshape(n, k)
    spec = QuantSpec("int4", group_size=None if group_size is None else g, symmetric=symmetric,
                     scale_dtype=_dtype_name(scale_dtype))
    zeros = None if symmetric else zero.to(torch.uint8)
    return PackedWeight(spec, (n, k), pack_int4(codes), scale, zeros)


def _expand_blocks(scales: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales [..., ceil(N/rows), ceil(K/cols)] -> one a value [..., N, K]."""
    n, k = shape
    return scales.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :n, :k]


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] | None = (128, 128),
                 scale_dtype: torch.dtype = torch.float32) -> PackedWeight:
    """float8 e4m3 of a float [N, K], scaled so that each block's (None: each row's) largest magnitude is
    448; the cast rounds to nearest. A normal value is then within 2**-4 of itself relatively, a
    subnormal one within s * 2**-10."""
    if weight.dim() != 2:
        raise ValueError(f"a weight is [N, K], not {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.float()
    if block is None:
        amax = w.abs().amax(-1, keepdim=True)
    else:
        rows, cols = math.ceil(n / block[0]), math.ceil(k / block[1])
        padded = torch.nn.functional.pad(w.abs(), (0, cols * block[1] - k, 0, rows * block[0] - n))
        amax = padded.reshape(rows, block[0], cols, block[1]).amax(dim=(1, 3))
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype)
    full = scale.float() if block is None else _expand_blocks(scale.float(), (n, k), block)
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return PackedWeight(QuantSpec("fp8", block=block, scale_dtype=_dtype_name(scale_dtype)), (n, k), q, scale)


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float [..., N, K] a packed weight stands for (a bank of experts keeps its leading dims),
    computed in float32 and then cast to `dtype`."""
    n, k = packed.shape
    spec = packed.spec
    lead = packed.qweight.shape[:-2]
    if spec.kind == "int4":
        groups = packed.scales.shape[-1]
        codes = unpack_int4(packed.qweight, k).float().reshape(*lead, n, groups, k // groups)
        if packed.zeros is not None:
            zero = packed.zeros.to(codes.device).float()[..., None]
        else:
            zero = float(SYMMETRIC_ZERO)  # a Python number: no host-to-device copy (CUDA-graph safe)
        w = (codes - zero) * packed.scales.float()[..., None]
        return w.reshape(*lead, n, k).to(dtype)
    q = packed.qweight.float()
    if spec.block is None:
        return (q * packed.scales.float()).to(dtype)
    return (q * _expand_blocks(packed.scales.float(), (n, k), spec.block)).to(dtype)


# --- the on-disk layouts --------------------------------------------------------------------------------


def _int4_from(n: int, k: int, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None) -> PackedWeight:
    groups = scales.shape[-1]
    if k % groups:
        raise _fail(f"{groups} scale groups do not divide K = {k}")
    g = k // groups
    if zeros is not None and bool((zeros == SYMMETRIC_ZERO).all()):
        zeros = None
    spec = QuantSpec("int4", group_size=None if groups == 1 else g, symmetric=zeros is None,
                     scale_dtype=_dtype_name(scales.dtype))
    return PackedWeight(spec, (n, k), qweight.contiguous(), scales.contiguous(), zeros)


def _group_size(k: int, group_size: int) -> int:
    g = k if group_size <= 0 else group_size  # GPTQ and AWQ write -1 for one group a column
    if k % g:
        raise _fail(f"group size {g} does not divide K = {k}")
    return g


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              group_size: int, v1: bool = True) -> PackedWeight:
    """A GPTQ 4-bit linear: `qweight` int32 [K/8, N], `qzeros` int32 [K/g, N/8], `scales` [K/g, N],
    `g_idx` [K] (or None). `v1`: the "gptq" checkpoint format, zero points stored minus one."""
    k8, n = qweight.shape
    k = k8 * 8
    g = _group_size(k, group_size)
    if tuple(scales.shape) != (k // g, n) or tuple(qzeros.shape) != (k // g, math.ceil(n / 8)):
        raise _fail(f"GPTQ scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not fit qweight "
                    f"{tuple(qweight.shape)} with group size {g}")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64).cpu(), torch.arange(k) // g):
        raise _fail("act-order GPTQ (g_idx other than k // group_size, desc_act) is not supported")
    zeros = unpack_int4(qzeros, n).to(torch.int16) + (1 if v1 else 0)  # v1: 15 + 1 stands for 16
    # qweight's word (r, n) holds rows 8r..8r+7 of column n, nibble j = row 8r+j: its transpose is canonical.
    return _int4_from(n, k, qweight.t(), scales.t(), zeros.t().to(torch.uint8).contiguous())


def _unawq(packed: torch.Tensor, n: int) -> torch.Tensor:
    codes = unpack_int4(packed)  # nibble order
    where = torch.tensor([AWQ_ORDER.index(j) for j in range(8)], device=packed.device)
    return codes.reshape(*packed.shape[:-1], -1, 8)[..., where].reshape(*packed.shape[:-1], -1)[..., :n]


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> PackedWeight:
    """An AWQ GEMM 4-bit linear: `qweight` int32 [K, N/8] in AWQ's interleaved order, `qzeros` int32
    [K/g, N/8] likewise, `scales` [K/g, N]."""
    k = qweight.shape[0]
    n = scales.shape[1]
    g = _group_size(k, group_size)
    if (tuple(qweight.shape) != (k, math.ceil(n / 8)) or tuple(scales.shape) != (k // g, n)
            or tuple(qzeros.shape) != (k // g, math.ceil(n / 8))):
        raise _fail(f"AWQ qweight {tuple(qweight.shape)} / qzeros {tuple(qzeros.shape)} / scales "
                    f"{tuple(scales.shape)} do not fit group size {g}")
    codes = _unawq(qweight, n)  # [K, N]
    zeros = _unawq(qzeros, n)  # [K/g, N]
    return _int4_from(n, k, pack_int4(codes.t()), scales.t(), zeros.t().contiguous())


def from_compressed_tensors_int4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                                 weight_shape: torch.Tensor | tuple[int, int],
                                 weight_zero_point: torch.Tensor | None = None) -> PackedWeight:
    """compressed-tensors `pack-quantized` with 4 bits (group or channel strategy): `weight_packed` int32
    [N, ceil(K/8)], `weight_scale` [N, K/g] ([N, 1] per channel), `weight_shape` (N, K), and
    `weight_zero_point` int32 [ceil(N/8), K/g] when asymmetric."""
    n, k = (int(v) for v in weight_shape)
    groups = weight_scale.shape[-1] if weight_scale.dim() == 2 else 0
    if tuple(weight_packed.shape) != (n, math.ceil(k / 8)) or tuple(weight_scale.shape) != (n, groups):
        raise _fail(f"weight_packed {tuple(weight_packed.shape)} / weight_scale {tuple(weight_scale.shape)} "
                    f"do not fit weight_shape {(n, k)} with 4 bits")
    zeros = None
    if weight_zero_point is not None:
        if tuple(weight_zero_point.shape) != (math.ceil(n / 8), groups):
            raise _fail(f"weight_zero_point {tuple(weight_zero_point.shape)} does not fit {(n, groups)}")
        # packed along N; a signed zero point zp is stored as zp + 8, which is the canonical code itself
        zeros = unpack_int4(weight_zero_point.t().contiguous(), n).t().contiguous()
    return _int4_from(n, k, weight_packed, weight_scale, zeros)


def _fp8_from(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None) -> PackedWeight:
    if weight.dtype != torch.float8_e4m3fn:
        raise _fail(f"an FP8 weight is float8_e4m3fn, not {weight.dtype}")
    n, k = weight.shape
    want = (n, 1) if block is None else (math.ceil(n / block[0]), math.ceil(k / block[1]))
    if tuple(scales.shape) != want:
        raise _fail(f"FP8 scales {tuple(scales.shape)} do not fit weight {(n, k)}: {want} expected")
    spec = QuantSpec("fp8", block=block, scale_dtype=_dtype_name(scales.dtype))
    return PackedWeight(spec, (n, k), weight.contiguous(), scales.contiguous())


def from_fp8_block(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                   block: tuple[int, int] = (128, 128)) -> PackedWeight:
    """Block FP8 as DeepSeek/Qwen write it (`quant_method: fp8`, `weight_block_size`): `weight`
    float8_e4m3fn [N, K] and `weight_scale_inv` [ceil(N/rows), ceil(K/cols)], W = weight * scale_inv."""
    return _fp8_from(weight, weight_scale_inv, tuple(block))  # type: ignore[arg-type]


def from_compressed_tensors_fp8(weight: torch.Tensor, weight_scale: torch.Tensor,
                                strategy: str, block_structure: tuple[int, int] | None = None) -> PackedWeight:
    """compressed-tensors `float-quantized` (8-bit float weights): `weight` float8_e4m3fn [N, K] and
    `weight_scale`: one number (strategy "tensor", made one a row here), [N, 1] ("channel") or
    [ceil(N/rows), ceil(K/cols)] ("block", with the scheme's `block_structure`)."""
    n = weight.shape[0]
    if strategy == "tensor":
        if weight_scale.numel() != 1:
            raise _fail(f"a per-tensor weight_scale has one value, not {weight_scale.numel()}")
        return _fp8_from(weight, weight_scale.reshape(1, 1).expand(n, 1), None)
    if strategy == "channel":
        return _fp8_from(weight, weight_scale.reshape(-1, 1) if weight_scale.dim() == 1 else weight_scale, None)
    if strategy == "block" and block_structure is not None:
        return _fp8_from(weight, weight_scale, (int(block_structure[0]), int(block_structure[1])))
    raise _fail(f"float-quantized strategy {strategy!r} (block structure {block_structure}) is not supported")
