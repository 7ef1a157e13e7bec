"""A random-weight model at true size with its decoder layers packed, built so that the float model never
exists on the device (omni-bench's `--quantize`: Qwen3-Omni-30B-A3B is 66 GiB in bfloat16, about 22 GiB
packed int4).

How: the model is constructed on the device, except that its decoder layers' classes (those of
quant/apply.decoder_stacks, found on a meta-device probe) are constructed on the meta device, and its
vision tower's in host memory (where the loaders keep it until the first image: runtime/vision_place.py);
then each decoder layer in turn gets random float weights on the device, is packed there
(quant/apply.quantize_layer) and its float weights dropped before the next. At most one float layer is on
the device at a time.

Random weights: normal(0, 0.02) for matrices and expert banks (routers included, so routing follows the
input), ones for 1-D weights (norms), zeros for 1-D biases. Only speed is measured with them, never quality.
It knows no family (the presets module passes `make`, the constructor) and no checkpoint. torch is imported
when a function runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def _constructed_on(where: dict) -> Iterator[None]:
    """While inside: each class in `where` (class -> device) builds its parameters on that device, wherever
    the rest of the model is built."""
    import torch

    saved = {}
    for cls, device in where.items():
        saved[cls] = cls.__init__

        def init(self, *args, __orig=cls.__init__, __device=device, **kwargs):
            with torch.device(__device):
                __orig(self, *args, **kwargs)

        cls.__init__ = init
    try:
        yield
    finally:
        for cls, init in saved.items():
            cls.__init__ = init


def materialize(module, device, generator, std: float = 0.02) -> int:
    """Give every parameter (and buffer) of `module` still on the meta device random values on `device`
    (the module docstring says which); the count of tensors made."""
    import torch
    from torch import nn

    made = 0
    with torch.no_grad():
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                if t.dim() >= 2:
                    t.normal_(0.0, std, generator=generator)
                else:
                    t.fill_(1.0 if name == "weight" else 0.0)
                sub._parameters[name] = nn.Parameter(t, requires_grad=False)
                made += 1
            for name, b in list(sub._buffers.items()):
                if b is not None and b.is_meta:  # none in a decoder layer today; zeros are harmless
                    sub._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
                    made += 1
    return made


def build_packed(make: Callable[[], object], device, spec, progress: Callable[[int, int], None] | None = None,
                 seed: int = 0):
    """(model, quant/apply.Packed): `make()` (the family's constructor of the random model) built on
    `device` with its decoder layers made, packed as `spec` says and freed one at a time (module docstring).
    `progress(done, total)` after each layer."""
    import torch

    from ..quant.apply import Packed, decoder_layers, quantize_layer

    with torch.device("meta"):  # a probe, to learn the decoder layers' classes: no memory, a fraction of a second
        probe = make()
    where = {type(layer): "meta" for _, layer in decoder_layers(probe)}
    where.update(_on_host(probe, device))
    del probe
    with _constructed_on(where), torch.device(device):
        model = make()
    generator = torch.Generator(device=device).manual_seed(seed)
    done = Packed()
    layers = decoder_layers(model)
    for i, (name, layer) in enumerate(layers):
        materialize(layer, device, generator)
        with torch.no_grad():
            quantize_layer(layer, spec, done, prefix=f"{name}.")
        if progress is not None:
            progress(i + 1, len(layers))
    materialize(model, device, generator)  # another module of those classes (none in either family today)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return model, done


def _on_host(probe, device) -> dict:
    """{the vision tower's class: "cpu"} off a CPU: the tower waits in host memory for the first image
    (runtime/vision_place.py); {} on a CPU or for a model without one."""
    import torch

    from ..runtime.vision_place import tower_class

    cls = tower_class(probe)
    return {} if cls is None or torch.device(device).type == "cpu" else {cls: "cpu"}


def layer_progress(progress: Callable[[str], None]) -> Callable[[int, int], None]:
    """omni-bench's message `progress` as a `progress(done, total)` of packed layers (about every 8th)."""
    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 8) == 0:
            progress(f"packed {done}/{total} decoder layers")
    return report


def load_asset(load: Callable, folder, device, name: str, quantize: str | None, group_size: int | None,
               progress: Callable[[str], None]):
    """(model, voices) of a built-in tiny checkpoint through its family's `load`, in float32: on `device`,
    or, with `quantize`, in host memory with its decoder layers then packed on `device` (the loader's
    `load_packed`, int4's group size fitted to the layers when none is given)."""
    import torch

    if quantize is None:
        return load(folder, device, torch.float32, name)
    from ..loader import load_packed

    model, voices = load(folder, torch.device("cpu"), torch.float32, name)
    load_packed(model, None, device, torch.float32, "the model", quantize, group_size, layer_progress(progress))
    return model, voices


def build(make: Callable[[], object], device, dtype, quantize: str | None, group_size: int | None,
          progress: Callable[[str], None]):
    """A full-size preset's random model: `make()` on `device`, or, with `quantize`, `build_packed` with
    `--quantize`'s spec (int4's group: 128 unless given)."""
    import torch

    if quantize is None:
        with torch.device("meta"):
            probe = make()
        with _constructed_on(_on_host(probe, device)), torch.device(device):
            return make()
    from ..quant.apply import spec_for

    return build_packed(make, device, spec_for(quantize, dtype, group_size), layer_progress(progress))[0]
