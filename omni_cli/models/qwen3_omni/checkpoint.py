"""Qwen3-Omni checkpoints: the weights through transformers' own class; the voices from config.json.

Thinker, talker, code predictor and code2wav are loaded in the asked dtype, as the reference runs
them (on a GPU, the vision tower in host memory until the first image: runtime/vision_place.py); a
quantized folder (config.json's quantization_config) through quant/checkpoint.py. It does not find
folders or pick devices (loader.py), nor generate (steps.py).
"""

from __future__ import annotations

from pathlib import Path

from . import speaker_ids


def load(path: Path, device, dtype, name: str):
    """(Qwen3OmniMoeForConditionalGeneration in eval mode on `device`, voices: name -> codec id)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from ...runtime import vision_place
    from ..weights import from_pretrained, quantized_from, to_device

    voices = speaker_ids(path, name)
    omni = quantized_from(Qwen3OmniMoeForConditionalGeneration, path, dtype, name, device)
    if omni is None:
        omni = from_pretrained(Qwen3OmniMoeForConditionalGeneration, path, dtype, name, device)
    # the vision tower to host memory until the first image (runtime/vision_place.py)
    to_device(omni, lambda m: vision_place.place(m, device), device, name, path=path, dtype=dtype)
    return omni, voices
