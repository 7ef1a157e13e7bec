"""loader: finding a checkpoint, refusing what is not one, device/dtype choice, loading the tiny model."""

from __future__ import annotations

import logging
import shutil

import pytest

from omni_cli import loader
from omni_cli.errors import ModelError, UsageError
from omni_cli.loader import check_voice, load_model, pick_device, pick_dtype, resolve_model


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


# -- resolve_model ------------------------------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(ModelError) as err:
        resolve_model(str(tmp_path / "nope"))
    assert one_line(err.value) == f"model folder {tmp_path / 'nope'} does not exist"


def test_relative_missing_folder_is_not_a_hub_id():
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model("./no/such/folder")


def test_folder_without_config(fake_model):
    folder = fake_model("empty", model_type=None)
    with pytest.raises(ModelError) as err:
        resolve_model(str(folder))
    assert one_line(err.value) == f"{folder} has no config.json: not a model folder"


def test_not_an_omni_config(fake_model):
    folder = fake_model("llama", model_type="llama")
    with pytest.raises(ModelError) as err:
        resolve_model(str(folder))
    assert one_line(err.value) == (f"{folder} is a llama model, not Qwen2.5-Omni (qwen2_5_omni) or Qwen3-Omni "
                                   "(qwen3_omni_moe): omni-cli runs those two families")


def test_bad_config_json(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json cannot be read"):
        resolve_model(str(folder))


def test_a_file_is_not_a_model_folder(tmp_path):
    file = tmp_path / "model.bin"
    file.write_bytes(b"x")
    with pytest.raises(ModelError, match="not a model folder"):
        resolve_model(str(file))


@pytest.mark.parametrize(
    "missing, words",
    [("spk_dict.pt", "spk_dict.pt"), ("model.safetensors", "weights"), ("tokenizer.json", "tokenizer")],
)
def test_incomplete_checkpoint(fake_model, missing, words):
    files = tuple(f for f in ("model.safetensors", "tokenizer.json", "spk_dict.pt") if f != missing)
    folder = fake_model("partial", files=files)
    with pytest.raises(ModelError) as err:
        resolve_model(str(folder))
    assert words in one_line(err.value)
    assert str(folder) in str(err.value)
    assert isinstance(err.value, loader.IncompleteModel)
    assert err.value.exit_code == 1  # the README: model not found or not loadable is a runtime failure


def test_complete_folder(fake_model):
    folder = fake_model("ok")
    path, is_demo = resolve_model(str(folder))
    assert path == folder.resolve()
    assert is_demo is False


def test_sharded_weights_and_split_tokenizer_count(fake_model):
    folder = fake_model("sharded", files=("model.safetensors.index.json", "vocab.json", "merges.txt", "spk_dict.pt"))
    assert resolve_model(str(folder))[0] == folder.resolve()


def test_hub_id_not_in_cache_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError) as err:
        resolve_model("nobody/no-such-omni")
    message = one_line(err.value)
    assert "nobody/no-such-omni" in message
    assert "hf download nobody/no-such-omni" in message


def test_hub_id_found_in_cache(tmp_path, fake_model, monkeypatch):
    """A hub id resolves to its snapshot in the local hub cache, offline, without a download."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--someone--tiny-omni"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = fake_model(f"hub/models--someone--tiny-omni/snapshots/{revision}")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    path, is_demo = resolve_model("someone/tiny-omni")
    assert path == snapshot.resolve()
    assert is_demo is False


def test_not_a_path_nor_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a/b/c", "just-a-name"):
        with pytest.raises(ModelError, match="does not exist"):
            resolve_model(name)


def test_omni_model_env(fake_model, monkeypatch, capsys):
    folder = fake_model("from-env")
    monkeypatch.setenv("OMNI_MODEL", str(folder))
    assert resolve_model(None) == (folder.resolve(), False)
    assert capsys.readouterr().err == ""


def test_omni_model_env_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_MODEL", str(tmp_path / "gone"))
    with pytest.raises(ModelError, match="gone does not exist"):
        resolve_model(None)


def test_default_is_the_tiny_demo_with_one_notice(tiny_model_dir, monkeypatch, capsys, caplog):
    """The library says it through logging, once, and prints nothing itself (the CLI shows it as note:)."""
    monkeypatch.delenv("OMNI_MODEL", raising=False)
    with caplog.at_level(logging.INFO, logger="omni_cli.loader"):
        path, is_demo = resolve_model(None)
    assert path == tiny_model_dir.resolve()
    assert is_demo is True
    notices = [r.getMessage() for r in caplog.records if r.name == "omni_cli.loader"]
    assert len(notices) == 1
    assert "random" in notices[0] and "OMNI_MODEL" in notices[0] and "-m" in notices[0]
    assert capsys.readouterr().err == ""


def test_the_tiny_model_named_by_any_path_is_the_demo(tiny_model_dir, tmp_path, monkeypatch):
    """The shipped folder is recognised as the built-in demo however it is named (relative path, symlink),
    and a copy elsewhere is an ordinary checkpoint: the demo is known by where it is, not by its name."""
    monkeypatch.chdir(tiny_model_dir.parent.parent)
    assert resolve_model("assets/tiny-qwen2.5-omni") == (tiny_model_dir.resolve(), True)
    link = tmp_path / "link"
    link.symlink_to(tiny_model_dir, target_is_directory=True)
    assert resolve_model(str(link)) == (tiny_model_dir.resolve(), True)
    copy = shutil.copytree(tiny_model_dir, tmp_path / "tiny-qwen2.5-omni")
    assert resolve_model(str(copy)) == (copy.resolve(), False)


# -- device and dtype ---------------------------------------------------------------------------


def test_auto_device():
    import torch

    device = pick_device("auto")
    if torch.cuda.is_available():
        assert device.type == "cuda"
    elif not (hasattr(torch, "npu") or torch.backends.mps.is_available()):
        assert device == torch.device("cpu")


def test_cpu_device():
    import torch

    assert pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "cuda:99", "gpu", "npu:7"])
def test_bad_device(name):
    with pytest.raises(UsageError) as err:
        pick_device(name)
    message = one_line(err.value)
    assert name in message
    assert "cpu" in message  # names what is available / known
    assert err.value.exit_code == 2  # the README: a bad flag value is a usage error


def test_cuda_absent_names_what_is_available():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UsageError, match="not available here: available: cpu"):
        pick_device("cuda")


def test_dtypes():
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_dtype("auto", cpu) == torch.float32
    assert pick_dtype("auto", cuda) == torch.bfloat16
    assert pick_dtype("float32", cuda) == torch.float32
    assert pick_dtype("bfloat16", cpu) == torch.bfloat16
    assert pick_dtype("float16", cpu) == torch.float16
    assert pick_dtype("bf16", cpu) == torch.bfloat16


def test_bad_dtype():
    import torch

    with pytest.raises(UsageError, match="unknown dtype 'int8'"):
        pick_dtype("int8", torch.device("cpu"))


# -- voices -------------------------------------------------------------------------------------


def test_check_voice():
    speakers = {"Chelsie": {}, "Ethan": {}}
    assert check_voice(speakers, "Ethan") == "Ethan"
    assert check_voice(speakers, "chelsie") == "Chelsie"
    assert check_voice(["Chelsie", "Ethan"], "ETHAN") == "Ethan"
    with pytest.raises(UsageError) as err:
        check_voice(speakers, "Bob")
    assert one_line(err.value) == "unknown voice 'Bob': this model's voices are Chelsie, Ethan"


# -- loading ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="auto")


def test_load_tiny(tiny, tiny_model_dir):
    import torch
    from transformers import GenerationConfig, Qwen2_5OmniForConditionalGeneration

    assert isinstance(tiny, loader.LoadedModel)
    assert isinstance(tiny.model, Qwen2_5OmniForConditionalGeneration)
    assert sorted(tiny.speakers) == ["Chelsie", "Ethan"]
    assert sorted(tiny.voices) == ["Chelsie", "Ethan"]
    for entry in tiny.speakers.values():
        assert {"bos_token", "cond", "ref_mel"} <= set(entry)
    assert tiny.device == torch.device("cpu")
    assert tiny.dtype == torch.float32
    assert tiny.path == tiny_model_dir.resolve()
    assert tiny.is_demo is True
    assert tiny.name == "tiny-qwen2.5-omni"
    assert isinstance(tiny.generation_config, GenerationConfig)
    assert tiny.tokenizer.chat_template
    assert tiny.model.training is False
    assert next(tiny.model.token2wav.parameters()).dtype == torch.float32


def test_load_tiny_bfloat16_keeps_token2wav_float32(tiny_model_dir):
    import torch

    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.thinker.parameters()).dtype == torch.bfloat16
    assert next(loaded.model.talker.parameters()).dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.token2wav.parameters()} == {torch.float32}


def test_packed_bfloat16_runs_token2wav_in_bfloat16_within_a_stated_bound(tiny_model_dir, tmp_path):
    """Packed (`--quantize`, or a quantized folder), token2wav follows the model's dtype
    (quant/apply.cast_token2wav: 0.9 GB of the 7B's 10.8 GiB). Measured on this tiny model, 200 codes, three
    seeds: whole decode in bfloat16 against float32 SNR 37.2 dB; bfloat16 streamed against bfloat16 whole
    39.7 dB (float32: >= 85 dB, test_vocoder.py). Asserted: >= 30 dB both, on 60 codes."""
    import numpy as np
    import torch

    from omni_cli.config import QuantizeOptions
    from omni_cli.models.qwen2_5_omni.vocoder import StreamingVocoder
    from omni_cli.quant.writing import quantize_folder

    packed = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", quantize="int4")
    plain = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    quantize_folder(str(tiny_model_dir), tmp_path / "int4", QuantizeOptions(group_size=16, device="cpu"))
    folder = load_model(str(tmp_path / "int4"), device="cpu", dtype="bfloat16")
    for loaded in (packed, folder):
        assert {p.dtype for p in loaded.model.token2wav.parameters()} == {torch.bfloat16}
    voice = packed.speakers[next(iter(packed.speakers))]
    codes = np.random.default_rng(0).integers(0, 8192, 60).tolist()

    def decode(loaded, streamed: bool):
        vocoder = StreamingVocoder(loaded.model.token2wav, voice["cond"], voice["ref_mel"], max_codes=64, generator=7)
        if not streamed:
            return vocoder.decode_whole(codes)
        blocks = [b for i in range(0, len(codes), 10) for b in vocoder.push(codes[i:i + 10])]
        return np.concatenate(blocks + vocoder.finish())

    def snr_db(signal, reference):
        return 10 * np.log10(float((reference ** 2).sum()) / float(((signal - reference) ** 2).sum()))

    whole = decode(packed, streamed=False)
    assert whole.dtype == np.float32 and np.isfinite(whole).all()
    assert snr_db(whole, decode(plain, streamed=False)) >= 30.0
    assert snr_db(decode(packed, streamed=True), whole) >= 30.0


def test_load_bad_device_before_anything(tiny_model_dir):
    with pytest.raises(UsageError):
        load_model(str(tiny_model_dir), device="tpu")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_weights(tiny_model_dir, tmp_path, damage, capsys):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 64)
    with pytest.raises(ModelError) as err:
        load_model(str(folder), device="cpu")
    assert "broken" in one_line(err.value)
    assert capsys.readouterr().err == ""  # nothing from transformers on stderr


def test_the_demo_model_runs_on_one_cpu_thread():
    """Its operations are too small for a second thread, which only makes them wait on a busy machine."""
    import subprocess
    import sys

    from conftest import cli_env

    script = ("import torch, omni_cli; before = torch.get_num_threads(); omni_cli.load(device='cpu'); "
              "print(before, torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", script], env=cli_env(OMP_NUM_THREADS="2"), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1"]
