"""Quantized checkpoint folders (quant/checkpoint.py reads them, quant/writing.py and omni-quantize write
them), built here from the built-in tiny models:

- GPTQ (v1, symmetric) and AWQ GEMM (zero points) Qwen2.5-Omni folders, the thinker only quantized as in the
  official Qwen2.5-Omni-7B-GPTQ-Int4 / -AWQ, written by small packers below (inverses of formats.from_gptq /
  from_awq, following the formats' documented layouts);
- compressed-tensors pack-quantized (group and channel, symmetric and with zero points) and float-quantized
  block FP8 Qwen3-Omni folders, compressed by compressed-tensors' own compressors, experts stored one by one
  as the community checkpoints store them, the talker left in float through `ignore`; and a block-FP8
  (`quant_method: fp8`, `weight_scale_inv`) one.

Checked: (a) the packed weights loaded dequantize to what the format's own code decompresses (compressed-tensors)
or to what the packers packed; ignored layers load as float, equal to the source; (b) the engine on a loaded
folder gives the greedy text ids and codes of transformers' `generate` on a float model holding the same weights
dequantized; (c) omni-quantize then load equals quantize_model at load, every tensor bit for bit, and the
config it writes is one compressed-tensors reads; (d) an unsupported config, a missing tensor, a wrong shape and
an unexpected tensor are one-line ModelErrors, and one `error:` line with a non-zero exit code from the CLI.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

import qwen3_reference as ref  # noqa: E402  (tests/ is on sys.path)
from safetensors.torch import load_file, save_file  # noqa: E402
from test_quant_parity import PROMPT, _generate  # noqa: E402
from torch import nn  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from omni_cli.assistant import Assistant  # noqa: E402
from omni_cli.config import RuntimeOptions  # noqa: E402
from omni_cli.errors import ModelError  # noqa: E402
from omni_cli.faces.quantize import quantize_app  # noqa: E402
from omni_cli.loader import TINY_MODEL_DIR, load_model  # noqa: E402
from omni_cli.prompt import Conversation, build_ids  # noqa: E402
from omni_cli.quant import formats  # noqa: E402
from omni_cli.quant.apply import dequantized, quantize_model  # noqa: E402
from omni_cli.quant.experts import QuantExperts  # noqa: E402
from omni_cli.quant.formats import QuantSpec  # noqa: E402
from omni_cli.quant.linear import QuantLinear  # noqa: E402

ASSET = {"qwen2_5": TINY_MODEL_DIR, "qwen3": ref.ASSET}
G = 16  # a group size (and FP8 block side) that divides every width of the tiny models
# the decoder layers' linears as the checkpoints name them (routers and the shared expert's gate excluded)
QUANTIZED = re.compile(r"^(?P<stack>thinker|talker)\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|"
                       r"mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj)$")


# --- packers: the on-disk layouts from the canonical one ------------------------------------------------


def to_gptq(p: formats.PackedWeight) -> dict:
    """GPTQ v1: qweight [K/8, N] (the canonical words transposed), qzeros [K/g, N/8] of z - 1 packed along N,
    scales [K/g, N], g_idx [K]."""
    n, k = p.shape
    z = p.zeros if p.zeros is not None else torch.full_like(p.scales, 8, dtype=torch.uint8)
    groups = p.scales.shape[1]
    return {"qweight": p.qweight.t().contiguous(), "qzeros": formats.pack_int4((z.t().to(torch.int16) - 1) & 0xF),
            "scales": p.scales.t().contiguous(), "g_idx": (torch.arange(k) // (k // groups)).to(torch.int32)}


def _awq_pack(codes):  # [R, N] -> [R, N/8], word c's nibble i = column 8c + AWQ_ORDER[i]
    r, n = codes.shape
    order = torch.tensor(formats.AWQ_ORDER)
    return formats.pack_int4(codes.reshape(r, n // 8, 8)[..., order].reshape(r, n))


def to_awq(p: formats.PackedWeight) -> dict:
    codes = formats.unpack_int4(p.qweight, p.shape[1])  # [N, K]
    return {"qweight": _awq_pack(codes.t()), "qzeros": _awq_pack(p.zeros.t()), "scales": p.scales.t().contiguous()}


def ct_int4(w, symmetric, group):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group" if group else "channel",
                            group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    wg = w.reshape(w.shape[0], -1, group or w.shape[1])
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    disk = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp.to(torch.int8)}, scheme)
    return disk, PackedQuantizationCompressor.decompress(disk, scheme)["weight"]


def ct_fp8(w, block):
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=list(block))
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    disk = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": formats.quantize_fp8(w, block).scales}, scheme)
    return disk, FloatQuantizationCompressor.decompress(disk, scheme)["weight"]


def ct_config(fmt, weights, ignore):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": fmt}}, "ignore": ignore}


# Each case: family -> (quantization_config, pack(name, float weight) -> (tensors, the float it stands for)),
# with which stacks are quantized.
def case(name):
    if name == "gptq":
        def pack(_key, w):
            p = formats.quantize_int4(w, G, symmetric=True)
            return to_gptq(p), p.dequantize()
        return "qwen2_5", {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": True, "desc_act": False,
                           "checkpoint_format": "gptq"}, pack, ("thinker",)
    if name == "awq":
        def pack(_key, w):
            p = formats.quantize_int4(w, G, symmetric=False)
            return to_awq(p), p.dequantize()
        return "qwen2_5", {"quant_method": "awq", "bits": 4, "group_size": G, "version": "gemm", "zero_point": True,
                           "modules_to_not_convert": ["talker", "token2wav", "visual"]}, pack, ("thinker",)
    if name.startswith("ct-int4"):
        symmetric, group = "zeros" not in name, None if "channel" in name else G
        weights = {"num_bits": 4, "type": "int", "symmetric": symmetric,
                   "strategy": "group" if group else "channel", "group_size": group}
        return "qwen3", ct_config("pack-quantized", weights, ["lm_head", "re:^talker\\..*", "re:.*mlp\\.gate$"]), \
            lambda _key, w: ct_int4(w, symmetric, group), ("thinker",)
    if name == "ct-fp8":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [G, G]}
        return "qwen3", ct_config("float-quantized", weights, ["re:^talker\\..*"]), \
            lambda _key, w: ct_fp8(w, (G, G)), ("thinker",)
    assert name == "fp8"

    def pack(_key, w):
        p = formats.quantize_fp8(w, (G, G))
        return {"weight": p.qweight, "weight_scale_inv": p.scales}, p.dequantize()
    return "qwen3", {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [G, G], "activation_scheme": "dynamic"}, \
        pack, ("thinker", "talker")


def write_folder(folder, family, tensors, qconfig):
    folder.mkdir()
    for f in ASSET[family].iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, folder / f.name)
    config = json.loads((ASSET[family] / "config.json").read_text())
    config["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


@functools.lru_cache(maxsize=None)
def built(name, tmp):
    """(folder, {module: the float its packed weight stands for}) of case `name`, written under `tmp`."""
    family, qconfig, pack, stacks = case(name)
    source = load_file(str(ASSET[family] / "model.safetensors"))
    tensors, expect = {}, {}
    for key, value in source.items():
        module, _, leaf = key.rpartition(".")
        m = QUANTIZED.match(module)
        if leaf == "weight" and m and m["stack"] in stacks:
            disk, stands_for = pack(module, value)
            tensors.update({f"{module}.{k}": v for k, v in disk.items()})
            expect[module] = stands_for
        else:
            tensors[key] = value
    return write_folder(tmp / name, family, tensors, qconfig), expect


@functools.lru_cache(maxsize=None)
def loaded_case(name, tmp):
    """load_model of case `name`'s folder (once for the module's tests)."""
    return load_model(str(built(name, tmp)[0]), device="cpu")


@functools.lru_cache(maxsize=None)
def float_model(family):
    return load_model(str(ASSET[family]), device="cpu").model


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("quant-checkpoints")


def loaded_weights(model):
    """{checkpoint module name: dequantized float32 weight} of a loaded model's packed modules, experts one by
    one (gate rows, then up rows, as the bank holds them)."""
    from omni_cli.runtime.compat import checkpoint_name

    out = {}
    for name, sub in model.named_modules():
        c = checkpoint_name(name)
        if isinstance(sub, QuantLinear):
            out[c] = sub.packed.dequantize()
        elif isinstance(sub, QuantExperts):
            for e in range(sub.num_experts):
                gate, up = sub.expert("gate_up", e).dequantize().chunk(2)
                out.update({f"{c}.{e}.gate_proj": gate, f"{c}.{e}.up_proj": up,
                            f"{c}.{e}.down_proj": sub.expert("down", e).dequantize()})
    return out


CASES = ["gptq", "awq", "ct-int4", "ct-int4-zeros", "ct-int4-channel", "ct-int4-channel-zeros", "ct-fp8", "fp8"]


@pytest.mark.parametrize("name", CASES)
def test_loaded_weights_dequantize_to_what_the_format_stands_for(name, tmp):
    _folder, expect = built(name, tmp)
    model = loaded_case(name, tmp).model
    got = loaded_weights(model)
    assert got.keys() == expect.keys()
    for module, w in expect.items():
        assert torch.equal(got[module], w.float()), module
    # what is not quantized (the ignored talker, routers, the rest) is float and equal to the source
    source = load_file(str(ASSET[case(name)[0]] / "model.safetensors"))
    from omni_cli.runtime.compat import checkpoint_name

    floats = {checkpoint_name(k): v for k, v in model.state_dict().items()}
    for key, value in source.items():
        if key.rpartition(".")[0] not in expect and key in floats:
            assert torch.equal(floats[key], value), key
    if case(name)[0] == "qwen3" and "talker" not in case(name)[3]:
        assert not any(isinstance(m, (QuantLinear, QuantExperts)) for m in model.talker.modules())
        assert isinstance(model.thinker.model.language_model.layers[0].mlp.experts, QuantExperts)


@pytest.mark.parametrize("name", ["gptq", "ct-int4-zeros", "fp8"])  # (AWQ's and CT FP8's layouts: checked above)
def test_engine_on_a_loaded_folder_matches_generate_on_its_dequantized_weights(name, tmp):
    family = case(name)[0]
    loaded = loaded_case(name, tmp)
    reference = copy.deepcopy(float_model(family))
    with torch.no_grad():
        for module, tensors in dequantized(loaded.model):
            for attr, value in tensors.items():
                getattr(reference.get_submodule(module), attr).copy_(value)
    a = Assistant(loaded, RuntimeOptions(max_context=512, max_codes=128))
    n_codes = 24
    voice = sorted(a.loaded.speakers)[0]
    ids = build_ids(a.loaded.tokenizer, Conversation(system=a.default_system).messages(PROMPT))
    reply = a.say(PROMPT, greedy=True, voice=voice, max_text_tokens=16, max_codes=n_codes)
    text, codes = _generate(family, a, reference, ids, voice, 16, n_codes)
    assert reply.text_ids == text
    assert list(reply.codes) == codes and len(codes) >= 3


def run_cli(*args):
    return CliRunner().invoke(quantize_app, [str(a) for a in args])


@pytest.mark.parametrize("family,flags,spec", [
    ("qwen3", ["--group-size", G, "--zeros"], QuantSpec("int4", group_size=G, symmetric=False)),
    ("qwen2_5", ["--fp8", "--block", G], QuantSpec("fp8", block=(G, G))),
])
def test_omni_quantize_then_load_equals_quantize_model_bit_for_bit(family, flags, spec, tmp_path):
    dst = tmp_path / "out"
    result = run_cli(ASSET[family], dst, "--device", "cpu", "-q", *flags)
    assert result.exit_code == 0, result.output
    assert not [p for p in tmp_path.iterdir() if p.name != "out"]  # the temp folder was renamed
    for part in ("tokenizer.json", "generation_config.json") + (("spk_dict.pt",) if family == "qwen2_5" else ()):
        assert (dst / part).read_bytes() == (ASSET[family] / part).read_bytes()
    ours = load_model(str(dst), device="cpu").model.state_dict()
    theirs_model = copy.deepcopy(float_model(family))
    quantize_model(theirs_model, spec)
    theirs = theirs_model.state_dict()
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    # the config is one compressed-tensors reads, and experts are stored one by one
    # (as transformers hands it over: CompressedTensorsConfig, whose quantization_config is compressed-tensors')
    from compressed_tensors.compressors import ModelCompressor
    from transformers.utils.quantization_config import CompressedTensorsConfig

    qconfig = json.loads((dst / "config.json").read_text())["quantization_config"]
    read = ModelCompressor.from_compression_config(CompressedTensorsConfig.from_dict(qconfig)).quantization_config
    assert read.format == ("pack-quantized" if spec.kind == "int4" else "float-quantized")
    weights = read.config_groups["group_0"].weights
    assert (weights.num_bits, weights.group_size or weights.block_structure) == (
        (4, G) if spec.kind == "int4" else (8, [G, G]))
    keys = load_file(str(dst / "model.safetensors")).keys()
    if family == "qwen3":
        assert "thinker.model.layers.0.mlp.experts.3.up_proj.weight_zero_point" in keys
        assert "thinker.model.layers.0.mlp.gate.weight" in keys and "thinker.lm_head" in qconfig["ignore"]


def test_omni_quantize_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    result = run_cli("tiny", tmp_path / "out", "--group-size", G)
    assert result.exit_code == 2 and "--force" in result.output
    assert (tmp_path / "out" / "keep").read_text() == "x"
    assert run_cli("tiny", tmp_path / "o2", "--bits", "8").exit_code == 2


def _broken(tmp, name, edit_tensors=None, edit_config=None):
    folder, _ = built("ct-int4", tmp)
    bad = tmp / name
    shutil.copytree(folder, bad)
    if edit_tensors:
        tensors = load_file(str(bad / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(bad / "model.safetensors"))
    if edit_config:
        config = json.loads((bad / "config.json").read_text())
        edit_config(config["quantization_config"])
        (bad / "config.json").write_text(json.dumps(config))
    return bad


L0 = "thinker.model.layers.0"
BROKEN = {
    "unsupported": (None, lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3),
                    "pack-quantized with 3-bit int weights"),
    "missing": (lambda t: t.pop(f"{L0}.self_attn.q_proj.weight_scale"), None, f"lack {L0}.self_attn.q_proj.weight_scale"),
    "missing-expert": (lambda t: [t.pop(k) for k in list(t) if k.startswith(f"{L0}.mlp.experts.2.down_proj.")], None,
                       f"lack {L0}.mlp.experts.2.down_proj"),
    "shape": (lambda t: t.update({f"{L0}.mlp.gate.weight": torch.zeros(5, 64)}), None, f"{L0}.mlp.gate.weight is [5, 64]"),
    "unexpected": (lambda t: t.update({"thinker.model.extra.weight": torch.zeros(2)}), None,
                   "unexpected tensor thinker.model.extra.weight"),
    "ignored-but-packed": (None, lambda q: q["ignore"].append(f"{L0}.self_attn.k_proj"),
                           f"{L0}.self_attn.k_proj is stored quantized"),
}


@pytest.mark.parametrize("what", list(BROKEN))
def test_bad_folders_are_one_line_errors(what, tmp):
    tensors, config, words = BROKEN[what]
    bad = _broken(tmp, what, tensors, config)
    with pytest.raises(ModelError) as err:
        load_model(str(bad), device="cpu")
    assert words in str(err.value) and "\n" not in str(err.value)
    if what in ("unsupported", "missing"):
        result = run_cli(bad, tmp / f"{what}-out", "--group-size", G)
        assert result.exit_code == 1
        lines = result.output.strip().splitlines()
        assert lines[-1].startswith("error: ") and words in lines[-1] and "Traceback" not in result.output


def test_a_quantized_source_is_refused(tmp):
    folder, _ = built("ct-int4", tmp)
    result = run_cli(folder, tmp / "requantized", "--group-size", G)
    assert result.exit_code == 2 and "quantized already" in result.output


def test_no_float_copy_of_the_packed_layers_is_made(tmp):
    """The loaded model holds packed tensors, not float weights, where the folder is quantized."""
    model = loaded_case("ct-int4", tmp).model
    layer = model.thinker.model.language_model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantLinear) and layer.mlp.gate.weight.dtype == torch.float32
    assert not any(p.is_meta for p in model.parameters())
    assert not any(isinstance(m, nn.Linear) for m in layer.self_attn.modules())


def test_omni_quantize_never_writes_over_its_source(tmp_path):
    """--force may replace a folder, never the checkpoint being read (nor one that holds it): that would
    delete the float weights after packing them."""
    import shutil

    from omni_cli.loader import TINY_MODEL_DIR

    src = tmp_path / "models" / "float"
    shutil.copytree(TINY_MODEL_DIR, src)
    before = sorted(p.name for p in src.iterdir())
    for dst in (src, tmp_path / "models"):
        result = run_cli(str(src), dst, "--group-size", G, "--force")
        assert result.exit_code == 2 and "holds the source checkpoint" in result.output, result.output
    assert sorted(p.name for p in src.iterdir()) == before


def test_files_read_a_tensor_into_host_memory_as_they_read_it_onto_the_device(tmp):
    """`Files.get(key, host=True)` (the vision tower's path off a CPU: a second handle of the file, opened once,
    reading into host memory) gives the tensor the device handle gives, for every tensor of every file."""
    from omni_cli.quant.checkpoint import Files

    folder, _ = built("ct-int4", tmp)
    files = Files(folder, torch.device("cpu"), "test")
    for key in files.keys():
        on_host = files.get(key, host=True)
        assert on_host.device.type == "cpu" and torch.equal(on_host, files.get(key)), key
    assert len(files._host) == len(files.handles)  # one host handle a file, reused


def test_a_folder_read_ahead_loads_the_same_model_and_every_block_is_read(tmp, monkeypatch):
    """With the read ahead on for a tiny folder (its size floor lowered, blocks of 4 KiB, 3 readers), the
    loader gives every tensor the plain load gives, and the readers went through every block of every
    tensor: the ranges are the files' own (safetensors' header), in the loader's order."""
    from omni_cli import read_ahead

    folder, _ = built("ct-int4", tmp)
    plain = load_model(str(folder), device="cpu").model.state_dict()
    made = []
    real = read_ahead.ReadAhead.__init__

    def spy(self, reads, readers=read_ahead.READERS):
        made.append(self)
        real(self, reads, readers=3)
    stops = []  # the loader's stop, recorded, not obeyed: the readers finish whatever the timing
    monkeypatch.setattr(read_ahead, "MIN_BYTES", 0)
    monkeypatch.setattr(read_ahead, "BLOCK", 4096)
    monkeypatch.setattr(read_ahead.ReadAhead, "__init__", spy)
    monkeypatch.setattr(read_ahead.ReadAhead, "stop", lambda self: stops.append(self))
    ahead = load_model(str(folder), device="cpu").model.state_dict()
    assert len(made) == 1 and stops == made  # started once, stopped once the loader was done
    for t in made[0].threads:
        t.join(timeout=30)
    assert made[0].next == len(made[0].reads)
    size = (folder / "model.safetensors").stat().st_size
    assert sum(end - start for _, start, end in made[0].reads) > 0.9 * size
    assert ahead.keys() == plain.keys()
    for key, value in plain.items():
        assert torch.equal(ahead[key], value), key
