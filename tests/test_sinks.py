"""sinks: an audio file (WAV, FLAC, Ogg Vorbis/Opus, MP3; by extension or by name) appears whole or not at
all, even under an interrupt or an abort from another thread; streamed WAV (stdout) is valid as it grows; the
speaker sink plays every sample in order, waits for the device at close(), stops at once at abort()
and counts underruns (against a fake sound device paced at real time); tee, null and recording sinks."""

from __future__ import annotations

import io
import os
import threading
import time
import wave
from pathlib import Path
import tempfile

import numpy as np
import pytest
import soundfile as sf

from audio_device import FakeSoundDevice
from omni_cli.errors import AudioDeviceError, OutputError, UsageError
from omni_cli.audio.sinks import NullSink, Sink, TeeSink, WavSink, WavStreamSink, wav_header
from omni_cli.audio.speaker import SpeakerSink, find_output_device, output_devices

from fakes import RecordingSink  # a test double (tests/fakes.py)

SR = 24_000


def blocks(n: int = 3, size: int = 2400, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-0.9, 0.9, size).astype(np.float32) for _ in range(n)]


def test_all_sinks_follow_the_protocol(tmp_path):
    sinks = (WavSink(tmp_path / "a.wav"), NullSink(), RecordingSink(), WavStreamSink(io.BytesIO()), TeeSink([]),
             SpeakerSink(backend=FakeSoundDevice()))
    for sink in sinks:
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
    with pytest.raises(UsageError, match="is a folder") as err:
        WavSink(tmp_path)
    assert err.value.exit_code == 2
    assert os.listdir(tmp_path) == []


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


# -- AudioFileSink: formats by extension or by name --------------------------------------------


def _tone(seconds: float = 1.3) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


@pytest.mark.parametrize("name, major, subtype", [("speech.wav", "WAV", "PCM_16"), ("speech.flac", "FLAC", "PCM_16"),
                                                  ("speech.ogg", "OGG", "VORBIS"), ("speech.OPUS", "OGG", "OPUS"),
                                                  ("speech.mp3", "MP3", "MPEG_LAYER_III")])
def test_file_format_by_extension_reads_back(tmp_path, name, major, subtype):
    from omni_cli.audio.sinks import FILE_FORMATS, AudioFileSink, writable_formats

    fmt = next(k for k, v in FILE_FORMATS.items() if v[:2] == (major, subtype))
    if fmt not in writable_formats():
        pytest.skip(f"this libsndfile cannot write {fmt}")
    tone = _tone()
    path = tmp_path / name
    with AudioFileSink(path) as sink:
        sink.start(SR)
        for part in np.array_split(tone, 7):  # blocks of odd sizes, as the vocoder hands them over
            sink.write(part)
        assert os.listdir(tmp_path) != [name]  # only the hidden temp file until close()
    info = sf.info(path)
    assert (info.format, info.subtype, info.samplerate, info.channels) == (major, subtype, SR, 1)
    data, _ = sf.read(path, dtype="float32")
    assert len(data) == len(tone)  # the duration, to the sample (libsndfile trims the codecs' padding)
    if major in ("WAV", "FLAC"):
        assert np.max(np.abs(data - tone)) <= 1 / 32767 + 1e-6
    else:  # lossy: the same tone, not the same samples
        middle = slice(SR // 10, -SR // 10)
        assert np.corrcoef(data[middle], tone[middle])[0, 1] > 0.95
    assert os.listdir(tmp_path) == [name]


def test_format_overrides_the_extension(tmp_path):
    from omni_cli.audio.sinks import AudioFileSink

    path = tmp_path / "speech.bin"
    with AudioFileSink(path, format="FLAC") as sink:
        sink.start(SR)
        sink.write(_tone(0.2))
    assert sf.info(path).format == "FLAC"
    # WavSink keeps its promise whatever the name.
    with WavSink(tmp_path / "named.flac") as sink:
        sink.start(SR)
        sink.write(_tone(0.2))
    assert sf.info(tmp_path / "named.flac").format == "WAV"
    # No extension: WAV, as before formats existed.
    with AudioFileSink(tmp_path / "plain") as sink:
        sink.start(SR)
    assert sf.info(tmp_path / "plain").format == "WAV"


@pytest.mark.parametrize("name, fmt, words", [("speech.txt", None, ["unknown audio file extension '.txt'", ".wav", ".flac",
                                                                     ".opus", "--format"]),
                                              ("speech.wav", "aiff", ["'aiff'", "wav, flac, ogg, opus"])])
def test_unknown_format_is_a_usage_error_and_makes_nothing(tmp_path, name, fmt, words):
    from omni_cli.audio.sinks import AudioFileSink

    with pytest.raises(UsageError) as err:
        AudioFileSink(tmp_path / name, format=fmt)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message
    assert os.listdir(tmp_path) == []


def test_a_format_this_libsndfile_lacks(tmp_path, monkeypatch):
    from omni_cli.audio.sinks import AudioFileSink

    real = sf.available_subtypes
    monkeypatch.setattr(sf, "available_subtypes", lambda fmt=None: {} if fmt == "MP3" else real(fmt))
    with pytest.raises(UsageError, match=r"speech.mp3: this machine's libsndfile has no MP3 encoder; supported formats "
                                         r"are wav, flac, ogg, opus$"):
        AudioFileSink(tmp_path / "speech.mp3")
    with pytest.raises(UsageError, match="supported formats are wav, flac, ogg, opus$"):
        AudioFileSink(tmp_path / "speech.wav", format="mp3")


def test_opus_refuses_a_rate_it_cannot_carry(tmp_path):
    from omni_cli.audio.sinks import AudioFileSink, writable_formats

    if "opus" not in writable_formats():
        pytest.skip("no Opus here")
    sink = AudioFileSink(tmp_path / "x.opus")
    with pytest.raises(OutputError, match="Opus takes 8, 12, 16, 24 or 48 kHz, not 22050 Hz"):
        sink.start(22_050)
    assert os.listdir(tmp_path) == []


def test_an_interrupt_right_after_a_temp_file_is_made_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) can land between creating a temp file and remembering it: the names are
    chosen first, so the probe and the .part are removed all the same."""
    import omni_cli.atomic as sinks  # where the temp files are made

    real = sinks._create_exclusive

    def then_interrupted(path, mode):
        real(path, mode)
        raise KeyboardInterrupt

    monkeypatch.setattr(sinks, "_create_exclusive", then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        WavSink(tmp_path / "x.wav")  # the writability probe
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(sinks, "_create_exclusive", real)
    sink = WavSink(tmp_path / "x.wav")
    monkeypatch.setattr(sinks, "_create_exclusive", then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        sink.start(SR)  # the .part
    assert [p for p in os.listdir(tmp_path) if p.endswith(".part")]  # made, and known to the sink
    sink.abort()
    assert os.listdir(tmp_path) == []


def test_abort_from_another_thread_waits_for_a_write_in_progress(tmp_path):
    """abort() must not close the file under a write() that is running (libsndfile would write into
    freed memory): it waits for the write, then removes the temp file."""
    sink = WavSink(tmp_path / "x.wav")
    sink.start(SR)
    inside, finished = threading.Event(), threading.Event()
    real_file = sink._file

    class SlowFile:
        def write(self, arr):
            inside.set()
            time.sleep(0.3)
            real_file.write(arr)
            finished.set()

        def close(self):
            real_file.close()

    sink._file = SlowFile()
    writer = threading.Thread(target=sink.write, args=(_tone(0.1),))
    writer.start()
    assert inside.wait(5)
    sink.abort()
    assert finished.is_set()  # abort() waited for the write
    writer.join(5)
    assert sink.aborted and os.listdir(tmp_path) == []


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


# -- WavStreamSink (-o -) -----------------------------------------------------------------------


class Pipe(io.RawIOBase):
    """A write-only, unseekable stream that records what reached it and when it was flushed."""

    def __init__(self):
        self.data = bytearray()
        self.flushed_sizes = []

    def writable(self):
        return True

    def seekable(self):
        return False

    def write(self, b):
        self.data += bytes(b)
        return len(b)

    def flush(self):
        self.flushed_sizes.append(len(self.data))


def test_wav_stream_to_a_pipe_is_streamed_and_readable():
    pipe = Pipe()
    sink = WavStreamSink(pipe)
    sink.start(SR)
    assert bytes(pipe.data) == wav_header(SR)  # the header goes out before any audio
    assert pipe.data[4:8] == b"\xff\xff\xff\xff" and pipe.data[40:44] == b"\xff\xff\xff\xff"
    parts = blocks()
    for i, b in enumerate(parts):
        sink.write(b)
        assert len(pipe.data) == 44 + 2 * 2400 * (i + 1)  # each block is out (flushed) as it is written
        assert pipe.flushed_sizes[-1] == len(pipe.data)
    sink.close()
    assert pipe.data[4:8] == b"\xff\xff\xff\xff"  # a pipe cannot seek: the sizes stay "unknown"
    data, rate = sf.read(io.BytesIO(bytes(pipe.data)), dtype="float32")
    assert rate == SR
    assert np.max(np.abs(data - np.concatenate(parts))) <= 1 / 32768 + 1e-7


def test_wav_stream_to_a_file_gets_real_sizes(tmp_path):
    path = tmp_path / "x.wav"
    with open(path, "wb") as f:
        f.write(b"")
        sink = WavStreamSink(f)
        sink.start(SR)
        for b in blocks():
            sink.write(b)
        sink.close()
    with wave.open(str(path)) as w:
        assert (w.getnframes(), w.getframerate(), w.getnchannels(), w.getsampwidth()) == (7200, SR, 1, 2)
    assert path.stat().st_size == 44 + 2 * 7200


def test_wav_stream_in_append_mode_is_not_patched(tmp_path):
    path = tmp_path / "x.wav"
    path.write_bytes(b"")
    with open(path, "ab") as f:
        sink = WavStreamSink(f)
        sink.start(SR)
        sink.write(blocks(1)[0])
        sink.close()
    data = path.read_bytes()
    assert len(data) == 44 + 4800 and data[40:44] == b"\xff\xff\xff\xff"


def test_wav_stream_has_the_same_samples_as_the_wav_file(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.uniform(-1.3, 1.3, 50_000).astype(np.float32)
    x[:6] = [0.5 / 32768, 1.5 / 32768, -0.5 / 32768, 1.0, -1.0, 0.0]
    with WavSink(tmp_path / "a.wav") as a:
        a.start(SR)
        a.write(x)
    buf = io.BytesIO()
    b = WavStreamSink(buf)
    b.start(SR)
    b.write(x)
    b.close()
    ints_a = sf.read(tmp_path / "a.wav", dtype="int16")[0].astype(int)
    ints_b = sf.read(io.BytesIO(buf.getvalue()), dtype="int16")[0].astype(int)
    assert np.abs(ints_a - ints_b).max() <= 1  # equal with libsndfile 1.2; at most 1 LSB apart elsewhere


def test_wav_stream_broken_pipe_is_an_output_error():
    class Closed(Pipe):
        def write(self, b):
            raise BrokenPipeError(32, "Broken pipe")

    sink = WavStreamSink(Closed())
    with pytest.raises(OutputError, match="stdout was closed while the WAV was being written"):
        sink.start(SR)
    sink.abort()


# -- TeeSink ------------------------------------------------------------------------------------


def test_tee_writes_to_all_and_aborts_all_on_failure(tmp_path):
    rec, null = RecordingSink(), NullSink()
    tee = TeeSink([WavSink(tmp_path / "a.wav"), rec, null])
    tee.start(SR)
    for b in blocks():
        tee.write(b)
    tee.close()
    assert sf.info(tmp_path / "a.wav").frames == 7200 and rec.audio.shape == (7200,) and null.samples == 7200
    assert rec.closed and null.closed and tee.samples == 7200

    class Broken(NullSink):
        def write(self, block):
            raise OutputError("disk full")

    wav, rec = WavSink(tmp_path / "b.wav"), RecordingSink()
    tee = TeeSink([wav, Broken(), rec])
    tee.start(SR)
    with pytest.raises(OutputError):
        tee.write(blocks(1)[0])
    assert wav.aborted and rec.aborted and not (tmp_path / "b.wav").exists()


# -- SpeakerSink against a fake device ----------------------------------------------------------


def test_devices_are_listed_and_found():
    sd = FakeSoundDevice()
    devices = output_devices(sd)
    assert [(d["index"], d["name"], d["default"]) for d in devices] == [(0, "Fake Speakers", True), (2, "USB Headset", False)]
    assert find_output_device(None, sd)["index"] == 0
    assert find_output_device("2", sd)["index"] == 2
    assert find_output_device("headset", sd)["index"] == 2
    assert find_output_device("FAKE SPEAKERS", sd)["index"] == 0
    with pytest.raises(UsageError, match="not an output device"):
        find_output_device("1", sd)  # the microphone
    with pytest.raises(UsageError, match="ambiguous"):
        find_output_device("e", sd)
    with pytest.raises(UsageError, match="no audio output device is called"):
        find_output_device("hdmi", sd)
    with pytest.raises(AudioDeviceError, match="no sound output device found"):
        find_output_device(None, FakeSoundDevice(devices=[]))
    with pytest.raises(AudioDeviceError, match="no default sound output device"):
        find_output_device(None, FakeSoundDevice(default=None))


def _ramp(n, start=0):
    return ((np.arange(start, start + n) % 1000) + 1).astype(np.float32) / 1000  # never 0


def test_speaker_plays_every_sample_in_order_across_callbacks():
    sd = FakeSoundDevice(speed=50.0, blocksize=480)
    sink = SpeakerSink(backend=sd, prebuffer=0.05)
    sink.start(SR)
    sizes = [100, 7, 2000, 480, 1, 5000, 333]  # blocks that do not line up with the callbacks
    at = 0
    for n in sizes:
        sink.write(_ramp(n, at))
        at += n
    sink.close()
    (stream,) = sd.streams
    played = stream.audio
    first = np.flatnonzero(played)[0]
    np.testing.assert_array_equal(played[first:first + at], _ramp(at))
    assert not played[first + at:].any() and not played[:first].any()
    assert stream.closed and sink.closed and sink.finished.is_set()
    assert sink.stats["underruns"] == 0 and sink.played == at


def test_speaker_close_waits_for_the_device_to_play_out():
    sd = FakeSoundDevice(speed=1.0, blocksize=480)
    sink = SpeakerSink(backend=sd, prebuffer=0.1)
    sink.start(SR)
    sink.write(np.full(SR // 2, 0.5, dtype=np.float32))  # 0.5 s
    t = time.perf_counter()
    sink.close()
    waited = time.perf_counter() - t
    stream = sd.streams[0]
    assert 0.4 < waited < 1.0, waited
    assert stream.callback_times[-1] - t > 0.45  # the last buffer was asked for just before close() returned
    assert np.count_nonzero(stream.audio) == SR // 2


def test_speaker_plays_silence_until_the_start_up_buffer_is_full():
    sd = FakeSoundDevice(speed=1.0, blocksize=240)
    sink = SpeakerSink(backend=sd, prebuffer=0.2)
    sink.start(SR)
    sink.write(np.full(2400, 0.5, dtype=np.float32))  # 0.1 s: below the start-up buffer
    time.sleep(0.15)
    assert not sd.streams[0].audio.any() and sink.underruns == 0
    sink.write(np.full(2400, 0.5, dtype=np.float32))  # 0.2 s queued: playback starts
    time.sleep(0.1)
    assert sd.streams[0].audio.any()
    sink.close()
    assert sink.underruns == 0 and np.count_nonzero(sd.streams[0].audio) == 4800


def test_speaker_short_reply_below_the_start_up_buffer_still_plays():
    sd = FakeSoundDevice(speed=20.0)
    sink = SpeakerSink(backend=sd, prebuffer=1.0)
    sink.start(SR)
    sink.write(np.full(1000, 0.5, dtype=np.float32))
    sink.close()  # the end of input starts playback
    assert np.count_nonzero(sd.streams[0].audio) == 1000


def test_speaker_paced_at_real_time_with_a_fast_producer_has_no_underruns():
    sd = FakeSoundDevice(speed=1.0, blocksize=480)
    sink = SpeakerSink(backend=sd, prebuffer=0.1)
    sink.start(SR)
    for i in range(8):  # 0.15 s blocks, produced twice as fast as they play
        sink.write(_ramp(3600, i * 3600))
        time.sleep(0.075)
    sink.close()
    assert sink.stats["underruns"] == 0 and sink.stats["underrun_seconds"] == 0
    played = sd.streams[0].audio
    first = np.flatnonzero(played)[0]
    np.testing.assert_array_equal(played[first:first + 8 * 3600], _ramp(8 * 3600))


def test_speaker_counts_underruns_of_a_slow_producer():
    sd = FakeSoundDevice(speed=1.0, blocksize=480)
    sink = SpeakerSink(backend=sd, prebuffer=0.05)
    sink.start(SR)
    for i in range(5):  # 0.1 s blocks, one every 0.2 s: half the time there is nothing to play
        sink.write(_ramp(2400, i * 2400))
        time.sleep(0.2)
    sink.close()
    stats = sink.stats
    assert 3 <= stats["underruns"] <= 5, stats
    assert 0.25 <= stats["underrun_seconds"] <= 0.7, stats
    # Silence was inserted between blocks, but every sample still played, in order.
    played = sd.streams[0].audio
    np.testing.assert_array_equal(played[played != 0], _ramp(5 * 2400))


def test_speaker_abort_stops_at_once_from_another_thread():
    sd = FakeSoundDevice(speed=1.0, blocksize=480)
    sink = SpeakerSink(backend=sd, prebuffer=0.05)
    sink.start(SR)
    sink.write(np.full(5 * SR, 0.5, dtype=np.float32))  # 5 s queued
    closer = threading.Thread(target=sink.close)  # the caller waits for the end of playback...
    closer.start()
    time.sleep(0.3)
    t = time.perf_counter()
    sink.abort()  # ...and a Ctrl-C handler aborts
    stopped = time.perf_counter() - t
    closer.join(1.0)
    assert not closer.is_alive()
    stream = sd.streams[0]
    calls = stream.calls
    time.sleep(0.1)
    assert stream.calls == calls  # no callback after abort() returned
    assert stopped < 0.05, stopped
    assert sink.aborted and not sink.closed and not stream.active
    assert len(stream.audio) < SR  # well under a second of the five was played
    sink.write(np.ones(10, dtype=np.float32))  # the vocoder thread may still write: dropped
    sink.close()
    assert not stream.closed  # closing may wait on the driver: it is left to the next open()
    SpeakerSink(backend=sd).open(SR)
    assert stream.closed


def test_speaker_abort_during_close_on_the_same_thread():
    # What a Ctrl-C while omni-say waits for the end of playback does: the handler aborts, close() raises.
    sd = FakeSoundDevice(speed=1.0)
    sink = SpeakerSink(backend=sd, prebuffer=0.05)
    sink.start(SR)
    sink.write(np.full(3 * SR, 0.5, dtype=np.float32))

    class Interrupted(BaseException):
        pass

    original_wait = sink.finished.wait

    def wait(timeout=None):
        original_wait(0.2)
        sink.abort()
        raise Interrupted

    sink.finished.wait = wait
    with pytest.raises(Interrupted):
        sink.close()
    assert sink.aborted and not sd.streams[0].active


def test_speaker_device_failure_at_start_is_an_audio_device_error():
    sink = SpeakerSink(backend=FakeSoundDevice(fail_start=True))
    with pytest.raises(AudioDeviceError, match="cannot play on audio device 'Fake Speakers'"):
        sink.start(SR)
    assert sink.aborted


def test_speaker_close_without_start_and_abort_without_start():
    sd = FakeSoundDevice()
    SpeakerSink(backend=sd).close()
    sink = SpeakerSink(backend=sd)
    sink.open(SR)
    sink.abort()
    SpeakerSink(backend=sd).open(SR)
    assert sd.streams[0].closed
