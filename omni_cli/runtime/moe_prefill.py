"""A prompt's routed experts in the engine's own forwards (Qwen3-Omni's thinker and talker MoE layers over
many rows): the library's grouped products, with what sits around them in three launches of ours.

transformers' "grouped_mm" experts (the default on a GPU) sort the picks by expert, gather their rows, run
two grouped products (torch's grouped_mm), and between and after them SiLU over the strided gate half,
the weights applied to a copy of every pick's row, the rows put back in pick order, and a reduction: on an
H100, a 2,500-token prompt, 0.56 ms of products and 0.9 ms of the rest a layer (48 layers: ~43 of the
prefill's 106 ms; `scripts/prefill_profile.py`). Here the products are the same calls, and the rest is
the SiLU gate in one launch and the weighting, the return to pick order and the sum in one more
(runtime/moe_kernels.py).

What it knows:
- `routed(gate_up, down, hidden, top_k_index, top_k_weights)`: the experts' output [T, H] for the library's
  fused expert tensors (gate_up [E, 2I, H], down [E, H, I]); the same rounding as the library's path (each
  pick's weighted row rounded to the activations' dtype, a token's picks summed in float32), with no host
  sync, so a prefill's CUDA graph captures it.
- `install(layers)` and `inside(enabled)`: a stack's library experts modules get a forward that takes
  `routed` while the calling thread is inside (runtime/decoder.py runs every stack of the engine there)
  and the call can run it (CUDA, bfloat16, more than one row, triton, torch's grouped_mm), else the
  library's own forward. transformers' `generate` on the same model (the tests' reference) runs outside,
  so it keeps the library's path. `OMNI_NO_MOE_PREFILL=1` (or `ENABLED = False`) leaves every call to the
  library.

What it does not know: the routing (the library's router runs before it), a shared expert (the sparse
block adds it), packed banks (quant/experts.py has grouped kernels of its own), the one-token decode steps
(runtime/fused.py), biased or transposed or interleaved expert layouts (left to the library).
"""

from __future__ import annotations

import contextlib
import os
import threading
import types

import torch
import torch.nn.functional as F

ENABLED = os.environ.get("OMNI_NO_MOE_PREFILL", "") in ("", "0")

_here = threading.local()  # .depth: how many `inside` blocks the calling thread is in
_kernels = None  # runtime/moe_kernels.py once imported (it needs triton); False where it cannot be


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [P, K] times w [E, K, N] by runs of rows ending at offs [E] (int32): torch's grouped product."""
    grouped = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return grouped(x, w, offs=offs)


def routed(gate_up: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor, top_k_index: torch.Tensor,
           top_k_weights: torch.Tensor, kernels=None) -> torch.Tensor:
    """Token t's output sum_j w[t, j] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)) over its picks e = ids[t, j],
    [T, H] (hidden [T, H], ids and weights [T, k]). `kernels`: runtime/moe_kernels.py or a stand-in with
    its functions (the tests' interpreted copy)."""
    kernels = kernels or _kernel_module()
    E = gate_up.shape[0]
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the picks in expert order
    ends = torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
    rows = hidden.index_select(0, order // k)  # [P, H], each pick's token row, in expert order
    h = _grouped_mm(rows, gate_up.transpose(1, 2), ends)  # [P, 2I]: gate | up
    y = _grouped_mm(kernels.silu_mul(h), down.transpose(1, 2), ends)  # [P, H]
    at = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return kernels.weighted_sum(y, top_k_weights, at)  # pick p's row of y is at[p]


@contextlib.contextmanager
def inside(enabled: bool = True):
    """The calling thread's installed experts take `routed` (where a call can) until the block ends."""
    if not enabled:
        yield
        return
    _here.depth = getattr(_here, "depth", 0) + 1
    try:
        yield
    finally:
        _here.depth -= 1


def install(layers) -> None:
    """Give each library experts module of `layers` (a decoder stack) the dispatching forward, once."""
    if getattr(layers, "_omni_routed", False):
        return
    for layer in layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None and "forward" not in vars(experts) and _library_layout(experts):
            experts.forward = types.MethodType(_forward, experts)
    layers._omni_routed = True


def _library_layout(experts) -> bool:
    """transformers' fused experts with the layout `routed` computes: [gate; up] rows, no bias, SiLU."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and getattr(experts, "is_concatenated", True)
            and not getattr(experts, "is_transposed", False) and not getattr(experts, "has_bias", False)
            and not getattr(experts, "_is_expert_parallel", False)
            and type(getattr(experts, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))


def _forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    if _takes(hidden_states, self.gate_up_proj):
        return routed(self.gate_up_proj, self.down_proj, hidden_states, top_k_index, top_k_weights)
    return type(self).forward(self, hidden_states, top_k_index, top_k_weights)


def _takes(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return ENABLED and getattr(_here, "depth", 0) > 0 and hidden.shape[0] > 1 and _runs_here(hidden, weight)


def _runs_here(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where `routed` can run: NVIDIA's CUDA with triton and torch's grouped product, in bfloat16 (the
    dtype torch's CUDA grouped_mm takes)."""
    return (hidden.is_cuda and torch.version.hip is None and hidden.dtype == torch.bfloat16
            and weight.dtype == hidden.dtype and (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm"))
            and bool(_kernel_module()))


def _kernel_module():
    global _kernels
    if _kernels is None:
        try:
            from . import moe_kernels
        except ImportError:
            _kernels = False
        else:
            _kernels = moe_kernels
    return _kernels
