"""Qwen3-Omni (30B-A3B): model_type "qwen3_omni_moe".

What the loader and the API ask of this family (no torch at import): a complete folder holds weights
and tokenizer (the voices are in config.json: `talker_config.speaker_id`, name -> codec id); the
defaults of a reply; and `load` / `build_steps` (checkpoint.py, steps.py), which import torch.

    checkpoint.py  weights through transformers' class
    steps.py       ModelSteps for the runtime: 16-id frames, reply vector, vocoder
    thinker.py     the MoE thinker's prefill / decode_one over a static cache
    talker.py      the MoE talker and its code predictor: one frame a step
    code2wav.py    streaming code2wav: causal, a sliding-window cache and left context
    presets.py     omni-bench: true-size configs with random weights, transformers' generate timed
"""

from __future__ import annotations

import json
from pathlib import Path

from ...config import SamplingOptions
from ..audio_features import clip_rows, join
from ..base import Family, family_of
from ..vision import image_inputs  # noqa: F401 - the family's, shared with Qwen2.5-Omni

MODEL_TYPE = "qwen3_omni_moe"
TITLE = "Qwen3-Omni"
EXAMPLE_HUB_ID = "Qwen/Qwen3-Omni-30B-A3B-Instruct"

# No system prompt unless asked for: the talker reads only the user turns, and the model speaks
# under any system prompt (or none).
DEFAULT_SYSTEM = ""
NEEDS_DEFAULT_SYSTEM = False
DEFAULT_VOICE = "Ethan"
CODES_PER_SECOND = 12.5  # talker steps (16-codebook frames of 80 ms) per second of audio

# The reference's codebook-0 sampling (transformers 5.17 `Qwen3OmniMoeForConditionalGeneration.generate`;
# the code predictor's own settings are in talker.py): it does not read generation_config.json.
TALKER_SAMPLING = SamplingOptions(do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)


def missing_parts(folder: Path) -> list[str]:
    return []  # the voices are in config.json


def voices(folder: Path, name: str) -> list[str]:
    return list(speaker_ids(folder, name))


def speaker_ids(folder: Path, name: str) -> dict[str, int]:
    """Voice name (capitalised, as people write it: "Ethan") -> codec id, from config.json."""
    from ...errors import ModelError

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if config.get("enable_audio_output") is False:
            return {}  # a thinker-only checkpoint (Qwen3-Omni-30B-A3B-Thinking): text replies only
        speakers = config["talker_config"]["speaker_id"]
        return {str(n).capitalize(): int(i) for n, i in speakers.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"{name}: config.json has no talker_config.speaker_id (the voices)") from exc


def load(path: Path, device, dtype, name: str, early=None):
    """(model, voices) on `device`: see checkpoint.load. (`early`: never given, READS_WEIGHTS_EARLY being off.)"""
    from .checkpoint import load as _load

    return _load(path, device, dtype, name)


def build_steps(model, voices: dict, runtime=None):
    """The runtime's `ModelSteps` over a loaded model, under `runtime` (a `RuntimeOptions`: cache sizes,
    graphs, compile; None = the defaults)."""
    from .steps import Qwen3Steps

    return Qwen3Steps(model, voices, runtime)


def talker_sampling(generation_config=None) -> SamplingOptions:
    """The talker's sampling: the reference's, with what the checkpoint's generation_config.json says for
    the talker (`talker_temperature`, `talker_top_k`, `talker_top_p`, `talker_repetition_penalty`, the
    names of `generate`'s talker arguments) taking precedence."""
    from ...config import talker_overrides

    return talker_overrides(TALKER_SAMPLING, generation_config)


def audio_inputs(feature_extractor, clips, n_window: int = 50) -> tuple[dict, list[int]]:
    """The encoder inputs for `clips` (16 kHz mono AudioClips) as Qwen3OmniMoeProcessor makes them
    (Whisper log-mel features padded to the longest clip, with their mask; each clip's frames made alone:
    models/audio_features.py says where that differs), and how many audio tokens each becomes in the
    prompt (the encoder's length rule: 13 tokens a 100-frame chunk, then the rest halved three times;
    `n_window` as the processor's default, which must match the encoder's config)."""
    features, mask = join([clip_inputs(feature_extractor, clip) for clip in clips])
    frames = mask.sum(-1)
    chunk = 2 * n_window
    rest = (frames % chunk - 1) // 2 + 1
    lengths = ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13
    return {"input_features": features, "feature_attention_mask": mask}, lengths.tolist()


def clip_inputs(feature_extractor, clip):
    """One clip's feature frames, as its processor makes them for the clip alone."""
    return clip_rows(feature_extractor, clip.pcm, margin=False)


def audio_token_id(config) -> int:
    """The prompt's audio placeholder id."""
    return int(config.thinker_config.audio_token_id)


def image_token_id(config) -> int:
    return int(config.thinker_config.image_token_id)


def image_processor(path: Path):
    """The checkpoint's image processor (as Qwen2.5-Omni's), its patch, time and merge sizes those of the
    vision encoder in config.json: a checkpoint whose preprocessor_config.json leaves them out (the
    built-in tiny model's) would otherwise get the processor's defaults (14-pixel patches) and not fit."""
    from .. import vision

    processor = vision.image_processor(path)
    sizes = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))["thinker_config"]["vision_config"]
    for name, key in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                      ("merge_size", "spatial_merge_size")):
        if key in sizes:
            setattr(processor, name, int(sizes[key]))
    return processor


# This package as the `Family` the loader and the API use.
FAMILY: Family = family_of(globals(), HEARS_AUDIO=True, SEES_IMAGES=True,
                            READS_WEIGHTS_EARLY=False)  # its experts are stacked while loading (see qwen2_5_omni's note)
