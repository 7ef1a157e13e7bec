"""One evaluation of Qwen2.5-Omni's token2wav DiT, restated so that an ODE on a fixed grid does less work.

The vocoder's flow-matching ODE evaluates the DiT 36 times per window (RK4 over 10 time points), and in
each evaluation transformers' layers do work that does not depend on the ODE's state, or do it in many
small kernels (on a GPU a window is launch-bound: ~1,000 kernels an evaluation):

- The time embedding and each layer's AdaLN modulation (`attn_norm.linear`, a 1024 -> 6144 product of
  a 25 MB float32 weight, and `norm_out.linear`) depend only on the time point. `DitPlan.grid` computes
  them once per ODE grid (per model: the grid is fixed by the number of steps and the sway), with the
  same operations on the same batch of two, so the numbers are identical; an evaluation reads its row.
- q, k and v are three products of one input: `DitPlan` stacks their weights into one matrix (the
  modules keep views of its rows, so no memory is added), with the first heads' RoPE rows (next) under them.
- RoPE touches only the first head, de-interleaved and rotated by half (two copies, two negations and
  four concatenations a layer): `rope_rows` are that head's q and k rows in those orders, with the signs,
  so the same product gives the rotation's inputs for q's head and k's, and both rotated heads are
  written into their places in the q/k/v product at once (one view of the two).
  Compiled, inductor fuses that element-wise work itself: `dit_forward_compiled` runs the layers' own
  attention (with the time conditioning table).
- The AdaLN modulation `norm(x) * (1 + scale) + shift` is the LayerNorm's own affine (`_modulated`: the
  CFG batch's two rows share the time point, so one weight and bias serve both), and each gated residual
  `x + gate * y` one `torch.addcmul`: one kernel where the library makes three and two.

Counted as dispatched operators on the CPU (true size), an evaluation launches 267 kernels where it
launched 511 before these last three changes.

The rest is the library's float operations in the library's order (`DiTDecoderLayer.forward` and
`DiTAttention.forward` of transformers 5.17-5.24, the attention through the configured attention
function), with the layer's mask passed in (`attention_masks`) instead of rebuilt from block differences
in every layer. The fused products can round differently from three separate ones in the last bit (a
matrix of another shape may get another kernel), and a fused multiply-add may round its product and sum
once where the library rounds twice; the tests hold the whole decode to transformers' token2wav within
1e-5 (measured on the CPU, tiny model: 8.3e-7 of a 0.45 peak; bit-identical before the fused modulations
and residuals). Where a transformers version lacks `deinterleave_head_dim` (its DiT's RoPE laid out
otherwise), each layer's own attention module runs (`FUSED_ATTENTION`).

It knows the DiT's layer structure and nothing of windows, chunks, noise, CUDA graphs or BigVGAN
(vocoder.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as _library

from ...runtime.fused import fuse_rows

# The layout `_attention` restates (transformers 5.17-5.24): RoPE on the first head only, applied after
# `deinterleave_head_dim`. A version without that helper runs the layers' own attention instead.
FUSED_ATTENTION = hasattr(_library, "deinterleave_head_dim")

# RK4's four evaluations per step sit at these fractions of the step (the 3/8 rule, as transformers'
# RungeKutta4ODESolver): t0, t0 + dt/3, t0 + 2dt/3, t1.
THIRD, TWO_THIRDS = 1 / 3, 2 / 3


class DitPlan:
    """What every evaluation of one DiT shares: the stacked q/k/v weights with the first heads' RoPE rows,
    and per ODE grid the time conditioning.

    Made once per token2wav model (`for_dit`), on the device the model is on then; the tensors it holds
    must outlive the CUDA graphs that read them, so it is kept on the model.
    """

    def __init__(self, dit) -> None:
        self.dit = dit
        self.layers = list(dit.transformer_blocks)
        self.fused_attention = FUSED_ATTENTION
        # (weight, bias) of each layer's q/k/v and the first heads' RoPE rows stacked; the q/k/v modules are
        # re-pointed at views of their rows.
        self.qkv = [fuse_rows([layer.attn.to_q, layer.attn.to_k, layer.attn.to_v, _rope_linear(layer.attn)])
                    for layer in self.layers]
        self._grids: dict = {}

    @classmethod
    def for_dit(cls, dit) -> "DitPlan":
        plan = getattr(dit, "_omni_dit_plan", None)
        if plan is None:
            plan = dit._omni_dit_plan = cls(dit)
        return plan

    @torch.inference_mode()
    def time_conditioning(self, t: torch.Tensor) -> torch.Tensor:
        """[6 * layers + 2, 2, width] for time point `t` (a 0-d tensor), for the CFG batch of two: each
        layer's (shift, 1 + scale, gate) for attention and for the MLP, then the final norm's (1 + scale,
        shift). The library adds the 1 to the scale in every evaluation; the same sum is made once here."""
        dit = self.dit
        embedding = dit.time_embed(t.repeat(2))
        parts: list[torch.Tensor] = []
        for layer in self.layers:
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = \
                layer.attn_norm.linear(layer.attn_norm.silu(embedding)).chunk(6, dim=1)
            parts += [shift_msa, 1 + scale_msa, gate_msa, shift_mlp, 1 + scale_mlp, gate_mlp]
        scale, shift = dit.norm_out.linear(dit.norm_out.silu(embedding)).chunk(2, dim=1)
        parts += [1 + scale, shift]
        return torch.stack(parts)

    @torch.inference_mode()
    def grid(self, num_steps: int, sway: float | None, device: torch.device, dtype: torch.dtype):
        """The ODE's time points (`ode_times`) and, per RK4 step, the time conditioning of its four
        evaluations in order (a tuple of four contiguous tensors), made once per grid. The evaluation times
        come from `rk4_times`, as `rk4_step`'s do, so they are the same numbers. CUDA graphs read these
        tensors, so they live here, on the model, not on one utterance's vocoder."""
        key = (num_steps, sway, device, dtype)
        if key not in self._grids:
            times = ode_times(num_steps, sway, device, dtype)
            steps = []
            for i in range(num_steps - 1):
                _, points = rk4_times(times[i], times[i + 1])
                steps.append(tuple(self.time_conditioning(t) for t in points))
            self._grids[key] = times, steps
        return self._grids[key]


def ode_times(num_steps: int, sway: float | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The flow-matching ODE's time points as transformers' token2wav makes them: `num_steps` from 0 to 1,
    bent towards 0 by the sway sampling coefficient."""
    times = torch.linspace(0, 1, num_steps, device=device, dtype=dtype)
    if sway is not None:
        times += sway * (torch.cos(torch.pi / 2 * times) - 1 + times)
    return times


def attention_masks(dit, block_diff: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per DiT layer, the additive attention mask [1, 1, T, T] for block differences `block_diff` [T, T].

    The same mask a `DiTDecoderLayer` builds from `block_diff` on every call (key block minus query
    block within the layer's look-back / look-ahead), turned into what scaled_dot_product_attention
    turns a boolean mask into (0 where attended, -inf elsewhere), so the attention is the same float
    operations. Layers with the same reach share one tensor; broadcast over the batch and the heads.
    """
    by_reach: dict[tuple[int, int], torch.Tensor] = {}
    masks = []
    for layer in dit.transformer_blocks:
        reach = (layer.look_backward_block, layer.look_ahead_block)
        if reach not in by_reach:
            allowed = (block_diff >= -float(reach[0])) & (block_diff <= float(reach[1]))
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            by_reach[reach] = mask.masked_fill_(allowed.logical_not(), float("-inf"))[None, None]
        masks.append(by_reach[reach])
    return masks


def dit_forward(plan: DitPlan, x, cond, static, rope, masks, fused_attention: bool = True) -> torch.Tensor:
    """One CFG evaluation (batch of two) of the DiT: the velocity's input for state `x` [1, T, mel].

    `cond`: the time point's conditioning (`DitPlan.time_conditioning`, or a row of `DitPlan.grid`);
    `static`: the window's fixed input (voice and codes, CFG batch); `rope`: (cos, sin); `masks`: one
    per layer (`attention_masks`). `fused_attention` False: the layers' own attention modules."""
    dit = plan.dit
    hidden = dit.input_embed.proj(torch.cat((torch.cat([x, x], dim=0), static), dim=-1))
    for i, (layer, mask) in enumerate(zip(plan.layers, masks)):
        shift_msa, scale_msa_1, gate_msa, shift_mlp, scale_mlp_1, gate_mlp = cond[6 * i : 6 * i + 6]
        norm = _modulated(layer.attn_norm.norm, hidden, scale_msa_1, shift_msa)
        if fused_attention and plan.fused_attention:
            attention = _attention(layer.attn, norm, *plan.qkv[i], rope, mask)
        else:
            attention = layer.attn(hidden_states=norm, position_embeddings=rope, attention_mask=mask)
        # The library's `hidden + gate * attention` as one kernel, where it made two (see the docstring).
        hidden = torch.addcmul(hidden, gate_msa.unsqueeze(1), attention)
        norm = _modulated(layer.ff_norm, hidden, scale_mlp_1, shift_mlp)
        hidden = torch.addcmul(hidden, gate_mlp.unsqueeze(1), layer.ff(norm))
    return dit.proj_out(_modulated(dit.norm_out.norm, hidden, cond[-2], cond[-1]))


def _modulated(norm, hidden: torch.Tensor, scale_1: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The library's AdaLN `norm(hidden) * (1 + scale) + shift` as the LayerNorm's own affine: one kernel
    where it made three. The CFG batch's two rows of `scale_1` and `shift` are the same numbers (one time
    point for both: `DitPlan.time_conditioning`), so the first row is the affine's weight and bias."""
    return F.layer_norm(hidden, norm.normalized_shape, scale_1[0], shift[0], norm.eps)


def dit_forward_compiled(plan: DitPlan, x, cond, static, rope, masks) -> torch.Tensor:
    """`dit_forward` as the vocoder has inductor compile it: with the layers' own attention, whose RoPE
    copies and concatenations inductor fuses into a kernel or two, where `rope_rows`' product would add
    a launch (measured: a compiled first chunk 79 ms before the plan, 85 ms with the fused attention)."""
    return dit_forward(plan, x, cond, static, rope, masks, fused_attention=False)


def rope_rows(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of the first head's q and k, each twice: de-interleaved (`deinterleave_head_dim`:
    the even dims, then the odd ones), q's then k's, and then both rotated by half with the sign
    (`rotate_half` of that: minus the odd dims, then the even ones). One product of these 4 x head_dim
    rows gives what the library makes from q and k with two copies, two negations and four
    concatenations; a negated row gives the exact negation of the row's product."""
    d = attn.inner_dim // attn.heads
    even, odd = slice(0, d, 2), slice(1, d, 2)
    rows = [(linear.weight.data[:d], linear.bias.data[:d]) for linear in (attn.to_q, attn.to_k)]
    weights = [torch.cat([w[even], w[odd]]) for w, _ in rows] + [torch.cat([-w[odd], w[even]]) for w, _ in rows]
    biases = [torch.cat([b[even], b[odd]]) for _, b in rows] + [torch.cat([-b[odd], b[even]]) for _, b in rows]
    return torch.cat(weights), torch.cat(biases)


def _rope_linear(attn) -> torch.nn.Linear:
    """`rope_rows` as a linear layer of its own, for `fuse_rows` to stack under q, k and v."""
    weight, bias = rope_rows(attn)
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
    linear.weight.data, linear.bias.data = weight, bias
    return linear


def _attention(attn, hidden, weight, bias, rope, mask) -> torch.Tensor:
    """`DiTAttention.forward` with q, k, v and the first heads' RoPE inputs (`rope_rows`) from one
    product of the stacked weights."""
    batch = hidden.shape[0]
    inner, head_dim = attn.inner_dim, attn.inner_dim // attn.heads
    qkv, rope_inputs = F.linear(hidden, weight, bias).split([3 * inner, 4 * head_dim], dim=-1)
    query, key, value = (part.unflatten(-1, (attn.heads, head_dim)).transpose(1, 2) for part in qkv.split(inner, dim=-1))
    # Only the first head gets RoPE (as the checkpoint was trained), in the de-interleaved layout:
    # `apply_rotary_pos_emb`'s (x * cos) + (rotate_half(x) * sin), with x and rotate_half(x) made by the
    # product, for q's first head and k's at once, written into those heads (one view of both).
    first_heads = qkv.unflatten(-1, (3, attn.heads, head_dim))[:, :, :2, 0]
    x, x_half = rope_inputs.unflatten(-1, (2, 2, head_dim)).unbind(2)
    cos, sin = (r.unsqueeze(2) for r in rope)
    torch.addcmul(x * cos, x_half, sin, out=first_heads)
    attend = _library.ALL_ATTENTION_FUNCTIONS[attn.config._attn_implementation]
    weights, _ = attend(attn, query, key, value, attention_mask=mask, is_causal=False)
    weights = weights.reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
    return attn.to_out[1](attn.to_out[0](weights))


def rk4_final(velocity: Callable, x: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """transformers' RK4 solver (`RungeKutta4ODESolver`), same float operations, final value only.

    `velocity(i, j, t, x)`: the velocity at evaluation j (0..3) of step i, time t. The library's
    `integrate` also interpolates at each time point with Python comparisons of device scalars (host
    syncs); on its own grid every point is an interval end, so the final value is the last step's.
    Without those branches the whole ODE is capturable as one CUDA graph.
    """
    for i in range(times.shape[0] - 1):
        x = rk4_step(lambda j, t, y, i=i: velocity(i, j, t, y), x, times[i], times[i + 1])
    return x


def rk4_step(velocity: Callable, x: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor) -> torch.Tensor:
    """One step of transformers' RK4 (3/8 rule) from t0 to t1; `velocity(j, t, x)` at evaluation j."""
    dt, (_, t_third, t_two_thirds, _) = rk4_times(t0, t1)
    k1 = velocity(0, t0, x)
    k2 = velocity(1, t_third, x + dt * k1 * THIRD)
    k3 = velocity(2, t_two_thirds, x + dt * (k2 - k1 * THIRD))
    k4 = velocity(3, t1, x + dt * (k1 - k2 + k3))
    return x + (k1 + 3 * (k2 + k3) + k4) * dt / 8


def rk4_times(t0: torch.Tensor, t1: torch.Tensor) -> tuple:
    """(dt, the times of one RK4 step's four evaluations): the 3/8 rule's t0, t0 + dt/3, t0 + 2dt/3, t1."""
    dt = t1 - t0
    return dt, (t0, t0 + dt * THIRD, t0 + dt * TWO_THIRDS, t1)
