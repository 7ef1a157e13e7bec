"""The vision encoder in host memory until the conversation's first image (runtime/vision_place.py).

On this CPU the meta device stands for the GPU: a move there is real for every tensor (their data is dropped,
nothing is computed), so a tensor still on the CPU is one the move left on the host. tests/test_gpu.py
checks the same on CUDA with replies: the first image brings the tower, and the reply equals one with the
tower on the device from the start.
"""

from __future__ import annotations

import pytest
import torch

from omni_cli.errors import OmniError
from omni_cli.loader import load_model
from omni_cli.runtime import vision_place

ASSETS = ["assets/tiny-qwen2.5-omni", "assets/tiny-qwen3-omni"]
META = torch.device("meta")


def split(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the tower's parameters and buffers, every other parameter and buffer of `model`)."""
    prefix = vision_place.tower_prefix(model)
    assert prefix is not None and prefix.endswith("visual.")
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return ([t for n, t in tensors if n.startswith(prefix)], [t for n, t in tensors if not n.startswith(prefix)])


@pytest.mark.parametrize("asset", ASSETS)
def test_placing_a_model_leaves_its_vision_tower_on_the_host_until_it_is_brought(asset):
    model = load_model(asset, device="cpu").model
    tower = vision_place.tower(model)
    size = sum(p.numel() * p.element_size() for p in tower.parameters())
    vision_place.place(model, META)
    inside, outside = split(model)
    assert inside and all(t.device.type == "cpu" for t in inside)
    assert outside and all(t.is_meta for t in outside)
    assert vision_place.tower(model) is tower  # still the thinker's registered child
    assert vision_place.host_bytes(model) == size > 0
    vision_place.bring(model.thinker, META)
    assert all(t.is_meta for t in split(model)[0])
    assert vision_place.host_bytes(model) == 0
    vision_place.bring(model.thinker, META)  # once there, nothing more


def test_a_tower_read_onto_the_device_goes_back_to_the_host():
    """transformers reads a float folder straight onto the device: `place` takes the tower back (wholly,
    buffers too), not only leaves it."""
    model = load_model(ASSETS[0], device="cpu").model
    tower = vision_place.tower(model)
    moved = tower.blocks[0].to(META)  # a part of it on the "device", as a device map would leave it
    assert next(moved.parameters()).is_meta
    with pytest.raises(NotImplementedError):  # meta tensors hold no data to bring back: the move is attempted
        vision_place.place(model, META)


def test_on_the_cpu_nothing_is_held_apart():
    model = load_model(ASSETS[0], device="cpu").model
    vision_place.place(model, "cpu")
    assert vision_place.host_bytes(model) == 0
    vision_place.bring(model.thinker, torch.device("cpu"))
    assert all(t.device.type == "cpu" for t in model.parameters())


def test_an_out_of_memory_first_image_is_one_line_and_leaves_the_tower_on_the_host(monkeypatch):
    model = load_model(ASSETS[1], device="cpu").model
    vision_place.place(model, META)
    tower = vision_place.tower(model)
    real_to = tower.to

    def full(*args, **kwargs):
        if any(torch.device(a).type == "meta" for a in args if isinstance(a, (str, torch.device))):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real_to(*args, **kwargs)

    monkeypatch.setattr(tower, "to", full)
    with pytest.raises(OmniError) as err:
        vision_place.bring(model.thinker, META)
    message = str(err.value)
    assert "\n" not in message and "vision encoder" in message and "first image" in message
    assert "--quantize int4" in message
    assert all(t.device.type == "cpu" for t in split(model)[0])
    assert vision_place.host_bytes(model) > 0


def test_a_random_preset_builds_its_tower_on_the_host():
    """omni-bench's true-size presets (models/random_packed.build) never make the tower on the device: the
    built-in tiny config stands in, built on the meta device (the packed build, `--quantize`, makes random
    numbers on the device, which the meta device cannot: tests/test_gpu.py builds that one on CUDA)."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    from omni_cli.models.random_packed import build

    config = Qwen2_5OmniConfig.from_pretrained(ASSETS[0])
    model = build(lambda: Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=torch.float32), META,
                  torch.float32, None, None, lambda message: None)
    inside, outside = split(model)
    assert inside and all(t.device.type == "cpu" for t in inside)
    assert outside and all(t.is_meta for t in outside)
