"""Where the thinker's vision encoder lives: in host memory from loading until the conversation's first
image, then on the model's device for good.

Why: most conversations show no image, and the tower is a large share of a small card. Qwen2.5-Omni-7B's
is 676 M parameters, 1.35 GB in bfloat16 (the packed 7B's weights: 4.0 GB packed, 5.8 GB float);
Qwen3-Omni-30B-A3B's 539 M, 1.08 GB (counted on the meta device). The first image pays one copy of it; an
out-of-memory there is a one-line error that leaves the tower on the host, so text and audio turns go on.

The loaders place a model with `place` (`model.to(device)`, the tower moved to the host instead, where
transformers' `from_pretrained` read a float folder's straight onto the device with the rest);
quant/checkpoint.py and models/random_packed.py never put it on the device at all (`tower_prefix`,
`tower_class`). runtime/encoders.py calls `bring` before the encoder runs. On the CPU, and for a model
without a vision tower, every function here does nothing. It knows no family (compat.visual finds the
tower) and nothing of images.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from . import compat

log = logging.getLogger("omni_cli.runtime")

HOST = torch.device("cpu")


def tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of `model` (a whole *ForConditionalGeneration or a thinker), None where it has none."""
    thinker = getattr(model, "thinker", model)
    try:
        return compat.visual(thinker)
    except AttributeError:
        return None


def tower_prefix(model: nn.Module) -> str | None:
    """The tower's module name in `model` with a trailing dot (`thinker.visual.`, or `thinker.model.visual.`
    from transformers 5.21), None where it has none: what quant/checkpoint.py keeps on the host."""
    t = tower(model)
    if t is None:
        return None
    return next((f"{name}." for name, m in model.named_modules() if m is t), None)


def tower_class(model: nn.Module) -> type | None:
    """The tower's class, for random_packed.py to construct it on the host (a meta-device probe serves)."""
    t = tower(model)
    return None if t is None else type(t)


def place(model: nn.Module, device) -> None:
    """`model.to(device)` but for the vision tower, which goes to (or stays in) host memory whole, the
    device's copy of any of it given back (transformers reads a float folder straight onto the device)."""
    t = tower(model)
    if t is None or torch.device(device).type == "cpu":
        model.to(device)
        return
    owner = compat.thinker_core(model.thinker if hasattr(model, "thinker") else model)
    owner.visual = None  # out of nn.Module.to's reach for the move; the attribute stays a registered child
    try:
        model.to(device)
    finally:
        owner.visual = t
    if any(x.device.type != "cpu" for x in _tensors(t)):
        t.to(HOST)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def host_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights kept in host memory (the vision tower until the first image): 0 when all
    are on the device, or the device is the CPU."""
    t = tower(model)
    if t is None:
        return 0
    params = list(t.parameters())
    if not params or params[0].device.type != "cpu":
        return 0
    first = next((p for p in model.parameters() if p.device.type != "cpu"), None)
    if first is None:  # the whole model runs on the CPU: nothing is held apart
        return 0
    return sum(p.numel() * p.element_size() for p in params)


def bring(thinker: nn.Module, device: torch.device) -> None:
    """The vision tower on `device` before its first image (a no-op once there). Out of memory: the tower
    goes back to the host and an OmniError says so in one line."""
    from ..errors import OmniError
    from ..models.weights import free_memory, is_oom

    t = tower(thinker)
    if t is None or _device_of(t) == device:
        return
    size = sum(p.numel() * p.element_size() for p in t.parameters())
    try:
        t.to(device)
    except Exception as exc:
        if not is_oom(exc):
            raise
        t.to(HOST)
        free_memory(device)
        raise OmniError(f"out of memory on {device} bringing the vision encoder ({size / 1e9:.2f} GB) there for "
                        "the first image: free GPU memory or load with --quantize int4 or a smaller --max-context; "
                        "text and audio turns go on") from exc
    log.debug("vision encoder moved to %s for the first image (%.2f GB)", device, size / 1e9)


def _tensors(module: nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return HOST if p is None else p.device
