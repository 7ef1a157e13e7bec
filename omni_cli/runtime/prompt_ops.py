"""What the engine's forwards of a prompt (runtime/decoder.py: prefills, a kept conversation's rests, their
CUDA graphs) run in place of three of the library's pieces on a GPU: a MoE layer's routed experts, the
RMSNorm, and the rotary embedding. The decode steps have their own (runtime/fused.py); these are the same
ideas for many rows.

- **Routed experts** (`routed`): transformers' "grouped_mm" experts (the default on a GPU) sort the picks
  by expert, gather their rows, run two grouped products (torch's grouped_mm), and between and after them
  SiLU over the strided gate half, the weights applied to a copy of every pick's row, the rows put back in
  pick order, and a reduction: on an H100, a 2,500-token Qwen3-Omni prompt, 0.56 ms of products and 0.9 ms
  of the rest a layer. Here the products are the same calls and the rest is two launches of
  runtime/moe_kernels.py, with the library's rounding (the hidden state came out bit-identical).
- **RMSNorm**: the library's is seven kernels (float32 copy, square, mean, rsqrt, scale, cast, weight);
  torch's fused `rms_norm` is one (`fused.rms_norm`, as the decode steps use it). Four norms a layer
  (Qwen3-Omni's per-head q and k norms too): at 60 rows that is ~1,300 launches of a prompt's ~3,800. It
  scales before casting back, so a value can differ from the library's in the last bit (a 2,500-token
  Qwen3-Omni prompt's hidden state: at most 0.125 on values up to 3.8, bfloat16). On an H100 it took that
  prompt's thinker prefill from 80.7 to 65.1 ms of device time (74.4 to 61.2 ms of kernels, 4,631 to
  3,287 launches); 60 tokens, 15.7 to 13.0 ms of kernels.

- **Rotary embedding**: the library's q * cos + rotate_half(q) * sin is five kernels for q and
  five for k; runtime/rope_kernel.py is one launch each, written with the library's roundings (the same
  values through Triton's interpreter and, compiled without FP fusion, on an H100: rope_kernel.py).
  On that H100 prompt, 65.0 to 56.8 ms of device time. The attention calls its modeling module's
  `apply_rotary_pos_emb`, so that name is what `install` wraps (once per module, for every caller).

- **Attention of a long prompt's graph** (`cudnn_attention`): SDPA picks flash attention for a prompt's
  causal attention, and cuDNN's is left out of a prompt's forwards (decoder.py `no_cudnn_attention`: it
  builds a plan for every new length, on the thread that runs it). A graph of a long prompt from an empty
  cache (`graphs.PrefillGraphs`, over 512 rows, captured between turns) has one length and is replayed
  without cuDNN being asked again: there cuDNN's kernel runs, called directly (no process-wide switch,
  which other threads read). On an H100, 2,560 rows at Qwen3-Omni's widths (32 query heads, 4 key heads,
  128 wide, bfloat16, in a graph): 118 µs against flash's 228 (`scripts/attn_backends.py`; at 512 rows 13
  against 20, at 64 rows slower: 7.5 against 6.3). The values differ from flash's in the last bits.

`install(layers)` gives a stack's library modules of those kinds a forward that takes ours while the calling
thread is `inside` (decoder.py runs every stack of the engine there) and the call can run it (a CUDA
tensor; the experts also want bfloat16, more than one row, triton and torch's grouped_mm), else the
library's own forward. `fused.FusedDecoder` installs them on its stack where the policy has the kernels on
(`RuntimeOptions.kernels`: `--no-kernels` / OMNI_NO_KERNELS=1 leave a prompt to the library's modules
too). transformers' `generate` on the same model (the tests' reference) runs outside, so it keeps the
library's modules. `EXPERTS` / `NORMS` / `ROPE` turn each on or off for a process
(scripts/prefill_profile.py's comparisons).

What it does not know: the routing (the library's router runs before the experts), a shared expert (the
sparse block adds it), packed banks (quant/experts.py has grouped kernels of its own), biased, transposed or
interleaved expert layouts, norms other than the Qwen RMSNorm, rotary forms other than the plain one (cos
and sin cut in sections inside it, as older library versions did): those are left to the library.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
import types

import torch
import torch.nn.functional as F

from .fused import kernels_wanted, rms_norm

EXPERTS = True  # the routed experts
NORMS = True  # the fused RMSNorm (module docstring: measured on an H100)
ROPE = True  # the rotary embedding in one launch (runtime/rope_kernel.py)
ATTENTION = True  # cuDNN's attention inside `cudnn_attention` blocks (a long prompt's graph)

_here = threading.local()  # .depth: `inside` blocks the calling thread is in; .cudnn: `cudnn_attention` blocks
_cudnn_refused: list[str] = []  # why cuDNN's attention failed once in this process (then never asked again)
log = logging.getLogger(__name__)


def routed(gate_up: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor, top_k_index: torch.Tensor,
           top_k_weights: torch.Tensor, kernels=None) -> torch.Tensor:
    """Token t's output sum_j w[t, j] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)) over its picks e = ids[t, j],
    [T, H] (hidden [T, H], ids and weights [T, k]; the library's fused expert tensors gate_up [E, 2I, H],
    down [E, H, I]), with no host sync (a prefill's CUDA graph captures it). `kernels`:
    runtime/moe_kernels.py or a stand-in with its functions (the tests' interpreted copy)."""
    if kernels is None:
        from . import moe_kernels as kernels  # needs triton: `_routed_runs_here` found it
    E = gate_up.shape[0]
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = kernels.expert_order(flat, E)  # the picks in expert order
    ends = torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
    rows = hidden.index_select(0, order // k)  # [P, H], each pick's token row, in expert order
    h = _grouped_mm(rows, gate_up.transpose(1, 2), ends)  # [P, 2I]: gate | up
    y = _grouped_mm(kernels.silu_mul(h), down.transpose(1, 2), ends)  # [P, H]
    at = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return kernels.weighted_sum(y, top_k_weights, at)  # pick p's row of y is at[p]


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [P, K] times w [E, K, N] by runs of rows ending at offs [E] (int32): torch's grouped product."""
    grouped = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return grouped(x, w, offs=offs)


@contextlib.contextmanager
def inside():
    """The calling thread's installed modules take our forms (where a call can) until the block ends."""
    _here.depth = getattr(_here, "depth", 0) + 1
    try:
        yield
    finally:
        _here.depth -= 1


@contextlib.contextmanager
def cudnn_attention(enabled: bool = True):
    """`enabled`: the calling thread's causal prompt attention takes cuDNN's kernel until the block ends,
    where a call can (`_cudnn_runs_here`). For forwards of one fixed length that are captured as a graph:
    the plan is built once, by the warm-up forwards before the capture."""
    if not enabled:
        yield
        return
    _here.cudnn = getattr(_here, "cudnn", 0) + 1
    try:
        yield
    finally:
        _here.cudnn -= 1


def install(layers) -> None:
    """Give the library's experts and RMSNorm modules of `layers` (a decoder stack) the dispatching forward,
    once; and transformers' "sdpa" attention the one that takes cuDNN's in `cudnn_attention` blocks."""
    _dispatch_attention()
    if getattr(layers, "_omni_prompt_ops", False):
        return
    for module in layers.modules():
        if "forward" in vars(module):
            continue
        if _library_experts(module):
            module.forward = types.MethodType(_experts_forward, module)
        elif _library_norm(module):
            module.forward = types.MethodType(_norm_forward, module)
        if hasattr(module, "q_proj"):
            _dispatch_rope(sys.modules.get(type(module).__module__))
    layers._omni_prompt_ops = True


def _dispatch_rope(modeling) -> None:
    """The attention of a modeling module calls its module's `apply_rotary_pos_emb(q, k, cos, sin,
    unsqueeze_dim=1)` (both families' thinker and talker layers in transformers 5.17 and 5.25: their
    M-RoPE sections are merged into cos and sin before the layers): that name, once, becomes a function
    that takes `rope_kernel.rope` inside the engine's forwards where it can run and the library's function
    everywhere else (Qwen2.5-Omni's DiT calls it too, on the vocoder's thread), with the same arguments."""
    library = getattr(modeling, "apply_rotary_pos_emb", None)
    if library is None or getattr(library, "_omni_library", None) is not None or not _plain_rope(library):
        return

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if ROPE and unsqueeze_dim == 1 and _inside() and _rope_runs_here(q, k, cos, sin):
            from . import rope_kernel  # needs triton: `kernels_wanted` found it
            return rope_kernel.rope(q, cos, sin), rope_kernel.rope(k, cos, sin)
        return library(q, k, cos, sin, unsqueeze_dim)

    setattr(apply_rotary_pos_emb, "_omni_library", library)  # the library's, for the tests and a second install
    apply_rotary_pos_emb.__doc__ = library.__doc__
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb


def _dispatch_attention() -> None:
    """transformers' registered "sdpa" attention function becomes, once, one that runs cuDNN's attention
    where the calling thread is in a `cudnn_attention` block and the call can (`_cudnn_runs_here`: a
    causal prompt from an empty cache), and the library's function everywhere else, with the same
    arguments. The layers look the function up by name at each call, so every model in the process sees
    it; outside those blocks it is the library's."""
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # pragma: no cover - the library moved it: its own attention stays
        return
    library = AttentionInterface._global_mapping.get("sdpa")
    if library is None or getattr(library, "_omni_library", None) is not None:
        return

    def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, **kwargs):
        if (ATTENTION and getattr(_here, "cudnn", 0) > 0 and not _cudnn_refused and not kwargs.get("softcap")
                and kwargs.get("position_bias") is None
                and _cudnn_runs_here(module, query, key, value, attention_mask, dropout, is_causal)):
            try:
                return _cudnn_sdpa(query, key, value, scaling).transpose(1, 2).contiguous(), None  # [B, L, H, D]
            except RuntimeError as exc:  # a cuDNN or GPU without this kernel: flash's, from now on
                # (the warm-up forwards before a capture meet this first: a capture never sees it)
                _cudnn_refused.append(str(exc))
                log.warning("cuDNN's attention failed (%.200s); prompts keep flash attention", exc)
        return library(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)

    setattr(sdpa_attention_forward, "_omni_library", library)
    sdpa_attention_forward.__doc__ = library.__doc__
    AttentionInterface._global_mapping["sdpa"] = sdpa_attention_forward


def _cudnn_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention [B, H, L, D] by cuDNN's kernel, called directly: SDPA's choice of kernel reads
    process-wide switches (decoder.py turns cuDNN's off around every prompt); this reads none. Key heads
    may be fewer than the query's (grouped), as SDPA's `enable_gqa` passes them to it."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, None, False, 0.0, True, False,
                                                              scale=scale)[0]


def _cudnn_runs_here(module, query, key, value, mask, dropout, is_causal) -> bool:
    """Where cuDNN's kernel gives what the library's call would: the causal attention of a prompt from an
    empty cache (no mask, as many keys as queries, more than one row, no dropout, a causal module), on
    CUDA in bfloat16 or float16, heads at most 128 wide and a multiple of 8, whole groups of query heads,
    where the GPU and cuDNN have the kernel."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not (causal and mask is None and dropout == 0.0 and query.dim() == 4 and key.dim() == 4):
        return False
    B, H, L, D = query.shape
    return (query.is_cuda and L > 1 and key.shape[2] == L and value.shape == key.shape and key.shape[0] == B
            and key.shape[3] == D and H % key.shape[1] == 0 and D % 8 == 0 and D <= 128
            and query.dtype in (torch.bfloat16, torch.float16) and query.dtype == key.dtype == value.dtype
            and _cudnn_attention_exists(query.device))


@functools.cache
def _cudnn_attention_exists(device: torch.device) -> bool:
    """cuDNN's fused attention: cuDNN 9 or later, on an Ampere GPU or newer (what torch's own choice asks)."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return bool(version and version >= 90000 and torch.cuda.get_device_capability(device) >= (8, 0))


def _plain_rope(fn) -> bool:
    """The library's plain form: (q, k, cos, sin, unsqueeze_dim=1), cos and sin already per position. From
    5.2x the name holds a module made of the function (`use_kernel_forward_from_hub`): its forward's."""
    try:
        params = list(inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn).parameters)
    except (TypeError, ValueError):
        return False
    return params == ["q", "k", "cos", "sin", "unsqueeze_dim"]


def _library_experts(module) -> bool:
    """transformers' fused experts with the layout `routed` computes: [gate; up] rows, no bias, SiLU."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and getattr(module, "is_concatenated", True)
            and not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False)
            and not getattr(module, "_is_expert_parallel", False)
            and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))


def _library_norm(module) -> bool:
    """A Qwen decoder's RMSNorm (weight * normalised x, float32 statistics): the classes `fused.rms_norm`
    reproduces."""
    name = type(module).__name__
    return (name.startswith("Qwen") and name.endswith("RMSNorm") and isinstance(getattr(module, "weight", None),
            torch.Tensor) and isinstance(getattr(module, "variance_epsilon", None), float))


def _inside() -> bool:
    return getattr(_here, "depth", 0) > 0


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    if EXPERTS and _inside() and hidden_states.shape[0] > 1 and _routed_runs_here(hidden_states, self.gate_up_proj):
        return routed(self.gate_up_proj, self.down_proj, hidden_states, top_k_index, top_k_weights)
    return type(self).forward(self, hidden_states, top_k_index, top_k_weights)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if NORMS and _inside() and _norm_runs_here(hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def _rope_runs_here(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Where `rope_kernel.rope` can run: a CUDA device with the decode kernels (`fused.kernels_wanted`), q
    and k [B, H, L, D] with the last dimension contiguous, cos and sin [B, L, D], one dtype."""
    if q.dim() != 4 or k.dim() != 4 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    B, _, L, D = q.shape
    return (cos.shape == sin.shape == (B, L, D) and k.shape[0] == B and k.shape[2:] == (L, D)
            and q.dtype == k.dtype == cos.dtype == sin.dtype and q.is_cuda and kernels_wanted(q.device))


def _norm_runs_here(hidden: torch.Tensor) -> bool:
    return hidden.is_cuda  # on a CPU `fused.rms_norm` is the library's math anyway


def _routed_runs_here(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where `routed` can run: where the decode kernels can (`fused.kernels_wanted`: NVIDIA's CUDA with
    triton), with torch's grouped product, in bfloat16 (the dtype torch's CUDA grouped_mm takes)."""
    return (hidden.dtype == torch.bfloat16 and weight.dtype == hidden.dtype
            and (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")) and kernels_wanted(hidden.device))
