"""A prompt's audio and image placeholders filled with the thinker's encoders' outputs, as both families'
reference forwards fill them: the library's `get_audio_features` / `get_image_features` on the
processor's inputs, timed without a host sync (`stats.encoder_timer`), scattered in order over the
placeholder positions.

The encoders run without cuDNN's attention (`decoder.no_cudnn_attention`): cuDNN keeps its plans per host
thread, and each turn's engine thread is a new one, so every turn built them again for every window of
every layer. Measured on an H200, one 5 s clip at true size: the call itself takes 18-20 ms on a thread
that has run it before (either family, with or without cuDNN), where a turn's encoder time was 60-180 ms.
The audio tower's inputs are laid out and its window indices made on the host (`compat.audio_encoder`),
so that nothing in the encoder reads a value back from the device. On a GPU the tower replays a CUDA graph
per number of feature chunks where the pauses between turns made one (runtime/audio_graphs.py). The
vision tower waits in host memory until the first image (runtime/vision_place.py); that image's turn
moves it, outside the encoder's time.

It knows neither the family (the caller passes its thinker module and placeholder id) nor the prompt's
positions (decoder.mrope_positions) nor what the talker reads of them.
"""

from __future__ import annotations

import torch

from . import audio_graphs, compat, vision_place
from .decoder import no_cudnn_attention
from .stats import encoder_timer


def with_audio(module, input_ids: torch.Tensor, embeds: torch.Tensor, media: dict, token: int, places: int):
    """(embeds with the audio encoder's outputs at the `token` positions, those positions [1, L, W]);
    `places`: how many `token`s `input_ids` holds, counted on the host (`place`)."""
    dev = embeds.device
    features = media["input_features"].to(dev, embeds.dtype)  # the processor's float32, in the model's dtype
    mask = media["feature_attention_mask"]
    # A graph of the tower where a pause between turns made one for this many chunks
    # (runtime/audio_graphs.py), else the library's call; either's host work before the timer.
    replay = audio_graphs.replay_call(compat.audio_tower(module), features, mask)
    encode = replay or compat.audio_encoder(module, features, mask, dev)
    with encoder_timer(media, dev), no_cudnn_attention(dev.type == "cuda"):
        audio = encode()
    return place(embeds, input_ids, token, audio, places)


def with_images(module, input_ids: torch.Tensor, embeds: torch.Tensor, media: dict, token: int, places: int):
    """(embeds with the vision encoder's outputs at the `token` positions, those positions, the encoder's
    whole output: Qwen3-Omni's deepstack features are in it); `places` as in `with_audio`."""
    dev = embeds.device
    vision_place.bring(module, dev)  # from host memory, before the conversation's first image (once)
    with encoder_timer(media, dev, "image"), no_cudnn_attention(dev.type == "cuda"):
        out = module.get_image_features(media["pixel_values"].to(dev), media["image_grid_thw"].to(dev),
                                        return_dict=True)
    embeds, positions = place(embeds, input_ids, token, torch.cat(list(out.pooler_output), dim=0), places)
    return embeds, positions, out


def place(embeds: torch.Tensor, input_ids: torch.Tensor, token: int, features: torch.Tensor, places: int):
    """`features` ([n, W], in order) at the n positions of `token` in `input_ids` ([1, L]), of which the host
    counted `places`. Checked on the host first: on a GPU a count that does not match is a device-side
    assert in the scatter, which ends the process (a server's too); here it is an error of the turn (an
    internal one: the prompt's text is checked for media markers, prompt.py `_checked`)."""
    if places != features.shape[0]:
        raise RuntimeError(f"the prompt has {places} places for its encoder's outputs but the encoder gave "
                           f"{features.shape[0]}: the prompt's media and its markers disagree")
    positions = (input_ids == token).unsqueeze(-1).expand_as(embeds)
    return embeds.masked_scatter(positions, features.to(embeds.dtype)), positions


def timed_into(media: dict | None, part: dict) -> None:
    """The encoders' times recorded in `part` (a prompt's new clips and images, runtime/context.py) added to
    the whole prompt's `media`, which the turn's stats read."""
    if media is None or part is media:
        return
    for key in ("encoder_time", "image_encoder_time"):
        if part.get(key):
            media[key] = media.get(key, []) + part[key]
