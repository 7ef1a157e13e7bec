"""scripts/make_random_checkpoint.py: the folder it writes (tiny preset, CPU) is a checkpoint omni_cli loads and
replies with, its special text ids are the tiny tokenizer's, its voices are shaped right, the output is
deterministic, and a non-empty folder is refused in one line unless --force is given."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import REPO_ROOT, TINY_MODEL, cli_env  # noqa: E402

SCRIPT = REPO_ROOT / "scripts" / "make_random_checkpoint.py"
ARGS = ("--preset", "tiny", "--device", "cpu", "--dtype", "float32")


@pytest.fixture(scope="module")
def script() -> dict:
    """The script's globals, run in-process (a subprocess would pay torch's import again)."""
    return runpy.run_path(str(SCRIPT), run_name="make_random_checkpoint")


def _make(script: dict, out: Path, *extra: str) -> str:
    """Run the script's main into `out`; its stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert script["main"]([str(out), *ARGS, *extra]) == 0, err.getvalue()
    return err.getvalue()


@pytest.fixture(scope="module")
def made(script, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("random") / "tiny-random"
    return out, _make(script, out)


def _ids(config: dict, where: str = "") -> dict[str, int]:
    """Every int-valued *token_id / *token_index of a config dict, by its dotted path."""
    found = {}
    for key, value in config.items():
        if isinstance(value, dict):
            found.update(_ids(value, f"{where}{key}."))
        elif isinstance(key, str) and key.endswith(("token_id", "token_index")) and isinstance(value, int):
            found[where + key] = value
    return found


def test_writes_a_checkpoint_folder_and_says_so(script, made):
    out, stderr = made
    copied = script["COPIED"]  # the tokenizer files, chat template, preprocessor and generation configs
    assert "tokenizer.json" in copied and "generation_config.json" in copied
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", "spk_dict.pt", *copied])
    for name in copied:
        assert (out / name).read_bytes() == (TINY_MODEL / name).read_bytes(), name
    lines = stderr.splitlines()
    assert lines[0].endswith("building tiny on cpu (float32, token2wav float32) ...")
    assert "saving the weights" in stderr
    assert lines[-1].split("] ", 1)[1].startswith(f"wrote {out}: 11 files, ")


def test_config_names_the_tiny_tokenizers_ids(made):
    out, _ = made
    written = json.loads((out / "config.json").read_text())
    tiny = json.loads((TINY_MODEL / "config.json").read_text())
    assert _ids(written) == _ids(tiny)
    assert written["thinker_config"]["text_config"]["vocab_size"] == tiny["thinker_config"]["text_config"]["vocab_size"]


def test_voices_have_the_tiny_bos_ids_and_the_dits_shapes(made):
    out, _ = made
    voices = torch.load(out / "spk_dict.pt", weights_only=True)
    tiny = torch.load(TINY_MODEL / "spk_dict.pt", weights_only=True)
    dit = json.loads((out / "config.json").read_text())["token2wav_config"]["dit_config"]
    assert list(voices) == ["Chelsie", "Ethan"]
    for name, voice in voices.items():
        assert voice["bos_token"] == tiny[name]["bos_token"] and isinstance(voice["bos_token"], int)
        assert voice["cond"].shape == (1, dit["enc_emb_dim"]) and voice["cond"].dtype == torch.float32
        assert voice["ref_mel"].shape == (1, 300, dit["mel_dim"]) and voice["ref_mel"].dtype == torch.float32


def test_the_folder_loads_and_replies_with_text_and_audio(made, caplog):
    import omni_cli

    out, _ = made
    with caplog.at_level("WARNING", logger="omni_cli.loader"):
        assistant = omni_cli.load(str(out), device="cpu", dtype="float32")
    assert not caplog.records  # no weight left random
    assert assistant.voices == ["Chelsie", "Ethan"]
    model = assistant.loaded.model
    assert model.thinker.get_input_embeddings().weight.dtype == torch.float32
    assert model.token2wav.code2wav_dit_model.text_embed.codec_embed.weight.dtype == torch.float32
    reply = assistant.say("Hello", max_text_tokens=4, max_codes=30, greedy=True)
    assert 0 < len(reply.text_ids) <= 4
    assert 0 < len(reply.codes) <= 30
    assert reply.sample_rate == 24000 and reply.audio.size > 0


def test_same_files_again_and_force_replaces_old_weights(script, made, tmp_path):
    from safetensors.torch import load_file

    out, _ = made
    again = tmp_path / "again"
    again.mkdir()
    (again / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    (again / "notes.txt").write_text("mine")
    _make(script, again, "--force")
    assert not (again / "model-00001-of-00002.safetensors").exists()
    assert (again / "notes.txt").read_text() == "mine"
    first, second = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    a, b = (torch.load(d / "spk_dict.pt", weights_only=True) for d in (out, again))
    assert all(torch.equal(a[v][k], b[v][k]) for v in a for k in ("cond", "ref_mel"))


@pytest.mark.e2e
def test_a_non_empty_folder_is_refused_in_one_line(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), *ARGS], env=cli_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == f"make_random_checkpoint: {tmp_path} is not empty: pass --force to write into it\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_copy_text_ids_copies_nested_text_ids_and_keeps_codec_ids(script):
    tiny = {"audio_token_index": 771, "dtype": "float32", "vocab_size": 1024,
            "thinker_config": {"user_token_id": 313, "text_config": {"eos_token_id": 770, "pad_token_id": 768}},
            "talker_config": {"tts_text_pad_token_id": 984, "tts_codec_pad_token_id": 1, "pad_token_id": None,
                              "only_here": {"bos_token_id": 5}},
            "flag_token_id": True}
    real = {"audio_token_index": 151646, "dtype": "bfloat16", "vocab_size": 152064,
            "thinker_config": {"user_token_id": 872, "text_config": {"eos_token_id": None}},
            "talker_config": {"tts_text_pad_token_id": 151859, "tts_codec_pad_token_id": 8292, "pad_token_id": 7}}
    assert script["copy_text_ids"](tiny, real) == {
        "audio_token_index": 771, "dtype": "bfloat16", "vocab_size": 152064,
        "thinker_config": {"user_token_id": 313, "text_config": {"eos_token_id": 770, "pad_token_id": 768}},
        "talker_config": {"tts_text_pad_token_id": 984, "tts_codec_pad_token_id": 8292, "pad_token_id": 7},
    }
