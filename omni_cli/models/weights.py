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
            raise OmniError(f"out of memory loading {name}: try --dtype bfloat16 or a smaller model") from exc
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


def to_device(model, place, device, name: str) -> None:
    """`place(model)` (moves it to `device`), with out-of-memory as a one-line error."""
    try:
        place(model)
    except Exception as exc:
        if is_oom(exc):
            free_memory(device)
            raise OmniError(f"out of GPU memory loading {name}: try --dtype bfloat16 or a smaller model") from exc
        raise


def free_memory(device: "torch.device") -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
