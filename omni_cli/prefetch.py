"""A local model folder's weight files read into the page cache on background threads, from the moment
`omni_cli.load` is called, while the process imports torch and transformers.

On a machine that has read nothing yet, a start is two waits in a row on the same disk: the imports (24 s
for a packed 7B folder on an H100 machine: torch's and transformers' files from a cold disk, their
bytecode compiled) and then the weights (11.7 s for its 10 GB at 0.86 GB/s; docs/benchmarks.md, nineteenth
pass). The imports are mostly the interpreter compiling and executing, so the disk can read the weights
meanwhile; the loaders then read them as before (safetensors maps the files, early_weights.py reads them
once torch is imported) and find them in memory. Nothing here changes what is loaded: a read that fails
or is stopped only leaves the loader more to read from the disk.

It reads only where the files fit well within the memory the system says is available (`SHARE` of
MemAvailable; otherwise the first files would be evicted before the loader reads them, and the disk would
read them twice) and are worth a thread (`MIN_BYTES`): not for a hub id (its files may not be downloaded
yet), the built-in tiny models, a system without /proc/meminfo, or with OMNI_NO_PREFETCH=1. It knows
nothing of formats, families or devices: only files, their sizes and the memory.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from .config import env_flag

log = logging.getLogger("omni_cli.loader")

PREFETCH_ENV = "OMNI_NO_PREFETCH"  # 1: read nothing ahead
SHARE = 0.5  # of the available memory, at most, for the files read ahead
MIN_BYTES = 256 << 20  # smaller folders load in a moment anyway
READERS = 2  # files read at once
CHUNK = 16 << 20  # bytes a read


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (the memory the kernel can give without swapping), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Prefetch:
    """Threads reading `files` to their end, `READERS` at a time, until done or `stop`."""

    def __init__(self, files: list[Path]) -> None:
        self.files = list(files)
        self.read = 0  # bytes read so far (all threads)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> "Prefetch":
        left = list(self.files)

        def reader() -> None:
            buffer = bytearray(CHUNK)
            while not self._stop.is_set():
                with self._lock:
                    if not left:
                        return
                    path = left.pop(0)
                self._read(path, buffer)

        self._threads = [threading.Thread(target=reader, name=f"prefetch-{i}", daemon=True)
                         for i in range(min(READERS, len(self.files)))]
        for thread in self._threads:
            thread.start()
        return self

    def _read(self, path: Path, buffer: bytearray) -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                while not self._stop.is_set():
                    n = f.readinto(buffer)  # the GIL is released while the disk reads
                    if not n:
                        return
                    with self._lock:
                        self.read += n
        except OSError as exc:  # the loader reads the file itself and reports what is wrong with it
            log.debug("reading %s ahead stopped: %s", path, exc)

    def stop(self) -> None:
        """Stop reading (the model is loaded: what is left would only cost the disk and a core)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        for thread in self._threads:
            thread.join(timeout)


def start(model) -> Prefetch | None:
    """Reading the weight files of `model` (a folder, or None for $OMNI_MODEL) ahead, or None where it
    does not apply (module docstring)."""
    from .early_weights import weight_files
    from .loader import MODEL_ENV

    if env_flag(PREFETCH_ENV):
        return None
    text = os.fspath(model) if model is not None else os.environ.get(MODEL_ENV, "").strip()
    if not text:
        return None
    folder = Path(text).expanduser()
    files = weight_files(folder) if folder.is_dir() else None
    if not files:  # (regular files only: a FIFO would block its reader for good)
        return None
    try:
        total = sum(f.stat().st_size for f in files)
    except OSError:
        return None
    memory = available_memory()
    if total < MIN_BYTES or memory is None or total > SHARE * memory:
        return None
    log.debug("reading %d weight files (%.1f GB) ahead of the imports", len(files), total / 1e9)
    return Prefetch(files).start()
