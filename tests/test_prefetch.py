"""Reading a model folder's weight files ahead (omni_cli/prefetch.py): every byte of every file is read, a
stop stops it, and it reads nothing where it does not apply (not a folder, no safetensors, too small, more
than the memory's share, switched off). `omni_cli.load` stops it once the model is loaded or has failed."""

from __future__ import annotations

import json
import threading
import time

import pytest

from omni_cli import prefetch


def folder_of(tmp_path, sizes: list[int]):
    """A folder with an index naming one file per size (their bytes: anything; nothing parses them)."""
    names = [f"model-{i:05d}.safetensors" for i in range(len(sizes))]
    for name, size in zip(names, sizes):
        (tmp_path / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"w{i}": n for i, n in enumerate(names)}}))
    return tmp_path


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(prefetch, "MIN_BYTES", 0)
    monkeypatch.setattr(prefetch, "CHUNK", 4096)
    monkeypatch.delenv(prefetch.PREFETCH_ENV, raising=False)


def test_every_byte_of_every_file_is_read(tmp_path, small):
    sizes = [100_000, 3, 50_001]
    ahead = prefetch.start(folder_of(tmp_path, sizes))
    assert ahead is not None and len(ahead.files) == 3
    ahead.join(10)
    assert ahead.read == sum(sizes)


def test_a_stop_stops_the_readers(tmp_path, small, monkeypatch):
    monkeypatch.setattr(prefetch, "CHUNK", 1)  # a byte a read: ~a second for this file
    ahead = prefetch.start(folder_of(tmp_path, [1 << 20]))
    time.sleep(0.05)
    ahead.stop()
    ahead.join(5)
    assert not any(t.is_alive() for t in ahead._threads)
    assert 0 < ahead.read < 1 << 20


def test_nothing_is_read_where_it_does_not_apply(tmp_path, small, monkeypatch):
    (tmp_path / "f").mkdir()
    folder = folder_of(tmp_path / "f", [1000])
    assert prefetch.start("Qwen/Qwen2.5-Omni-7B") is None  # a hub id: not a folder here
    assert prefetch.start(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert prefetch.start(tmp_path / "empty") is None  # no safetensors
    monkeypatch.setattr(prefetch, "available_memory", lambda: 1500)
    assert prefetch.start(folder) is None  # 1000 bytes > half of 1500
    monkeypatch.setattr(prefetch, "available_memory", lambda: None)
    assert prefetch.start(folder) is None  # memory unknown
    monkeypatch.setattr(prefetch, "available_memory", lambda: 1 << 40)
    monkeypatch.setattr(prefetch, "MIN_BYTES", 1001)
    assert prefetch.start(folder) is None  # too small to be worth it
    monkeypatch.setattr(prefetch, "MIN_BYTES", 0)
    monkeypatch.setenv(prefetch.PREFETCH_ENV, "1")
    assert prefetch.start(folder) is None
    monkeypatch.delenv(prefetch.PREFETCH_ENV)
    monkeypatch.setenv("OMNI_MODEL", str(folder))
    ahead = prefetch.start(None)  # the folder $OMNI_MODEL names
    assert ahead is not None
    ahead.join(10)
    assert ahead.read == 1000


def test_available_memory_reads_the_kernels_figure():
    memory = prefetch.available_memory()
    assert memory is None or 1 << 20 < memory < 1 << 50


def test_load_stops_the_reading_once_it_returns_or_fails(monkeypatch):
    import omni_cli
    from omni_cli import assistant

    stopped = threading.Event()

    class Ahead:
        def stop(self):
            stopped.set()

    monkeypatch.setattr(prefetch, "start", lambda model: Ahead())

    def fail(*args, **kwargs):
        assert not stopped.is_set()  # still reading while the model loads
        raise RuntimeError("no such model")

    monkeypatch.setattr(assistant.Assistant, "load", fail)
    with pytest.raises(RuntimeError, match="no such model"):
        omni_cli.load("somewhere")
    assert stopped.is_set()
