"""A mixture-of-experts layer's experts over packed weights (`QuantExperts`), in place of the library's
experts module (transformers 5 keeps them fused: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]).

What it knows:
- A bank is E packed weights of one shape and spec stacked along a leading dim (`formats.PackedWeight` with
  qweight [E, N, K/8] / [E, N, K], scales and zeros [E, ...]): the layout the picked-expert kernels read.
  The buffers keep their bits in integer dtypes, as `QuantLinear`'s do (linear.py says why).
- `forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])` is the library's experts call (the
  sparse block routes, then calls its experts): each expert some token picked is dequantized alone (one
  expert's weights at a time, never the bank) and applied to its tokens, summed as the library sums them.
  That is the prefill's path on a CPU; on CUDA the prompt's picks go through the grouped products
  (`quant_kernels.int4_moe_mm` / `fp8_moe_mm`: sorted by expert on the device, no host sync). A one-token
  decode step reads the banks through `runtime/fused.py`, which sends them to the picked-expert kernels.
- `from_experts` quantizes the library's module round-to-nearest, expert by expert.

What it does not know: routing (the sparse block's router, kept in full precision), the shared expert (plain
linears: `QuantLinear`), checkpoint names (the loader stacks per-expert tensors with `from_packed`), kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .formats import PackedWeight, QuantSpec
from .linear import as_bits, quantize_weight

PARTS = ("gate_up", "down")


class QuantExperts(nn.Module):
    """E experts, each SiLU(x Wg^T) * (x Wu^T) then W_down, with the weights packed (module docstring)."""

    def __init__(self, gate_up: Sequence[PackedWeight], down: Sequence[PackedWeight], act_fn: nn.Module) -> None:
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"{len(gate_up)} gate/up weights and {len(down)} down weights")
        self.num_experts = len(gate_up)
        self.act_fn = act_fn
        self.meta: dict[str, tuple[QuantSpec, tuple[int, int], torch.dtype, torch.dtype]] = {}
        for part, weights in zip(PARTS, (gate_up, down)):
            first = weights[0]
            if any(w.spec != first.spec or w.shape != first.shape for w in weights):
                raise ValueError(f"the experts' {part} weights differ in spec or shape")
            self.meta[part] = (first.spec, first.shape, first.qweight.dtype, first.scales.dtype)
            self.register_buffer(f"{part}_qweight", as_bits(torch.stack([w.qweight for w in weights])))
            self.register_buffer(f"{part}_scales", as_bits(torch.stack([w.scales for w in weights])))
            zeros = None if first.zeros is None else torch.stack([w.zeros for w in weights])
            self.register_buffer(f"{part}_zeros", zeros)

    @classmethod
    def from_experts(cls, experts: nn.Module, spec: QuantSpec) -> QuantExperts:
        """Round-to-nearest `spec` of the library's experts module, one expert at a time (on its device)."""
        gate_up = [quantize_weight(w, spec) for w in experts.gate_up_proj.detach()]
        down = [quantize_weight(w, spec) for w in experts.down_proj.detach()]
        return cls(gate_up, down, experts.act_fn)

    def bank(self, part: str) -> PackedWeight:
        """The experts' `part` ("gate_up" or "down") as one PackedWeight with a leading expert dim."""
        spec, shape, qdtype, sdtype = self.meta[part]
        qweight, scales = getattr(self, f"{part}_qweight"), getattr(self, f"{part}_scales")
        if qweight.dtype != qdtype:
            qweight = qweight.view(qdtype)
        if scales.dtype != sdtype:
            scales = scales.view(sdtype)
        return PackedWeight(spec, shape, qweight, scales, getattr(self, f"{part}_zeros"))

    def expert(self, part: str, e: int) -> PackedWeight:
        bank = self.bank(part)
        zeros = None if bank.zeros is None else bank.zeros[e]
        return PackedWeight(bank.spec, bank.shape, bank.qweight[e], bank.scales[e], zeros)

    @property
    def weight_bytes(self) -> int:
        return sum(self.bank(part).nbytes for part in PARTS)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        kernels = _kernels_for(hidden)
        if kernels is not None:
            return self._grouped(kernels, hidden, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden)
        with torch.no_grad():  # which experts any token picked: a host sync, as in the library's loop
            hit = torch.unique(top_k_index).tolist()
        for e in hit:
            token, pick = torch.where(top_k_index == e)
            x = hidden[token]
            gate, up = F.linear(x, self.expert("gate_up", e).dequantize(x.dtype)).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.expert("down", e).dequantize(x.dtype))
            out.index_add_(0, token, (y * top_k_weights[token, pick, None]).to(out.dtype))
        return out

    def _grouped(self, kernels, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        """CUDA: every token's picked experts in two launches (gate/up, then down with the SiLU gate), the
        picks sorted by expert on the device: no host sync, so a prefill's CUDA graph captures it."""
        gate_up, down = self.bank("gate_up"), self.bank("down")
        plan = kernels.moe_plan(top_k_index, self.num_experts)  # one sort of the picks for both products
        if gate_up.spec.kind == "int4":
            def product(x, bank, gate):
                g = bank.shape[1] if bank.spec.group_size is None else bank.spec.group_size
                return kernels.int4_moe_mm(x, bank.qweight, bank.scales, top_k_index, bank.zeros, group_size=g,
                                           gate=gate, plan=plan)
        else:
            def product(x, bank, gate):
                return kernels.fp8_moe_mm(x, bank.qweight, bank.scales, top_k_index, block=bank.spec.block, gate=gate,
                                          plan=plan)
        picks = product(product(hidden, gate_up, False), down, True)  # [T*k, H] in pick order
        from ..runtime.moe_kernels import weighted_sum  # one launch: the weights and the sum of each token's picks

        return weighted_sum(picks, top_k_weights.to(picks.dtype))

    def extra_repr(self) -> str:
        spec, shape = self.meta["gate_up"][:2]
        return f"num_experts={self.num_experts}, gate_up={list(shape)}, down={list(self.meta['down'][1])}, spec={spec}"


def _kernels_for(x: torch.Tensor):
    """runtime/quant_kernels.py where a one-token product may run there (CUDA with triton), else None."""
    if x.device.type != "cuda" or torch.version.hip is not None:
        return None
    try:
        from ..runtime import quant_kernels
    except ImportError:
        return None
    return quant_kernels


def picked_product(bank: PackedWeight, x: torch.Tensor, idx: torch.Tensor, *, weights: torch.Tensor | None = None,
                   gate: bool = False) -> torch.Tensor:
    """Expert idx[p]'s weight of `bank` times input p for each pick p of idx [k] (as `kernels.picked_gemv`):
    x is one row [K] for every pick or one row per pick [k, K] (with `gate`, [k, 2K]: SiLU(gate) * up).
    Returns [k, N]; with `weights` [k], the picks scaled and summed, [N]. On CUDA the picked-expert kernels
    read only the picked experts' packed rows, idx staying on the device; elsewhere the picked experts are
    dequantized (k weights, not the bank) and multiplied."""
    kernels = _kernels_for(x)
    if kernels is not None:
        if bank.spec.kind == "int4":
            g = bank.shape[1] if bank.spec.group_size is None else bank.spec.group_size
            return kernels.int4_picked_gemv(x, bank.qweight, bank.scales, idx, bank.zeros, group_size=g,
                                            weights=weights, gate=gate)
        return kernels.fp8_picked_gemv(x, bank.qweight, bank.scales, idx, block=bank.spec.block,
                                       weights=weights, gate=gate)
    zeros = None if bank.zeros is None else bank.zeros[idx]
    w = PackedWeight(bank.spec, bank.shape, bank.qweight[idx], bank.scales[idx], zeros).dequantize(x.dtype)
    if gate:
        half = x.shape[-1] // 2
        x = F.silu(x[..., :half]) * x[..., half:]
    y = torch.matmul(w, x.expand(idx.numel(), -1).unsqueeze(-1)).squeeze(-1)  # [k, N]
    return y if weights is None else (y * weights.unsqueeze(-1)).sum(0)
