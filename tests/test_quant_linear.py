"""quant/linear.py: QuantLinear against F.linear over the dequantized weight, quantize_linears on a toy
transformer-like module against the same module with each weight replaced by its dequantized self, the
packed buffers through module dtype casts and state_dict, and (through Triton's interpreter) the kernel
path against the reference path."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from interpreted import DT, kernel_module, ulps
from omni_cli.quant.formats import QuantSpec, quantize_fp8, quantize_int4
from omni_cli.quant.linear import QuantLinear, quantize_linears

SPECS = {
    "int4-g32": QuantSpec("int4", group_size=32, scale_dtype="float16"),
    "int4-g64-zeros": QuantSpec("int4", group_size=64, symmetric=False, scale_dtype="bfloat16"),
    "int4-row": QuantSpec("int4", group_size=None),
    "fp8-block": QuantSpec("fp8", block=(32, 64), scale_dtype="float32"),
    "fp8-row": QuantSpec("fp8", block=None, scale_dtype="bfloat16"),
}


def rtn(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The float32 weight `spec`'s round-to-nearest stands for, straight from formats."""
    sdt = getattr(torch, spec.scale_dtype)
    if spec.kind == "int4":
        return quantize_int4(weight, spec.group_size, spec.symmetric, sdt).dequantize(torch.float32)
    return quantize_fp8(weight, spec.block, sdt).dequantize(torch.float32)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("bias", [False, True])
def test_forward_on_cpu_is_f_linear_over_the_dequantized_weight(name, bias):
    torch.manual_seed(len(name) + bias)
    spec = SPECS[name]
    lin = nn.Linear(128, 72, bias=bias)
    q = QuantLinear.from_linear(lin, spec)
    x = torch.randn(3, 5, 128)
    assert q.packed.spec == spec and q.packed.shape == (72, 128)
    want = F.linear(x, q.packed.dequantize(torch.float32), lin.bias)
    assert torch.equal(q(x), want)
    assert torch.equal(q(x), F.linear(x, rtn(lin.weight.detach(), spec), lin.bias))
    # and it is a quantized weight, not the original one
    assert not torch.equal(q(x), lin(x))
    assert (q(x) - lin(x)).norm() / lin(x).norm() < (0.2 if spec.kind == "int4" else 0.05)


class Block(nn.Module):
    def __init__(self, d: int, f: int, experts: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, experts, bias=False)  # a router: kept whole
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(d, f, bias=False), "up_proj": nn.Linear(d, f, bias=False),
                                  "down_proj": nn.Linear(f, d, bias=False)})
        self.norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        att = torch.softmax(self.q_proj(x) @ self.k_proj(x).transpose(-1, -2) / x.shape[-1] ** 0.5, -1)
        h = h + self.o_proj(att @ self.v_proj(x))
        mix = torch.softmax(self.gate(h), -1).sum(-1, keepdim=True)
        m = self.mlp
        return h + mix * m["down_proj"](F.silu(m["gate_proj"](h)) * m["up_proj"](h))


class Toy(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 128, f: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, f, 4) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def skip(name: str) -> bool:
    return name == "lm_head" or name.endswith(".gate")


@pytest.mark.parametrize("name", ["int4-g64-zeros", "fp8-block"])
def test_quantize_linears_is_the_model_with_dequantized_weights(name):
    torch.manual_seed(1)
    spec = SPECS[name]
    model = Toy().eval()
    ref = copy.deepcopy(model)
    expected = []
    for n, sub in ref.named_modules():
        if isinstance(sub, nn.Linear) and not skip(n):
            expected.append(n)
            sub.weight.data = rtn(sub.weight.data, spec)
    ids = torch.randint(0, 50, (2, 7))
    before = model(ids)
    with torch.no_grad():
        done = quantize_linears(model, spec, skip)
    assert sorted(done.names) == sorted(expected) and len(expected) == 2 * 7
    for n, sub in model.named_modules():
        if n in expected:
            assert isinstance(sub, QuantLinear)
        elif n:
            assert not isinstance(sub, QuantLinear)
    assert type(model.lm_head) is nn.Linear and type(model.layers[1].gate) is nn.Linear
    out = model(ids)
    assert torch.equal(out, ref(ids))  # bit-equal: the same F.linear over the same weights
    assert not torch.equal(out, before)
    assert done.bytes_before == sum(ref.get_submodule(n).weight.numel() * 4 for n in expected)


def test_bytes_int4_g128_float16_scales():
    model = Toy(d=128, f=256).half()
    spec = QuantSpec("int4", group_size=128, scale_dtype="float16")
    shapes = [tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not skip(n)]
    done = quantize_linears(model, spec, skip)
    assert done.bytes_before == sum(n * k * 2 for n, k in shapes)
    assert done.bytes_after == sum(n * k // 2 + n * (k // 128) * 2 for n, k in shapes)  # nibbles + fp16 scales
    assert done.bytes_after < done.bytes_before / 3
    assert done.bytes_after == sum(m.weight_bytes for m in model.modules() if isinstance(m, QuantLinear))


def test_a_linear_under_two_names_is_quantized_once():
    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    done = quantize_linears(model, SPECS["int4-g32"], lambda n: False)
    assert done.names == ["0"] and model[0] is model[2] and isinstance(model[0], QuantLinear)
    kept = nn.Sequential(shared, nn.ReLU(), shared)
    assert quantize_linears(kept, SPECS["int4-g32"], lambda n: n == "2").names == []


def test_what_module_casts_do_to_buffers():
    """The fact QuantLinear works around: .half() casts float8 buffers, leaves integer ones."""
    m = nn.Module()
    m.register_buffer("codes", torch.zeros(4, dtype=torch.int32))
    m.register_buffer("f8", torch.zeros(4).to(torch.float8_e4m3fn))
    m.half()
    assert m.codes.dtype == torch.int32 and m.f8.dtype == torch.float16


@pytest.mark.parametrize("name", sorted(SPECS))
def test_casts_and_state_dict_keep_the_packed_dtypes(name):
    torch.manual_seed(2)
    spec = SPECS[name]
    q = QuantLinear.from_linear(nn.Linear(128, 64, bias=True), spec)
    want = {"qweight": torch.int32 if spec.kind == "int4" else torch.float8_e4m3fn,
            "scales": getattr(torch, spec.scale_dtype)}
    x = torch.randn(4, 128)
    y = q(x)
    packed = (q.packed.qweight.clone(), q.packed.scales.clone())
    for cast in (lambda m: m.half(), lambda m: m.to(torch.float16), lambda m: m.to(torch.bfloat16),
                 lambda m: m.float(), lambda m: m.to("cpu", torch.float16)):
        cast(q)
        p = q.packed
        assert p.qweight.dtype == want["qweight"] and p.scales.dtype == want["scales"]
        assert torch.equal(p.qweight.view(torch.uint8), packed[0].view(torch.uint8))
        assert torch.equal(p.scales, packed[1])
        if p.zeros is not None:
            assert p.zeros.dtype == torch.uint8
    assert q.bias is not None and q.bias.dtype == torch.float16  # the last cast: the bias follows
    q.float()
    assert torch.allclose(q(x), y, atol=1e-2)
    q.bias = None
    y = q(x)
    # a state_dict round trip, through torch.save, into another layer of the same shape
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    assert all(not t.is_floating_point() for t in state.values())
    other = QuantLinear.from_linear(nn.Linear(128, 64, bias=False), spec)
    assert not torch.equal(other(x), y)
    other.load_state_dict(state)
    assert torch.equal(other(x), y)
    assert other.packed.qweight.dtype == want["qweight"]


def test_cpu_auto_never_calls_a_kernel(monkeypatch):
    import sys
    q = QuantLinear.from_linear(nn.Linear(64, 32), SPECS["int4-g32"])
    monkeypatch.setitem(sys.modules, "omni_cli.runtime.quant_kernels", None)  # importing it would fail
    x = torch.randn(1, 64, dtype=torch.float16)
    assert q.kernel == "auto"
    assert torch.equal(q(x), F.linear(x, q.packed.dequantize(torch.float16), q.bias.half()))


# --- the kernel path, through Triton's interpreter ------------------------------------------------------


@pytest.fixture(scope="module")
def qk():
    return kernel_module("omni_cli.runtime.quant_kernels")




@pytest.mark.parametrize("rows,bias", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_kernel_path_is_the_reference_path(qk, monkeypatch, name, rows, bias):
    """Within 1 ulp of float16 of the exact product (the kernels apply the scales to partial sums, so they
    match the weight as dequantized in float32, where the reference path rounds it to x's dtype first: the
    two agree to the weights' rounding, `rel` < 2e-3); with a bias, added after the kernel's rounding (the
    reference adds it before its one rounding), within 1 ulp of the product plus 1 of the sum (a sum that
    cancels has a small ulp)."""
    torch.manual_seed(rows)
    calls = []
    for fn in ("int4_gemv", "fp8_gemv"):
        real = getattr(qk, fn)
        monkeypatch.setattr(qk, fn, lambda *a, _real=real, _fn=fn, **k: calls.append(_fn) or _real(*a, **k))
    q = QuantLinear.from_linear(nn.Linear(128, 40, bias=bias), SPECS[name]).half()
    if bias:
        assert q.bias is not None
        q.bias.data = torch.randn(40, dtype=DT)  # large enough to matter
    x = torch.randn(rows, 128, dtype=DT)
    q.kernel = "off"
    eager = q(x)
    bias32 = None if q.bias is None else q.bias.float()
    ref = F.linear(x.float(), q.packed.dequantize(torch.float32), bias32).to(DT)
    q.kernel = "on"
    y = q(x)
    assert ((y.float() - eager.float()).norm() / eager.float().norm()).item() < 2e-3
    assert calls == [SPECS[name].kind + "_gemv"]
    assert y.shape == ref.shape and y.dtype == DT
    if not bias:
        assert ulps(y, ref) <= 1
        return
    assert q.bias is not None
    product = (ref.float() - q.bias.float()).abs()
    bound = (torch.maximum(product, torch.tensor(1 / 64)) + torch.maximum(ref.float().abs(), torch.tensor(1 / 64)))
    assert ((y.float() - ref.float()).abs() <= bound * torch.finfo(DT).eps).all()
    assert ulps(y, ref - q.bias) > 100  # the bias is really added


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_plain_steps_packed_layer_takes_its_norm_and_residual_into_one_launch(qk, monkeypatch, name):
    """runtime.fused.gemv over a packed layer: one kernel call with the norm and the residual inside it,
    equal to the steps it replaces (the norm, the layer, the add) within the norm's rounding; with a bias
    (which would come between the product and the residual) or the kernels off, those steps."""
    from omni_cli.runtime import fused

    torch.manual_seed(5)
    calls = []
    for fn in ("int4_gemv", "fp8_gemv"):
        real = getattr(qk, fn)
        monkeypatch.setattr(qk, fn, lambda *a, _real=real, _fn=fn, **k: calls.append((_fn, sorted(k))) or _real(*a, **k))
    q = QuantLinear.from_linear(nn.Linear(128, 40, bias=False), SPECS[name]).half()
    x, residual = torch.randn(1, 128, dtype=DT) * 2, torch.randn(1, 40, dtype=DT)
    norm = (torch.rand(128) + 0.5).to(DT)
    q.kernel = "off"
    steps = fused.gemv(x, q, norm=norm, eps=1e-6, residual=residual)
    assert calls == []
    q.kernel = "on"
    y = fused.gemv(x, q, norm=norm, eps=1e-6, residual=residual)
    assert len(calls) == 1 and {"norm", "residual"} <= set(calls[0][1])
    assert ((y.float() - steps.float()).norm() / steps.float().norm()).item() < 2e-3
    assert ((y.float() - (steps - residual).float()).norm() / y.float().norm()).item() > 0.1  # residual in
    with_bias = QuantLinear.from_linear(nn.Linear(128, 40), SPECS[name]).half()
    with_bias.kernel = "on"
    calls.clear()
    fused.gemv(x, with_bias, norm=norm, eps=1e-6, residual=residual)
    assert len(calls) == 1 and "residual" not in calls[0][1]  # the layer alone; the add after its bias
