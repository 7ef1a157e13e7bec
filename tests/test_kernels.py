"""runtime/kernels.py on a CPU, through Triton's interpreter: each kernel against the eager math it
replaces, and Qwen3-Omni's fused decode steps (thinker, talker, code predictor) with the kernels against
the same steps without them. The GPU's figures and its own parity tests are in tests/test_gpu.py.

Triton is not a dependency of the CPU package; CI (.ci/run) installs it, and there a missing triton
fails these tests instead of skipping them."""

from __future__ import annotations

import copy
import importlib
import os

import pytest
import torch
import torch.nn.functional as F

from omni_cli.runtime import fused

# float16: the interpreter rounds a cast to bfloat16 toward zero where a GPU rounds to nearest; its float16
# casts round as a GPU's. The kernels do the same with either: they cast to the activations' dtype.
DT = torch.float16


@pytest.fixture(scope="module")
def kernels():
    if os.environ.get("TRITON_INTERPRET") != "1":  # set by conftest.py where there is no GPU
        pytest.skip("a machine with a GPU: tests/test_gpu.py runs the kernels there")
    try:
        import triton  # noqa: F401
    except ImportError:
        if os.environ.get("OMNI_CI", "") not in ("", "0"):
            pytest.fail("triton is missing: .ci/run installs it for these tests")
        pytest.skip("triton is not installed")
    return importlib.import_module("omni_cli.runtime.kernels")


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in units of b's spacing in DT (at least that of 1/64)."""
    spacing = torch.maximum(b.float().abs(), torch.tensor(1 / 64)) * torch.finfo(DT).eps
    return ((a.float() - b.float()).abs() / spacing).max().item()


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


def test_qwen3_steps_with_the_kernels_equal_the_steps_without(kernels, monkeypatch):
    """The tiny model's three stacks (MoE thinker, MoE talker with a shared expert, the dense code
    predictor with its two-row first step), in half precision: each fused step with the kernels gives
    the hidden state it gives without them, to the rounding of the dtype."""
    import qwen3_reference as ref
    from omni_cli.runtime import compat
    from omni_cli.runtime.kv_cache import StaticKVCache

    model = copy.deepcopy(ref.model("tiny")).to(DT)  # the helper's model is shared by other tests
    talker = model.talker
    stacks = [(compat.thinker_text_model(model.thinker), model.config.thinker_config.text_config, True),
              (talker.model, model.config.talker_config.text_config, True),
              (talker.code_predictor.model, model.config.talker_config.code_predictor_config, False)]

    def forced(device):
        fused._kernels = kernels
        return True

    for stack, config, mrope in stacks:
        outs = []
        for use in (False, True):
            monkeypatch.setattr(fused, "kernels_wanted", forced if use else (lambda device: False))
            cache = StaticKVCache.for_config(config, 8, device="cpu", dtype=DT)
            dec = fused.FusedDecoder(stack, cache, mrope=mrope, as_sum=True)
            assert dec.kernels is use
            torch.manual_seed(2)
            width = config.hidden_size
            with torch.no_grad():
                steps = [dec.step(torch.randn(1, 2, width, dtype=DT), torch.tensor([0, 1]), 8)]
                steps += [dec.step(torch.randn(1, 1, width, dtype=DT), torch.tensor([p]), 8) for p in (2, 3)]
            outs.append(torch.cat(steps, dim=1))
        without, with_kernels = outs
        assert ulps(with_kernels, without) <= 4, type(stack).__name__


def test_the_kernels_are_wanted_on_cuda_only_and_can_be_turned_off(kernels, monkeypatch):
    monkeypatch.delenv("OMNI_NO_KERNELS", raising=False)
    assert fused.kernels_wanted(torch.device("cuda")) is (torch.version.hip is None)
    assert fused.kernels_wanted(torch.device("cpu")) is False
    monkeypatch.setenv("OMNI_NO_KERNELS", "1")
    assert fused.kernels_wanted(torch.device("cuda")) is False
