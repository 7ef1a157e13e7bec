"""A clip's encoder inputs made alone, and joined into a prompt's batch: Whisper log-mel features.

Both families' processors run Whisper's feature extractor over a batch of clips: Qwen2.5-Omni's pads every
clip with zeros to 300 s, Qwen3-Omni's to the longest clip of the prompt; each encoder then reads only
the frames its mask keeps. Making each clip's frames alone, once, lets a conversation keep them per clip
(`omni_cli/encoder_inputs.py`) and pay for the new clip only: 300 s of padding cost ~250 ms a clip on a
laptop core, every turn, for every clip said so far.

`clip_rows(extractor, clip, margin)` gives a clip's kept frames; `join(rows)` lays rows out as a batch (the
mask, the frames past each clip's end filled with the value silence has in that clip's features). With
`margin`, the clip is followed by enough zeros that its last frames see zeros as in a padded batch
(Qwen2.5-Omni: equal, frame for frame, to its processor's); without, its end is reflected as for the
longest clip of a batch (Qwen3-Omni: equal to its processor's for a clip said alone; beside a longer clip,
the processor's last frame of the shorter one sees padding, which this leaves out, so that a clip's
inputs do not depend on the clips said with it).

`spoken_inputs(family, folder, clips, kept)` is the benchmark presets' way to the same inputs, with the
extractor of a checkpoint folder (loaded once).

It knows Whisper's extractor settings (`n_fft`, `hop_length`, `n_samples`), no model and no prompt.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only (the family packages import this with no numpy or torch)
    import numpy as np


def clip_rows(extractor, pcm: "np.ndarray", margin: bool, limit: int | None = None):
    """[mel bins, frames] of a 16 kHz clip's frames, those its mask keeps: ceil(samples / hop). `limit`:
    the extractor's longest clip in samples (longer ones are cut there, as its truncation does)."""
    import numpy as np

    if limit is not None:
        pcm = pcm[:limit]
    frames = -(-len(pcm) // extractor.hop_length)
    if margin:
        pcm = np.concatenate([pcm, np.zeros(2 * extractor.n_fft, np.float32)])
    out = extractor([pcm], sampling_rate=16_000, padding="longest", truncation=False, return_tensors="pt")
    return out["input_features"][0, :, :frames]


def join(rows: list):
    """(features [clips, mel bins, longest], mask [clips, longest]) of `rows` (clip_rows'): each clip's
    frames, then the floor of its own log-mel (what zeros become in it) where the batch pads it."""
    import torch

    width = max(row.shape[-1] for row in rows)
    features = torch.stack([torch.nn.functional.pad(row, (0, width - row.shape[-1]), value=float(row.min()))
                            for row in rows])
    mask = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, row in enumerate(rows):
        mask[i, :row.shape[-1]] = 1
    return features, mask


def spoken_inputs(family, folder, clips, kept=None) -> tuple[dict, list[int]]:
    """`family.audio_inputs` for `clips` with the feature extractor of the checkpoint in `folder`; `kept`: an
    encoder_inputs.EncoderInputs, which makes each clip's features once, as an assistant's conversation does."""
    extractor = _extractor(str(folder))
    return family.audio_inputs(extractor, clips) if kept is None else kept.audio_inputs(family, extractor, clips)


@functools.cache
def _extractor(folder: str):
    from transformers import AutoFeatureExtractor

    return AutoFeatureExtractor.from_pretrained(folder, local_files_only=True)
