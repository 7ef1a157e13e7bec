"""read_ahead.py: a safetensors file's tensor ranges as its header gives them (the bytes there are the
tensor's), reads joined and cut into blocks in the order given, readers that go through every block once,
stop when told, and end quietly on an error; the switch and the size floor."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from omni_cli import read_ahead  # noqa: E402
from omni_cli.read_ahead import ReadAhead, blocks, tensor_ranges  # noqa: E402


def test_tensor_ranges_are_where_the_file_holds_each_tensor(tmp_path):
    tensors = {"a": torch.arange(10, dtype=torch.float32), "b.weight": torch.ones(3, 5, dtype=torch.bfloat16),
               "c": torch.tensor([7], dtype=torch.int64)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    data = path.read_bytes()
    ranges = tensor_ranges(str(path))
    assert ranges.keys() == tensors.keys()
    for key, (start, end) in ranges.items():
        assert data[start:end] == tensors[key].contiguous().view(torch.uint8).numpy().tobytes(), key


def test_blocks_join_neighbours_and_cut_at_the_block_size(monkeypatch):
    monkeypatch.setattr(read_ahead, "BLOCK", 10)
    spans = [("f", 0, 4), ("f", 4, 25), ("g", 0, 5), ("f", 30, 32)]
    assert blocks(spans) == [("f", 0, 10), ("f", 10, 20), ("f", 20, 25), ("g", 0, 5), ("f", 30, 32)]


def _file(tmp_path, size):
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * (size // 256))
    return str(path)


def test_readers_take_every_block_once(tmp_path, monkeypatch):
    path = _file(tmp_path, 1 << 16)
    reads = [(path, at, at + 1024) for at in range(0, 1 << 16, 1024)]
    seen, lock = [], threading.Lock()
    take = ReadAhead._take

    def counted(self):
        read = take(self)
        if read is not None:
            with lock:
                seen.append(read)
        return read
    monkeypatch.setattr(ReadAhead, "_take", counted)
    ahead = ReadAhead(reads, readers=4)
    for t in ahead.threads:
        t.join(timeout=30)
    assert sorted(seen) == sorted(reads) and len(ahead.threads) == 4


def test_stop_ends_the_reads_and_an_error_ends_them_quietly(tmp_path):
    path = _file(tmp_path, 4096)
    assert ReadAhead([], readers=2).threads == []  # nothing to read: no threads
    stopped = ReadAhead([(path, 0, 10)] * 5, readers=0)  # no readers: the reads wait
    assert stopped._take() == (path, 0, 10)
    stopped.stop()
    assert stopped._take() is None
    broken = ReadAhead([(str(tmp_path / "gone.bin"), 0, 10), (path, 0, 10)], readers=1)
    broken.threads[0].join(timeout=30)
    assert not broken.threads[0].is_alive()  # the missing file's OSError ended it, nothing raised


def test_the_switch_and_the_size_floor(tmp_path, monkeypatch):
    path = _file(tmp_path, 4096)
    monkeypatch.setattr(read_ahead, "MIN_BYTES", 1000)
    assert ReadAhead.of([(path, 0, 999)]) is None
    made = ReadAhead.of([(path, 0, 4096)])
    assert made is not None
    made.stop()
    monkeypatch.setenv("OMNI_NO_READ_AHEAD", "1")
    assert ReadAhead.of([(path, 0, 4096)]) is None


def test_reads_stop_once_one_comes_at_the_page_caches_speed(tmp_path, monkeypatch):
    """A large read faster than a disk gives (here: any read, the rate lowered) means the files are in the
    page cache: the readers stop instead of copying them all again."""
    path = _file(tmp_path, 1 << 16)
    monkeypatch.setattr(read_ahead, "JUDGED", 1)
    monkeypatch.setattr(read_ahead, "CACHED_RATE", 1.0)
    ahead = ReadAhead([(path, at, at + 1024) for at in range(0, 1 << 16, 1024)], readers=1)
    ahead.threads[0].join(timeout=30)
    assert ahead.stopped.is_set() and ahead.next == 1


def test_fewer_readers_on_a_machine_with_less_memory():
    gib = 1 << 30
    assert [read_ahead.readers_for(m) for m in (128 * gib, 32 * gib, 16 * gib, 8 * gib, 1 * gib, None)] == \
        [16, 16, 8, 4, 2, 16]


def test_a_header_too_short_too_large_or_not_an_object_is_a_value_error(tmp_path):
    """Read before anything large: a file shorter than the length field, a length over HEADER_MAX (never
    read), a header that is not a JSON object."""
    import json
    import struct

    from omni_cli.read_ahead import HEADER_MAX, safetensors_header

    cases = {"short": b"\x01\x02", "huge": struct.pack("<Q", HEADER_MAX + 1) + b"{}",
             "list": struct.pack("<Q", 2) + b"[]", "junk": struct.pack("<Q", 3) + b"{x}"}
    for name, data in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        with pytest.raises(ValueError):
            safetensors_header(path)
    good = tmp_path / "good.safetensors"
    body = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    good.write_bytes(struct.pack("<Q", len(body)) + body)
    assert safetensors_header(good) == ({"__metadata__": {"format": "pt"}}, 8 + len(body))
