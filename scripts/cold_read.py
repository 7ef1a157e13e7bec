"""How fast a disk gives a checkpoint's safetensors files to a reader that finds nothing in the page cache.

Usage (as root, where the page cache may be dropped):
    python scripts/cold_read.py FOLDER [--cuda]        the first 5 files, each way below, cache dropped before each
    python scripts/cold_read.py FOLDER --full T MB     the whole folder once, T threads of MB-megabyte reads

The ways: one thread of 16 MB reads (then the same again from the page cache, as a check that dropping it
worked), several threads and block sizes, O_DIRECT, and with --cuda safetensors' own reader straight to the
GPU (what `omni_cli/early_weights.py` does). Each line gives the bytes, the seconds and the rate. It reads
into a scratch buffer and keeps nothing. Used for the start-up figures in docs/benchmarks.md (2026-12-01,
fourth pass); nothing in omni_cli depends on it.
"""

from __future__ import annotations

import mmap
import os
import queue
import sys
import threading
import time


def drop_page_cache() -> bool:
    os.system("sync")
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def read(files: list[str], threads: int, block: int, direct: bool = False) -> tuple[int, float]:
    """(bytes read, seconds): `threads` threads taking `block`-byte reads of `files` from one queue."""
    jobs: queue.Queue = queue.Queue()
    for file in files:
        for offset in range(0, os.path.getsize(file), block):
            jobs.put((file, offset))
    total = [0]
    lock = threading.Lock()

    def work() -> None:
        buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        fds: dict[str, int] = {}
        n = 0
        while True:
            try:
                file, offset = jobs.get_nowait()
            except queue.Empty:
                break
            if file not in fds:
                fds[file] = os.open(file, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            n += os.preadv(fds[file], [buffer], offset)
        for fd in fds.values():
            os.close(fd)
        with lock:
            total[0] += n

    t0 = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return total[0], time.perf_counter() - t0


def safetensors_to_cuda(files: list[str], readers: int) -> float:
    import torch
    from concurrent.futures import ThreadPoolExecutor

    from safetensors import safe_open

    def one(file: str) -> None:
        with safe_open(file, framework="pt", device="cuda") as f:
            for key in f.keys():
                f.get_tensor(key)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        list(pool.map(one, files))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    folder = sys.argv[1]
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    if "--full" in sys.argv:
        i = sys.argv.index("--full")
        threads, block = int(sys.argv[i + 1]), int(sys.argv[i + 2]) << 20
        n, dt = read(files, threads, block)
        print(f"whole folder, {threads} threads {block >> 20}M: {n / 1e9:.2f} GB in {dt:.2f} s = {n / dt / 1e9:.2f} GB/s")
        return
    subset = files[:5]
    size = sum(os.path.getsize(f) for f in subset)
    print(f"{len(files)} files, subset {len(subset)} files {size / 1e9:.2f} GB", flush=True)

    def case(label: str, threads: int, block: int, direct: bool = False) -> None:
        dropped = drop_page_cache()
        n, dt = read(subset, threads, block, direct)
        print(f"{label:40s} dropped={dropped} {n / 1e9:6.2f} GB {dt:6.2f} s {n / dt / 1e9:6.2f} GB/s", flush=True)

    case("1 thread 16M", 1, 16 << 20)
    n, dt = read(subset, 1, 16 << 20)
    print(f"{'same again, not dropped':40s} {n / dt / 1e9:6.2f} GB/s", flush=True)
    for threads, mb in [(4, 16), (16, 16), (64, 4), (16, 64), (32, 16)]:
        case(f"{threads} threads {mb}M", threads, mb << 20)
    for threads, mb in [(16, 16), (64, 4)]:
        try:
            case(f"O_DIRECT {threads} threads {mb}M", threads, mb << 20, direct=True)
        except OSError as exc:
            print("O_DIRECT failed:", exc)
    if "--cuda" in sys.argv:
        for readers in (4, 16):
            drop_page_cache()
            dt = safetensors_to_cuda(subset, readers)
            print(f"safetensors to cuda, {readers} readers: {size / dt / 1e9:.2f} GB/s ({dt:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
