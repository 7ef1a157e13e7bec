"""What slows a cold start's import while the weights are read: the import timed beside each kind of reader.

Usage (as root on a GPU machine, where the page cache may be dropped):
    python scripts/import_beside_reads.py FOLDER [CASE ...]

Each case runs in a fresh interpreter, after `sync; echo 3 > /proc/sys/vm/drop_caches`: a thread starts
reading FOLDER's safetensors files, and the main thread imports torch and transformers' Qwen2.5-Omni
classes, as a load does (omni_cli/loader.py). It prints the import's seconds and the reader's. Cases:

    alone     no reader: the import by itself, from the cold disk
    pread     16 MB `os.preadv`s into one scratch buffer: the disk, no mapping, no copies
    mapped    safetensors to the CPU through its mapping, each tensor copied (page faults in the copy)
    cuda      early_weights.py's way: safetensors straight to the GPU, 4 files at once
    pinned    `os.preadv` into pinned host buffers, then copies to the GPU: no mapping

The import on these machines took 16 s alone and 22-27 s while early_weights.py read the 7B's weights
(docs/benchmarks.md, "Start-up, fourth pass"); the cases say which part of the reading slows it. What
this does not do: load a model, or say anything about a warm machine.
"""

from __future__ import annotations

import subprocess
import sys
import time

from cold_read import drop_page_cache  # scripts/cold_read.py, beside this one

CASES = ("alone", "pread", "mapped", "cuda", "pinned")
BLOCK = 16 << 20

CHILD = r"""
import os, sys, threading, time, mmap
folder, case = sys.argv[1], sys.argv[2]
files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
BLOCK = 16 << 20
done = {}

def pread():
    buf = mmap.mmap(-1, BLOCK)
    for path in files:
        fd, off = os.open(path, os.O_RDONLY), 0
        while (n := os.preadv(fd, [buf], off)) > 0:
            off += n
        os.close(fd)

def mapped():
    from safetensors import safe_open
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                f.get_tensor(key).clone()

def cuda():
    import torch
    from concurrent.futures import ThreadPoolExecutor
    from safetensors import safe_open
    torch.cuda.init()
    def one(path):
        with safe_open(path, framework="pt", device="cuda") as f:
            return [f.get_tensor(key) for key in f.keys()]
    with ThreadPoolExecutor(4) as pool:
        kept = list(pool.map(one, files))
    torch.cuda.synchronize()

def pinned():
    import torch
    torch.cuda.init()
    bufs = [torch.empty(BLOCK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    stream = torch.cuda.Stream()
    events = [None, None]
    kept = []
    i = 0
    for path in files:
        size = os.path.getsize(path)
        out = torch.empty(size, dtype=torch.uint8, device="cuda")
        fd, off = os.open(path, os.O_RDONLY), 0
        while off < size:
            if events[i] is not None:
                events[i].synchronize()
            n = os.preadv(fd, [memoryview(bufs[i].numpy())], off)
            with torch.cuda.stream(stream):
                out[off:off + n].copy_(bufs[i][:n], non_blocking=True)
                events[i] = torch.cuda.Event()
                events[i].record(stream)
            off += n
            i ^= 1
        os.close(fd)
        kept.append(out)
    stream.synchronize()

readers = {"pread": pread, "mapped": mapped, "cuda": cuda, "pinned": pinned}
t0 = time.perf_counter()
thread = None
if case in readers:
    def run():
        readers[case]()
        done["reader"] = time.perf_counter() - t0
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
import torch
import transformers.models.qwen2_5_omni.modeling_qwen2_5_omni  # noqa: F401
imported = time.perf_counter() - t0
if thread is not None:
    thread.join()
print(f"{case:7s} import {imported:6.2f} s   reader {done.get('reader', 0.0):6.2f} s", flush=True)
"""


def main() -> None:
    folder = sys.argv[1]
    cases = sys.argv[2:] or list(CASES)
    for case in cases:
        if case not in CASES:
            sys.exit(f"unknown case {case}: one of {', '.join(CASES)}")
    for case in cases:
        if not drop_page_cache():
            print("(page cache not dropped: not allowed here)")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", CHILD, folder, case], check=False)
        print(f"        whole process {time.perf_counter() - t0:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
