"""omni_cli/quant: packed weights (formats.py) and quantization_config detection (detect.py).

Each on-disk layout is built here from its documented formula with numpy and explicit bit shifts (an
independent writer), and what formats.py unpacks must dequantize to the reference computed here by the
format's formula. Where the `compressed-tensors` package is installed, its own compressor and
decompressor are checked against ours as well (skipped where it is not)."""

from __future__ import annotations

import ast
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_cli.errors import ModelError
from omni_cli.quant import detect, formats

RNG_SEED = 30


def rng() -> np.random.Generator:
    return np.random.default_rng(RNG_SEED)


def words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] codes -> int32 words, element j in bits 4j..4j+3, by explicit shifts on uint32."""
    out = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for j in range(8):
        out |= (nibbles[..., j].astype(np.uint32) & 0xF) << np.uint32(4 * j)
    return out.view(np.int32)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


# --- packing --------------------------------------------------------------------------------------------


def test_int4_packing_is_eight_a_word_little_end_first_and_two_a_byte():
    codes = rng().integers(0, 16, size=(5, 24), dtype=np.uint8)
    packed = formats.pack_int4(t(codes))
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (5, 3)
    assert np.array_equal(packed.numpy(), words(codes.reshape(5, 3, 8)))
    assert torch.equal(formats.unpack_int4(packed), t(codes))
    as_bytes = formats.pack_int4_bytes(t(codes))
    assert np.array_equal(as_bytes.numpy(), (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
    assert torch.equal(formats.unpack_int4_bytes(as_bytes), t(codes))
    # a K that is not a multiple of 8 is padded with zero codes and cut back on unpacking
    odd = t(codes[:, :13])
    assert torch.equal(formats.unpack_int4(formats.pack_int4(odd), 13), odd)
    assert torch.equal(formats.unpack_int4_bytes(formats.pack_int4_bytes(odd), 13), odd)


# --- round trips ----------------------------------------------------------------------------------------


def group_steps(w: torch.Tensor, packed: formats.PackedWeight) -> torch.Tensor:
    """Each element's step s (its group's scale as stored), [N, K]."""
    n, k = w.shape
    s = packed.scales.float()
    return s.repeat_interleave(k // s.shape[1], 1)


@pytest.mark.parametrize("group_size", [32, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int4_round_trip_is_within_half_a_step(group_size, symmetric, scale_dtype):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * 0.05 + (0.02 if not symmetric else 0.0)
    w[3, :32] = 0.0  # a group of zeros keeps a usable scale
    packed = formats.quantize_int4(w, group_size, symmetric, scale_dtype)
    assert packed.spec.kind == "int4" and packed.spec.symmetric is symmetric and packed.spec.group_size == group_size
    assert packed.qweight.shape == (48, 16) and packed.scales.shape == (48, 128 // (group_size or 128))
    assert packed.scales.dtype == scale_dtype and (packed.zeros is None) is symmetric
    groups = 128 // (group_size or 128)
    assert packed.nbytes == 48 * 128 // 2 + 48 * groups * (packed.scales.element_size() + (0 if symmetric else 1))
    err = (packed.dequantize() - w).abs()
    step = group_steps(w, packed)
    # half a step; a scale rounded to its dtype may have shrunk by up to half that dtype's eps (bfloat16:
    # 2**-8, float32: 2**-24) of itself, and the clipped end of the range then misses by that share of
    # 7.5 (symmetric) or 15 steps more; 1e-6 for float32's own arithmetic
    slack = 15 * torch.finfo(scale_dtype).eps / 2 + 1e-6
    assert (err <= step * (0.5 + slack)).all(), (err / step).max()
    assert torch.equal(packed.dequantize()[3, :32], torch.zeros(32))
    codes = formats.unpack_int4(packed.qweight)
    assert codes.min() == 0 or codes.max() == 15  # the range is used


@pytest.mark.parametrize("block", [(128, 128), (16, 32), None])
def test_fp8_round_trip_is_within_e4m3s_rounding(block):
    torch.manual_seed(1)
    w = torch.randn(130, 200) * torch.logspace(-3, 0, 200)  # columns of very different sizes
    packed = formats.quantize_fp8(w, block)
    n_rows, n_cols = (130, 1) if block is None else (math.ceil(130 / block[0]), math.ceil(200 / block[1]))
    assert packed.qweight.dtype == torch.float8_e4m3fn and packed.scales.shape == (n_rows, n_cols)
    err = (packed.dequantize() - w).abs()
    s = packed.scales if block is None else packed.scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:130, :200]
    # e4m3: 3 mantissa bits, so half a unit in the last place is 2**-4 of a normal value; below 2**-6
    # (the smallest normal) the spacing is 2**-9, half of it 2**-10, times the scale
    bound = torch.maximum(w.abs() * 2**-4, s * 2**-10) * (1 + 1e-6)
    assert (err <= bound).all()
    assert packed.qweight.float().abs().max() == formats.FP8_MAX  # each scale puts its largest at 448


# --- GPTQ -----------------------------------------------------------------------------------------------


def gptq_case(n=24, k=64, g=16, v1=True):
    r = rng()
    codes = r.integers(0, 16, size=(k, n), dtype=np.uint8)  # W^T's codes, [K, N]
    zeros = r.integers(1, 16, size=(k // g, n), dtype=np.uint8)
    scales = (r.random((k // g, n)) * 0.01 + 0.001).astype(np.float16)
    qweight = words(codes.reshape(k // 8, 8, n).transpose(0, 2, 1))  # packed along K: [K/8, N]
    stored = (zeros - 1) if v1 else zeros
    qzeros = words(stored.reshape(k // g, n // 8, 8))  # packed along N: [K/g, N/8]
    ref = np.zeros((n, k), dtype=np.float32)
    for kk in range(k):
        for nn in range(n):
            ref[nn, kk] = (int(codes[kk, nn]) - int(zeros[kk // g, nn])) * np.float32(scales[kk // g, nn])
    return t(qweight), t(qzeros), t(scales), ref


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_unpacks_to_its_formula(v1):
    qweight, qzeros, scales, ref = gptq_case(v1=v1)
    g_idx = torch.arange(64, dtype=torch.int32) // 16
    packed = formats.from_gptq(qweight, qzeros, scales, g_idx, group_size=16, v1=v1)
    assert packed.shape == (24, 64) and packed.qweight.shape == (24, 8) and packed.scales.dtype == torch.float16
    assert packed.spec.group_size == 16 and not packed.spec.symmetric
    assert np.array_equal(packed.dequantize().numpy(), ref)


def test_gptq_symmetric_drops_its_zeros_and_act_order_is_refused():
    r = rng()
    codes = r.integers(0, 16, size=(32, 8), dtype=np.uint8)
    qweight = t(words(codes.reshape(4, 8, 8).transpose(0, 2, 1)))
    qzeros = t(np.full((1, 1), 0x77777777, dtype=np.int64).astype(np.int32))  # v1: 8 - 1 in every nibble
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    packed = formats.from_gptq(qweight, qzeros, scales, None, group_size=-1)
    assert packed.zeros is None and packed.spec.symmetric and packed.spec.group_size is None
    assert np.array_equal(packed.dequantize().numpy(), ((codes.astype(np.float32) - 8) * 0.5).T)
    shuffled = torch.randperm(32, generator=torch.Generator().manual_seed(0)).to(torch.int32) // 8
    with pytest.raises(ModelError, match="act-order"):
        formats.from_gptq(qweight, t(np.zeros((4, 1), np.int32)), torch.ones(4, 8), shuffled, group_size=8)


# --- AWQ ------------------------------------------------------------------------------------------------


def test_awq_gemm_unpacks_its_interleaved_order():
    r = rng()
    n, k, g = 16, 64, 32
    codes = r.integers(0, 16, size=(k, n), dtype=np.uint8)
    zeros = r.integers(0, 16, size=(k // g, n), dtype=np.uint8)
    scales = (r.random((k // g, n)) * 0.01 + 0.001).astype(np.float16)
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of word c holds column 8c + order[i]

    def awq_pack(a):
        out = np.zeros((a.shape[0], a.shape[1] // 8), dtype=np.uint32)
        for c in range(a.shape[1] // 8):
            for i in range(8):
                out[:, c] |= a[:, 8 * c + order[i]].astype(np.uint32) << np.uint32(4 * i)
        return out.view(np.int32)

    packed = formats.from_awq(t(awq_pack(codes)), t(awq_pack(zeros)), t(scales), group_size=g)
    ref = np.array([[(int(codes[kk, nn]) - int(zeros[kk // g, nn])) * np.float32(scales[kk // g, nn])
                     for kk in range(k)] for nn in range(n)], dtype=np.float32)
    assert np.array_equal(packed.dequantize().numpy(), ref)
    with pytest.raises(ModelError, match="do not fit"):
        formats.from_awq(t(awq_pack(codes)), t(awq_pack(zeros)), t(scales[:, :8]), group_size=g)


# --- compressed-tensors pack-quantized ------------------------------------------------------------------


def ct_case(symmetric: bool, group: int | None, n=24, k=64):
    """By hand from compressed-tensors' formula: signed q in -8..7 stored as q + 8, element i of a row at
    bit 4i; a signed zero point likewise, packed along N."""
    r = rng()
    groups = 1 if group is None else k // group
    q = r.integers(-8, 8, size=(n, k))
    zp = np.zeros((n, groups), dtype=np.int64) if symmetric else r.integers(-8, 8, size=(n, groups))
    scale = (r.random((n, groups)) * 0.01 + 0.001).astype(np.float32)
    packed = words((q + 8).reshape(n, k // 8, 8))
    zp_packed = words((zp + 8).T.reshape(groups, n // 8, 8)).T  # [N/8, groups]
    per = k // groups
    ref = np.array([[(q[a, b] - zp[a, b // per]) * scale[a, b // per] for b in range(k)] for a in range(n)],
                   dtype=np.float32)
    return t(packed), t(scale), (None if symmetric else t(zp_packed)), ref


@pytest.mark.parametrize("symmetric,group", [(True, 32), (False, 16), (True, None), (False, None)])
def test_compressed_tensors_pack_quantized_unpacks_to_its_formula(symmetric, group):
    packed_t, scale, zp, ref = ct_case(symmetric, group)
    packed = formats.from_compressed_tensors_int4(packed_t, scale, torch.tensor([24, 64]), zp)
    assert packed.spec.symmetric is symmetric and packed.spec.group_size == group
    assert np.allclose(packed.dequantize().numpy(), ref, rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def ct():
    try:
        import compressed_tensors
    except ImportError:
        if os.environ.get("OMNI_CI", "") not in ("", "0"):
            pytest.fail("compressed-tensors is missing: the test extra installs it for these tests")
        pytest.skip("compressed-tensors is not installed")
    return compressed_tensors


@pytest.mark.parametrize("symmetric,strategy", [(True, "group"), (False, "group"), (True, "channel"), (False, "channel")])
def test_compressed_tensors_own_compressor_agrees_int4(ct, symmetric, strategy):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    torch.manual_seed(2)
    n, k, g = 16, 96, 32
    w = torch.randn(n, k) * 0.05 + 0.01
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=g if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    wg = w.reshape(n, -1, g if strategy == "group" else k)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp.to(torch.int8)}
    disk = PackedQuantizationCompressor.compress(state, scheme)
    theirs = PackedQuantizationCompressor.decompress(disk, scheme)["weight"]
    ours = formats.from_compressed_tensors_int4(disk["weight_packed"], disk["weight_scale"], disk["weight_shape"],
                                                disk.get("weight_zero_point"))
    assert torch.equal(ours.dequantize(), theirs.float())
    # and our own round-to-nearest makes the same scales and codes as theirs
    mine = formats.quantize_int4(w, g if strategy == "group" else None, symmetric)
    assert torch.allclose(mine.scales, scale, rtol=1e-6)
    assert (mine.qweight == disk["weight_packed"]).float().mean() > 0.99  # a tie may round the other way


@pytest.mark.parametrize("strategy", ["channel", "block", "tensor"])
def test_compressed_tensors_own_compressor_agrees_fp8(ct, strategy):
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    torch.manual_seed(3)
    n, k = 40, 72
    w = torch.randn(n, k)
    block = (16, 32)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                            block_structure=list(block) if strategy == "block" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    if strategy == "tensor":
        scale = (w.abs().amax() / formats.FP8_MAX).reshape(1)
    else:
        scale = formats.quantize_fp8(w, block if strategy == "block" else None).scales
    disk = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert disk["weight"].dtype == torch.float8_e4m3fn
    theirs = FloatQuantizationCompressor.decompress(disk, scheme)["weight"]
    ours = formats.from_compressed_tensors_fp8(disk["weight"], disk["weight_scale"], strategy,
                                               block if strategy == "block" else None)
    assert torch.equal(ours.dequantize(), theirs.float())


# --- block FP8 ------------------------------------------------------------------------------------------


def test_fp8_block_weight_scale_inv_multiplies_each_128_block():
    r = rng()
    n, k = 130, 260  # a partial block at each edge
    w8 = torch.from_numpy(r.standard_normal((n, k)).astype(np.float32) * 50).to(torch.float8_e4m3fn)
    inv = r.random((2, 3)).astype(np.float32) + 0.01
    packed = formats.from_fp8_block(w8, t(inv), (128, 128))
    w = w8.float().numpy()
    ref = np.array([[w[a, b] * inv[a // 128, b // 128] for b in range(k)] for a in range(n)], dtype=np.float32)
    assert np.array_equal(packed.dequantize().numpy(), ref)
    with pytest.raises(ModelError, match="do not fit"):
        formats.from_fp8_block(w8, t(inv[:, :2]))
    with pytest.raises(ModelError, match="float8_e4m3fn"):
        formats.from_fp8_block(w8.float(), t(inv))


# --- detect ---------------------------------------------------------------------------------------------

GPTQ = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "damp_percent": 0.01,
        "quant_method": "gptq", "checkpoint_format": "gptq", "true_sequential": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True,
       "modules_to_not_convert": ["visual", "audio_tower"]}
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                       "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                   "group_size": 32, "dynamic": False, "actorder": None,
                                                   "observer": "minmax"}}},
         "ignore": ["re:.*audio_tower.*", "re:.*visual.*", "re:^talker\\..*", "lm_head"]}
FP8_CT = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"],
                                        "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                    "strategy": "block", "block_structure": [128, 128], "dynamic": False},
                                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                                              "group_size": 128, "dynamic": True}}},
          "ignore": ["lm_head"]}
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["thinker.audio_tower", "code2wav"]}


def test_detect_reads_each_kind():
    (q,) = detect.detect({"model_type": "qwen2_5_omni", "quantization_config": GPTQ})
    assert (q.method, q.format, q.kind, q.bits, q.group_size, q.symmetric, q.where) == (
        "gptq", "gptq", "int4", 4, 128, True, "")
    (q,) = detect.detect({"thinker_config": {"quantization_config": AWQ}})
    assert (q.method, q.format, q.group_size, q.symmetric, q.ignore, q.where) == (
        "awq", "gemm", 128, False, ("visual", "audio_tower"), "thinker_config")
    (q,) = detect.detect({"quantization_config": W4A16})
    assert (q.method, q.format, q.kind, q.group_size, q.symmetric, q.strategy, q.targets) == (
        "compressed-tensors", "pack-quantized", "int4", 32, True, "group", ("Linear",))
    assert q.ignore == ("re:.*audio_tower.*", "re:.*visual.*", "re:^talker\\..*", "lm_head")
    (q,) = detect.detect({"quantization_config": FP8_CT})
    assert (q.kind, q.bits, q.block, q.strategy, q.ignore) == ("fp8", 8, (128, 128), "block", ("lm_head",))
    both = detect.detect({"thinker_config": {"quantization_config": FP8_BLOCK},
                          "talker_config": {"quantization_config": FP8_BLOCK}})
    assert [(q.method, q.block, q.where) for q in both] == [("fp8", (128, 128), "thinker_config"),
                                                          ("fp8", (128, 128), "talker_config")]
    assert both[0].ignore == ("thinker.audio_tower", "code2wav")
    assert detect.detect({"model_type": "qwen3_omni_moe", "thinker_config": {}}) == ()
    channel = {**W4A16, "config_groups": {"g": {**W4A16["config_groups"]["group_0"],
                                                "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                            "strategy": "channel"}}}}
    (q,) = detect.detect({"quantization_config": channel})
    assert (q.group_size, q.symmetric, q.strategy) == (None, False, "channel")


@pytest.mark.parametrize("config,says", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({**GPTQ, "bits": 8}, "GPTQ with 8 bits"),
    ({**GPTQ, "desc_act": True}, "act-order"),
    ({**AWQ, "version": "gemv"}, "AWQ version 'gemv'"),
    ({**W4A16, "format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized'"),
    ({**W4A16, "config_groups": {"g": {**W4A16["config_groups"]["group_0"],
                                       "input_activations": {"num_bits": 8, "type": "int"}}}}, "quantized activations"),
    ({**FP8_BLOCK, "weight_block_size": None}, "weight_block_size"),
])
def test_detect_names_what_is_not_supported_in_one_line(config, says):
    with pytest.raises(ModelError, match="not supported") as caught:
        detect.detect({"thinker_config": {"quantization_config": config}})
    message = str(caught.value)
    assert says in message and "\n" not in message and message.startswith("thinker_config.quantization_config:")


def test_detect_imports_no_torch():
    tree = ast.parse(Path(detect.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] in ("torch", "numpy", "transformers")]
