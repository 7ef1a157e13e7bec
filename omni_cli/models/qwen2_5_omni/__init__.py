"""Qwen2.5-Omni (3B, 7B): model_type "qwen2_5_omni".

What the loader and the API ask of this family (no torch at import): what a complete folder holds
(weights, tokenizer, `spk_dict.pt` with the voices), the voices without loading weights, the defaults
of a reply, and `load` / `build_steps` (checkpoint.py, steps.py), which import torch when called.

    checkpoint.py  weights through transformers' class; voices from spk_dict.pt
    steps.py       ModelSteps for the runtime: reply vector, talker sampling, vocoder, warm-up
    thinker.py     thinker prefill / decode_one over a static cache
    talker.py      talker prefill / decode_one (thinker_to_talker_proj, codec_head)
    vocoder.py     streaming token2wav: block-wise DiT windows + BigVGAN with overlap trimming
    dit.py         one DiT evaluation for the vocoder's ODE: time conditioning per grid, fused products
    presets.py     omni-bench: true-size configs with random weights, transformers' generate timed
"""

from __future__ import annotations

from pathlib import Path

from ...config import SamplingOptions
from ..audio_features import clip_rows, join
from ..base import Family, family_of
from ..vision import image_inputs, image_processor  # noqa: F401 - the family's, shared with Qwen3-Omni

MODEL_TYPE = "qwen2_5_omni"
TITLE = "Qwen2.5-Omni"
EXAMPLE_HUB_ID = "Qwen/Qwen2.5-Omni-7B"

# The model card asks for this system prompt for audio output: the talker speaks only under it.
DEFAULT_SYSTEM = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)
NEEDS_DEFAULT_SYSTEM = True  # the talker speaks reliably only under it
DEFAULT_VOICE = "Chelsie"
CODES_PER_SECOND = 50  # talker steps (codes) per second of audio
# Prompts (thinker and talker) replayed as CUDA graphs, as Qwen3-Omni's are (runtime/graphs.py
# `PrefillGraphs`, bfloat16 only). On an H100 the 7B's 60-token prefill falls from 21.9 to 9.6 ms (bf16) and
# 41.1 to 12.6 ms (int4), its first audio from 328 to 305 ms and 310 to 252 ms, for 0.15 GiB of peak
# (docs/benchmarks.md, nineteenth pass). One 10-turn spoken conversation with them ended in a device-side
# assert of the audio placeholders' scatter; five more ran through (three in the twentieth pass, checking
# before every scatter that the device's ids were the host's). The likely cause, a random reply holding a
# media marker's id, now stops on the host (prompt.py `_checked`, encoders.place's count).
PROMPT_GRAPHS = True


def missing_parts(folder: Path) -> list[str]:
    """What this family needs beyond weights and tokenizer: the voices."""
    return [] if (folder / "spk_dict.pt").is_file() else ["spk_dict.pt (the voices)"]


def voices(folder: Path, name: str) -> list[str]:
    from .checkpoint import voice_names

    return voice_names(folder, name)


def load(path: Path, device, dtype, name: str, early=None):
    """(model, voices) on `device`: see checkpoint.load."""
    from .checkpoint import load as _load

    return _load(path, device, dtype, name, early=early)


# The loader may read the folder's weights onto a GPU while transformers is imported (early_weights.py):
# they load with no key conversion. (Qwen3-Omni's experts are stacked while loading: the stored and the
# stacked copies would both be on the device at once, so it reads them the usual way.)
READS_WEIGHTS_EARLY = True


def build_steps(model, voices: dict, runtime=None):
    """The runtime's `ModelSteps` over a loaded model, under `runtime` (a `RuntimeOptions`: cache sizes,
    graphs, compile; None = the defaults)."""
    from .steps import Qwen25Steps

    return Qwen25Steps(model, voices, runtime)


# The reference's talker settings (transformers' Qwen2_5OmniForConditionalGeneration.generate).
TALKER_SAMPLING = SamplingOptions(do_sample=True, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05)


def talker_sampling(generation_config=None) -> SamplingOptions:
    """The talker's sampling: the reference's, with what the checkpoint's generation_config.json says for
    the talker (`talker_temperature`, `talker_top_k`, `talker_top_p`, `talker_repetition_penalty`, the
    names of `generate`'s talker arguments) taking precedence."""
    from ...config import talker_overrides

    return talker_overrides(TALKER_SAMPLING, generation_config)


def audio_inputs(feature_extractor, clips) -> tuple[dict, list[int]]:
    """The encoder inputs for `clips` (16 kHz mono AudioClips) as Qwen2_5OmniProcessor makes them
    (Whisper log-mel features, clips cut at the extractor's 300 s, with their mask: the frames the mask
    keeps are the processor's; the batch is padded to its longest clip, not to 300 s, which the encoder
    never reads), and how many audio tokens each clip becomes in the prompt (its features' length after
    the encoder's two halvings)."""
    features, mask = join([clip_inputs(feature_extractor, clip) for clip in clips])
    lengths = ((mask.sum(-1) - 1) // 2 + 1 - 2) // 2 + 1
    return {"input_features": features, "feature_attention_mask": mask}, lengths.tolist()


def clip_inputs(feature_extractor, clip):
    """One clip's kept feature frames, as its processor makes them in a batch padded past its end."""
    return clip_rows(feature_extractor, clip.pcm, margin=True, limit=feature_extractor.n_samples)


def audio_token_id(config) -> int:
    """The prompt's audio placeholder id (`<|AUDIO|>`)."""
    return int(config.thinker_config.audio_token_index)


def image_token_id(config) -> int:
    """The prompt's image placeholder id (`<|IMAGE|>`)."""
    return int(config.thinker_config.image_token_index)



# This package as the `Family` the loader and the API use.
FAMILY: Family = family_of(globals(), HEARS_AUDIO=True, SEES_IMAGES=True)
