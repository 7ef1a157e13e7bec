"""Loading a family's weights through transformers: `from_pretrained` with one-line errors (a folder's
weights read straight onto the device, or handed over by early_weights.py), `to_device`, transformers'
warnings kept quiet while loading (`quiet_transformers`), and `one_line` for messages.

The families' checkpoint modules and the loader use it; it knows no family, no folder layout (loader.py
finds and checks folders) and no runtime. torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelError, OmniError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

log = logging.getLogger("omni_cli.loader")  # its messages are the loader's (the faces show them so)


@contextlib.contextmanager
def quiet_transformers():
    """Keep transformers' and huggingface_hub's warnings and progress bars off stderr while loading."""
    import transformers
    from transformers.utils import logging as hf_logging

    old_level = hf_logging.get_verbosity()
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield transformers
    finally:
        hf_logging.set_verbosity(old_level)
        if bars_were_on:
            hf_logging.enable_progress_bar()


def one_line(exc: BaseException | str, limit: int = 300) -> str:
    """An exception's message (or a message) on one line, shortened to `limit` characters."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text or type(exc).__name__


def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def from_pretrained(cls, path: Path, dtype, name: str, device=None, early=None):
    """`cls.from_pretrained(path)` in `dtype` from local files, with one-line errors, and a warning for
    weights the folder lacks (transformers' own is silenced by `quiet_transformers`).

    On an accelerator the weights are read straight onto `device` (a `device_map`): no full copy in host
    memory first, and the reading overlaps the host-to-device copies. On a CPU, or without `accelerate`
    (which transformers needs for a device map), they are read into host memory and moved after.
    `early`: an `EarlyWeights` reading the folder's weights already (early_weights.py); its tensors go to
    transformers as the `state_dict`, with the folder's config and generation config, which is what
    loading from the folder does with the files."""
    where = {}
    if device is not None and getattr(device, "type", "cpu") != "cpu" and _has_accelerate():
        where = {"device_map": {"": device}}
    tensors = early.take() if early is not None else None
    try:
        if tensors is not None:
            model, info = _from_tensors(cls, path, tensors, dtype, where)
        else:
            model, info = cls.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                              output_loading_info=True, **where)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        if is_oom(exc):
            raise oom_error(name, path, device, dtype) from exc
        raise ModelError(f"cannot load the weights of {name} ({path}): {one_line(exc)}") from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        log.warning("%s lacks %d weights (first: %s): they are random", name, len(missing), missing[0])
    return model


def quantized_from(cls, path: Path, dtype, name: str, device):
    """`cls` from a quantized folder (config.json's quantization_config: quant/checkpoint.py, packed weights
    read onto `device`), or None for a float folder, which `from_pretrained` loads. transformers' own
    quantizers never see the folder: they would need gptqmodel / compressed-tensors and decompress experts."""
    import torch

    from ..quant import checkpoint

    if checkpoint.folder_quantization(path, name) is None:
        return None
    try:
        return checkpoint.load(cls, path, dtype, torch.device(device if device is not None else "cpu"), name)
    except (KeyboardInterrupt, OmniError):
        raise
    except Exception as exc:
        if is_oom(exc):
            raise OmniError(f"out of memory loading {name}: try a smaller model") from exc
        raise ModelError(f"cannot load the weights of {name} ({path}): {one_line(exc)}") from exc


def _from_tensors(cls, path: Path, tensors: dict, dtype, where: dict):
    """`cls.from_pretrained` of the folder's config with `tensors` as the state dict (early_weights.py)."""
    from transformers import GenerationConfig

    config = cls.config_class.from_pretrained(str(path), local_files_only=True)
    model, info = cls.from_pretrained(None, config=config, state_dict=tensors, dtype=dtype,
                                      output_loading_info=True, **where)
    tensors.clear()  # transformers loaded copies of them: free the originals
    if where:  # on a GPU: give their memory back, for other programs too
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if (path / "generation_config.json").is_file() and getattr(model, "can_generate", lambda: False)():
        model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    return model, info


def _has_accelerate() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def to_device(model, place, device, name: str, path: Path | None = None, dtype=None, quantize: str | None = None) -> None:
    """`place(model)` (moves it to `device`), with out-of-memory as a one-line error (`oom_error`: what
    would fit, where the checkpoint `path` is known)."""
    try:
        place(model)
    except Exception as exc:
        if is_oom(exc):
            free_memory(device)
            raise oom_error(name, path, device, dtype, quantize) from exc
        raise


# Bytes a weight takes, by what --quantize asks: bfloat16 2 (float32 4); int4 0.5 + a bfloat16 scale per
# 128 inputs (0.516) and the layout's rounding; fp8 1 + a float32 scale per 128x128 block.
BYTES_PER_WEIGHT = {"int4": 0.53, "fp8": 1.02}
# Packed by --quantize (quant/apply.py's decoder stacks): a checkpoint's tensors under these names, but the
# routers and the shared expert's gate, which stay in the model's dtype.
PACKED_PREFIXES = ("thinker.model.layers.", "talker.model.layers.", "thinker.model.language_model.layers.")
KEPT_SUFFIXES = ("mlp.gate.weight", "shared_expert_gate.weight")
# What the weights may take of the free memory and still leave room for caches, activations and graphs.
WEIGHTS_SHARE = 0.9


def checkpoint_parameters(path: Path) -> tuple[int, int]:
    """(parameters, of which --quantize packs) of a folder's safetensors, from their headers only (a few KB
    read a file); (0, 0) where there are none (a .bin checkpoint) or a header cannot be read."""
    import math

    from ..read_ahead import safetensors_header

    total = packable = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            header, _ = safetensors_header(file)
        except (OSError, ValueError):
            return 0, 0
        for key, info in header.items():
            if key == "__metadata__" or not isinstance(info, dict):
                continue
            n = math.prod(info.get("shape") or [1])
            total += n
            if key.startswith(PACKED_PREFIXES) and len(info.get("shape") or ()) >= 2 and not key.endswith(KEPT_SUFFIXES):
                packable += n
    return total, packable


def weights_estimate(total: int, packable: int, quantize: str | None, float_bytes: int = 2) -> float:
    """Bytes of a model's weights with `total` parameters, `packable` of them packed as `quantize` asks."""
    if quantize is None:
        return float(total * float_bytes)
    return (total - packable) * float_bytes + packable * BYTES_PER_WEIGHT[quantize]


def oom_error(name: str, path: Path | None, device, dtype=None, quantize: str | None = None) -> OmniError:
    """The one-line error of an out-of-memory while loading `name`: with the checkpoint's parameter count
    and the device's free memory, which --quantize would fit the weights, or, where they fit, that the
    rest (caches, activations) did not and a smaller --max-context would help."""
    total, packable = checkpoint_parameters(path) if path is not None else (0, 0)
    available = _available(device)
    where = getattr(device, "type", "cpu")
    if not total or available is None:
        return OmniError(f"out of {'GPU ' if where != 'cpu' else ''}memory loading {name}: try --quantize int4 "
                         "(or fp8), --dtype bfloat16 or a smaller model")
    float_bytes = 4 if str(dtype) in ("torch.float32", "float32") else 2
    gib = 2**30
    sizes = {q: weights_estimate(total, packable, q, float_bytes) for q in (None, "fp8", "int4")}
    said = ", ".join(f"{q or str(dtype or 'bfloat16').removeprefix('torch.')} ~{b / gib:.1f} GiB" for q, b in sizes.items())
    head = (f"out of memory on {device} loading {name} ({total / 1e9:.1f} B parameters; weights {said}; "
            f"{available / gib:.1f} GiB free)")
    if sizes[quantize] <= WEIGHTS_SHARE * available:
        return OmniError(f"{head}: the weights fit, the rest did not: try a smaller --max-context")
    fits = [q for q in ("fp8", "int4") if sizes[q] <= WEIGHTS_SHARE * available and sizes[q] < sizes[quantize]]
    if fits:
        return OmniError(f"{head}: try --quantize {fits[0]}")
    return OmniError(f"{head}: even --quantize int4 does not fit: a smaller model or a device with more memory")


def _available(device) -> int | None:
    """Bytes this process could have on `device` once what the failed load held is freed: the free memory
    plus what torch's allocator keeps (None off CUDA)."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    free_memory(device)
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def free_memory(device: "torch.device") -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
