"""Reading a folder's safetensors files into the page cache, many requests at once, ahead of a loader that
takes their tensors one by one.

A packed folder's loader (quant/checkpoint.py) reads each tensor through safetensors' file mapping on one
thread: on a cold disk every page it touches is a small read that waits for the disk, where the same disk
gives ~2 GB/s to 16 readers of large blocks (docs/benchmarks.md, fourth pass). An H100 machine's 10 GB:
10.5-11.2 s that way, 8.7-9.2 s with this (twentieth pass). `ReadAhead` reads the byte ranges of the
tensors, in the order the loader will take them, on `READERS` threads (`os.preadv` into a buffer each
thread reuses: the bytes land in the page cache, where the loader's mapping then finds them). It starts
once the imports are done: reads beside the imports slowed them more than they saved (fourth pass).

What it knows: the safetensors header's offsets. What it does not: the tensors' meaning. It stops at
`stop()` (the loader is done, or failed), or as soon as a large read comes at the page cache's speed
(the files were read before), never reads a range twice, and any error reading ends its threads quietly:
the loader reads what is left itself, as without it. OMNI_NO_READ_AHEAD=1 turns it off.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Iterable

from .config import env_flag

READ_AHEAD_ENV = "OMNI_NO_READ_AHEAD"
READERS = 16  # threads reading at once (fourth pass: 16 readers of 64 MB gave the disk's best rate)
BLOCK = 64 << 20  # bytes a read asks for (each reader's buffer: 1 GiB for 16, held while they read)
MEMORY_SHARE = 32  # the readers' buffers take at most 1/MEMORY_SHARE of the machine's memory
MIN_BYTES = 1 << 30  # smaller folders are read by the loader alone (mostly from the page cache anyway)
# A read of at least JUDGED bytes that comes faster than CACHED_RATE came from the page cache (a cold disk
# gives 1-2 GB/s): the files were read before, and copying them again would only take memory bandwidth
# from the loader, so the reads stop.
JUDGED, CACHED_RATE = 8 << 20, 5e9


HEADER_MAX = 100 << 20  # a safetensors header claiming more bytes is not read (a corrupt or hostile file)


def safetensors_header(path) -> tuple[dict, int]:
    """(the JSON header of the safetensors file at `path`, the offset its data starts at): an 8-byte
    little-endian length, then the JSON. ValueError where the file is too short for it, claims a header
    over HEADER_MAX bytes, or the header is not a JSON object; OSError where it cannot be read."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > HEADER_MAX:
            raise ValueError(f"{path}: a safetensors header of {size} bytes")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: a safetensors header that is not an object")
    return header, 8 + size


def tensor_ranges(path: str) -> dict[str, tuple[int, int]]:
    """Each tensor's (start, end) byte offsets in the safetensors file at `path` (`safetensors_header`; the
    data offsets are counted from the header's end)."""
    header, base = safetensors_header(path)
    return {k: (base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def blocks(spans: Iterable[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """`spans` ((path, start, end), in the order wanted) joined where one ends where the next starts in the
    same file, then cut into reads of at most BLOCK bytes."""
    joined: list[list] = []
    for path, start, end in spans:
        if joined and joined[-1][0] == path and joined[-1][2] == start:
            joined[-1][2] = end
        else:
            joined.append([path, start, end])
    return [(path, at, min(at + BLOCK, end)) for path, start, end in joined for at in range(start, end, BLOCK)]


def _memory() -> int | None:
    """The machine's memory in bytes, where the system says (None elsewhere)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def readers_for(memory: int | None) -> int:
    """READERS, fewer where their buffers would take more than 1/MEMORY_SHARE of `memory` (bytes; None:
    unknown), at least 2: 16 on a 32 GiB machine and up, 8 on 16 GiB, 4 on 8 GiB."""
    if memory is None:
        return READERS
    return max(2, min(READERS, memory // (MEMORY_SHARE * BLOCK)))


class ReadAhead:
    """Threads reading `reads` ((path, start, end), in order) into the page cache until done or stopped."""

    def __init__(self, reads: list[tuple[str, int, int]], readers: int = READERS) -> None:
        self.reads, self.next = reads, 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._run, name=f"omni-read-ahead-{i}", daemon=True)
                        for i in range(min(readers, len(reads)))]
        for t in self.threads:
            t.start()

    @classmethod
    def of(cls, spans: list[tuple[str, int, int]]) -> "ReadAhead | None":
        """One over `spans` if the switch allows it and they are worth it (`MIN_BYTES`), else None."""
        if env_flag(READ_AHEAD_ENV) or sum(end - start for _, start, end in spans) < MIN_BYTES:
            return None
        return cls(blocks(spans), readers=readers_for(_memory()))

    def _take(self) -> tuple[str, int, int] | None:
        with self.lock:
            if self.stopped.is_set() or self.next >= len(self.reads):
                return None
            self.next += 1
            return self.reads[self.next - 1]

    def _run(self) -> None:
        buffer, fds = bytearray(BLOCK), {}
        try:
            while (read := self._take()) is not None:
                path, start, end = read
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                began = time.perf_counter()
                os.preadv(fds[path], [memoryview(buffer)[:end - start]], start)
                if end - start >= JUDGED and (end - start) > CACHED_RATE * (time.perf_counter() - began):
                    self.stop()  # in the page cache already
        except OSError:
            pass  # the loader reads what is left itself
        finally:
            for fd in fds.values():
                os.close(fd)

    def stop(self) -> None:
        """No new reads (those under way finish on their own)."""
        self.stopped.set()
