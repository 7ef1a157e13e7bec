"""A fixed-shape decode step for a Qwen2-style decoder stack, ready to be captured as a CUDA graph.

`FusedDecoder.prepare` fuses each layer's q/k/v projections into one matrix and gate/up into another,
*in place*: the library's `q_proj`, `k_proj`, ... keep working as views into the fused storage, so the
reference-exact prefill path and this decode path share one copy of the weights (no extra memory).

`step(embeds, pos, span)` runs one token: the RoPE angles come from a table (the same float32 math the
library does per call), the new key/value is written at a *device-side* position, and attention reads
the first `span` cache rows (a host-chosen bucket, so shapes are fixed per bucket) under a mask of the
valid ones. No host sync, no Python branch on a tensor value, no allocation that depends on data.

It does not know which LLM it runs, nor sampling. Its float results can differ from the library's
layer-by-layer path in the last bits (fused matmuls may round differently); tests compare the tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...runtime.graphs import compile_fn
from ...runtime.kv_cache import StaticKVCache


def _fuse_rows(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack the weights (and biases) of `linears` into one matrix and re-point each module at its rows."""
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


class _Layer:
    """One layer's tensors, fused, as plain tensors (so a compiled layer function can take them as arguments)."""

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"the fused step assumes SiLU-gated MLPs (Qwen2), not {type(mlp.act_fn).__name__}")
        self.in_norm = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.post_norm = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        self.qkv_w, self.qkv_b = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        self.split = (attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0])
        self.o_w = attn.o_proj.weight
        self.gate_up_w, _ = _fuse_rows([mlp.gate_proj, mlp.up_proj])
        self.down_w = mlp.down_proj.weight
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The library's Qwen2 RMSNorm, op for op (float32 statistics, result cast back, then scaled)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the library applies it (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def layer_step(hidden, in_w, post_w, qkv_w, qkv_b, o_w, gate_up_w, down_w, keys, values, pos, cos, sin, valid,
               eps: float, split: tuple[int, int, int], head_dim: int, scaling: float):
    """One decoder layer for one token. Pure function of tensors: what `torch.compile` fuses."""
    x = rms_norm(hidden, in_w, eps)
    q, k, v = F.linear(x, qkv_w, qkv_b).split(split, dim=-1)
    q = rotate(q.view(1, 1, -1, head_dim).transpose(1, 2), cos, sin)
    k = rotate(k.view(1, 1, -1, head_dim).transpose(1, 2), cos, sin)
    v = v.view(1, 1, -1, head_dim).transpose(1, 2)
    keys.index_copy_(2, pos, k)
    values.index_copy_(2, pos, v)
    span = valid.shape[-1]
    att = F.scaled_dot_product_attention(q, keys[:, :, :span], values[:, :, :span], attn_mask=valid,
                                         scale=scaling, enable_gqa=True)
    hidden = hidden + F.linear(att.transpose(1, 2).reshape(1, 1, -1), o_w)
    x = rms_norm(hidden, post_w, eps)
    gate, up = F.linear(x, gate_up_w).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, down_w)


class FusedDecoder:
    def __init__(self, model, cache: StaticKVCache, compile: bool = False) -> None:
        """`model`: the library's decoder stack (`.layers`, `.norm`, `.rotary_emb`); `cache`: its static cache.

        `compile`: run each layer through `torch.compile` (inductor fuses the many small element-wise
        kernels of a one-token step); the same compiled code serves every layer.
        """
        self.layers = [_Layer(layer) for layer in model.layers]
        self.norm = (model.norm.weight, model.norm.variance_epsilon)
        self.cache = cache
        param = next(model.parameters())
        positions = torch.arange(cache.max_len, device=param.device).view(1, 1, -1).expand(3, 1, -1)
        with torch.no_grad():
            probe = torch.zeros(1, 1, 1, device=param.device, dtype=param.dtype)
            cos, sin = model.rotary_emb(probe, positions)  # [1, max_len, head_dim], the library's math
        self.cos, self.sin = cos[0], sin[0]
        self.layer_fn = compile_fn(layer_step, fullgraph=True) if compile else layer_step

    def step(self, embeds: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One token: `embeds` [1, 1, W], `pos` [1] long (device) its position, `span` ≥ pos+1 rows to attend."""
        cos = self.cos.index_select(0, pos).view(1, 1, 1, -1)
        sin = self.sin.index_select(0, pos).view(1, 1, 1, -1)
        valid = (torch.arange(span, device=pos.device) <= pos).view(1, 1, 1, span)
        hidden = embeds
        for i, L in enumerate(self.layers):
            hidden = self.layer_fn(
                hidden, L.in_norm[0], L.post_norm[0], L.qkv_w, L.qkv_b, L.o_w, L.gate_up_w, L.down_w,
                self.cache.keys[i], self.cache.values[i], pos, cos, sin, valid,
                L.in_norm[1], L.split, L.head_dim, L.scaling,
            )
        return rms_norm(hidden, *self.norm)
