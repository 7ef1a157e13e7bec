"""sinks: the WAV file appears whole or not at all; the null and recording sinks count and keep."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from omni_cli.errors import OutputError
from omni_cli.sinks import NullSink, RecordingSink, Sink, WavSink

SR = 24_000


def blocks(n: int = 3, size: int = 2400, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-0.9, 0.9, size).astype(np.float32) for _ in range(n)]


def test_all_sinks_follow_the_protocol(tmp_path):
    for sink in (WavSink(tmp_path / "a.wav"), NullSink(), RecordingSink()):
        assert isinstance(sink, Sink)


# -- WavSink ------------------------------------------------------------------------------------


def test_wav_roundtrip_pcm16(tmp_path):
    path = tmp_path / "out.wav"
    parts = blocks()
    sink = WavSink(path)
    sink.start(SR)
    for b in parts:
        sink.write(b)
        assert not path.exists()  # nothing under the final name before close()
    sink.close()
    data, rate = sf.read(path, dtype="float32")
    info = sf.info(path)
    assert (rate, info.channels, info.format, info.subtype) == (SR, 1, "WAV", "PCM_16")
    expected = np.concatenate(parts)
    assert data.shape == expected.shape
    assert np.max(np.abs(data - expected)) <= 1.0 / 32767 + 1e-6
    assert sink.samples == expected.size
    assert sink.seconds == pytest.approx(expected.size / SR)
    assert sorted(os.listdir(tmp_path)) == ["out.wav"]  # no temp file left


def test_wav_roundtrip_float_is_exact(tmp_path):
    path = tmp_path / "out.wav"
    parts = blocks(seed=1)
    with WavSink(path, subtype="FLOAT") as sink:
        sink.start(SR)
        for b in parts:
            sink.write(b)
    data, rate = sf.read(path, dtype="float32")
    assert rate == SR
    np.testing.assert_array_equal(data, np.concatenate(parts))


def test_pcm16_clips_instead_of_wrapping(tmp_path):
    path = tmp_path / "loud.wav"
    with WavSink(path) as sink:
        sink.start(SR)
        sink.write(np.array([2.0, -3.0, 1.5, -1.0, 0.5], dtype=np.float32))
    data, _ = sf.read(path, dtype="float32")
    assert data[0] > 0.99 and data[1] < -0.99 and data[2] > 0.99
    assert data[4] == pytest.approx(0.5, abs=1e-4)


def test_write_accepts_2d_mono_and_lists(tmp_path):
    sink = RecordingSink()
    sink.start(SR)
    sink.write(np.zeros((1, 10), dtype=np.float64))
    sink.write([0.5] * 5)
    assert sink.audio.dtype == np.float32 and sink.audio.shape == (15,)
    with pytest.raises(ValueError):
        sink.write(np.zeros((2, 10), dtype=np.float32))


def test_abort_leaves_nothing(tmp_path):
    path = tmp_path / "out.wav"
    sink = WavSink(path)
    sink.start(SR)
    sink.write(blocks(1)[0])
    assert len(os.listdir(tmp_path)) == 1  # the temp file, hidden
    sink.abort()
    assert os.listdir(tmp_path) == []
    sink.abort()  # idempotent
    sink.close()  # and close after abort does nothing
    assert os.listdir(tmp_path) == []


def test_exception_inside_with_aborts(tmp_path):
    path = tmp_path / "out.wav"
    with pytest.raises(RuntimeError):
        with WavSink(path) as sink:
            sink.start(SR)
            sink.write(blocks(1)[0])
            raise RuntimeError("engine died")
    assert os.listdir(tmp_path) == []


def test_abort_keeps_an_existing_file_untouched(tmp_path):
    path = tmp_path / "out.wav"
    path.write_bytes(b"old contents")
    sink = WavSink(path)
    sink.start(SR)
    sink.write(blocks(1)[0])
    assert path.read_bytes() == b"old contents"
    sink.abort()
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["out.wav"]


def test_close_replaces_an_existing_file(tmp_path):
    path = tmp_path / "out.wav"
    path.write_bytes(b"old contents")
    with WavSink(path) as sink:
        sink.start(SR)
        sink.write(blocks(1)[0])
    assert sf.info(path).frames == 2400


def test_abort_after_close_keeps_the_wav(tmp_path):
    path = tmp_path / "out.wav"
    sink = WavSink(path)
    sink.start(SR)
    sink.write(blocks(1)[0])
    sink.close()
    sink.abort()
    sink.close()
    assert sf.info(path).frames == 2400


def test_close_without_audio_writes_an_empty_wav(tmp_path):
    path = tmp_path / "silent.wav"
    WavSink(path).close()
    info = sf.info(path)
    assert (info.samplerate, info.channels, info.frames) == (SR, 1, 0)


def test_file_mode_follows_umask(tmp_path):
    path = tmp_path / "out.wav"
    with WavSink(path) as sink:
        sink.start(SR)
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~umask)


def test_misuse_is_a_bug_not_an_output_error(tmp_path):
    sink = WavSink(tmp_path / "x.wav")
    with pytest.raises(RuntimeError):
        sink.write(np.zeros(3, dtype=np.float32))
    sink.start(SR)
    with pytest.raises(RuntimeError):
        sink.start(SR)
    sink.abort()


def test_missing_folder(tmp_path):
    path = tmp_path / "no" / "such" / "x.wav"
    with pytest.raises(OutputError) as err:
        WavSink(path)
    assert "\n" not in str(err.value)
    assert "does not exist" in str(err.value)
    assert not (tmp_path / "no").exists()


def test_parent_is_a_file(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OutputError, match="not a folder"):
        WavSink(tmp_path / "file" / "x.wav")


def test_path_is_a_folder(tmp_path):
    with pytest.raises(OutputError, match="is a folder"):
        WavSink(tmp_path)


def _writable(folder: Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


@pytest.fixture
def unwritable_dir(tmp_path):
    """A folder this process cannot create files in (a read-only one; /sys when running as root)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if not _writable(folder):
            yield folder
            return
        sys_dir = Path("/sys")
        if sys_dir.is_dir() and not _writable(sys_dir):  # root ignores file modes; sysfs refuses it
            yield sys_dir
            return
        pytest.skip("no unwritable folder to test with")
    finally:
        folder.chmod(0o755)


def test_unwritable_folder(unwritable_dir):
    before = set(os.listdir(unwritable_dir))
    with pytest.raises(OutputError) as err:
        WavSink(unwritable_dir / "omni-test.wav")
    assert "\n" not in str(err.value)
    assert str(unwritable_dir / "omni-test.wav") in str(err.value)
    assert set(os.listdir(unwritable_dir)) == before


# -- NullSink / RecordingSink -------------------------------------------------------------------


def test_null_sink_counts():
    sink = NullSink()
    sink.start(SR)
    for b in blocks(4, 1200):
        sink.write(b)
    sink.close()
    assert (sink.samples, sink.blocks, sink.closed) == (4800, 4, True)
    assert sink.seconds == pytest.approx(0.2)


def test_recording_sink_keeps_copies_and_times():
    sink = RecordingSink()
    sink.start(16_000)
    buf = np.ones(100, dtype=np.float32)
    sink.write(buf)
    buf[:] = 0  # a producer reusing its buffer must not change what was recorded
    sink.write(buf)
    sink.close()
    assert sink.sample_rate == 16_000
    assert sink.audio.shape == (200,)
    assert sink.audio[:100].sum() == 100 and sink.audio[100:].sum() == 0
    assert len(sink.times) == 2 and sink.start_time <= sink.times[0] <= sink.times[1] <= sink.end_time
    assert sink.first_block_time == sink.times[0]
    assert sink.closed and not sink.aborted


def test_recording_sink_empty_and_aborted():
    sink = RecordingSink()
    assert sink.audio.shape == (0,) and sink.audio.dtype == np.float32
    sink.start(SR)
    sink.abort()
    assert sink.aborted and not sink.closed
    sink.close()
    assert not sink.closed
