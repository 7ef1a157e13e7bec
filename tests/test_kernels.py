"""runtime/kernels.py on a CPU, through Triton's interpreter: each kernel against the eager math it
replaces, and Qwen3-Omni's fused decode steps (thinker, talker, code predictor) with the kernels against
the same steps without them. The GPU's figures and its own parity tests are in tests/test_gpu.py.

Triton is not a dependency of the CPU package; CI (.ci/run) installs it, and there a missing triton
fails these tests instead of skipping them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from interpreted import DT, kernel_module, ulps
from omni_cli.runtime import fused


@pytest.fixture(scope="module")
def kernels():
    return kernel_module("omni_cli.runtime.kernels")




@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_does_the_norm_the_gate_and_the_residual_of_the_eager_layer(kernels, rows):
    torch.manual_seed(0)
    N, K = 40, 96  # neither a multiple of the kernel's blocks
    w = torch.randn(N, K, dtype=DT) * 0.1
    x = torch.randn(1, rows, K, dtype=DT) * 3
    norm_w = torch.rand(K, dtype=DT) + 0.5
    res = torch.randn(1, rows, N, dtype=DT)
    gate_up = torch.randn(1, rows, 2 * K, dtype=DT)

    def product(inp):
        return F.linear(inp.float(), w.float()).to(DT)

    assert ulps(kernels.gemv(x, w), product(x)) <= 1
    assert ulps(kernels.gemv(x, w, norm=norm_w, eps=1e-6), product(fused.rms_norm(x, norm_w, 1e-6))) <= 1
    assert ulps(kernels.gemv(gate_up, w, gate=True, residual=res), res + product(fused.gated(gate_up))) <= 1
    assert ulps(kernels.gemv(x, w, residual=res), res + product(x)) <= 1
    # Each part is really done: without the norm, the gate or the residual the results are far off.
    assert ulps(kernels.gemv(x, w), product(fused.rms_norm(x, norm_w, 1e-6))) > 8
    assert ulps(kernels.gemv(gate_up[..., :K], w, residual=res), res + product(fused.gated(gate_up))) > 8


def test_picked_gemv_is_the_eager_experts(kernels):
    torch.manual_seed(1)
    E, H, I, k = 6, 48, 40, 3
    gate_up = torch.randn(E, 2 * I, H, dtype=DT) * 0.1
    down = torch.randn(E, H, I, dtype=DT) * 0.1
    x = torch.randn(1, H, dtype=DT)
    idx = torch.tensor([[4, 0, 2]])
    weight = torch.softmax(torch.randn(1, k), -1).to(DT)
    h_ref = fused.picked_matvec(gate_up, idx, x.unsqueeze(1))  # [1, k, 2I]
    out_ref = (fused.picked_matvec(down, idx, fused.gated(h_ref)) * weight.unsqueeze(-1)).sum(dim=1)
    h = kernels.picked_gemv(x[0], gate_up, idx[0])
    assert ulps(h, h_ref[0]) <= 1
    assert ulps(kernels.picked_gemv(h, down, idx[0], weights=weight[0], gate=True), out_ref[0]) <= 1
    res = torch.randn(H, dtype=DT)
    assert ulps(kernels.picked_gemv(h, down, idx[0], weights=weight[0], gate=True, residual=res),
                res + out_ref[0]) <= 1
    # The picks are read by index: other experts give another result.
    assert ulps(kernels.picked_gemv(x[0], gate_up, torch.tensor([1, 0, 2])), h_ref[0]) > 8


@pytest.mark.parametrize("heads, kv, span, pos, norm, split", [
    (4, 2, 8, 5, True, False), (4, 1, 100, 77, True, False), (2, 2, 16, 0, True, False), (4, 2, 100, 99, False, False),
    # over ATTEND_MAX_SPAN (made 32 here): parts of 16 rows, the last of them past `pos` (empty), row `pos`
    # in a part of its own or mid-part, and a span whose parts are all full
    (4, 2, 100, 77, True, True), (4, 1, 100, 64, True, True), (2, 2, 48, 0, False, True), (4, 2, 128, 127, True, True),
    (7, 1, 100, 50, False, True), (6, 2, 90, 89, True, True),  # groups of 7 and 3 heads (the 7B's), padded to 16
], ids=lambda v: str(v))
def test_attend_is_the_eager_attention_block(kernels, heads, kv, span, pos, norm, split, monkeypatch):
    """One token's attention (per-head norms, RoPE, the cache write, softmax over rows 0..pos) in one launch
    against `fused.attention`'s eager ops: spans of one and of two row blocks, grouped and plain heads, the
    first and the last row of a span; over ATTEND_MAX_SPAN rows, split over programs and joined."""
    if split:  # parts of 16 rows a head up to 64 rows, a group's parts of 16 past that
        monkeypatch.setattr(kernels, "ATTEND_MAX_SPAN", 32)
        monkeypatch.setattr(kernels, "ATTEND_SPLIT_ROWS", 16)
        monkeypatch.setattr(kernels, "ATTEND_GROUP_FROM", 64)
        monkeypatch.setattr(kernels, "ATTEND_GROUP_ROWS", 16)
    torch.manual_seed(3)
    D, L, eps = 32, 128, 1e-6
    qkv = torch.randn(1, 1, (heads + 2 * kv) * D, dtype=DT)
    q_w, k_w = torch.rand(D, dtype=DT) + 0.5, torch.rand(D, dtype=DT) + 0.5
    angle = torch.rand(D // 2) * 6
    cos, sin = torch.cat([angle.cos()] * 2).to(DT), torch.cat([angle.sin()] * 2).to(DT)
    keys, values = torch.randn(1, kv, L, D, dtype=DT), torch.randn(1, kv, L, D, dtype=DT)
    k_ref, v_ref = keys.clone(), values.clone()
    p = torch.tensor([pos])

    q, k, v = (t.view(1, 1, -1, D) for t in qkv.split([heads * D, kv * D, kv * D], dim=-1))
    if norm:
        q, k = fused.rms_norm(q, q_w, eps), fused.rms_norm(k, k_w, eps)
    q, k = fused.rotate(q.transpose(1, 2), cos, sin), fused.rotate(k.transpose(1, 2), cos, sin)
    k_ref.index_copy_(2, p, k)
    v_ref.index_copy_(2, p, v.transpose(1, 2))
    valid = (torch.arange(span) <= pos).view(1, 1, 1, span)
    want = F.scaled_dot_product_attention(q.float(), k_ref[:, :, :span].float(), v_ref[:, :, :span].float(),
                                          attn_mask=valid, scale=D ** -0.5, enable_gqa=True).to(DT)

    got = kernels.attend(qkv, q_w if norm else None, k_w if norm else None, cos, sin, keys, values, p, span, eps,
                         D ** -0.5, heads)
    assert torch.equal(keys, k_ref) and torch.equal(values, v_ref)  # the new row written, nothing else
    assert ulps(got, want.transpose(1, 2).reshape(-1)) <= 2
    # Really the masked softmax over rows 0..pos: attending to the whole span instead is far off.
    everything = F.scaled_dot_product_attention(q.float(), k_ref[:, :, :span].float(), v_ref[:, :, :span].float(),
                                                scale=D ** -0.5, enable_gqa=True).to(DT)
    if pos < span - 1:
        assert ulps(got, everything.transpose(1, 2).reshape(-1)) > 8


def _forced(kernels):
    """A stand-in for `fused.kernels_wanted` / `attend_wanted` that says yes on the CPU."""
    def wanted(device):
        fused._kernels = kernels
        return True
    return wanted


def _four_steps(dec, width: int, dtype, seed: int) -> torch.Tensor:
    """A fused stack's two-row first step, then two one-token steps (positions 2 and 3), on random inputs."""
    torch.manual_seed(seed)
    with torch.no_grad():
        steps = [dec.step(torch.randn(1, 2, width).to(dtype), torch.tensor([0, 1]), 8)]
        steps += [dec.step(torch.randn(1, 1, width).to(dtype), torch.tensor([p]), 8) for p in (2, 3)]
    return torch.cat(steps, dim=1)


def test_qwen3_steps_with_the_kernels_equal_the_steps_without(kernels, monkeypatch):
    """The tiny model's three stacks (MoE thinker, MoE talker with a shared expert, the dense code
    predictor with its two-row first step), in half precision: each fused step with the product kernels
    gives the hidden state it gives without them, to the rounding of the dtype. With the attention kernel
    too, the one-token steps are as close to the same steps in float32 as the library's attention is
    (the kernel's softmax is float32 where the CPU's half-precision attention rounds; they differ by more
    than a few units of the last place, and neither is the exact one)."""
    import qwen3_reference as ref
    from omni_cli.runtime import compat
    from omni_cli.runtime.kv_cache import StaticKVCache

    base = ref.model("tiny")  # shared by other tests: copied before the cast

    forced = _forced(kernels)

    def run(dtype, products: bool, attend: bool):
        monkeypatch.setattr(fused, "kernels_wanted", forced if products else (lambda device: False))
        monkeypatch.setattr(fused, "attend_wanted", forced if attend else (lambda device: False))
        model = copy.deepcopy(base).to(dtype)
        talker = model.talker
        stacks = [(compat.thinker_text_model(model.thinker), model.config.thinker_config.text_config, True),
                  (talker.model, model.config.talker_config.text_config, True),
                  (talker.code_predictor.model, model.config.talker_config.code_predictor_config, False)]
        outs = {}
        for stack, config, mrope in stacks:
            cache = StaticKVCache.for_config(config, 8, device="cpu", dtype=dtype)
            dec = fused.FusedDecoder(stack, cache, mrope=mrope, as_sum=True)
            assert (dec.kernels, dec.attend) == (products, attend)
            outs[type(stack).__name__] = _four_steps(dec, config.hidden_size, dtype, seed=2)
        return outs

    without, products, both = run(DT, False, False), run(DT, True, False), run(DT, True, True)
    exact = run(torch.float32, False, False)
    for name, want in without.items():
        assert ulps(products[name], want) <= 4, name
        # The one-token rows (positions 2 and 3), against float32: the kernel's error is no larger.
        err = {k: (v[name][:, 2:].float() - exact[name][:, 2:]).abs().max().item()
               for k, v in (("without", without), ("both", both))}
        assert err["both"] <= 1.1 * err["without"], (name, err)
        assert ulps(both[name], want) <= 64, name  # and close to the library's (a wrong kernel is far off)


def test_qwen25_steps_with_the_attention_kernel_are_as_close_as_the_librarys(kernels, monkeypatch):
    """Qwen2.5-Omni's thinker and talker (q/k/v with a bias, 3-D RoPE; their projections not `as_sum`),
    half precision: with the attention kernel, the one-token steps are as close to float32's as the
    library's attention is, and close to its steps."""
    from omni_cli.loader import TINY_MODEL_DIR, load_model
    from omni_cli.runtime import compat
    from omni_cli.runtime.kv_cache import StaticKVCache

    base = load_model(str(TINY_MODEL_DIR), device="cpu").model
    forced = _forced(kernels)

    def run(dtype, attend: bool):
        monkeypatch.setattr(fused, "attend_wanted", forced if attend else (lambda device: False))
        model = copy.deepcopy(base).to(dtype)
        stacks = [(compat.thinker_text_model(model.thinker), model.config.thinker_config.text_config),
                  (model.talker.model, model.config.talker_config)]
        outs = {}
        for stack, config in stacks:
            dec = fused.FusedDecoder(stack, StaticKVCache.for_config(config, 8, device="cpu", dtype=dtype))
            assert dec.attend is attend and not dec.kernels
            outs[type(stack).__name__] = _four_steps(dec, config.hidden_size, dtype, seed=5)
        return outs

    without, attend, exact = run(DT, False), run(DT, True), run(torch.float32, False)
    for name, want in without.items():
        err = {k: (v[name][:, 2:].float() - exact[name][:, 2:]).abs().max().item()
               for k, v in (("without", without), ("attend", attend))}
        assert err["attend"] <= 1.1 * err["without"], (name, err)
        # and near the library's (measured: 37 and 74 units; its half-precision softmax on the CPU rounds)
        assert ulps(attend[name], want) <= 128, name
        assert torch.equal(attend[name][:, :2], want[:, :2])  # the two-row first step: the library's


@pytest.mark.parametrize("grouped", [True, False], ids=["a-program-a-group", "a-program-a-head"])
def test_a_span_longer_than_one_program_reads_is_split_and_is_the_same_attention(kernels, monkeypatch, grouped):
    """Past `ATTEND_MAX_SPAN` rows a step's attention is split over programs (parts of
    `ATTEND_SPLIT_ROWS`; a program for each key/value head's group of query heads, or for each query head)
    and joined: the steps' hidden states equal those of the one-program kernel to the rounding of the
    dtype (the sums are regrouped), and differ from them where a part is lost."""
    import qwen3_reference as ref
    from omni_cli.runtime.kv_cache import StaticKVCache

    model = copy.deepcopy(ref.model("tiny")).to(DT)
    stack, config = model.talker.code_predictor.model, model.config.talker_config.code_predictor_config
    monkeypatch.setattr(fused, "attend_wanted", _forced(kernels))
    monkeypatch.setattr(kernels, "ATTEND_GROUPED", grouped)

    def run(limit: int, rows: int):
        monkeypatch.setattr(kernels, "ATTEND_MAX_SPAN", limit)
        monkeypatch.setattr(kernels, "ATTEND_SPLIT_ROWS", rows)
        monkeypatch.setattr(kernels, "ATTEND_GROUP_FROM", limit)
        monkeypatch.setattr(kernels, "ATTEND_GROUP_ROWS", rows)
        dec = fused.FusedDecoder(stack, StaticKVCache.for_config(config, 8, device="cpu", dtype=DT), mrope=False,
                                 as_sum=True)
        return _four_steps(dec, config.hidden_size, DT, seed=4)

    whole = run(1024, 256)
    assert ulps(run(4, 2), whole) <= 4  # span 8 > 4: four parts of two rows, one program each
    assert ulps(run(4, 4), whole) <= 4

    launched: list[str] = []
    wrap = torch.library.wrap_triton

    def spy(kernel, lose: bool = False):  # records each launch; `lose`: a join that reads part 0 only
        name = getattr(kernel, "fn", kernel).__name__
        launched.append(name)
        if lose and name == "_attend_join_kernel":
            return _Grid(lambda grid, *a, **kw: wrap(kernel)[grid](a[0], a[1], 1, **kw))
        return wrap(kernel)

    monkeypatch.setattr(torch.library, "wrap_triton", spy)
    run(4, 2)
    # the tiny code predictor's heads of 8 values are too narrow for the groups' products (tl.dot takes 16
    # or more): per-head parts, grouped or not (the groups' kernel: test_attend_is_the_eager_attention_block)
    assert {"_attend_part_kernel", "_attend_join_kernel"} <= set(launched)
    assert "_attend_kernel" not in launched and "_attend_group_kernel" not in launched
    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: spy(kernel, lose=True))
    assert ulps(run(4, 2)[:, 2:], whole[:, 2:]) > 8  # rows 2.. lost from the one-token steps: far off


class _Grid:
    """`launcher[grid](*args)` as a Triton kernel is launched, calling `fn(grid, *args)`."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kw: self.fn(grid, *args, **kw)


def test_the_kernels_are_wanted_on_cuda_only_and_can_be_turned_off(kernels, monkeypatch):
    """The hardware says where they can run (`kernels_wanted`); the runtime options whether they are asked
    for: `--no-kernels`, or OMNI_NO_KERNELS=1 / OMNI_NO_ATTEND=1 read once by `RuntimeOptions.from_env`. A
    stack whose policy has them off never uses them, even where the hardware has them."""
    import qwen3_reference as ref
    from omni_cli.config import RuntimeOptions
    from omni_cli.runtime.graphs import Policy
    from omni_cli.runtime.kv_cache import StaticKVCache

    assert fused.kernels_wanted(torch.device("cuda")) is (torch.version.hip is None)
    assert fused.kernels_wanted(torch.device("cpu")) is False
    assert RuntimeOptions.from_env(environ={}).kernels is True
    off = RuntimeOptions.from_env(environ={"OMNI_NO_KERNELS": "1", "OMNI_NO_ATTEND": "1"})
    assert off.kernels is False and off.attention_kernel is False
    assert RuntimeOptions.from_env(environ={"OMNI_NO_KERNELS": "1"}, kernels=True).kernels is True  # a flag wins

    forced = _forced(kernels)
    monkeypatch.setattr(fused, "kernels_wanted", forced)
    monkeypatch.setattr(fused, "attend_wanted", forced)
    model = copy.deepcopy(ref.model("tiny")).to(DT)
    stack, config = model.talker.code_predictor.model, model.config.talker_config.code_predictor_config
    for runtime, on in ((RuntimeOptions(), True), (off, False)):
        cache = StaticKVCache.for_config(config, 8, device="cpu", dtype=DT)
        dec = fused.FusedDecoder(stack, cache, policy=Policy.of(runtime, "cpu"), mrope=False, as_sum=True)
        assert (dec.kernels, dec.attend) == (on, on)
