"""Which parts of an Omni model get packed weights, and packing them layer by layer (`quantize_model`).

What is quantized: the decoder layers of the thinker and of the talker (`decoder_stacks`): attention's q/k/v/o, a
dense MLP's gate/up/down, a mixture-of-experts layer's expert banks and its shared expert. Batch-1 decode
reads these every step, and they are nearly all of the bytes (Qwen3-Omni-30B-A3B: 29 of its 35 B
parameters are the thinker's experts).
What stays in the model's dtype, and why:
- the routers (`mlp.gate`) and the shared expert's sigmoid gate (`shared_expert_gate`): a few KB a layer,
  and an expert picked differently changes the whole token;
- norms, embeddings and the LM / codec heads: embeddings are read one row a step, the heads decide each
  token (and the official checkpoints keep them 16-bit too);
- Qwen3-Omni's code predictor (`talker.code_predictor`): quantizing it is known to degrade long audio
  (mlx-vlm's 4-bit Qwen3-Omni fix), and it is small (5 layers of 1024);
- the vocoders (token2wav, code2wav), the audio and vision encoders, the talker's input projections:
  they run once a prompt or on the vocoder thread, off the decode loop's critical bytes. Qwen2.5-Omni's
  token2wav runs in float32 in a float model, as the reference runs it, but in the model's dtype once the
  model is packed (`cast_token2wav`): its 449 M parameters are 1.8 GB in float32, a sixth of the
  packed 7B, and people quantize to fit a card.

`quantize_model` packs one decoder layer at a time on the target device (a layer moved there in the
model's dtype, packed, its float weights freed), so neither the float model nor a float copy of the
quantized part ever has to fit the device; what is left (embeddings, encoders, vocoder) moves after.
It does not know checkpoint formats (loading packed tensors: quant/checkpoint.py) nor kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .experts import QuantExperts
from .formats import QuantSpec
from .linear import QuantLinear, quantize_linears

KEEP = ("mlp.gate", "shared_expert_gate")  # names inside them (suffixes) kept in the model's dtype

SPECS: dict[str, dict[str, Any]] = {  # what `--quantize` asks for
    "int4": dict(kind="int4", group_size=128, symmetric=True),
    "fp8": dict(kind="fp8", block=(128, 128)),
}


def spec_for(name: str, dtype: torch.dtype, group_size: int | None = None) -> QuantSpec:
    """The QuantSpec `--quantize NAME` means for a model in `dtype`: int4 with group scales in that dtype
    (the official and community checkpoints' choice), FP8 with 128x128 block scales in float32 (the
    block-FP8 checkpoints')."""
    if name not in SPECS:
        raise ValueError(f"unknown quantization {name!r} (int4 or fp8)")
    fields = dict(SPECS[name])
    if name == "int4":
        if group_size is not None:
            fields["group_size"] = group_size
        fields["scale_dtype"] = str(dtype).removeprefix("torch.")
    return QuantSpec(**fields)


def keep(name: str) -> bool:
    """Whether the module `name` (relative to a decoder layer or the model) stays in the model's dtype."""
    return name.endswith(KEEP)


def is_expert_bank(module: nn.Module) -> bool:
    """The library's fused experts module (3-D `gate_up_proj` and `down_proj`)."""
    w = getattr(module, "gate_up_proj", None)
    return isinstance(w, torch.Tensor) and w.dim() == 3 and isinstance(getattr(module, "down_proj", None), torch.Tensor)


@dataclass
class Packed:
    """What `quantize_model` did: layers packed, and the quantized weights' bytes before and after."""

    layers: int = 0
    names: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0


def decoder_stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """(qualified name, layers) of the thinker's and the talker's decoder stacks (where the model has a
    talker); the thinker's text model moved in transformers 5.21 (runtime/compat.py)."""
    from ..runtime import compat

    text = compat.thinker_text_model(model.thinker)
    stacks = [(_name_of(model, text.layers), text.layers)]
    talker = getattr(model, "talker", None)
    if talker is not None and getattr(model, "has_talker", True):
        stacks.append((_name_of(model, talker.model.layers), talker.model.layers))
    return stacks


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, sub in model.named_modules() if sub is module)


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, layer) of each layer of `decoder_stacks`."""
    return [(f"{stack}.{i}", layer) for stack, layers in decoder_stacks(model) for i, layer in enumerate(layers)]


def quantize_layer(layer: nn.Module, spec: QuantSpec, done: Packed, prefix: str = "") -> None:
    """Pack `layer`'s expert banks and linears (but those `keep` names) in place, on the device it is on."""
    for name, sub in list(layer.named_modules()):
        if is_expert_bank(sub):
            parent, _, child = name.rpartition(".")
            done.bytes_before += sum(t.numel() * t.element_size() for t in (sub.gate_up_proj, sub.down_proj))
            bank = QuantExperts.from_experts(sub, spec)
            setattr(layer.get_submodule(parent), child, bank)
            done.bytes_after += bank.weight_bytes
            done.names.append(f"{prefix}{name}")
    replaced = quantize_linears(layer, spec, skip=keep)
    done.bytes_before += replaced.bytes_before
    done.bytes_after += replaced.bytes_after
    done.names += [f"{prefix}{n}" for n in replaced.names]
    done.layers += 1


def quantize_model(model: nn.Module, spec: QuantSpec, device: torch.device | None = None,
                   progress: Callable[[int, int], None] | None = None) -> Packed:
    """Pack the decoder stacks of `model` (the module docstring says which parts) round-to-nearest, one
    layer at a time: each layer is moved to `device` (None: where it is), packed there, and its float
    weights freed before the next. `progress(done, total)` after each layer. The rest of the model is not
    moved: the caller moves it after."""
    layers = decoder_layers(model)
    done = Packed()
    for i, (name, layer) in enumerate(layers):
        if device is not None:
            layer.to(device)
        with torch.no_grad():
            quantize_layer(layer, spec, done, prefix=f"{name}.")
        if progress is not None:
            progress(i + 1, len(layers))
    return done


def cast_token2wav(model: nn.Module, dtype: torch.dtype) -> None:
    """`model`'s token2wav (Qwen2.5-Omni's; other families have none), buffers too, in the dtype it runs in
    beside LLMs in `dtype`: float32, as the reference runs it, unless the model is packed; then `dtype`
    (module docstring: why). One cast: a float32 copy on the way would take 1.8 GB more."""
    token2wav = getattr(model, "token2wav", None)
    if token2wav is not None:
        token2wav.to(dtype if has_packed(model) else torch.float32)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights in `model` (QuantLinear and QuantExperts; a fused QuantLinear's views
    not counted twice)."""
    total, seen = 0, set()
    for sub in model.modules():
        if isinstance(sub, (QuantLinear, QuantExperts)):
            for t in sub.buffers(recurse=False):
                key = (t.untyped_storage().data_ptr(), t.storage_offset())
                if key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
    return total


def has_packed(model: nn.Module) -> bool:
    """Whether any module of `model` holds packed weights."""
    return any(isinstance(sub, (QuantLinear, QuantExperts)) for sub in model.modules())


def dequantized(model: nn.Module, dtype: torch.dtype = torch.float32):
    """(module name, {parameter name: float tensor}) of each packed module in `model`: what the library's
    module in that place would hold (`weight` of a linear; `gate_up_proj`, `down_proj` of an expert bank).
    The reference a quantized model is compared against, and the error quantization adds."""
    for name, sub in model.named_modules():
        if isinstance(sub, QuantLinear):
            yield name, {"weight": sub.packed.dequantize(dtype)}
        elif isinstance(sub, QuantExperts):
            yield name, {"gate_up_proj": sub.bank("gate_up").dequantize(dtype),
                         "down_proj": sub.bank("down").dequantize(dtype)}
