"""Qwen2.5-Omni checkpoints: the weights through transformers' own class, and the voices in `spk_dict.pt`.

`load` reads the weights (thinker and talker in the asked dtype, token2wav in float32, as the
reference runs it; a quantized folder through quant/checkpoint.py, its token2wav in the asked dtype:
quant/apply.py says why; on a GPU the vision tower in host memory until the first image:
runtime/vision_place.py) and the voices (name -> {bos_token, cond, ref_mel}); `voice_names` lists the
voices without torch, reading the pickle with a restricted unpickler that never runs code from it.
Every failure a person can fix is a one-line ModelError / OmniError. It does not find folders or pick
devices (loader.py), nor generate (steps.py).
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any, Mapping

from ...errors import ModelError

log = logging.getLogger("omni_cli.loader")

# What a voice entry in spk_dict.pt carries.
SPEAKER_KEYS = ("bos_token", "cond", "ref_mel")


def load(path: Path, device, dtype, name: str, early=None):
    """(Qwen2_5OmniForConditionalGeneration in eval mode on `device`, voices). `early`: the folder's
    weights being read already (models/weights.py's from_pretrained)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from ...quant.apply import cast_token2wav
    from ...runtime import vision_place
    from ..weights import from_pretrained, quantized_from, to_device

    omni = quantized_from(Qwen2_5OmniForConditionalGeneration, path, dtype, name, device)
    if omni is None:
        # The base class's from_pretrained, as Qwen2_5OmniForConditionalGeneration.from_pretrained calls
        # it, but asking for the loading report (the subclass's override cannot return it); the voices
        # are loaded below, as the override would.
        base = super(Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniForConditionalGeneration)
        omni = from_pretrained(base, path, dtype, name, device, early=early)

    def place(model):
        vision_place.place(model, device)  # the vision tower to host memory until the first image
        if getattr(model, "has_talker", False):
            cast_token2wav(model, dtype)

    to_device(omni, place, device, name, path=path, dtype=dtype)
    speakers = _load_speakers(path / "spk_dict.pt", name)
    # What Qwen2_5OmniForConditionalGeneration.from_pretrained does after loading (load_speakers).
    omni.speaker_map = dict(speakers)
    return omni, speakers


def voice_names(folder: Path, name: str) -> list[str]:
    """The voice names in spk_dict.pt, without torch when the file is a torch zip checkpoint."""
    file = folder / "spk_dict.pt"
    try:
        data = _read_torch_pickle_shallow(file)
    except _NotShallow:
        # Not the zip format torch has written since 1.6 (or something our reader refuses): let torch
        # read it, at the price of importing torch.
        return list(_load_speakers(file, name))
    except Exception as exc:  # a damaged file: unpickling bad bytes can raise nearly anything
        raise ModelError(f"{name}: cannot read spk_dict.pt: {_one_line(exc)}") from exc
    _check_speakers(data, name)
    return list(data)


def _load_speakers(file: Path, name: str) -> dict:
    import torch

    try:
        data = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise ModelError(f"{name}: cannot read spk_dict.pt: {_one_line(exc)}") from exc
    _check_speakers(data, name)
    return data


def _check_speakers(data: Any, name: str) -> None:
    """A ModelError unless `data` is a non-empty dict of voice name -> entry with SPEAKER_KEYS."""
    if not isinstance(data, dict):
        raise ModelError(f"{name}: spk_dict.pt is not a dict of voices")
    for voice, entry in data.items():
        if not isinstance(entry, Mapping) or any(k not in entry for k in SPEAKER_KEYS):
            raise ModelError(f"{name}: spk_dict.pt entry '{voice}' lacks one of {', '.join(SPEAKER_KEYS)}")
    if not data:
        raise ModelError(f"{name}: spk_dict.pt has no voices")


class _NotShallow(Exception):
    """spk_dict.pt is not something `_read_torch_pickle_shallow` reads; torch.load may."""


class _TensorStub:
    """Stands for a tensor in a shallowly read checkpoint: the structure is kept, the data never read."""


def _tensor_stub(*_args) -> _TensorStub:
    return _TensorStub()


class _ShallowUnpickler(pickle.Unpickler):
    """Reads the object tree of a torch zip checkpoint with every tensor replaced by `_TensorStub`.

    Safer than torch.load and free of torch: only plain containers and torch's tensor-rebuilding names
    are resolved (to stubs); any other global refuses the file, so no code from it ever runs. Storages
    (persistent ids) become stubs, so the tensor data in the zip is not even read."""

    _REBUILD = {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_parameter_with_state"}

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if module == "torch._utils" and name in self._REBUILD:
            return _tensor_stub
        if module == "torch" and name.endswith("Storage"):
            return _TensorStub  # only ever passed around inside a persistent id
        raise _NotShallow(f"{module}.{name}")

    def persistent_load(self, pid):
        return _TensorStub()


def _read_torch_pickle_shallow(file: Path) -> Any:
    """The object saved in a torch zip checkpoint (`torch.save`), tensors as `_TensorStub`s."""
    if not zipfile.is_zipfile(file):
        raise _NotShallow("not a zip checkpoint")
    with zipfile.ZipFile(file) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise _NotShallow("no single data.pkl")
        with archive.open(pickles[0]) as stream:
            return _ShallowUnpickler(stream).load()


def _one_line(exc: BaseException) -> str:
    from ..weights import one_line

    return one_line(exc)
