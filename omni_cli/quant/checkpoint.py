"""Quantized checkpoints on disk: loading the ones people download (`load`); writing our own is
writing.py's.

Loading (`load(cls, path, dtype, device, name)`), for a folder whose config.json has a
`quantization_config` (detect.py reads it):
- the model is built from the config (the quantization_config dropped, so transformers' own quantizers
  never run) with its *parameters* on the meta device and its buffers real (rotary inv_freq, filters:
  computed by the constructors on the CPU, in the asked dtype as from_pretrained computes them), so no float
  copy of the model is ever made, on the host or the device;
- each module the safetensors files hold quantized (GPTQ `qweight`/`qzeros`/`scales`/`g_idx`, AWQ GEMM
  `qweight`/`qzeros`/`scales`, compressed-tensors `weight_packed`/`weight_scale`/`weight_shape`/
  `weight_zero_point`, FP8 `weight` e4m3 with `weight_scale_inv` or `weight_scale`) becomes a `QuantLinear`,
  its tensors read from the file onto the device and converted to the canonical layout there
  (formats.from_*); experts stored one by one (`...mlp.experts.<e>.gate_proj/up_proj/down_proj.*`, how every
  Qwen3-Omni checkpoint stores them) become a `QuantExperts` bank, gate rows then up rows as transformers
  fuses them (its conversion mapping for qwen2_moe-style experts: MergeModulelist, then Concatenate(dim=1)
  of [gate, up]: gate_up_proj [E, 2I, H]);
- the float tensors are read onto the device in the model's dtype and put in place of the meta parameters,
  under the names `compat.checkpoint_name` gives (transformers 5.21+ moved the thinker's text model to
  `thinker.model.language_model`); float experts stored one by one are stacked as transformers stacks them;
  the vision tower's are read into host memory, never onto the device (runtime/vision_place.py: it waits
  there for the conversation's first image);
- a module the config's `ignore` / `modules_to_not_convert` names (exact names, "re:" patterns, and for the
  GPTQ/AWQ/FP8 lists a name's part, as transformers matches those) must be stored in float: it loads as float;
- a tensor the model has no place for, a parameter the files lack, or a shape that does not fit is a one-line
  ModelError naming the first.

It does not know: which layers to quantize (apply.py), the folder's other files (the face copies them), kernels,
act-order GPTQ, GPTQ/AWQ writing, or `.bin` weights (safetensors only).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from . import detect, formats
from .detect import Quantization
from .experts import QuantExperts
from .formats import PackedWeight
from .linear import QuantLinear

log = logging.getLogger("omni_cli.loader")

EXPERT = re.compile(r"^(?P<bank>.+\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)$")
# the tensors of a quantized linear, per on-disk format (bias apart); "?" marks the optional ones
TENSORS = {
    ("gptq", "int4"): ("qweight", "qzeros", "scales", "g_idx?"),
    ("awq", "int4"): ("qweight", "qzeros", "scales"),
    ("compressed-tensors", "int4"): ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point?"),
    ("compressed-tensors", "fp8"): ("weight", "weight_scale", "input_scale?"),  # a static input scale: dropped
    ("fp8", "fp8"): ("weight", "weight_scale_inv"),
}
MARKERS = ("qweight", "weight_packed", "weight_scale_inv", "weight_scale")  # a module stored quantized


def quantization_of(config: Mapping[str, Any], name: str) -> Quantization | None:
    """The one quantization a config.json mapping declares (None: a float checkpoint); a one-line
    ModelError where its sub-configs declare differing ones."""
    found = detect.detect(config)
    if not found:
        return None
    first = found[0]
    key = (first.method, first.format, first.kind, first.group_size, first.symmetric, first.block, first.strategy)
    for q in found[1:]:
        if (q.method, q.format, q.kind, q.group_size, q.symmetric, q.block, q.strategy) != key:
            raise ModelError(f"{name}: quantization_config in {q.where} differs from {first.where or 'the top level'}'s: "
                             "one scheme per checkpoint is supported")
    ignore = tuple(dict.fromkeys(n for q in found for n in q.ignore))
    return Quantization(first.method, first.format, first.kind, first.bits, first.group_size, first.symmetric,
                        first.block, first.strategy, first.targets, ignore, first.where)


def folder_quantization(path: Path, name: str) -> Quantization | None:
    """`quantization_of` a folder's config.json."""
    return quantization_of(json.loads((Path(path) / "config.json").read_text(encoding="utf-8")), name)


def ignored(module: str, q: Quantization) -> bool:
    """Whether `q`'s ignore list names `module` (a checkpoint name)."""
    for entry in q.ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif entry == module or (q.method != "compressed-tensors" and entry in module.split(".")) \
                or (q.method != "compressed-tensors" and "." in entry and entry in module):
            return True
    return False


# --- reading ------------------------------------------------------------------------------------------


class Files:
    """The folder's safetensors, by tensor name, read lazily onto one device (or, asked, into host memory)."""

    def __init__(self, path: Path, device: torch.device, name: str) -> None:
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ModelError(f"{name}: a quantized checkpoint is read from safetensors files; {path} has none")
        where = "cpu" if device.type == "cpu" else str(device)
        self.paths = [str(path / f) for f in files]
        self.handles = [safe_open(p, framework="pt", device=where) for p in self.paths]
        self.where = {key: i for i, h in enumerate(self.handles) for key in h.keys()}  # name -> its file's index
        self.name = name
        self._host: dict[int, Any] = {}  # a file's handle reading into host memory, opened on first use

    def keys(self):
        return self.where.keys()

    def get(self, key: str, host: bool = False) -> torch.Tensor:
        """`key`'s tensor on the device, or with `host` read straight into host memory (not through the device)."""
        i = self.where[key]
        if not host:
            return self.handles[i].get_tensor(key)
        if i not in self._host:
            from safetensors import safe_open

            self._host[i] = safe_open(self.paths[i], framework="pt", device="cpu")
        return self._host[i].get_tensor(key)

    def dtype(self, key: str) -> str:
        return self.handles[self.where[key]].get_slice(key).get_dtype()


@contextlib.contextmanager
def _parameters_on_meta(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory) and their buffers real;
    floating tensors default to `dtype`, as from_pretrained builds a model."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        register(self, name, param)
        if param is not None and not param.is_meta:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    old_dtype = torch.get_default_dtype()
    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        torch.set_default_dtype(old_dtype)


def _float_config(cls, path: Path):
    """`cls`'s config from the folder with every quantization_config removed."""
    data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    data.pop("quantization_config", None)
    for key in detect.SUB_CONFIGS:
        if isinstance(data.get(key), dict):
            data[key].pop("quantization_config", None)
    return cls.config_class.from_dict(data)


def _packed(q: Quantization, get: Callable[[str], torch.Tensor | None], prefix: str, name: str) -> PackedWeight:
    """One linear's PackedWeight from its stored tensors (`get(suffix)`: None where absent)."""
    try:
        if q.method == "gptq":
            return formats.from_gptq(get("qweight"), get("qzeros"), get("scales"), get("g_idx"), q.group_size or -1,
                                     v1=q.format == "gptq")
        if q.method == "awq":
            return formats.from_awq(get("qweight"), get("qzeros"), get("scales"), q.group_size or -1)
        if q.kind == "int4":
            shape = get("weight_shape")
            if shape is None:
                raise ModelError("no weight_shape")
            return formats.from_compressed_tensors_int4(get("weight_packed"), get("weight_scale"), shape.tolist(),
                                                        get("weight_zero_point"))
        if q.method == "fp8":
            if q.block is None:
                raise ModelError("block FP8 without a weight_block_size")
            return formats.from_fp8_block(get("weight"), get("weight_scale_inv"), q.block)
        return formats.from_compressed_tensors_fp8(get("weight"), get("weight_scale"), q.strategy, q.block)
    except ModelError as exc:
        raise ModelError(f"{name}: {prefix}: {exc}") from exc


def _cat_rows(parts: list[PackedWeight], name: str, where: str) -> PackedWeight:
    """gate | up: one PackedWeight whose rows are the parts' rows in order."""
    spec = parts[0].spec
    if spec.kind == "fp8" and spec.block is not None and parts[0].shape[0] % spec.block[0]:
        raise ModelError(f"{name}: {where}: FP8 blocks of {spec.block[0]} rows do not divide the "
                         f"{parts[0].shape[0]} rows of gate_proj: cannot stack gate and up")
    zeros = None if parts[0].zeros is None else torch.cat([p.zeros for p in parts])
    return PackedWeight(spec, (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                        torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), zeros)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def load(cls, path: Path, dtype: torch.dtype, device: torch.device, name: str) -> nn.Module:
    """`cls` (the family's *ForConditionalGeneration) from a quantized folder, in eval mode: packed modules on
    `device`, float tensors there in `dtype`, buffers still where the constructors made them (the caller
    moves the model, which moves only those). See the module's docstring."""
    from ..runtime import compat

    path = Path(path)
    device = torch.device(device)
    q = folder_quantization(path, name)
    if q is None:
        raise ModelError(f"{name}: config.json has no quantization_config")
    files = Files(path, device, name)
    config = _float_config(cls, path)
    with _parameters_on_meta(dtype):
        model = cls(config)
    modules = {compat.checkpoint_name(n): n for n, _ in model.named_modules() if n}
    params = {compat.checkpoint_name(n): n for n, _ in model.named_parameters()}
    params.update({compat.checkpoint_name(n): n for n, _ in model.named_buffers()})

    by_module: dict[str, set[str]] = defaultdict(set)
    for key in files.keys():
        prefix, _, suffix = key.rpartition(".")
        by_module[prefix].add(suffix)
    quantized = sorted(p for p, s in by_module.items() if any(m in s for m in MARKERS))
    ahead = _read_ahead(files, quantized, by_module)
    try:
        return _load(model, files, q, quantized, by_module, modules, params, path, device, dtype, name)
    finally:
        if ahead is not None:
            ahead.stop()


def _read_ahead(files: Files, quantized: list[str], by_module: dict[str, set[str]]):
    """The files read into the page cache ahead of the loader (read_ahead.py), in its order: the packed
    modules' tensors by module name, then the float ones by name. None where it does not start."""
    from ..read_ahead import ReadAhead, tensor_ranges

    try:
        ranges = [tensor_ranges(p) for p in files.paths]
    except (OSError, ValueError, KeyError):
        return None
    order = [f"{prefix}.{suffix}" for prefix in quantized for suffix in sorted(by_module[prefix])]
    first = set(order)
    order += sorted(k for k in files.keys() if k not in first)
    return ReadAhead.of([(files.paths[files.where[k]], *ranges[files.where[k]][k]) for k in order])


def _load(model, files, q, quantized, by_module, modules, params, path, device, dtype, name) -> nn.Module:
    """`load`'s work once the files are open and the model built on the meta device."""
    from ..runtime import compat, vision_place

    want = TENSORS[(q.method, q.kind)]
    used: set[str] = set()

    def reader(prefix: str):
        def get(suffix: str) -> torch.Tensor | None:
            key = f"{prefix}.{suffix}"
            if key not in files.where:
                return None
            used.add(key)
            return files.get(key)
        return get

    def packed_of(prefix: str) -> tuple[PackedWeight, torch.Tensor | None]:
        if ignored(prefix, q):
            raise ModelError(f"{name}: {prefix} is stored quantized, but its quantization_config ignores it")
        have = by_module[prefix]
        for t in want:
            if not t.endswith("?") and t not in have:
                raise ModelError(f"{name}: the weights lack {prefix}.{t}")
        extra = sorted(have - {t.rstrip("?") for t in want} - {"bias"})
        if extra:
            raise ModelError(f"{name}: unexpected tensor {prefix}.{extra[0]} for {q.method} {q.format}")
        get = reader(prefix)
        packed = _packed(q, get, prefix, name)
        get("input_scale")  # activations stay in the model's dtype
        return packed, get("bias")

    banks: dict[str, dict[int, dict[str, tuple[PackedWeight, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for prefix in quantized:
        m = EXPERT.match(prefix)
        if m and m["bank"] in modules and hasattr(model.get_submodule(modules[m["bank"]]), "gate_up_proj"):
            banks[m["bank"]][int(m["e"])][m["part"]] = packed_of(prefix)
            continue
        target = modules.get(prefix)
        linear = None if target is None else model.get_submodule(target)
        if target is None or not isinstance(linear, nn.Linear):
            raise ModelError(f"{name}: unexpected tensor {prefix}.{sorted(by_module[prefix])[0]}: the model has "
                             "no linear layer there")
        packed, bias = packed_of(prefix)
        if packed.shape != (linear.out_features, linear.in_features):
            raise ModelError(f"{name}: {prefix} is {list(packed.shape)}, the model's layer "
                             f"[{linear.out_features}, {linear.in_features}]")
        if (bias is None) != (linear.bias is None):
            what = f"lack {prefix}.bias" if bias is None else f"have {prefix}.bias, which the model's layer has not"
            raise ModelError(f"{name}: the weights {what}")
        if bias is not None and tuple(bias.shape) != (linear.out_features,):
            raise ModelError(f"{name}: {prefix}.bias is {list(bias.shape)}, the model's [{linear.out_features}]")
        _set(model, target, QuantLinear(packed, None if bias is None else bias.to(dtype)))

    for bank, experts in banks.items():
        meta = model.get_submodule(modules[bank])
        count, two_i, hidden = meta.gate_up_proj.shape
        _every_expert(experts, count, bank, name, " (quantized)", f": the model has {count} experts")
        gate_up, down = [], []
        for e in range(count):
            parts = experts[e]
            if any(parts[p][1] is not None for p in parts):
                raise ModelError(f"{name}: unexpected tensor {bank}.{e}: expert biases")
            for part, want_shape in (("gate_proj", (two_i // 2, hidden)), ("up_proj", (two_i // 2, hidden)),
                                     ("down_proj", tuple(meta.down_proj.shape[1:]))):
                if parts[part][0].shape != want_shape:
                    raise ModelError(f"{name}: {bank}.{e}.{part} is {list(parts[part][0].shape)}, the model's "
                                     f"{list(want_shape)}")
            gate_up.append(_cat_rows([parts["gate_proj"][0], parts["up_proj"][0]], name, f"{bank}.{e}"))
            down.append(parts["down_proj"][0])
        _set(model, modules[bank], QuantExperts(gate_up, down, meta.act_fn))
        del gate_up, down, experts

    # the vision tower's tensors are read into host memory: it waits there for the first image
    host = vision_place.tower_prefix(model) if device.type != "cpu" else None
    _load_float(model, files, params, used, dtype, name, host)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ModelError(f"{name}: the weights lack {compat.checkpoint_name(left[0])}")
    model.eval()
    if (path / "generation_config.json").is_file() and getattr(model, "can_generate", lambda: False)():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    log.info("%s: %s %s weights loaded packed (%d matrices)", name, q.method, q.format, len(quantized))
    return model


def _load_float(model: nn.Module, files: Files, params: dict[str, str], used: set[str], dtype: torch.dtype,
                name: str, host: str | None = None) -> None:
    """The files' float tensors (those not `used` yet) in place of the model's meta parameters (and over its
    buffers), each cast to the dtype the model made it in; per-expert float weights stacked. Parameters
    named under `host` (a module prefix) are read into host memory."""
    stacks: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for key in sorted(k for k in files.keys() if k not in used):
        if key not in params:
            prefix, _, leaf = key.rpartition(".")
            m = EXPERT.match(prefix)
            if m and leaf == "weight" and f"{m['bank']}.gate_up_proj" in params:
                stacks[m["bank"]][int(m["e"])][m["part"]] = key
                continue
            raise ModelError(f"{name}: unexpected tensor {key}: the model has no such weight")
        _put(model, params[key], files.get(key, host=host is not None and params[key].startswith(host)), name, key)
    for bank, experts in stacks.items():
        target = params[f"{bank}.gate_up_proj"]
        current = _current(model, target)
        if current is None:
            raise ModelError(f"{name}: unexpected tensor {experts[min(experts)]['gate_proj']}: {bank} is stored quantized too")
        count = current.shape[0]
        _every_expert(experts, count, bank, name, ".weight", ".weight")
        gate = torch.stack([files.get(experts[e]["gate_proj"]) for e in range(count)])
        up = torch.stack([files.get(experts[e]["up_proj"]) for e in range(count)])
        _put(model, target, torch.cat([gate, up], dim=1), name, f"{bank}.*.gate_proj/up_proj.weight")
        del gate, up
        down = torch.stack([files.get(experts[e]["down_proj"]) for e in range(count)])
        _put(model, params[f"{bank}.down_proj"], down, name, f"{bank}.*.down_proj.weight")


def _every_expert(experts: dict, count: int, bank: str, name: str, lack: str, extra: str) -> None:
    """A one-line ModelError unless the files hold gate, up and down of each of the bank's `count` experts
    and no more (`lack` / `extra`: how the message names the missing or the surplus tensor)."""
    for e in range(count):
        for part in ("gate_proj", "up_proj", "down_proj"):
            if part not in experts.get(e, {}):
                raise ModelError(f"{name}: the weights lack {bank}.{e}.{part}{lack}")
    if len(experts) != count:
        raise ModelError(f"{name}: unexpected tensor {bank}.{max(experts)}.gate_proj{extra}")


def _current(model: nn.Module, target: str) -> torch.Tensor | None:
    parent, _, leaf = target.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    return owner._parameters.get(leaf) if leaf in owner._parameters else owner._buffers.get(leaf)


def _put(model: nn.Module, target: str, tensor: torch.Tensor, name: str, key: str) -> None:
    parent, _, leaf = target.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = _current(model, target)
    if old is None:
        raise ModelError(f"{name}: unexpected tensor {key}")
    if tuple(tensor.shape) != tuple(old.shape):
        raise ModelError(f"{name}: {key} is {list(tensor.shape)}, the model's {list(old.shape)}")
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ModelError(f"{name}: {key} is stored in {tensor.dtype} without its scale (weight_scale)")
    if tensor.is_floating_point() and old.is_floating_point():
        tensor = tensor.to(old.dtype)
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=old.requires_grad)
    else:
        owner._buffers[leaf] = tensor.to(old.device)
