"""The one PCM16 rule and the one WAV header: how float samples become 16-bit integers and back, and
the 44-byte header of a mono 16-bit WAV, written and read.

The rule (`to_int16`): clip to [-1, 1], multiply by 32768, round half to even (`np.rint`), clip to
[-32768, 32767]. Its inverse (`from_int16`) is int16 / 32768, so int -> float -> int is exact for every
int16 value. Every place that turns the model's float PCM into 16-bit samples goes through it: the
WAV stream on stdout, the file sinks (they hand libsndfile int16 arrays, which it writes as they are),
the microphone's VAD input and saved clips, and the server's PCM16 (streamed and whole files). So the
same seeded reply gives the same bytes in-process and through omni-serve. (libsndfile's own float ->
int16 conversion is not used: its rounding and scale have changed between releases.)

It knows numpy (imported when samples are converted) and the RIFF/WAVE layout of a mono 16-bit PCM
file; nothing of sinks, files on disk, HTTP or models.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

# What a streaming WAV header says for sizes not known yet (as ffmpeg and sox write and read it).
UNKNOWN_SIZE = 0xFFFFFFFF
WAV_HEADER_BYTES = 44


def to_int16(block: Any) -> "np.ndarray":
    """float samples -> int16 samples by the one rule (see the module docstring); any shape."""
    import numpy as np

    # float32 all the way, as the vocoders produce it: 32768 is a power of two, so the product is
    # exact in float32 and the rounding sees the true value (half steps included).
    arr = np.clip(np.asarray(block, dtype=np.float32), np.float32(-1.0), np.float32(1.0))
    return np.clip(np.rint(arr * np.float32(32768.0)), -32768, 32767).astype(np.int16)


def from_int16(samples: Any) -> "np.ndarray":
    """int16 samples -> float32 in [-1, 1): int / 32768, the exact inverse of `to_int16` on its range."""
    import numpy as np

    return np.asarray(samples, dtype=np.int16).astype(np.float32) / np.float32(32768.0)


def pcm16(block: Any) -> bytes:
    """Little-endian 16-bit PCM bytes of a float block (`to_int16`)."""
    return to_int16(block).astype("<i2").tobytes()


def from_pcm16(data: bytes) -> "np.ndarray":
    """float32 samples of little-endian 16-bit PCM bytes (`from_int16`); a trailing odd byte is dropped."""
    import numpy as np

    data = bytes(data)
    return from_int16(np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2"))


def wav_header(sample_rate: int, data_bytes: int = UNKNOWN_SIZE) -> bytes:
    """The 44-byte header of a mono 16-bit PCM WAV holding `data_bytes` of samples; UNKNOWN_SIZE (or a
    size that does not fit the 32-bit fields) for a stream. libsndfile writes the same 44 bytes for a
    mono PCM_16 WAV, so a file written through it and one written with this header are byte-identical."""
    riff = UNKNOWN_SIZE if data_bytes >= UNKNOWN_SIZE - 36 else 36 + data_bytes
    data = UNKNOWN_SIZE if data_bytes >= UNKNOWN_SIZE - 36 else data_bytes
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " + fmt + b"data" + struct.pack("<I", data)


def wav_bytes(block: Any, sample_rate: int) -> bytes:
    """A whole mono 16-bit WAV file of a float block, in memory."""
    data = pcm16(block)
    return wav_header(sample_rate, len(data)) + data


@dataclass(frozen=True)
class WavInfo:
    """What a PCM WAV header says."""

    sample_rate: int
    channels: int
    bits: int  # bits per sample
    format_tag: int  # 1: integer PCM, 3: IEEE float, 0xFFFE: WAVE_FORMAT_EXTENSIBLE
    data_offset: int  # where the samples start
    data_bytes: int | None  # None: unknown (a stream's 0xFFFFFFFF, or 0 with more bytes following)


def read_wav_header(data: bytes) -> WavInfo | None:
    """The header of a RIFF/WAVE file at the start of `data` (its chunks walked up to `data`), or None
    when `data` does not start with one or is cut before the samples begin."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    at, fmt = 12, None
    while at + 8 <= len(data):
        kind, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        body = at + 8
        if kind == b"fmt ":
            if size < 16 or body + 16 > len(data):
                return None
            tag, channels, rate, _byte_rate, _align, bits = struct.unpack_from("<HHIIHH", data, body)
            fmt = (tag, channels, rate, bits)
        elif kind == b"data":
            if fmt is None:
                return None
            known = None if size == UNKNOWN_SIZE or (size == 0 and len(data) > body) else size
            tag, channels, rate, bits = fmt
            return WavInfo(rate, channels, bits, tag, body, known)
        at = body + size + (size & 1)  # chunks are padded to an even length
    return None


# The first bytes of the audio files a server may send whole (vLLM-Omni's WAV; FLAC, Ogg). MP3 is not
# sniffed: its frame sync (0xFFE...) is also a plausible first PCM16 sample; a server says "mp3" instead.
_MAGIC = ((b"RIFF", "wav"), (b"fLaC", "flac"), (b"OggS", "ogg"))


def audio_file_kind(data: bytes) -> str | None:
    """"wav", "flac" or "ogg" when `data` starts like such a file, else None (raw samples, or unknown)."""
    for magic, name in _MAGIC:
        if data[:len(magic)] == magic:
            return name
    return None
