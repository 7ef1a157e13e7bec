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
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import apply_rotary_pos_emb

from .kv_cache import StaticKVCache


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
    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.qkv_w, self.qkv_b = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        self.split = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]]
        self.o_proj = attn.o_proj
        self.gate_up_w, _ = _fuse_rows([mlp.gate_proj, mlp.up_proj])
        self.intermediate = mlp.gate_proj.weight.shape[0]
        self.down_proj = mlp.down_proj
        self.act = mlp.act_fn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling


class FusedDecoder:
    def __init__(self, model, cache: StaticKVCache) -> None:
        """`model`: the library's decoder stack (`.layers`, `.norm`, `.rotary_emb`); `cache`: its static cache."""
        self.layers = [_Layer(layer) for layer in model.layers]
        self.norm = model.norm
        self.cache = cache
        param = next(model.parameters())
        positions = torch.arange(cache.max_len, device=param.device).view(1, 1, -1).expand(3, 1, -1)
        with torch.no_grad():
            probe = torch.zeros(1, 1, 1, device=param.device, dtype=param.dtype)
            cos, sin = model.rotary_emb(probe, positions)  # [1, max_len, head_dim], the library's math
        self.cos, self.sin = cos[0], sin[0]

    def step(self, embeds: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One token: `embeds` [1, 1, W], `pos` [1] long (device) its position, `span` ≥ pos+1 rows to attend."""
        cos = self.cos.index_select(0, pos).unsqueeze(0)  # [1, 1, head_dim]
        sin = self.sin.index_select(0, pos).unsqueeze(0)
        valid = (torch.arange(span, device=pos.device) <= pos).view(1, 1, 1, span)
        hidden = embeds
        for i, layer in enumerate(self.layers):
            hidden = hidden + self._attention(layer, i, layer.input_norm(hidden), cos, sin, pos, span, valid)
            x = layer.post_norm(hidden)
            gate, up = F.linear(x, layer.gate_up_w).split(layer.intermediate, dim=-1)
            hidden = hidden + layer.down_proj(layer.act(gate) * up)
        return self.norm(hidden)

    def _attention(self, layer: _Layer, i: int, x, cos, sin, pos, span, valid) -> torch.Tensor:
        q, k, v = F.linear(x, layer.qkv_w, layer.qkv_b).split(layer.split, dim=-1)
        d = layer.head_dim
        q = q.view(1, 1, -1, d).transpose(1, 2)
        k = k.view(1, 1, -1, d).transpose(1, 2)
        v = v.view(1, 1, -1, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = self.cache.keys[i], self.cache.values[i]
        keys.index_copy_(2, pos, k)
        values.index_copy_(2, pos, v)
        out = F.scaled_dot_product_attention(
            q, keys[:, :, :span], values[:, :, :span], attn_mask=valid, scale=layer.scaling, enable_gqa=True
        )
        return layer.o_proj(out.transpose(1, 2).reshape(1, 1, -1))
