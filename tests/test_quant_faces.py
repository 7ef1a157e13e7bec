"""--quantize at load and the memory figures, as the faces show them: the flags reach RuntimeOptions, omni-say
packs the built-in tiny model and answers as quantize_model-then-say does, --verbose tells the bytes,
omni-bench's --memory-limit, the out-of-memory messages, a quantized checkpoint refused, compile refused
over packed weights, and the keep-alive never handing over a server whose weights are packed otherwise."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from conftest import invoke


# -- flags -> RuntimeOptions ---------------------------------------------------------------------------


def test_quantize_flags_reach_runtime_options():
    from omni_cli.config import RuntimeOptions
    from omni_cli.faces.options import runtime_options

    rt = runtime_options("cpu", "auto", True, False, quantize="INT4", group_size=32)
    assert (rt.quantize, rt.group_size) == ("int4", 32)
    argv = rt.to_argv()
    assert argv[argv.index("--quantize") + 1] == "int4" and argv[argv.index("--group-size") + 1] == "32"
    assert RuntimeOptions.from_json(json.loads(json.dumps(rt.to_json()))) == rt
    assert "--quantize" not in RuntimeOptions().to_argv()


@pytest.mark.parametrize("quantize, group, words", [("int8", None, "int4 or fp8"), ("fp8", 64, "--group-size is for")])
def test_bad_quantize_flags_are_one_line(fake, quantize, group, words):
    args = ["--local", "--quantize", quantize, *(["--group-size", str(group)] if group else []), "hi"]
    result = invoke(*args)
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith("error: ") and words in result.stderr and len(result.stderr.splitlines()) == 1
    assert fake.load_args is None  # refused before anything loads


def test_chat_and_serve_take_the_flags(fake):
    from typer.testing import CliRunner

    from omni_cli.faces.bench import app as bench_app
    from omni_cli.faces.chat.main import chat_app
    from omni_cli.faces.serve import serve_app

    for app in (chat_app, serve_app, bench_app):
        shown = CliRunner().invoke(app, ["--help"], terminal_width=200).output
        assert "--quantize" in shown and "--group-size" in shown
    assert "--memory-limit" in CliRunner().invoke(bench_app, ["--help"], terminal_width=200).output


# -- omni-say --quantize int4 on the built-in tiny model --------------------------------------------------


def test_say_quantized_equals_quantize_model_then_say(tmp_path, monkeypatch):
    from omni_cli.assistant import Assistant
    from omni_cli.config import RuntimeOptions
    from omni_cli.loader import load_model
    from omni_cli.quant.apply import packed_bytes, quantize_model, spec_for

    monkeypatch.setenv("OMNI_LOCAL", "1")
    out = tmp_path / "x.wav"
    result = invoke("--quantize", "int4", "--greedy", "--seed", "0", "--keep-alive", "0", "--verbose",
                    "--device", "cpu", "-o", out, "Hello there")
    assert result.exit_code == 0, result.stderr
    assert out.stat().st_size > 44  # a WAV with samples

    import torch

    loaded = load_model(None, device="cpu")
    quantize_model(loaded.model, spec_for("int4", torch.float32, 16))  # 16: what fits the tiny model's widths
    expected = Assistant(loaded, RuntimeOptions(device="cpu")).say("Hello there", greedy=True, seed=0)
    assert result.stdout.strip() == expected.text.strip()
    assert "int4 group size 16" in result.stderr  # the default 128 does not divide its widths: said

    # --verbose: the weights' bytes, packed and float (on CPU there is no device peak)
    packed = packed_bytes(loaded.model)
    floats = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    from omni_cli.faces.timing import size_text

    assert "-- memory" in result.stderr
    line = next(x for x in result.stderr.splitlines() if x.startswith("weights"))
    assert f"{size_text(packed)} packed int4" in line and f"{size_text(floats)} float" in line
    assert "device peak" not in result.stderr


def test_memory_rows():
    from omni_cli.faces.timing import memory_rows

    assert memory_rows(None) == []
    plain = dict(memory_rows({"packed": 0, "float": 3 * 2**30, "weights": 3 * 2**30, "quantize": None, "peak": None}))
    assert plain == {"weights": "3.00 GiB"}
    rows = dict(memory_rows({"packed": 2**30, "float": 2**29, "weights": 3 * 2**29, "quantize": "fp8",
                             "peak": 5 * 2**30}))
    assert rows == {"weights": "1.50 GiB (1.00 GiB packed fp8 + 512.00 MiB float)", "device peak": "5.00 GiB"}
    waiting = dict(memory_rows({"packed": 0, "float": 3 * 2**30, "weights": 3 * 2**30, "quantize": None,
                                "peak": None, "host": 2**29}))
    assert waiting["in host memory"] == "512.00 MiB (the vision encoder, until the first image)"


# -- a quantized checkpoint, compile --------------------------------------------------------------------


def test_quantized_checkpoint_refuses_quantize(tmp_path, tiny_model_dir):
    from omni_cli.errors import UsageError
    from omni_cli.loader import load_model

    folder = tmp_path / "gptq"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["thinker_config"]["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                       "sym": True, "desc_act": False}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"quantized already \(gptq int4\): leave out --quantize int4"):
        load_model(folder, device="cpu", quantize="int4")


def test_compile_is_refused_over_packed_weights(caplog):
    from omni_cli.config import RuntimeOptions
    from omni_cli.runtime import graphs

    graphs._REFUSED.clear()
    with caplog.at_level(logging.WARNING, logger="omni_cli.runtime"):
        first = graphs.Policy.of(RuntimeOptions(compile=True, quantize="int4"), "cuda")
        graphs.Policy.of(RuntimeOptions(compile=True, quantize="int4"), "cuda")
    assert first.graphs_on and not first.compile_on and not first.compiling().compile_on
    assert sum("not supported" in r.message for r in caplog.records) == 1  # said once
    plain = graphs.Policy.of(RuntimeOptions(compile=True), "cuda")
    assert plain.compile_on and plain.compiling().compile_on


# -- omni-bench --memory-limit, presets packed as built ---------------------------------------------------


def test_memory_limit_sizes_and_cpu_error():
    import torch

    from omni_cli.errors import UsageError
    from omni_cli.faces.bench import cap_memory, parse_size

    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("24 gb") == 24 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5G") == int(1.5 * 2**30)
    for bad in ("lots", "24", "-1GiB", "0GiB", "24TiB"):
        with pytest.raises(UsageError, match="is not a size"):
            parse_size(bad)
    with pytest.raises(UsageError, match="caps a CUDA GPU's memory"):
        cap_memory("24GiB", torch.device("cpu"))


def test_bench_memory_limit_on_cpu_is_one_line():
    from typer.testing import CliRunner

    from omni_cli.faces.bench import app

    result = CliRunner().invoke(app, ["--preset", "tiny", "--memory-limit", "24GiB"], prog_name="omni-bench")
    assert result.exit_code != 0 and "caps a CUDA GPU's memory" in str(result.exception or result.output)


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_random_model_is_built_and_packed_layer_by_layer(family, monkeypatch):
    """The full-size presets' path on a tiny config: the decoder layers are made on the meta device, and
    each is given weights and packed in turn (never two float layers at once); nothing stays on meta."""
    import importlib

    import torch

    from omni_cli.models import random_packed
    from omni_cli.models.weights import quiet_transformers
    from omni_cli.quant.apply import decoder_layers, keep, packed_bytes, spec_for

    presets = importlib.import_module(f"omni_cli.models.{family}.presets")
    name = next(n for n, p in presets.PRESETS.items() if "asset" in p)
    config = presets.build_config(name)
    import transformers

    cls = getattr(transformers, {"qwen2_5_omni": "Qwen2_5OmniForConditionalGeneration",
                                 "qwen3_omni": "Qwen3OmniMoeForConditionalGeneration"}[family])
    def floating(name, module):  # a linear --quantize packs, still in float (the routers are kept float)
        return type(module) is torch.nn.Linear and not keep(name)

    float_layers = []  # at each materialize: how many decoder layers hold float (unpacked) linears
    real = random_packed.materialize
    built = []

    def watch(module, device, generator, std=0.02):
        made = real(module, device, generator, std)
        float_layers.append(sum(any(floating(n, m) and not m.weight.is_meta for n, m in layer.named_modules())
                                for _, layer in decoder_layers(built[0])))
        return made

    def make():
        m = cls._from_config(config, dtype=torch.float32)
        if not next(m.parameters()).is_meta:  # the real build, not the meta probe
            built.append(m)
        return m

    monkeypatch.setattr(random_packed, "materialize", watch)
    with quiet_transformers():
        model, done = random_packed.build_packed(make, torch.device("cpu"), spec_for("int4", torch.float32, 16))
    assert done.layers == len(decoder_layers(model)) > 0
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    assert packed_bytes(model) > 0
    assert not any(floating(n, m) for _, layer in decoder_layers(model) for n, m in layer.named_modules())
    assert float_layers[:-1] == [1] * done.layers and float_layers[-1] == 0  # one float layer at a time


# -- out of memory at load --------------------------------------------------------------------------------


def test_oom_says_what_would_fit(monkeypatch, tiny_model_dir):
    import torch

    from omni_cli.models import weights

    total, packable = weights.checkpoint_parameters(tiny_model_dir)
    assert 0 < packable < total
    monkeypatch.setattr(weights, "checkpoint_parameters", lambda path: (35_000_000_000, 32_000_000_000))
    cuda = torch.device("cuda", 0)
    gib = 2**30

    def message(free_gib, quantize=None):
        monkeypatch.setattr(weights, "_available", lambda device: int(free_gib * gib))
        return str(weights.oom_error("Qwen3-Omni", tiny_model_dir, cuda, torch.bfloat16, quantize))

    # bfloat16 ~65 GiB, fp8 ~36 GiB, int4 ~21 GiB of weights
    assert message(45).endswith("try --quantize fp8") and "35.0 B parameters" in message(45)
    assert message(30).endswith("try --quantize int4")
    assert message(30, "fp8").endswith("try --quantize int4")
    assert message(10).endswith("even --quantize int4 does not fit: a smaller model or a device with more memory")
    assert "the weights fit, the rest did not: try a smaller --max-context" in message(80)
    assert "try --quantize" in str(weights.oom_error("m", None, torch.device("cpu")))  # nothing known: the flags


def test_oom_while_packing_is_one_line(monkeypatch):
    import torch

    import omni_cli.quant.apply as apply
    from omni_cli.errors import OmniError
    from omni_cli.loader import load_model
    from omni_cli.models import weights

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(apply, "quantize_model", no_room)
    monkeypatch.setattr(weights, "_available", lambda device: 2**20)  # as a GPU would say: 1 MiB free
    with pytest.raises(OmniError, match=r"out of memory on cpu loading tiny-qwen2.5-omni \(0.0 B parameters;.*"
                                        r"even --quantize int4 does not fit"):
        load_model(None, device="cpu", quantize="int4")


def test_cache_oom_names_max_context():
    from omni_cli.assistant import _cache_oom

    assert str(_cache_oom(4096, None)).endswith("try --max-context 2048, or --quantize fp8 (smaller weights)")
    assert str(_cache_oom(4096, "int4")).endswith("try --max-context 2048")


# -- keep-alive: never another packing's server ----------------------------------------------------------


def test_keep_alive_record_names_the_packing(monkeypatch, tmp_path):
    from omni_cli.api import keep_alive

    record = {"key": "sha256:x", "quantize": "int4"}
    assert keep_alive.same_weights(record, "sha256:x", "int4")
    assert not keep_alive.same_weights(record, "sha256:x", None)
    assert not keep_alive.same_weights({"key": "sha256:x"}, "sha256:x", "fp8")  # an older server's: unpacked
    assert keep_alive.same_weights({"key": "sha256:x"}, "sha256:x", None)

    monkeypatch.setattr(keep_alive.paths, "server_dir", lambda: tmp_path)
    monkeypatch.setattr(keep_alive.paths, "keep_alive_record", lambda: tmp_path / "omni-serve.json")
    monkeypatch.setenv(keep_alive.RECORD_ENV, "1")
    keep_alive.record_self(8484, None, quantize="fp8")
    assert json.loads((tmp_path / "omni-serve.json").read_text())["quantize"] == "fp8"


class _Remote:
    def __init__(self, quantize):
        self.info = {"runtime": {"quantize": quantize}, "key": "k"}
        self.url, self.name, self.closed, self.is_demo = "http://127.0.0.1:8484", "m", False, False

    def close(self):
        self.closed = True


@pytest.mark.parametrize("served, asked, handed", [("int4", None, False), (None, "int4", False),
                                                   ("int4", "int4", True), (None, None, True)])
def test_server_on_the_port_is_handed_over_only_with_the_same_weights(monkeypatch, served, asked, handed):
    from omni_cli.api import client, keep_alive

    remote = _Remote(served)
    monkeypatch.setattr(client, "proven_health", lambda url, timeout: {"proof": {"key": "k"}})
    monkeypatch.setattr(keep_alive.RemoteAssistant, "connect", staticmethod(lambda *a, **k: remote))
    notes = []
    got = keep_alive._someone_elses("http://127.0.0.1:8484", None, "k", notes.append, asked)
    assert (got is remote) == handed
    if not handed:
        assert remote.closed and "weights" in notes[0]


@pytest.mark.parametrize("served, asked, used", [("int4", None, False), (None, None, True), ("fp8", "fp8", True)])
def test_found_server_with_other_weights_is_not_used(monkeypatch, served, asked, used):
    from omni_cli.api import client
    from omni_cli.config import RuntimeOptions
    from omni_cli.faces import connect

    remote = _Remote(served)
    monkeypatch.setattr(client, "find_local_server", lambda model, api_key=None: remote)
    where = connect.Where(runtime=RuntimeOptions(quantize=asked), quiet=True)
    assert (connect.find_server(where) is remote) == used
    assert remote.closed != used


def test_server_runtime_note_names_quantize(capsys):
    from omni_cli.config import RuntimeOptions
    from omni_cli.faces import connect

    remote = SimpleNamespace(info={"runtime": RuntimeOptions(device="cuda:0", dtype="bfloat16").to_json()})
    connect._runtime_note(remote, RuntimeOptions(quantize="int4"))
    assert "--quantize int4 would apply to a model loaded here" in capsys.readouterr().err
