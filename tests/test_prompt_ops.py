"""runtime/prompt_ops.py, runtime/moe_kernels.py and runtime/rope_kernel.py on a CPU, the kernels through
Triton's interpreter: the glue kernels and the rotary embedding against the library's torch ops, `routed`
against the library's experts module, and the engine's stacks taking our experts, norms and rotary
embedding inside their forwards and only there. On a GPU,
tests/test_gpu.py runs them in bfloat16 against the library."""

from __future__ import annotations

import copy

import pytest
import torch

from interpreted import DT, kernel_module, ulps
from omni_cli.runtime import compat, fused, prompt_ops
from omni_cli.runtime.decoder import forward_layers
from omni_cli.runtime.kv_cache import StaticKVCache


@pytest.fixture(scope="module")
def kernels():
    return kernel_module("omni_cli.runtime.moe_kernels")


def test_the_glue_kernels_are_the_librarys_ops(kernels):
    torch.manual_seed(0)
    T, k, H, I = 7, 3, 1100, 40  # H over one block of columns, with an edge
    h = torch.randn(T * k, 2 * I, dtype=DT) * 3
    assert ulps(kernels.silu_mul(h), fused.gated(h)) <= 1
    assert ulps(kernels.silu_mul(h), h[:, I:]) > 8  # the gate is really applied

    y = torch.randn(T * k, H, dtype=DT)
    w = torch.softmax(torch.randn(T, k), -1).to(DT)
    at = torch.randperm(T * k)
    want = (y[at].view(T, k, H) * w.unsqueeze(-1)).sum(1)  # the library's: weighted rows, then the sum
    assert ulps(kernels.weighted_sum(y, w, at), want) <= 1
    assert ulps(kernels.weighted_sum(y[at], w), want) <= 1  # in pick order already
    assert ulps(kernels.weighted_sum(y, w), want) > 8  # the rows really are looked up
    with pytest.raises(ValueError, match="one row per pick"):
        kernels.weighted_sum(y[:-1], w)


def test_the_rope_kernel_is_the_librarys_rotary_embedding():
    """q and k as the library's attention hands them over (transposed views of [B, L, H, D]), rotated as
    its `apply_rotary_pos_emb` rotates them: the same values in half precision and float32."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    rope = kernel_module("omni_cli.runtime.rope_kernel").rope
    library = getattr(m.apply_rotary_pos_emb, "_omni_library", m.apply_rotary_pos_emb)
    torch.manual_seed(4)
    B, L, H, Hk, D = 2, 5, 20, 3, 16  # 20 heads: over one block of 16, with an edge
    for dt in (DT, torch.float32):
        q = (torch.randn(B, L, H, D) * 4).to(dt).transpose(1, 2)
        k = (torch.randn(B, L, Hk, D) * 4).to(dt).transpose(1, 2)
        angle = torch.randn(B, L, D // 2).repeat(1, 1, 2) * 3
        cos, sin = angle.cos().to(dt), angle.sin().to(dt)
        want_q, want_k = library(q, k, cos, sin)
        got_q, got_k = rope(q, cos, sin), rope(k, cos, sin)
        assert got_q.shape == q.shape and got_k.shape == k.shape
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), dt
        assert not torch.equal(rope(q, cos, -sin), want_q)  # the rotation's direction matters
    with pytest.raises(ValueError, match="do not fit"):
        rope(q, cos[:, :-1], sin)


_PTX = """
import triton
from triton.backends.compiler import GPUTarget
from omni_cli.runtime import rope_kernel as rk
sig = dict.fromkeys(["x_ptr", "cos_ptr", "sin_ptr", "out_ptr"], "*bf16")
sig.update(dict.fromkeys(["H", "L", "sxb", "sxh", "sxl"], "i32"), HALF="constexpr", BLOCK_H="constexpr",
           BLOCK_D="constexpr")
src = triton.compiler.ASTSource(fn=rk._rope_kernel, signature=sig, constexprs={"HALF": 64, "BLOCK_H": 16,
                                                                               "BLOCK_D": 64})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=rk.LAUNCH).asm["ptx"])
"""


def test_the_rope_kernel_compiled_for_an_h100_rounds_each_product_and_sum():
    """The rotary kernel compiled for an H100 (sm_90: Triton's backend and its ptxas, no GPU needed), at
    Qwen3-Omni's head width, with the options it is launched with: each product and each sum one rounded
    bfloat16 operation, as torch's element-wise ops round them. With Triton's default fp fusion a product
    went into the sum as one fused multiply-add (fma.rn.bf16), and on an H100 the kernel gave values the
    library's ops do not (the twenty-second pass)."""
    import os
    import subprocess
    import sys

    kernel_module("omni_cli.runtime.rope_kernel")  # skips (fails in CI) without triton
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    out = subprocess.run([sys.executable, "-c", _PTX], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode and os.environ.get("OMNI_CI", "") in ("", "0"):
        pytest.skip(f"Triton cannot compile for sm_90 here: {out.stderr.strip()[-200:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    ptx = out.stdout
    assert "mul.rn.bf16" in ptx and "fma." not in ptx, [line for line in ptx.splitlines() if "fma." in line][:4]


def _experts(E=6, H=48, I=40, seed=1):
    """The library's Qwen3-Omni experts module, small, random, in DT."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

    config = Qwen3OmniMoeTextConfig(num_experts=E, hidden_size=H, moe_intermediate_size=I, hidden_act="silu")
    experts = m.Qwen3OmniMoeThinkerTextExperts(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts.to(DT).eval()


def test_routed_is_the_library_experts(kernels):
    experts = _experts()
    torch.manual_seed(2)
    T, k = 9, 2
    x = torch.randn(T, 48, dtype=DT)
    # expert 5 picked by no token, expert 0 by most
    ids = torch.stack([torch.zeros(T, dtype=torch.long), torch.randint(1, 5, (T,))], dim=1)
    w = torch.softmax(torch.randn(T, k), -1).to(DT)
    with torch.no_grad():
        want = experts(x, ids, w)
        got = prompt_ops.routed(experts.gate_up_proj, experts.down_proj, x, ids, w, kernels)
        assert ulps(got, want) <= 2
        # a pick's row taken back to the wrong token is far off
        assert ulps(prompt_ops.routed(experts.gate_up_proj, experts.down_proj, x, ids.flip(0), w, kernels),
                    want) > 8


def _thinker_stack():
    import qwen3_reference as ref

    model = copy.deepcopy(ref.model("tiny")).to(DT)  # shared by other tests: copied before the cast
    return compat.thinker_text_model(model.thinker), model.config.thinker_config.text_config


def test_the_stacks_take_ours_inside_their_forwards_only(kernels, monkeypatch):
    """The engine's forward of the tiny thinker stack in half precision, with ours allowed on this CPU:
    every MoE layer of a prompt takes `routed` and every norm of the layers ours, and the hidden state is
    the library's to a few units of the last place; the same modules called outside the engine's forwards
    (transformers' own generate) keep the library's path, and one-row forwards the library's experts."""
    stack, config = _thinker_stack()
    prompt_ops.install(stack.layers)  # as the engine's FusedDecoder does where the kernels are on
    experts_calls, norm_calls = [], []
    real_routed, real_norm = prompt_ops.routed, prompt_ops.rms_norm

    def routed_spy(*args, **kwargs):
        experts_calls.append(args[2].shape[0])
        return real_routed(*args, kernels=kernels)

    def norm_spy(x, *args):
        norm_calls.append(x.shape[-1])
        return real_norm(x, *args)

    def run(on: bool, n: int = 6):
        monkeypatch.setattr(prompt_ops, "EXPERTS", on)
        monkeypatch.setattr(prompt_ops, "NORMS", on)
        cache = StaticKVCache.for_config(config, 16, device="cpu", dtype=DT)
        torch.manual_seed(3)
        embeds = torch.randn(1, n, config.hidden_size, dtype=DT)
        with torch.no_grad():
            return forward_layers(stack, embeds, cache)

    rope_kernel = kernel_module("omni_cli.runtime.rope_kernel")
    rope_calls = []
    real_rope = rope_kernel.rope

    def rope_spy(x, cos, sin):
        rope_calls.append(x.shape[1])
        return real_rope(x, cos, sin)

    monkeypatch.setattr(prompt_ops, "routed", routed_spy)
    monkeypatch.setattr(prompt_ops, "rms_norm", norm_spy)
    monkeypatch.setattr(rope_kernel, "rope", rope_spy)
    monkeypatch.setattr(prompt_ops, "_routed_runs_here", lambda hidden, weight: True)  # this CPU, float16
    monkeypatch.setattr(prompt_ops, "_norm_runs_here", lambda hidden: True)
    monkeypatch.setattr(prompt_ops, "_rope_runs_here", lambda q, k, cos, sin: prompt_ops.ROPE)
    monkeypatch.setattr(prompt_ops, "ROPE", False)
    library = run(False)
    assert experts_calls == [] and norm_calls == [] and rope_calls == []
    monkeypatch.setattr(prompt_ops, "ROPE", True)
    ours = run(True)
    layers = config.num_hidden_layers
    assert experts_calls == [6] * layers
    assert rope_calls == [config.num_attention_heads, config.num_key_value_heads] * layers  # q and k
    head = config.hidden_size // config.num_attention_heads if getattr(config, "head_dim", None) is None else config.head_dim
    assert sorted(set(norm_calls)) == sorted({config.hidden_size, head})  # layer norms, per-head q and k norms
    assert len(norm_calls) == 4 * layers
    assert ulps(ours, library) <= 8
    experts_calls.clear()
    norm_calls.clear()
    rope_calls.clear()
    run(True, n=1)  # one row: the library's experts
    assert experts_calls == [] and len(norm_calls) == 4 * layers and len(rope_calls) == 2 * layers
    norm_calls.clear()
    rope_calls.clear()
    experts = stack.layers[0].mlp.experts
    with torch.no_grad():  # outside the engine's forwards: the library's modules
        experts(torch.randn(4, config.hidden_size, dtype=DT), torch.zeros(4, 2, dtype=torch.long),
                torch.ones(4, 2, dtype=DT))
        stack.layers[0].input_layernorm(torch.randn(4, config.hidden_size, dtype=DT))
        modeling = __import__(type(stack.layers[0].self_attn).__module__, fromlist=["_"])
        x, angle = torch.randn(1, 2, 3, 8, dtype=DT), torch.randn(1, 3, 8, dtype=DT)
        modeling.apply_rotary_pos_emb(x, x, angle.cos(), angle.sin())
    assert experts_calls == [] and norm_calls == [] and rope_calls == []
    assert "forward" in vars(experts) and copy.deepcopy(experts).forward.__self__ is not experts


@pytest.mark.parametrize("kernels_on", [True, False])
def test_the_engine_installs_them_where_the_kernels_are_on(kernels_on):
    """`--no-kernels` (OMNI_NO_KERNELS=1) leaves a prompt to the library's modules too."""
    from omni_cli.runtime.graphs import Policy

    stack, config = _thinker_stack()
    cache = StaticKVCache.for_config(config, 8, device="cpu", dtype=DT)
    policy = Policy(torch.device("cpu"), graphs_on=False, compile_on=False, kernels_on=kernels_on,
                    attention_kernel_on=False)
    fused.FusedDecoder(stack, cache, policy=policy, as_sum=True)
    layer = stack.layers[0]
    swapped = [m for m in (layer.mlp.experts, layer.input_layernorm, layer.self_attn.q_norm) if "forward" in vars(m)]
    assert len(swapped) == (3 if kernels_on else 0)


def test_a_long_prompt_graphs_attention_takes_cudnn_inside_its_block_only(monkeypatch):
    """transformers' "sdpa" function, as installed: inside a `cudnn_attention` block a causal prompt from an
    empty cache goes to `_cudnn_sdpa` (here a stand-in: this CPU has no cuDNN) and comes back in the
    library's layout, the same values as the library's call; outside a block, with a mask (a rest over a
    kept context), one row, or the switch off, the library's function runs. The thinker stack's forward
    takes it inside the block."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    import torch.nn.functional as F

    stack, config = _thinker_stack()
    prompt_ops.install(stack.layers)
    installed = ALL_ATTENTION_FUNCTIONS["sdpa"]
    library = installed._omni_library
    prompt_ops.install(stack.layers)  # once: a second install keeps the first wrapper
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is installed
    calls = []

    def stand_in(q, k, v, scale):  # what cuDNN's kernel computes, [B, H, L, D]
        calls.append((q.shape[2], k.shape[1]))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    monkeypatch.setattr(prompt_ops, "_cudnn_sdpa", stand_in)
    monkeypatch.setattr(prompt_ops, "_cudnn_runs_here", lambda module, q, k, v, mask, dropout, causal:
                        prompt_ops.ATTENTION and mask is None and q.shape[2] > 1)  # this CPU
    module = stack.layers[0].self_attn
    torch.manual_seed(0)
    q = torch.randn(1, 4, 7, 16)
    k, v = torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    want, _ = library(module, q, k, v, None, scaling=0.25)
    got, _ = installed(module, q, k, v, None, scaling=0.25)  # outside a block
    assert calls == [] and torch.equal(got, want)
    with prompt_ops.cudnn_attention():
        got, _ = installed(module, q, k, v, None, scaling=0.25)
        assert calls == [(7, 2)] and got.shape == want.shape == (1, 7, 4, 16)
        assert torch.allclose(got, want, atol=1e-6)
        mask = torch.zeros(1, 1, 7, 7)
        installed(module, q, k, v, mask, scaling=0.25)  # a rest's mask: the library's
        monkeypatch.setattr(prompt_ops, "ATTENTION", False)
        installed(module, q, k, v, None, scaling=0.25)
        assert len(calls) == 1
        monkeypatch.setattr(prompt_ops, "ATTENTION", True)
        cache = StaticKVCache.for_config(config, 16, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            forward_layers(stack.float(), torch.randn(1, 6, config.hidden_size), cache)
    assert calls[1:] == [(6, config.num_key_value_heads)] * config.num_hidden_layers
    with prompt_ops.cudnn_attention(False):
        installed(module, q, k, v, None, scaling=0.25)
    assert len(calls) == 1 + config.num_hidden_layers
    # A GPU or cuDNN without the kernel: the first failure is logged, and flash's (the library's) from then on.
    refused, failures = [], []

    def failing(*args):
        failures.append(1)
        raise RuntimeError("cuDNN Frontend error: no execution plan")

    monkeypatch.setattr(prompt_ops, "_cudnn_refused", refused)
    monkeypatch.setattr(prompt_ops, "_cudnn_sdpa", failing)
    with prompt_ops.cudnn_attention():
        got, _ = installed(module, q, k, v, None, scaling=0.25)
        assert torch.equal(got, want) and failures == [1] and "no execution plan" in refused[0]
        installed(module, q, k, v, None, scaling=0.25)
    assert failures == [1]
    monkeypatch.undo()  # the real conditions: never a CPU tensor, a mask, or one row
    assert not prompt_ops._cudnn_runs_here(module, q, k, v, None, 0.0, None)
