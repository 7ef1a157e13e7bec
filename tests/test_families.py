"""The family registry and what each family tells the loader and the API before any weights load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_cli.config import SamplingOptions, talker_overrides
from omni_cli.errors import ModelError
from omni_cli.loader import model_voices, resolve_model
from omni_cli.models import FAMILIES, family, qwen2_5_omni, qwen3_omni

ROOT = Path(__file__).resolve().parent.parent
TINY25 = ROOT / "assets" / "tiny-qwen2.5-omni"
TINY3 = ROOT / "assets" / "tiny-qwen3-omni"


def test_family_is_read_from_model_type():
    assert family("qwen2_5_omni") is qwen2_5_omni.FAMILY
    assert family("qwen3_omni_moe") is qwen3_omni.FAMILY
    assert sorted(FAMILIES) == ["qwen2_5_omni", "qwen3_omni_moe"]
    for fam in (qwen2_5_omni, qwen3_omni):
        assert FAMILIES[fam.MODEL_TYPE] == fam.__name__.rsplit(".", 1)[1]


def test_each_family_states_every_capability_of_the_base():
    """Both families are a `models.base.Family` whose every attribute has a value (nothing for a face to
    probe with getattr), made of their package's own constants and functions (`family_of`)."""
    from omni_cli.models.base import Family, family_of

    names = [n for n in dir(Family) if not n.startswith("_")]
    for package in (qwen2_5_omni, qwen3_omni):
        fam = package.FAMILY
        assert isinstance(fam, Family)
        assert all(hasattr(fam, n) for n in names)
        for name in ("voices", "load", "build_steps", "audio_inputs", "image_inputs", "missing_parts"):
            assert getattr(fam, name) is getattr(package, name), name  # the package's, not the base's stub
        assert (fam.MODEL_TYPE, fam.TITLE, fam.CODES_PER_SECOND, fam.DEFAULT_SYSTEM) == (
            package.MODEL_TYPE, package.TITLE, package.CODES_PER_SECOND, package.DEFAULT_SYSTEM)
        assert fam.talker_sampling() == package.TALKER_SAMPLING and fam.HEARS_AUDIO and fam.SEES_IMAGES
    assert qwen2_5_omni.FAMILY.NEEDS_DEFAULT_SYSTEM and not qwen3_omni.FAMILY.NEEDS_DEFAULT_SYSTEM
    assert qwen2_5_omni.FAMILY.READS_WEIGHTS_EARLY and not qwen3_omni.FAMILY.READS_WEIGHTS_EARLY
    with pytest.raises(TypeError, match="HEARS_VIDEO"):
        family_of({}, HEARS_VIDEO=True)  # a misspelt capability is an error, not a silent no-op


@pytest.mark.parametrize("model_type", ["llama", "qwen2_5_omni_thinker", "", None])
def test_unknown_model_type_is_one_error_naming_both_families(model_type):
    with pytest.raises(ModelError) as err:
        family(model_type, "/x")
    text = str(err.value)
    assert "\n" not in text and "Qwen2.5-Omni" in text and "Qwen3-Omni" in text


def test_voices_come_from_each_checkpoint_without_torch():
    code = ("import sys; from omni_cli.loader import model_voices; "
            f"print(model_voices({str(TINY25)!r}), model_voices({str(TINY3)!r})); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["['Chelsie', 'Ethan'] ['Aiden', 'Chelsie', 'Ethan']", "False"]
    assert model_voices(str(TINY3), notice=False) == ["Aiden", "Chelsie", "Ethan"]


def test_both_builtin_models_are_demos():
    assert resolve_model(str(TINY25))[1] is True
    assert resolve_model(str(TINY3))[1] is True


def test_qwen3_folder_without_speaker_map_is_a_model_error(tmp_path):
    folder = tmp_path / "q3"
    folder.mkdir()
    config = json.loads((TINY3 / "config.json").read_text())
    del config["talker_config"]["speaker_id"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="speaker_id"):
        qwen3_omni.voices(folder, "q3")


def test_talker_sampling_follows_the_checkpoints_talker_fields():
    from transformers import GenerationConfig

    base = SamplingOptions(do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
    assert talker_overrides(base, None) == base
    assert talker_overrides(base, GenerationConfig(temperature=0.3)) == base  # the thinker's fields are not the talker's
    changed = talker_overrides(base, GenerationConfig(talker_top_k=7, talker_temperature=0.5))
    assert (changed.top_k, changed.temperature, changed.top_p) == (7, 0.5, 1.0)
    assert qwen3_omni.talker_sampling() == qwen3_omni.TALKER_SAMPLING
    assert qwen2_5_omni.talker_sampling().top_k == 40 and qwen3_omni.talker_sampling().top_k == 50


def test_qwen3_thinker_only_checkpoint_has_no_voices(tmp_path):
    folder = tmp_path / "thinking"
    folder.mkdir()
    config = json.loads((TINY3 / "config.json").read_text())
    config["enable_audio_output"] = False
    (folder / "config.json").write_text(json.dumps(config))
    assert qwen3_omni.voices(folder, "thinking") == []
