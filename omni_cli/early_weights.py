"""Reading a checkpoint's weights onto the device on a thread while the main thread imports transformers.

On a GPU machine a command's start is mostly two waits in a row: importing transformers' model code
(6.5-11 s on an H200 machine, most of it Python holding the interpreter lock) and then reading the
weights onto the device (4-6 s for 22 GB from the page cache). The reading barely needs the lock
(safetensors maps the file; the copy to the device runs in torch with the lock released), so it can
happen during the import instead of after it. `EarlyWeights.start` begins it; `take()` hands the tensors
to transformers' `from_pretrained` as its `state_dict`, which then does with them exactly what it does
with the files: renames, dtype casts, tying, the missing-keys report (the true-size 7B folder loads bit
for bit the same model either way on an H200). It copies each tensor as it loads it, so the device holds
the weights twice for a moment (41.4 GiB at the peak for the 7B, against 20.8 GiB from the files); the
originals are then freed and their memory given back. Measured on an H200 ("again", page cache warm): the
weights' phase after the import went from 4.8-5.9 s to 2.8 s.

What it knows: a folder's safetensors files (the single `model.safetensors`, or the shards its index
names) and how much device memory is free. What it does not know: which model the tensors belong to, or
any dtype policy: they are read as stored. It reads nothing when the files and the model made from them
would not fit in `MEMORY_SHARE` of the free device memory together (a 7B model in bfloat16 on a 24 or
48 GB GPU loads from the files), when the folder holds other formats, or when anything about the read
fails: the caller then loads from the files as before, and that path reports any real error.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("omni_cli.loader")

MEMORY_SHARE = 0.9  # of the device's free memory, at most, for the files read and the model beside them
READERS = 4  # files read at once (H200, page cache: 4 readers 2.6 s for 22 GB, 16 readers 3.0 s)


def weight_files(folder: Path) -> list[Path] | None:
    """The safetensors files that hold a folder's weights, or None when they are not (only) safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        files = [folder / name for name in names]
        return files if files and all(f.is_file() for f in files) else None
    single = folder / "model.safetensors"
    return [single] if single.is_file() else None


class EarlyWeights:
    """The tensors of a folder's safetensors files, read onto `device` on a background thread."""

    def __init__(self, files: list[Path], device) -> None:
        self.files = files
        self.device = device
        self._tensors: dict | None = None
        self._thread = threading.Thread(target=self._read, name="omni-early-weights", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, folder: Path, device, dtype=None) -> "EarlyWeights | None":
        """Begin reading, or None when it should not be done here (see the module's docstring). `dtype`:
        what the model will be made in (the model's size is estimated from the files as if they were
        16-bit: a float32 model is twice their size)."""
        import torch

        try:
            files = weight_files(folder)
            if not files:
                return None
            size = sum(f.stat().st_size for f in files)
            if device.type == "cuda":
                model = size * max(1.0, (dtype.itemsize if dtype is not None else 2) / 2)
                free, _total = torch.cuda.mem_get_info(device)
                if size + model > MEMORY_SHARE * free:
                    log.debug("weights not read early: %.1f + %.1f GB against %.1f GB free", size / 1e9,
                              model / 1e9, free / 1e9)
                    return None
        except Exception as exc:  # noqa: BLE001 - an early read is only ever a shortcut
            log.debug("weights not read early: %s", exc)
            return None
        return cls(files, device)

    def _read(self) -> None:
        try:
            import torch
            from safetensors import safe_open

            def read(file: Path) -> dict:
                with safe_open(str(file), framework="pt", device=str(self.device)) as f:
                    return {key: f.get_tensor(key) for key in f.keys()}

            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # this thread's current device, for the copies
            with ThreadPoolExecutor(min(READERS, len(self.files)), thread_name_prefix="omni-early-weights") as pool:
                parts = list(pool.map(read, self.files))
            tensors = {}
            for part in parts:
                tensors.update(part)
            self._tensors = tensors
        except Exception as exc:  # noqa: BLE001 - the files are read again the usual way, which says what is wrong
            log.debug("reading the weights early failed: %s", exc)

    def take(self) -> dict | None:
        """The tensors (name -> tensor, as stored), once read; None if the read failed. Only once: the
        caller's model then owns them."""
        self._thread.join()
        tensors, self._tensors = self._tensors, None
        return tensors
