"""A linear layer over a packed weight (`QuantLinear`), and the swap of a module's nn.Linear layers for it
(`quantize_linears`).

What it knows:
- `QuantLinear` keeps a `formats.PackedWeight`'s tensors as buffers, so `.to(device)` moves them and
  `state_dict()` saves them. `nn.Module.to(dtype)` / `.half()` cast every floating-point tensor of a
  module, and float8_e4m3fn counts as floating point (integer tensors are left alone); so that a module
  cast cannot turn fp8 codes or scales into float16, those two buffers hold their *bits* in an integer
  dtype of the same width (float8 -> uint8, 16-bit -> int16, float32 -> int32), and `packed` views them
  back. int4 codes (int32) and zero points (uint8) are integers already. The bias is an ordinary
  parameter and follows the module's dtype.
- `forward(x)`: on CUDA with at most `KERNEL_ROWS` rows (a decode step), the batch-1 Triton kernels of
  `runtime.quant_kernels` (int4_gemv / fp8_gemv) where their shape rules hold; with more rows (a
  prefill), its tile-by-tile products (int4_mm / fp8_mm); otherwise (CPU, a shape the kernels refuse)
  the reference path: the weight dequantized to x's dtype (`formats.dequantize`) and `F.linear`, which
  materializes the whole weight for the call.
- `step(x, norm=, eps=, gate=, residual=)`: a plain decode step's product with its norm, gate or residual
  inside the same kernel (`runtime.fused.gemv` calls it), or None where the kernels do not take x.
- `quantize_linears(module, spec, skip)` quantizes round-to-nearest, one layer at a time.

What it does not know: loading a checkpoint's packed tensors into these buffers (the loader, with `formats.from_*`), which layers a
family keeps in full precision (the caller's `skip`), tensor parallelism, and activation quantization.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .formats import PackedWeight, QuantSpec, quantize_fp8, quantize_int4

KERNEL_ROWS = 2  # at most this many rows go to the matrix-vector kernels; more are a prefill

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # a float's bits kept in an integer of its width


def as_bits(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    return t.contiguous().view(_BITS[t.element_size()])


def quantize_weight(weight: torch.Tensor, spec: QuantSpec) -> PackedWeight:
    """Round-to-nearest `spec` of a float weight [N, K], on the device it is on."""
    scale_dtype = getattr(torch, spec.scale_dtype)
    if spec.kind == "int4":
        return quantize_int4(weight, spec.group_size, spec.symmetric, scale_dtype)
    return quantize_fp8(weight, spec.block, scale_dtype)


class QuantLinear(nn.Module):
    """y = x W^T + b with W a packed weight [N, K] (see the module's docstring for its buffers)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.spec: QuantSpec = packed.spec
        self.out_features, self.in_features = packed.shape
        self.qweight_dtype = packed.qweight.dtype
        self.scales_dtype = packed.scales.dtype
        self.register_buffer("qweight", as_bits(packed.qweight))
        self.register_buffer("scales", as_bits(packed.scales))
        self.register_buffer("zeros", packed.zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.kernel = "auto"  # "auto": CUDA and <= KERNEL_ROWS rows; "on": wherever the shapes allow; "off"

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: QuantSpec) -> QuantLinear:
        """Round-to-nearest `spec` of `linear`'s weight (on the device it is on); the bias is kept as is."""
        return cls(quantize_weight(linear.weight.detach(), spec), linear.bias)

    @property
    def packed(self) -> PackedWeight:
        """The weight as a PackedWeight (views of the buffers, in their true dtypes)."""
        qweight = self.qweight if self.qweight.dtype == self.qweight_dtype else self.qweight.view(self.qweight_dtype)
        scales = self.scales if self.scales.dtype == self.scales_dtype else self.scales.view(self.scales_dtype)
        return PackedWeight(self.spec, (self.out_features, self.in_features), qweight, scales, self.zeros)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the packed weight's tensors (the bias not counted)."""
        return self.packed.nbytes

    def _group_size(self) -> int:
        return self.in_features if self.spec.group_size is None else self.spec.group_size

    def _kernel_fits(self, x: torch.Tensor) -> bool:
        if self.kernel == "off" or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
        if self.kernel == "auto" and (x.device.type != "cuda" or x.numel() // max(x.shape[-1], 1) > KERNEL_ROWS):
            return False
        if self.spec.kind == "int4":
            g = self._group_size()
            return self.in_features % 8 == 0 and g % 8 == 0
        return True

    def _prefill_kernel_fits(self, x: torch.Tensor) -> bool:
        """CUDA, more than KERNEL_ROWS rows, kernels "auto", and the int4 shape rules (`_kernel_fits`)."""
        if self.kernel != "auto" or x.device.type != "cuda" or x.numel() // max(x.shape[-1], 1) <= KERNEL_ROWS:
            return False
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
        return self.spec.kind != "int4" or (self.in_features % 8 == 0 and self._group_size() % 8 == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if self._prefill_kernel_fits(x):
            # a prompt's many rows: weight tiles dequantized in registers (tl.dot), never the whole
            # matrix, and no host sync: the prefill's CUDA graphs capture it
            from ..runtime import quant_kernels

            rows = x.reshape(-1, x.shape[-1])
            if self.spec.kind == "int4":
                y = quant_kernels.int4_mm(rows, packed.qweight, packed.scales, packed.zeros, group_size=self._group_size())
            else:
                y = quant_kernels.fp8_mm(rows, packed.qweight, packed.scales, block=self.spec.block)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if self._kernel_fits(x):
            # needs triton: imported only when a kernel runs
            from ..runtime import quant_kernels

            if self.spec.kind == "int4":
                y = quant_kernels.int4_gemv(x, packed.qweight, packed.scales, packed.zeros,
                                            group_size=self._group_size())
            else:
                y = quant_kernels.fp8_gemv(x, packed.qweight, packed.scales, block=self.spec.block)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        # the reference path: the whole weight dequantized to x's dtype
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, packed.dequantize(x.dtype), bias)

    def step(self, x: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0, gate: bool = False,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """A decode step's product with what sits around it in one launch (`runtime.fused.gemv`'s arguments:
        x's RMSNorm with `norm` first, or SiLU(gate) * up of a [gate | up] x; `residual` added after), where
        the batch-1 kernels take x; None where they do not (the caller does it in steps), or where a bias
        would have to come between the product and the residual."""
        if not self._kernel_fits(x) or (self.bias is not None and residual is not None):
            return None
        from ..runtime import quant_kernels

        packed = self.packed
        if self.spec.kind == "int4":
            y = quant_kernels.int4_gemv(x, packed.qweight, packed.scales, packed.zeros, group_size=self._group_size(),
                                        gate=gate, norm=norm, eps=eps, residual=residual)
        else:
            y = quant_kernels.fp8_gemv(x, packed.qweight, packed.scales, block=self.spec.block, gate=gate, norm=norm,
                                       eps=eps, residual=residual)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, spec={self.spec}"


@dataclass
class Replaced:
    """What `quantize_linears` did: the qualified names replaced, and their weights' bytes before and after
    (biases, unchanged, not counted)."""

    names: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0


def quantize_linears(module: nn.Module, spec: QuantSpec, skip: Callable[[str], bool]) -> Replaced:
    """Replace each nn.Linear inside `module` whose qualified name `skip` does not exclude by a QuantLinear
    of `spec`, one layer at a time (the old weight is released before the next is quantized, so the peak is
    one layer's extra). A Linear registered under several names is quantized once, under its first name,
    and every name gets the same QuantLinear (the names listed are those of the first registration); it is
    kept whole if `skip` excludes any of its names. `module` itself is never replaced. Subclasses of
    nn.Linear count as Linear: a layer whose `.weight` its owner reads directly (nn.MultiheadAttention's
    out_proj) must be excluded by `skip`."""
    names: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        if name and isinstance(sub, nn.Linear):
            names.setdefault(id(sub), []).append(name)
    order = [group for group in names.values() if not any(skip(n) for n in group)]
    del names
    done = Replaced()
    for group in order:
        linear = module.get_submodule(group[0])
        assert isinstance(linear, nn.Linear)
        done.bytes_before += linear.weight.numel() * linear.weight.element_size()
        quantized = QuantLinear.from_linear(linear, spec)
        del linear
        for name in group:
            parent_name, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent_name), child, quantized)
        done.names.append(group[0])
        done.bytes_after += quantized.weight_bytes
    return done


def fuse_quant_rows(linears: list[QuantLinear]) -> QuantLinear | None:
    """One QuantLinear whose outputs are `linears`' outputs side by side (q | k | v, gate | up), with each
    part re-pointed at its rows of the fused buffers, so that the parts (the library's prefill) and the
    fused step share one copy. None where they cannot share one: differing specs or inputs, or FP8 blocks
    that a part's rows do not fill. A second call on the same parts returns the first's result."""
    first = linears[0]
    done = getattr(first, "fused_into", None)
    if done is not None and all(getattr(m, "fused_into", None) is done for m in linears):
        return done
    spec = first.spec
    if any(m.spec != spec or m.in_features != first.in_features for m in linears):
        return None
    if any((m.bias is None) != (first.bias is None) for m in linears):
        return None
    block_rows = spec.block[0] if spec.kind == "fp8" and spec.block is not None else 1
    if any(m.out_features % block_rows for m in linears[:-1]):
        return None
    parts = [m.packed for m in linears]
    zeros = None if parts[0].zeros is None else torch.cat([p.zeros for p in parts])
    n = sum(m.out_features for m in linears)
    packed = PackedWeight(spec, (n, first.in_features), torch.cat([p.qweight for p in parts]),
                          torch.cat([p.scales for p in parts]), zeros)
    bias = None if first.bias is None else torch.cat([m.bias.data for m in linears if m.bias is not None])
    fused = QuantLinear(packed, bias)
    del parts, packed
    row = 0
    for m in linears:
        rows = slice(row, row + m.out_features)
        scale_rows = rows if block_rows == 1 else slice(row // block_rows, -(-(row + m.out_features) // block_rows))
        m.qweight = fused.qweight[rows]
        m.scales = fused.scales[scale_rows]
        if fused.zeros is not None:
            m.zeros = fused.zeros[rows]
        if fused.bias is not None and m.bias is not None:
            m.bias.data = fused.bias.data[rows]
        object.__setattr__(m, "fused_into", fused)  # a plain attribute: not a submodule (no second state_dict entry)
        row += m.out_features
    return fused
