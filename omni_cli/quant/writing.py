"""Writing a packed model as a checkpoint in compressed-tensors' layout (`save`, and `quantize_folder`, what
omni-quantize does: load a float folder, pack it with apply.quantize_model, save it beside the folder's other
files, as a temp folder renamed at the end).

`save(model, dst, ...)`: a model packed by apply.quantize_model, written in compressed-tensors'
layout under the checkpoint's names (per-expert names, as the community Qwen3-Omni checkpoints use), sharded
safetensors with an index, and a `quantization_config` that compressed-tensors itself reads: pack-quantized
(int4, group or channel, with zero points when asymmetric) or float-quantized (FP8, block or channel).
Every nn.Linear left in float is listed in `ignore` (targets are "Linear").

It does not know: how a checkpoint is read back (checkpoint.py), which layers to quantize (apply.py), kernels,
GPTQ/AWQ writing.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from . import detect, formats
from .experts import QuantExperts
from .formats import PackedWeight
from .linear import QuantLinear

log = logging.getLogger("omni_cli.loader")

SHARD_BYTES = 4 << 30  # the largest safetensors file `save` writes


@dataclass(frozen=True)
class Written:
    """What `save` wrote."""

    tensors: int  # tensors written
    bytes: int  # their bytes
    files: int  # safetensors files
    ignored: int  # float linears listed in the quantization_config's `ignore`


def _int4_tensors(packed: PackedWeight) -> dict[str, torch.Tensor]:
    n, k = packed.shape
    out = {"weight_packed": packed.qweight, "weight_scale": packed.scales,
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if packed.zeros is not None:  # packed along N, eight a word: [ceil(N/8), K/g]
        out["weight_zero_point"] = formats.pack_int4(packed.zeros.t().contiguous()).t().contiguous()
    return out


def _tensors_of(packed: PackedWeight) -> dict[str, torch.Tensor]:
    if packed.spec.kind == "int4":
        return _int4_tensors(packed)
    return {"weight": packed.qweight, "weight_scale": packed.scales}


def _split_rows(packed: PackedWeight, rows: int) -> tuple[PackedWeight, PackedWeight]:
    """A bank expert's gate_up weight back into gate and up (the inverse of `_cat_rows`)."""
    spec = packed.spec
    step = spec.block[0] if spec.kind == "fp8" and spec.block is not None else 1
    if rows % step:
        raise ModelError(f"FP8 blocks of {step} rows do not divide an expert's {rows} gate rows: its gate and up "
                         "cannot be written apart (use a block that divides the experts' intermediate size)")
    parts = []
    for lo, hi in ((0, rows), (rows, packed.shape[0])):
        zeros = None if packed.zeros is None else packed.zeros[lo:hi]
        parts.append(PackedWeight(spec, (hi - lo, packed.shape[1]), packed.qweight[lo:hi],
                                  packed.scales[lo // step:-(-hi // step)], zeros))
    return parts[0], parts[1]


def checkpoint_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of everything `save` writes: packed modules in compressed-tensors' layout,
    experts one by one, float parameters and persistent buffers under their checkpoint names."""
    from ..runtime import compat

    inside: set[str] = set()
    for mname, sub in model.named_modules():
        if isinstance(sub, QuantLinear):
            c = compat.checkpoint_name(mname)
            for k, v in _tensors_of(sub.packed).items():
                yield f"{c}.{k}", v
            if sub.bias is not None:
                yield f"{c}.bias", sub.bias.detach()
            inside.add(mname)
        elif isinstance(sub, QuantExperts):
            c = compat.checkpoint_name(mname)
            rows = sub.meta["gate_up"][1][0] // 2
            for e in range(sub.num_experts):
                gate, up = _split_rows(sub.expert("gate_up", e), rows)
                for part, packed in (("gate_proj", gate), ("up_proj", up), ("down_proj", sub.expert("down", e))):
                    for k, v in _tensors_of(packed).items():
                        yield f"{c}.{e}.{part}.{k}", v
            inside.add(mname)
    for key, value in model.state_dict().items():
        owner = key.rpartition(".")[0]
        if owner in inside:
            continue
        c = compat.checkpoint_name(key)
        if c.endswith(".experts.gate_up_proj") and value.dim() == 3:  # a float bank: stored one by one
            bank = c.rpartition(".")[0]
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                yield f"{bank}.{e}.gate_proj.weight", value[e, :half]
                yield f"{bank}.{e}.up_proj.weight", value[e, half:]
        elif c.endswith(".experts.down_proj") and value.dim() == 3:
            bank = c.rpartition(".")[0]
            for e in range(value.shape[0]):
                yield f"{bank}.{e}.down_proj.weight", value[e]
        else:
            yield c, value


def float_linears(model: nn.Module) -> list[str]:
    """Checkpoint names of the nn.Linear layers left in float (what `ignore` lists)."""
    from ..runtime import compat

    return [compat.checkpoint_name(n) for n, m in model.named_modules() if type(m) is nn.Linear or
            (isinstance(m, nn.Linear) and not isinstance(m, QuantLinear))]


def quantization_config(spec: formats.QuantSpec, ignore: list[str]) -> dict[str, Any]:
    """The compressed-tensors `quantization_config` for packed weights of `spec` (targets "Linear")."""
    if spec.kind == "int4":
        weights = {"num_bits": 4, "type": "int", "symmetric": spec.symmetric, "dynamic": False,
                   "strategy": "group" if spec.group_size else "channel", "group_size": spec.group_size,
                   "block_structure": None, "actorder": None, "observer": "minmax"}
        fmt, acts = "pack-quantized", None
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "block" if spec.block else "channel", "group_size": None,
                   "block_structure": list(spec.block) if spec.block else None, "actorder": None,
                   "observer": "minmax"}
        fmt = "float-quantized"
        # what FP8-block checkpoints declare (activations quantized per token group by the runtime that
        # reads it); omni_cli keeps activations in the model's dtype
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
                "group_size": spec.block[1] if spec.block else 128, "observer": None}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": fmt}},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.20.1",
    }


def save(model: nn.Module, folder: Path, config: dict[str, Any], spec: formats.QuantSpec,
         shard_bytes: int = SHARD_BYTES, progress: Callable[[int, int], None] | None = None) -> Written:
    """Write `model` (packed by apply.quantize_model) into `folder` (which exists and is empty): safetensors
    (sharded past `shard_bytes`, with model.safetensors.index.json) and config.json (`config` with the
    compressed-tensors `quantization_config`). `progress(bytes_done, bytes_total)` after each file."""
    from safetensors.torch import save_file

    names: list[tuple[str, int]] = []
    seen: set[str] = set()
    for key, value in checkpoint_tensors(model):
        if key in seen:
            raise ModelError(f"two tensors would be written as {key}")
        seen.add(key)
        names.append((key, value.numel() * value.element_size()))
    total = sum(b for _, b in names)
    shards: list[list[str]] = [[]]
    size = 0
    for key, b in names:
        if shards[-1] and size + b > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += b
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    where = {key: files[i] for i, keys in enumerate(shards) for key in keys}
    done = 0
    for i, keys in enumerate(shards):
        wanted = set(keys)
        # clones on the CPU, so that no two entries share storage (safetensors refuses shared tensors)
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in checkpoint_tensors(model) if k in wanted}
        save_file(tensors, str(folder / files[i]), metadata={"format": "pt"})
        done += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        if progress is not None:
            progress(done, total)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(where.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    ignore = float_linears(model)
    config = dict(config)
    for key in detect.SUB_CONFIGS:
        if isinstance(config.get(key), dict):
            config[key] = {k: v for k, v in config[key].items() if k != "quantization_config"}
    config["quantization_config"] = quantization_config(spec, ignore)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return Written(tensors=len(names), bytes=total, files=len(files), ignored=len(ignore))


# --- a folder in, a folder out (omni-quantize) ----------------------------------------------------------

WEIGHT_FILE = re.compile(r"(model.*\.safetensors|model\.safetensors\.index\.json|pytorch_model.*\.bin(\.index\.json)?)$")


def check_destination(dst: Path, force: bool, src: str | None = None) -> None:
    """A UsageError unless `dst` may be written: absent, an empty folder, or (with `force`) any folder;
    never the source folder `src` or a folder holding it (--force would replace the checkpoint being read)."""
    from ..errors import UsageError

    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise UsageError(f"{dst} exists and is not a folder")
    if src is not None and Path(src).exists() and dst.exists():
        source, target = Path(src).resolve(), dst.resolve()
        if source == target or target in source.parents:
            raise UsageError(f"{dst} holds the source checkpoint {src}: write the packed one to another folder")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise UsageError(f"{dst} is a folder that is not empty: pass --force to replace it")


def quantize_folder(src: str | None, dst: Path, options, progress: Callable[[str, int, int], None] | None = None):
    """Load the float checkpoint `src` (anything loader.load_model takes) on the CPU, pack its decoder stacks
    layer by layer on `options.device` (apply.quantize_model), and write `dst` in compressed-tensors' layout
    with the folder's other files (tokenizer, generation config, voices) copied: written as a hidden folder
    beside `dst`, renamed at the end, so `dst` is either whole or as it was. `progress(phase, done, total)`
    ("layers", then "bytes"). Returns (Written, apply.Packed)."""
    import os
    import shutil

    from .. import atomic
    from ..errors import UsageError
    from ..loader import load_model, pick_device, pick_dtype
    from .apply import quantize_model, spec_for

    dst = Path(dst)
    check_destination(dst, options.force)
    device = pick_device(options.device)
    path_hint = json.loads((Path(src) / "config.json").read_text(encoding="utf-8")) if src and (Path(src) / "config.json").is_file() else {}
    dtype_name = options.dtype
    if dtype_name == "auto":
        dtype_name = str(path_hint.get("torch_dtype") or path_hint.get("dtype") or "bfloat16")
    dtype = pick_dtype(dtype_name, device)
    loaded = load_model(src, device="cpu", dtype=str(dtype).removeprefix("torch."))
    if any(isinstance(m, (QuantLinear, QuantExperts)) for m in loaded.model.modules()):
        raise UsageError(f"{loaded.name} is quantized already: omni-quantize reads a float checkpoint")
    if options.kind == "int4":
        spec = spec_for("int4", dtype, options.group_size)
        if not options.symmetric:
            spec = formats.QuantSpec("int4", spec.group_size, False, None, spec.scale_dtype)
    else:
        spec = formats.QuantSpec("fp8", block=(options.block, options.block))
    config = json.loads((loaded.path / "config.json").read_text(encoding="utf-8"))
    try:
        with torch.no_grad():
            packed = quantize_model(loaded.model, spec, device,
                                    progress=None if progress is None else lambda d, t: progress("layers", d, t))
    except ValueError as exc:  # a group or block that does not fit a layer's width
        raise UsageError(f"cannot quantize {loaded.name}: {exc}") from exc
    dst.parent.mkdir(parents=True, exist_ok=True)
    temp = atomic.temp_path(dst.absolute())
    os.mkdir(temp)
    try:
        for f in sorted(loaded.path.iterdir()):
            if f.is_file() and f.name != "config.json" and not WEIGHT_FILE.fullmatch(f.name):
                shutil.copy2(f, temp / f.name)
        written = save(loaded.model, temp, config, spec,
                       progress=None if progress is None else lambda d, t: progress("bytes", d, t))
        check_destination(dst, options.force)  # again: something may have appeared there meanwhile
        old = None
        if dst.exists():
            old = atomic.temp_path(dst.absolute(), ".old")
            os.rename(dst, old)
        os.rename(temp, dst)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return written, packed
