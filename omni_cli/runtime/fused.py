"""A fixed-shape decode step for a decoder stack of transformers' Qwen layers, ready to be captured as a
CUDA graph: Qwen2 (Qwen2.5-Omni's thinker and talker), Qwen3 dense (Qwen3-Omni's code predictor) and
Qwen3 mixture-of-experts (Qwen3-Omni's thinker and talker, with or without a shared expert).

`FusedDecoder` fuses each layer's q/k/v projections into one matrix and a dense MLP's gate/up into
another, *in place*: the library's `q_proj`, `k_proj`, ... keep working as views into the fused storage,
so the reference-exact prefill path and this decode path share one copy of the weights (no extra memory).
Expert weights are used as the library stores them (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]).

`step(embeds, pos, span)` runs n tokens (n = 1 for a decode step; a few for the code predictor's
prefill): the RoPE angles come from a table (the same float32 math the library does per call), the new
keys/values are written at *device-side* positions, and attention reads the first `span` cache rows (a
host-chosen bucket, so shapes are fixed per bucket) under a mask of the valid ones. A mixture-of-experts
layer routes on the device (softmax, top-k, the experts' rows read by index): no host sync, no Python
branch on a tensor value, no allocation that depends on data.

Where the stack's projections are small (`as_sum`) and the step runs uncompiled on CUDA with Triton,
each layer's projections are `runtime/kernels.py`'s one-launch matrix-vector products with their norm,
gate and residual inside (`kernels`; `RuntimeOptions.kernels`, OMNI_NO_KERNELS=1, turns them off). In those
stacks on CUDA, compiled or not, a one-token attention block (per-head norms, RoPE, the cache write,
attention) is one launch too (`kernels.attend`; `RuntimeOptions.attention_kernel`, OMNI_NO_ATTEND=1, turns
it off). What is on comes from the steps' `graphs.Policy`; nothing here reads the environment.

Packed weights (quant/: `QuantLinear`, `QuantExperts`) go through the same step: a packed q/k/v or gate/up
fuses into one packed layer (`fuse_rows`), a packed layer is called where a weight would be multiplied
(`linear`, `gemv`), and packed expert banks go to `quant.experts.picked_product` (the picked-expert
kernels on CUDA). The format is theirs; this module only tells a tensor from a packed layer.

It does not know which LLM it runs, nor sampling. Its float results can differ from the library's
layer-by-layer path in the last bits (fused matmuls and the experts' reduction order may round
differently); tests compare the tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .graphs import Policy, compile_fn, tracing
from .kv_cache import StaticKVCache


if TYPE_CHECKING:  # pragma: no cover - typing only: read where `kernels_wanted` said True, which set it
    from . import kernels as _kernels
else:
    _kernels = None  # runtime/kernels.py once `kernels_wanted` has imported it (it needs triton)


def kernels_wanted(device: torch.device) -> bool:
    """`runtime/kernels.py` for the small projections: on an NVIDIA GPU (ROCm's builds of torch call
    theirs "cuda" too; the kernels were measured on NVIDIA's only), where triton imports. (Whether they are
    asked for is the policy's: `RuntimeOptions.kernels`.)"""
    global _kernels
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    try:
        from . import kernels
    except ImportError:
        return False
    _kernels = kernels
    return True


def attend_wanted(device: torch.device) -> bool:
    """`kernels.attend` for the one-token attention blocks: where the kernels can run. (Whether it is asked
    for is the policy's: `RuntimeOptions.attention_kernel`.)"""
    return kernels_wanted(device)


def fuse_rows(linears: list) -> tuple[torch.Tensor | torch.nn.Module, torch.Tensor | None]:
    """Stack the weights (and biases) of `linears` into one matrix and re-point each module at its rows.
    Where they are already consecutive rows of one matrix (a second fused step over the same layers: the
    compiled steps built beside the plain ones, runtime/beside.py), that matrix is returned: no copy.
    Packed layers (`QuantLinear`) fuse into one `QuantLinear` that holds the bias (returned as None), or,
    where they cannot share one, a `Beside` of them."""
    if not isinstance(linears[0], torch.nn.Linear):
        from ..quant.linear import fuse_quant_rows

        return fuse_quant_rows(linears) or Beside(linears), None
    fused = _rows_of_one([m.weight.data for m in linears])
    if fused is not None:
        bias = _rows_of_one([m.bias.data for m in linears]) if linears[0].bias is not None else None
        if linears[0].bias is None or bias is not None:
            return fused, bias
    weight = torch.cat([m.weight.data for m in linears], dim=0)
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([m.bias.data for m in linears], dim=0)
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[row : row + n]
        if bias is not None:
            m.bias.data = bias[row : row + n]
        row += n
    return weight, bias


class Beside(torch.nn.Module):
    """Layers over one input whose outputs go side by side (packed q/k/v whose FP8 blocks straddle)."""

    def __init__(self, parts: list) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def weight_of(linear):
    """What the fused step multiplies by: a Linear's weight tensor, or the packed layer itself."""
    return linear.weight if isinstance(linear, torch.nn.Linear) else linear


def _rows_of_one(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The matrix whose consecutive rows `parts` are (contiguous views of one storage, in order), else None."""
    first = parts[0]
    if not all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for p in parts):
        return None
    offset = first.storage_offset()
    for p in parts:
        if p.storage_offset() != offset or p.shape[1:] != first.shape[1:]:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _check_silu(act) -> None:
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"the fused step assumes SiLU-gated MLPs, not {type(act).__name__}")


def _norm(module) -> tuple[torch.Tensor, float] | tuple[None, float]:
    return (None, 0.0) if module is None else (module.weight, module.variance_epsilon)


class _Layer:
    """One layer's tensors, fused, as plain tensors (so a compiled layer function can take them as arguments)."""

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.in_norm = _norm(layer.input_layernorm)
        self.post_norm = _norm(layer.post_attention_layernorm)
        self.q_norm = _norm(getattr(attn, "q_norm", None))  # Qwen3: RMSNorm over each head
        self.k_norm = _norm(getattr(attn, "k_norm", None))
        self.qkv_w, self.qkv_b = fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        self.split = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
        self.o_w = weight_of(attn.o_proj)
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.mlp, self.routing = _mlp_tensors(mlp)


def _mlp_tensors(mlp) -> tuple[tuple, tuple[int, bool] | None]:
    """(tensors, routing): a dense MLP's (gate_up, down) with routing None, or a sparse block's
    (router, experts' gate_up, experts' down[, shared gate_up, shared down, shared gate]) with
    routing (top_k, renormalise the top-k weights)."""
    if not hasattr(mlp, "experts"):
        _check_silu(mlp.act_fn)
        return (fuse_rows([mlp.gate_proj, mlp.up_proj])[0], weight_of(mlp.down_proj)), None
    experts, router = mlp.experts, mlp.gate
    _check_silu(experts.act_fn)
    if hasattr(experts, "bank"):  # packed experts (quant/experts.py): the banks the picked kernels read
        banks = (experts.bank("gate_up"), experts.bank("down"))
    else:
        banks = (experts.gate_up_proj, experts.down_proj)
    tensors: tuple = (router.weight, *banks)
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        _check_silu(shared.act_fn)
        gate_up, _ = fuse_rows([shared.gate_proj, shared.up_proj])
        tensors += (gate_up, weight_of(shared.down_proj), weight_of(mlp.shared_expert_gate))
    return tensors, (router.top_k, bool(router.norm_topk_prob))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The library's Qwen RMSNorm: on a CPU and compiled, op for op (float32 statistics, the result cast
    back, then scaled; inductor makes it one kernel). Uncompiled on an accelerator (the plain graphs the
    commands run), torch's fused norm: one kernel instead of seven, for the two or four norms of every
    layer (H200, plain graphs: Qwen3-Omni's frame 15.3 -> 11.0 ms; with Qwen2's joint RoPE, the 7B
    talker's step 3.2 -> 2.4 ms). It scales before casting back, so a result can differ from the
    library's in the last bit."""
    if x.device.type != "cpu" and not tracing():
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the library applies it (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def gated(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           as_sum: bool = False) -> torch.Tensor:
    """`F.linear` for the few rows of a decode step. With `as_sum`, compiled, it is a product and a float32
    sum, which inductor makes one reduction kernel (the input's norm fused into its loads): for Qwen3-Omni's
    small matrices (1024-2048 wide) that streams the weight near the memory's bandwidth where a GEMM
    library's one-row kernel reaches a fraction of it (H200: 5-12 µs a matrix against ~3 µs of reading;
    thinker step 4.25 -> 3.8 ms, talker step 1.8 -> 1.2 ms). For Qwen2.5-Omni-7B's large ones (3584 x
    18944) it was slower than cuBLAS (thinker 5.0 -> 7.5 ms a token): those stay GEMMs."""
    if not isinstance(weight, torch.Tensor):  # a packed layer (it holds its bias)
        return weight(x)
    if not (as_sum and tracing()):
        return F.linear(x, weight, bias)
    out = (x.unsqueeze(-2) * weight).sum(-1, dtype=torch.float32)
    return (out if bias is None else out + bias).to(x.dtype)


def gemv(x: torch.Tensor, w, *, norm: torch.Tensor | None = None, eps: float = 0.0, gate: bool = False,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.gemv` (its norm, gate and residual inside one launch) for a weight tensor; for a packed
    layer its own kernel's launch with them (`QuantLinear.step`), or, where that does not take x (layers
    side by side, a bias before the residual), the same math around the layer's product."""
    if isinstance(w, torch.Tensor):
        return _kernels.gemv(x, w, norm=norm, eps=eps, gate=gate, residual=residual)
    step = getattr(w, "step", None)
    y = step(x, norm=norm, eps=eps, gate=gate, residual=residual) if step is not None else None
    if y is not None:
        return y
    if norm is not None:
        x = rms_norm(x, norm, eps)
    y = w(gated(x) if gate else x)
    return y if residual is None else residual + y


def picked_matvec(weights: torch.Tensor, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weights[idx] @ x for every pick: weights [E, out, in], idx [n, k], x [n, k or 1, in] -> [n, k, out].

    Compiled, it is written as a product and a sum so that inductor makes one reduction kernel that reads
    the picked experts' rows in place (a matmul would first copy them out: 3x the memory traffic of a
    step that is all weight reading). Eager, the product would round each term to the weights' dtype,
    so it is a batched matmul over the gathered weights, which accumulates in float32 as the library does.
    """
    if tracing():
        return (weights[idx] * x.unsqueeze(-2)).sum(-1, dtype=torch.float32).to(x.dtype)
    return torch.matmul(weights[idx], x.unsqueeze(-1)).squeeze(-1)


def moe_mlp(x: torch.Tensor, tensors: tuple, top_k: int, renormalise: bool, as_sum: bool = False,
            kernels: bool = False) -> torch.Tensor:
    """A sparse MoE block on x [1, n, H]: the library's routing (`route`), then the picked experts and
    the shared one (`experts`)."""
    return experts(x, *route(x, tensors[0], top_k, renormalise, as_sum), tensors, as_sum, kernels)


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, renormalise: bool,
          as_sum: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's routing of x [1, n, H]: float32 softmax, top-k, optional renormalisation, weights
    cast back. Returns (weights [n, k], expert ids [n, k])."""
    rows = x.view(-1, x.shape[-1])  # [n, H]
    probs = linear(rows, router_w, as_sum=as_sum).softmax(dim=-1, dtype=torch.float32)
    # The top k by one sort (one kernel for 128 experts, where topk launches two); a stable sort orders
    # ties by index, a case of measure zero for float routing scores.
    weight, idx = (t[..., :top_k] for t in torch.sort(probs, dim=-1, descending=True, stable=True))  # [n, k]
    if renormalise:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    return weight.to(x.dtype), idx


def experts(x: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor, tensors: tuple, as_sum: bool = False,
            kernels: bool = False):
    """The picked experts on x [1, n, H], summed in top-k order as the library's grouped path sums them,
    plus the sigmoid-gated shared expert when there is one. With `kernels`, one token's picked experts
    are two launches that read the picked rows in place (`picked_gemv`), where the batched matmul
    first copies them out."""
    gate_up, down = tensors[1:3]
    rows = x.view(-1, x.shape[-1])  # [n, H]
    if not isinstance(gate_up, torch.Tensor):  # packed banks (quant/experts.py): its picked products
        from ..quant.experts import picked_product

        parts = [picked_product(down, picked_product(gate_up, row, ids), ids, weights=w, gate=True)
                 for row, ids, w in zip(rows, idx, weight)]
        # one token (a decode step): its row as it is, where a stack would copy it (a launch a layer)
        out = parts[0].view(1, -1) if len(parts) == 1 else torch.stack(parts)
    elif kernels and rows.shape[0] == 1:
        h = _kernels.picked_gemv(rows[0], gate_up, idx[0])  # [k, 2I]: gate | up
        out = _kernels.picked_gemv(h, down, idx[0], weights=weight[0], gate=True).view(1, -1)
    else:
        h = gated(picked_matvec(gate_up, idx, rows.unsqueeze(1)))  # [n, k, I]
        out = (picked_matvec(down, idx, h) * weight.unsqueeze(-1)).sum(dim=1)  # [n, H]
    if len(tensors) > 3:
        shared_gate_up, shared_down, shared_gate = tensors[3:]
        if kernels:
            shared = gemv(gemv(rows, shared_gate_up), shared_down, gate=True)
        else:
            shared = linear(gated(linear(rows, shared_gate_up, as_sum=as_sum)), shared_down, as_sum=as_sum)
        out = out + torch.sigmoid(linear(rows, shared_gate, as_sum=as_sum)) * shared
    return out.view_as(x)


def layer_step(hidden, in_w, post_w, qkv_w, qkv_b, q_norm_w, k_norm_w, o_w, mlp, keys, values, pos, cos, sin,
               valid, eps: float, split: tuple[int, int, int], head_dim: int, scaling: float,
               routing: tuple[int, bool] | None, as_sum: bool = False, kernels: bool = False,
               attend: bool = False):
    """One decoder layer for n tokens. Pure function of tensors: what `torch.compile` fuses. `as_sum`:
    the projections as reductions (`linear`); `kernels`: as runtime/kernels.py's launches; `attend`: a
    one-token attention block as its one launch (`kernels.attend`)."""
    hidden = attention(hidden, in_w, qkv_w, qkv_b, q_norm_w, k_norm_w, o_w, keys, values, pos, cos, sin, valid,
                       eps, split, head_dim, scaling, as_sum, kernels, attend)
    if routing is None:
        gate_up_w, down_w = mlp
        if kernels:  # the norm inside gate/up's launch, the gate and the residual inside down's
            return gemv(gemv(hidden, gate_up_w, norm=post_w, eps=eps), down_w, gate=True, residual=hidden)
        x = rms_norm(hidden, post_w, eps)
        return hidden + linear(gated(linear(x, gate_up_w, as_sum=as_sum)), down_w, as_sum=as_sum)
    x = rms_norm(hidden, post_w, eps)
    return hidden + moe_mlp(x, mlp, *routing, as_sum=as_sum, kernels=kernels)


def routed_attention(hidden, in_w, post_w, qkv_w, qkv_b, q_norm_w, k_norm_w, o_w, mlp, keys, values, pos, cos,
                     sin, valid, eps: float, split: tuple[int, int, int], head_dim: int, scaling: float,
                     routing: tuple[int, bool], as_sum: bool = False, kernels: bool = False,
                     attend: bool = False):
    """A mixture-of-experts layer's first part (`layer_step`'s arguments): attention, the MLP's norm and
    the routing; returns (hidden, normed x, weights, expert ids) for `routed_experts`."""
    hidden = attention(hidden, in_w, qkv_w, qkv_b, q_norm_w, k_norm_w, o_w, keys, values, pos, cos, sin, valid,
                       eps, split, head_dim, scaling, as_sum, kernels, attend)
    x = rms_norm(hidden, post_w, eps)
    return (hidden, x, *route(x, mlp[0], *routing, as_sum=as_sum))


def routed_experts(hidden, x, weight, idx, mlp, as_sum: bool = False, kernels: bool = False):
    """A mixture-of-experts layer's second part: the experts `routed_attention` chose, and the residual."""
    return hidden + experts(x, weight, idx, mlp, as_sum, kernels)


def attention(hidden, in_w, qkv_w, qkv_b, q_norm_w, k_norm_w, o_w, keys, values, pos, cos, sin, valid, eps: float,
              split: tuple[int, int, int], head_dim: int, scaling: float, as_sum: bool = False,
              kernels: bool = False, attend: bool = False):
    """A layer's attention block with its residual: norm, q/k/v, RoPE, the cache write at `pos`, attention
    over the first `valid.shape[-1]` rows, o."""
    n = hidden.shape[1]
    if kernels:  # the norm inside q/k/v's launch (no bias: `FusedDecoder` checks)
        qkv = gemv(hidden, qkv_w, norm=in_w, eps=eps)
    else:
        qkv = linear(rms_norm(hidden, in_w, eps), qkv_w, qkv_b, as_sum)
    span = valid.shape[-1]
    if attend and n == 1:  # any span: a long one split over programs (kernels.ATTEND_MAX_SPAN)
        att = _kernels.attend(qkv, q_norm_w, k_norm_w, cos.view(-1), sin.view(-1), keys, values, pos, span, eps,
                              scaling, split[0] // head_dim).view(1, 1, -1)
        return _out(hidden, att, o_w, as_sum, kernels)
    q, k, v = (t.view(1, n, -1, head_dim) for t in qkv.split(split, dim=-1))
    if q_norm_w is not None:  # Qwen3: per-head norms before RoPE (the layer's eps, as the library's)
        q = rotate(rms_norm(q, q_norm_w, eps).transpose(1, 2), cos, sin)
        k = rotate(rms_norm(k, k_norm_w, eps).transpose(1, 2), cos, sin)
    else:  # Qwen2: q and k side by side in the fused output, rotated as one (half the kernels, the same math)
        heads = split[0] // head_dim
        qk = rotate(qkv[..., : split[0] + split[1]].view(1, n, -1, head_dim).transpose(1, 2), cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
    v = v.transpose(1, 2)
    keys.index_copy_(2, pos, k)
    values.index_copy_(2, pos, v)
    att = F.scaled_dot_product_attention(q, keys[:, :, :span], values[:, :, :span], attn_mask=valid,
                                         scale=scaling, enable_gqa=True)
    return _out(hidden, att.transpose(1, 2).reshape(1, n, -1), o_w, as_sum, kernels)


def _out(hidden, att, o_w, as_sum: bool, kernels: bool):
    """The attention block's output projection and residual."""
    if kernels:
        return gemv(att, o_w, residual=hidden)
    return hidden + linear(att, o_w, as_sum=as_sum)


class FusedDecoder:
    def __init__(self, model, cache: StaticKVCache, policy: Policy | None = None, mrope: bool = True,
                 whole: bool = False, as_sum: bool = False) -> None:
        """`model`: the library's decoder stack (`.layers`, `.norm`, `.rotary_emb`); `cache`: its static cache;
        `policy`: what is on (None: the default runtime options on the stack's device).

        `policy.compile_on`: run each layer through `torch.compile` (inductor fuses the many small element-wise
        kernels of a one-token step); the same compiled code serves every layer of a kind. `whole`:
        compile the whole step instead (fusion across layer boundaries too; for small stacks, whose
        compile time is short). `mrope`: the stack's rotary takes three M-RoPE rows of positions (False:
        plain RoPE). `as_sum`: the projections are small: compiled, as reductions (`linear`); uncompiled
        on CUDA with triton, as runtime/kernels.py's launches (`policy.kernels_on`).
        """
        self.layers = [_Layer(layer) for layer in model.layers]
        for L in self.layers:  # the per-head norms share the layer's eps in every Qwen3 config
            if L.q_norm[0] is not None and (L.q_norm[1] != L.in_norm[1] or L.k_norm[1] != L.in_norm[1]):
                raise ValueError("the fused step assumes one RMSNorm eps per layer")
        self.norm = (model.norm.weight, model.norm.variance_epsilon)
        self.cache = cache
        param = next(model.parameters())
        policy = policy or Policy.of(None, param.device)
        compile = policy.compile_on
        positions = torch.arange(cache.max_len, device=param.device).view(1, 1, -1)
        positions = positions.expand(3, 1, -1) if mrope else positions[0]
        with torch.no_grad():
            probe = torch.zeros(1, 1, 1, device=param.device, dtype=param.dtype)
            cos, sin = model.rotary_emb(probe, positions)  # [1, max_len, head_dim], the library's math
        self.cos, self.sin = cos[0], sin[0]
        self.span_index = torch.arange(cache.max_len, device=param.device)
        self.as_sum = as_sum
        # Compiled, inductor's fused reductions are as fast in a step's graph (H200, measured): the kernels
        # serve the plain steps only. They add no bias.
        self.kernels = (as_sum and not compile and policy.kernels_on and kernels_wanted(param.device)
                        and all(L.qkv_b is None for L in self.layers))
        # A one-token attention block as one launch, compiled or not (kernels.attend): where inductor
        # made four kernels and cuDNN's attention a fifth, whose one query over a few rows leaves most of
        # the GPU idle. Its blocks need a head size that is a power of two. Every stack, with or without
        # `as_sum` (Qwen2.5-Omni's thinker and talker: their q/k/v bias is in the product, before it).
        self.attend = (policy.attention_kernel_on and attend_wanted(param.device)
                       and all(L.head_dim & (L.head_dim - 1) == 0 for L in self.layers))
        if policy.kernels_on:  # the stack's prompts (the library's layers) take our experts and norms on a GPU
            from . import prompt_ops  # it imports this module

            prompt_ops.install(model.layers)
        # Added to a slot's position for its RoPE angle: the delta an image prompt's 3-D positions leave
        # for what follows (0 for text and audio); a device tensor, so one captured graph serves every turn.
        self.rope_shift = torch.zeros(1, dtype=torch.long, device=param.device)
        self.layer_fn = compile_fn(layer_step, fullgraph=True) if compile and not whole else layer_step
        # A mixture-of-experts layer compiled as one function had the routing (its norm, softmax and sort)
        # fused into both expert reductions, which redid it in every thread block. Compiled in two parts,
        # the routing runs once and the experts read its ids from memory (H200, thinker: the gate/up
        # reduction, 50 MB, 19.2 -> 13.7 µs a layer; the step's graph 3.82 -> 3.68 ms).
        self.moe_parts = None
        if compile and not whole and any(L.routing is not None for L in self.layers):
            self.moe_parts = (compile_fn(routed_attention, fullgraph=True), compile_fn(routed_experts, fullgraph=True))
        if compile and whole:
            # This instance's step becomes the compiled one (mypy forbids assigning to a method).
            self.step = compile_fn(self.step, fullgraph=True)  # type: ignore[method-assign]

    def step(self, embeds: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """`embeds` [1, n, W] at positions `pos` ([n] long, device), attending to `span` ≥ max(pos)+1 rows."""
        n = embeds.shape[1]
        angle = pos + self.rope_shift
        cos = self.cos.index_select(0, angle).view(1, 1, n, -1)
        sin = self.sin.index_select(0, angle).view(1, 1, n, -1)
        valid = (self.span_index[:span].view(1, span) <= pos.view(n, 1)).view(1, 1, n, span)
        hidden = embeds
        for i, L in enumerate(self.layers):
            args = (hidden, L.in_norm[0], L.post_norm[0], L.qkv_w, L.qkv_b, L.q_norm[0], L.k_norm[0], L.o_w, L.mlp,
                    self.cache.keys[i], self.cache.values[i], pos, cos, sin, valid,
                    L.in_norm[1], L.split, L.head_dim, L.scaling, L.routing, self.as_sum, self.kernels, self.attend)
            if L.routing is not None and self.moe_parts is not None:
                attend_and_route, mix_experts = self.moe_parts
                hidden, x, weight, idx = attend_and_route(*args)
                hidden = mix_experts(hidden, x, weight, idx, L.mlp, self.as_sum, self.kernels)
            else:
                hidden = self.layer_fn(*args)
        return rms_norm(hidden, *self.norm)


class TokenDecoder:
    """A language model's one-token decode (embed -> fused stack -> head) over static buffers, replayed
    as one CUDA graph per span bucket (`StepGraphs`), or run eagerly with the same math where graphs are
    off. Its outputs live in the graph's buffers until the next call: callers use them at once."""

    def __init__(self, model, cache: StaticKVCache, embed, head, *, policy: Policy, as_sum: bool = False) -> None:
        dev = cache.keys[0].device
        self.fused = FusedDecoder(model, cache, policy=policy, as_sum=as_sum)
        self.cache, self.embed, self.head = cache, embed, head
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs = policy.step_graphs(self._step, cache.max_len, lazy=not policy.compile_on)

    def _step(self, span: int):
        embeds = self.embed(self.token.view(1, 1))
        hidden = self.fused.step(embeds, self.pos, span)
        return embeds, hidden, self.head(hidden)[:, -1].float()

    def capture(self) -> None:
        with torch.inference_mode():
            self.graphs.capture_all()

    def __call__(self, token: torch.Tensor):
        """Feed `token` ([1] long, device) at the cache's next position: (embeds, hidden, float32 logits)."""
        self.token.copy_(token)
        self.pos.fill_(self.cache.length)
        out = self.graphs(self.cache.length + 1)
        self.cache.advance(1)
        return out
