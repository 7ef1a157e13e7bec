"""What a checkpoint's `config.json` says of its quantization: `quantization_config` at the top, or in a
thinker's or talker's sub-config, read into a frozen `Quantization` — or a one-line `ModelError` naming
what is not supported.

Known (keys as the formats' libraries write them): GPTQ (`quant_method: gptq`, `bits`, `group_size`, `sym`,
`desc_act`, `checkpoint_format` "gptq" = v1 or "gptq_v2"), AWQ (`quant_method: awq`, `version: gemm`,
`zero_point`, `modules_to_not_convert`), compressed-tensors (`quant_method: compressed-tensors`, `format`,
`config_groups` of `targets` + `weights` {num_bits, type, strategy, group_size, symmetric, block_structure,
actorder}, `ignore`) in its `pack-quantized` (int4) and `float-quantized` (FP8 e4m3) formats, and block
FP8 (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size`, `modules_to_not_convert`).

Does not know: which tensors a layer holds (formats.py), nor whether the ignore patterns match the
model's names (the loader). Activation schemes (an FP8 checkpoint's dynamic activation scales) are
accepted and dropped: activations stay in the model's dtype. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ModelError

SUB_CONFIGS = ("thinker_config", "talker_config")


@dataclass(frozen=True)
class Quantization:
    """One `quantization_config`, as far as loading its weights needs it."""

    method: Literal["gptq", "awq", "compressed-tensors", "fp8"]  # the `quant_method`
    format: str  # gptq: "gptq" (v1, zeros minus one) or "gptq_v2"; awq: "gemm"; compressed-tensors:
    # "pack-quantized" or "float-quantized"; fp8: "block"
    kind: Literal["int4", "fp8"]  # what formats.PackedWeight the weights become
    bits: int  # 4 or 8
    group_size: int | None  # int4: inputs a scale covers; None: one scale per output channel (or fp8)
    symmetric: bool  # int4: no zero points stored (or all 8)
    block: tuple[int, int] | None  # fp8: (rows, cols) sharing one scale; None: per channel (or tensor)
    strategy: str  # compressed-tensors' weights strategy ("group", "channel", "tensor", "block"); else ""
    targets: tuple[str, ...]  # compressed-tensors: the module types/patterns quantized; else ()
    ignore: tuple[str, ...]  # modules left unquantized: `ignore` / `modules_to_not_convert` (names or "re:")
    where: str  # "" for the top-level config, else the sub-config's key ("thinker_config", ...)


def _fail(where: str, what: str) -> ModelError:
    place = f"{where}." if where else ""
    return ModelError(f"{place}quantization_config: {what} is not supported")


def _group(where: str, value: Any) -> int | None:
    if value is None or value == -1:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _fail(where, f"group size {value!r}")
    return value


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


def _gptq(q: Mapping[str, Any], where: str) -> Quantization:
    bits = q.get("bits")
    if bits != 4:
        raise _fail(where, f"GPTQ with {bits} bits (4 only)")
    if q.get("desc_act"):
        raise _fail(where, "act-order GPTQ (desc_act: true)")
    fmt = str(q.get("checkpoint_format") or "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail(where, f"GPTQ checkpoint_format {fmt!r}")
    return Quantization("gptq", fmt, "int4", 4, _group(where, q.get("group_size", 128)), bool(q.get("sym", True)),
                        None, "", (), _names(q.get("modules_to_not_convert")), where)


def _awq(q: Mapping[str, Any], where: str) -> Quantization:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise _fail(where, f"AWQ with {bits} bits (4 only)")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _fail(where, f"AWQ version {version!r} (gemm only)")
    if not q.get("zero_point", True):
        raise _fail(where, "AWQ without zero points")
    group = _group(where, q.get("group_size", q.get("q_group_size", 128)))
    return Quantization("awq", "gemm", "int4", 4, group, False, None, "", (),
                        _names(q.get("modules_to_not_convert")), where)


def _compressed(q: Mapping[str, Any], where: str) -> Quantization:
    groups = q.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise _fail(where, "compressed-tensors without config_groups")
    found: list[Quantization] = []
    targets: list[str] = []
    for name, scheme in groups.items():
        fmt = str(scheme.get("format") or q.get("format") or "")
        weights = scheme.get("weights")
        if not isinstance(weights, Mapping):
            raise _fail(where, f"compressed-tensors group {name!r} without weights")
        bits, typ = weights.get("num_bits"), weights.get("type")
        strategy = str(weights.get("strategy") or "")
        if weights.get("dynamic"):
            raise _fail(where, f"group {name!r}: dynamic weight scales")
        if fmt == "pack-quantized":
            if (bits, typ) != (4, "int"):
                raise _fail(where, f"pack-quantized with {bits}-bit {typ} weights (4-bit int only)")
            if strategy not in ("group", "channel"):
                raise _fail(where, f"pack-quantized strategy {strategy!r} (group or channel)")
            if weights.get("actorder") == "group":
                raise _fail(where, "pack-quantized with actorder 'group' (a g_idx)")
            acts = scheme.get("input_activations")
            if acts:
                raise _fail(where, f"pack-quantized with quantized activations ({acts.get('num_bits')}-bit)")
            group = _group(where, weights.get("group_size")) if strategy == "group" else None
            if strategy == "group" and group is None:
                raise _fail(where, "group strategy without a group_size")
            found.append(Quantization("compressed-tensors", fmt, "int4", 4, group, bool(weights.get("symmetric", True)),
                                      None, strategy, (), (), where))
        elif fmt == "float-quantized":
            if (bits, typ) != (8, "float"):
                raise _fail(where, f"float-quantized with {bits}-bit {typ} weights (8-bit float only)")
            if strategy not in ("tensor", "channel", "block"):
                raise _fail(where, f"float-quantized strategy {strategy!r}")
            if not weights.get("symmetric", True):
                raise _fail(where, "float-quantized with zero points")
            block = None
            if strategy == "block":
                structure = weights.get("block_structure")
                if not (isinstance(structure, (list, tuple)) and len(structure) == 2):
                    raise _fail(where, f"block strategy with block_structure {structure!r}")
                block = (int(structure[0]), int(structure[1]))
            found.append(Quantization("compressed-tensors", fmt, "fp8", 8, None, True, block, strategy, (), (), where))
        else:
            raise _fail(where, f"compressed-tensors format {fmt!r} (pack-quantized or float-quantized)")
        targets += _names(scheme.get("targets"))
    first = found[0]
    if any(f != first for f in found[1:]):
        raise _fail(where, "compressed-tensors with differing schemes in its config_groups")
    return Quantization(first.method, first.format, first.kind, first.bits, first.group_size, first.symmetric,
                        first.block, first.strategy, tuple(dict.fromkeys(targets)), _names(q.get("ignore")), where)


def _fp8(q: Mapping[str, Any], where: str) -> Quantization:
    fmt = str(q.get("fmt", "e4m3"))
    if fmt != "e4m3":
        raise _fail(where, f"FP8 format {fmt!r} (e4m3 only)")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2):
        raise _fail(where, f"FP8 without a weight_block_size (got {block!r})")
    return Quantization("fp8", "block", "fp8", 8, None, True, (int(block[0]), int(block[1])), "block", (),
                        _names(q.get("modules_to_not_convert") or q.get("ignored_layers")), where)


READERS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed, "fp8": _fp8}


def read(q: Mapping[str, Any], where: str = "") -> Quantization:
    """One `quantization_config` mapping."""
    method = str(q.get("quant_method", "")).lower()
    reader = READERS.get(method)
    if reader is None:
        raise _fail(where, f"quant_method {method or None!r} (gptq, awq, compressed-tensors, fp8)")
    return reader(q, where)


def detect(config: Mapping[str, Any]) -> tuple[Quantization, ...]:
    """Every `quantization_config` of a `config.json` mapping: the top level's, then the thinker's and the
    talker's sub-configs'; () for an unquantized checkpoint."""
    found = []
    if config.get("quantization_config"):
        found.append(read(config["quantization_config"]))
    for key in SUB_CONFIGS:
        sub = config.get(key)
        if isinstance(sub, Mapping) and sub.get("quantization_config"):
            found.append(read(sub["quantization_config"], key))
    return tuple(found)
