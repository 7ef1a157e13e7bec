"""The one PCM16 rule (audio/format.py): float -> int16 is clip to [-1, 1], x 32768, round half to even,
clip to int16; int16 / 32768 is its inverse. Every 16-bit output of the same float audio holds the same
samples and, for WAV, the same bytes: AudioFileSink's WAV (through libsndfile, handed int16), the WAV
stream of `-o -`, the server's PCM16 decoded by the client and written by AudioFileSink, the server's
whole WAV, and a saved microphone clip. Also the WAV header written and read."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile as sf

from omni_cli.api import client, protocol
from omni_cli.audio import format as fmt
from omni_cli.audio.sinks import AudioFileSink, WavStreamSink

SR = 24_000


def _awkward() -> np.ndarray:
    """Full scale, beyond it, exact half steps (k + 0.5) / 32768 both ways of zero, and noise: where floor,
    round-half-up and round-half-even part."""
    halves = (np.arange(-40, 40) + 0.5) / 32768
    edges = [1.0, -1.0, 1.5, -1.5, 7.0, -7.0, 32767.5 / 32768, -32767.5 / 32768, 32766.5 / 32768, 0.0, -0.0,
             1 / 32768, -1 / 32768, 0.5, -0.5]
    noise = np.random.default_rng(28).uniform(-1.2, 1.2, 24_001)
    return np.concatenate([halves, edges, noise]).astype(np.float32)


def test_the_rule_on_edges_and_half_steps():
    x = np.array([1.0, -1.0, 2.0, -2.0, 0.5 / 32768, 1.5 / 32768, 2.5 / 32768, -0.5 / 32768, -1.5 / 32768,
                  32767.5 / 32768, -32767.5 / 32768, 0.0], dtype=np.float32)
    assert fmt.to_int16(x).tolist() == [32767, -32768, 32767, -32768, 0, 2, 2, 0, -2, 32767, -32768, 0]
    # little-endian bytes, whatever the machine
    assert fmt.pcm16(np.array([1 / 32768, -1.0], np.float32)) == b"\x01\x00\x00\x80"


def test_int16_round_trip_is_exact_on_every_value():
    every = np.arange(-32768, 32768, dtype=np.int16)
    assert np.array_equal(fmt.to_int16(fmt.from_int16(every)), every)
    assert fmt.pcm16(fmt.from_pcm16(every.astype("<i2").tobytes())) == every.astype("<i2").tobytes()


def test_the_api_and_the_sinks_share_the_rule():
    """Before: sinks floored and the API rounded, so 11,968 of 24,001 samples of a reply differed by one."""
    from omni_cli.audio import sinks

    x = _awkward()
    assert protocol.pcm16(x) == fmt.pcm16(x) == sinks.pcm16(x)
    assert np.array_equal(protocol.from_pcm16(fmt.pcm16(x)), fmt.from_pcm16(fmt.pcm16(x)))


def _file_sink_wav(path, x, parts=7) -> bytes:
    with AudioFileSink(path) as sink:
        sink.start(SR)
        for part in np.array_split(x, parts):
            sink.write(part)
    return path.read_bytes()


def _stream_wav(path, x, parts=5) -> tuple[bytes, bytes]:
    """(`-o -` into a pipe, `-o - > FILE`): the stream's bytes, and those of the same stream into a file,
    whose sizes are patched in at close()."""
    class Pipe(io.BytesIO):
        def seekable(self):  # as a pipe: the sizes cannot be patched
            return False

    pipe = Pipe()
    with open(path, "wb") as file:
        for out in (pipe, file):
            sink = WavStreamSink(out)
            sink.start(SR)
            for part in np.array_split(x, parts):
                sink.write(part)
            sink.close()
    return pipe.getvalue(), path.read_bytes()


def test_one_block_gives_the_same_wav_bytes_in_process_through_the_stream_and_through_the_api(tmp_path):
    x = _awkward()
    in_process = _file_sink_wav(tmp_path / "a.wav", x)  # (a) -o FILE
    piped, streamed = _stream_wav(tmp_path / "b.wav", x)  # (b) -o -
    assert piped[44:] == streamed[44:] and piped[:44] == fmt.wav_header(SR)  # sizes unknown: a pipe
    # (c) the server's streamed PCM16 (base64 in delta.audio.data), decoded by the client, written by omni-say
    pieces = np.array_split(x, 3)
    decoded = []
    for piece in pieces:
        delta = {"audio": {"data": protocol.b64(protocol.pcm16(piece))}}
        _text, audio, rate = client._delta_parts({}, {"delta": delta}, delta)
        assert rate == SR
        decoded.append(audio)
    through_api = _file_sink_wav(tmp_path / "c.wav", np.concatenate(decoded))
    whole = base64.b64decode(protocol.b64(protocol.audio_file(x, "wav")))  # (d) a reply that is not streamed
    expected = fmt.wav_bytes(x, SR)
    assert in_process == streamed == through_api == whole == expected
    ints, rate = sf.read(io.BytesIO(in_process), dtype="int16")
    assert rate == SR and np.array_equal(ints, fmt.to_int16(x))


def test_flac_holds_the_rules_samples_too(tmp_path):
    x = _awkward()
    path = tmp_path / "a.flac"
    with AudioFileSink(path) as sink:
        sink.start(SR)
        sink.write(x)
    ints, _ = sf.read(path, dtype="int16")
    assert np.array_equal(ints, fmt.to_int16(x))
    served, _ = sf.read(io.BytesIO(protocol.audio_file(x, "flac")), dtype="int16")
    assert np.array_equal(served, ints)


def test_a_saved_recording_holds_the_rules_samples(tmp_path):
    from omni_cli.audio.microphone import save_clip
    from omni_cli.media import AudioClip

    x = _awkward()
    path = save_clip(AudioClip(x, 16_000, "microphone"), tmp_path / "me.wav")
    assert path.read_bytes() == fmt.wav_bytes(x, 16_000)


def test_wav_header_is_what_libsndfile_writes_and_reads_back():
    ints = np.arange(-50, 50, dtype=np.int16) * 300
    out = io.BytesIO()
    sf.write(out, ints, SR, format="WAV", subtype="PCM_16")
    assert out.getvalue()[:44] == fmt.wav_header(SR, 200)
    info = fmt.read_wav_header(out.getvalue())
    assert (info.sample_rate, info.channels, info.bits, info.format_tag, info.data_offset, info.data_bytes) == \
        (SR, 1, 16, 1, 44, 200)
    stream = fmt.read_wav_header(fmt.wav_header(16_000))
    assert (stream.sample_rate, stream.data_bytes) == (16_000, None)  # 0xFFFFFFFF: a stream, size unknown


def test_read_wav_header_walks_chunks_and_refuses_what_is_not_a_wav():
    fmt_chunk = fmt.wav_header(SR)[12:36]
    padded = b"RIFF\x00\x00\x00\x00WAVE" + b"LIST\x03\x00\x00\x00abc\x00" + fmt_chunk + b"data\x04\x00\x00\x00" + b"\x00" * 4
    info = fmt.read_wav_header(padded)
    assert info is not None and info.data_offset == len(padded) - 4 and info.data_bytes == 4
    for data in (b"", b"OggS" + b"\x00" * 40, b"RIFF\x00\x00\x00\x00WAVE", fmt.wav_header(SR)[:40]):
        assert fmt.read_wav_header(data) is None


@pytest.mark.parametrize("data, kind", [(b"RIFF....WAVE", "wav"), (b"fLaC\x00", "flac"), (b"OggS\x00", "ogg"),
                                        (b"\x01\x00\x02\x00", None), (b"", None)])
def test_audio_file_kind(data, kind):
    assert fmt.audio_file_kind(data) == kind
