"""A conversation's encoder inputs, made once per clip and per image.

Each turn's prompt holds every clip and image the conversation has said; their encoder inputs (log-mel
features, image patches) are the same every turn. `EncoderInputs` keeps each item's, keyed by its
content (a hash of the samples or pixels, with their rate or size), and makes only the new ones: the
family's own `audio_inputs` / `image_inputs` on that item alone, then the items joined as the family's
batch lays them out (models/audio_features.py for clips; images' patches are made per image by the
processor anyway, so they join by concatenation). It holds only the items of the last prompt it made:
a dropped turn's media go with it.

It knows neither the models nor the device: the inputs are host tensors, as the processors make them.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable


def _clip_key(clip) -> tuple:
    pcm = clip.pcm
    return (clip.sample_rate, pcm.shape[0], hashlib.blake2b(pcm.tobytes(), digest_size=16).digest())


def _image_key(image) -> tuple:
    return (image.size, image.mode, hashlib.blake2b(image.tobytes(), digest_size=16).digest())


class _Kept:
    """One kind's items: key -> what `make` gave for it, for the items of the last call only."""

    def __init__(self, key: Callable[[Any], tuple]) -> None:
        self.key = key
        self.items: dict[tuple, Any] = {}
        self.made = 0  # items made, not found, so far (what the tests count)

    def each(self, items, make: Callable[[Any], Any]) -> list:
        keys = [self.key(item) for item in items]  # each item hashed once
        kept: dict[tuple, Any] = {}
        for k, item in zip(keys, items):
            if k not in kept:
                found = self.items.get(k)
                if found is None:
                    found = make(item)
                    self.made += 1
                kept[k] = found
        self.items = kept
        return [kept[k] for k in keys]


class EncoderInputs:
    def __init__(self) -> None:
        self.clips = _Kept(_clip_key)
        self.images = _Kept(_image_key)

    def audio_inputs(self, family, extractor, clips) -> tuple[dict, list[int]]:
        """`family.audio_inputs(extractor, clips)`, each clip's made once (16 kHz AudioClips)."""
        from .models.audio_features import join

        def make(clip):
            media, counts = family.audio_inputs(extractor, [clip])
            return media["input_features"][0], counts[0]

        each = self.clips.each(clips, make)
        features, mask = join([row for row, _ in each])
        return {"input_features": features, "feature_attention_mask": mask}, [n for _, n in each]

    def image_inputs(self, family, processor, images) -> tuple[dict, list[int]]:
        """`family.image_inputs(processor, images)`, each image's made once (RGB PIL images)."""
        import torch

        def make(image):
            media, counts = family.image_inputs(processor, [image])
            return media["pixel_values"], media["image_grid_thw"][0], counts[0]

        each = self.images.each(images, make)
        return ({"pixel_values": torch.cat([p for p, _, _ in each]),
                 "image_grid_thw": torch.stack([g for _, g, _ in each])}, [n for _, _, n in each])
