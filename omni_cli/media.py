"""Audio and images given as input. Audio (a file, stdin's bytes, or samples): read, checked, made mono
and resampled to the 16 kHz the models' audio encoders hear. Images: opened with Pillow as RGB.

Any format libsndfile reads (WAV, FLAC, Ogg, MP3, ...) at any rate; the resampler is soxr's (high
quality). A file that is missing, empty, not audio, or holds no samples is a one-line `UsageError`.
`AudioClip` is the one audio clip type: a file read here, a recording from the microphone
(audio/microphone.py fills in how its turn ended) and a clip sent over the API are all one.

It knows no model (the features and the prompt's audio and image tokens are the family's) and imports
no torch; numpy is imported when samples are read (the microphone's module imports this one).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

ENCODER_RATE = 16_000  # what Qwen-Omni's Whisper-style audio encoders take


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no single truth value to compare by
class AudioClip:
    """Mono float32 samples at `sample_rate`, where they came from (for messages and transcripts), and,
    for a recording, how its turn ended (the other fields keep their defaults for a file's clip)."""

    pcm: "np.ndarray"  # float32, mono, nominally in [-1, 1]
    sample_rate: int  # its own rate (a file's, or the device's: not resampled)
    source: str = "audio"  # a file's name, "stdin", "microphone", ...
    # A recording's end: "silence" (speech, then the end silence), "stop" (the stop event), "limit" (the
    # longest clip), "interrupted" (Ctrl-C), "no speech" (nothing spoken in time); None: not a recording.
    ended_by: str | None = None
    recorded_seconds: float | None = None  # audio taken from the device before trimming (None: not recorded)
    speech_end: float | None = None  # where the last speech ended (seconds); None without VAD or speech
    overflows: int = 0  # times the device dropped input because its blocks were not taken in time

    @property
    def seconds(self) -> float:
        return len(self.pcm) / self.sample_rate

    def at(self, rate: int = ENCODER_RATE) -> "AudioClip":
        """The clip resampled to `rate` (itself when it is already there)."""
        if self.sample_rate == rate:
            return self
        import numpy as np
        import soxr

        pcm = soxr.resample(self.pcm, self.sample_rate, rate, quality="HQ").astype(np.float32)
        return replace(self, pcm=pcm, sample_rate=rate)


def read_audio(source: str | os.PathLike | bytes, name: str | None = None) -> AudioClip:
    """An audio file (a path, or its bytes: stdin's) as a mono clip at its own rate."""
    import numpy as np
    import soundfile

    data: io.BytesIO | Path  # what soundfile reads
    if isinstance(source, bytes):
        label, data = name or "stdin", io.BytesIO(source)
        if not source:
            raise UsageError(f"no audio on {label}: it was empty")
    else:
        path = Path(source).expanduser()
        label, data = name or str(source), path
        if not path.exists():
            raise UsageError(f"audio file {label} does not exist")
        if path.is_dir():
            raise UsageError(f"audio file {label} is a folder")
        if path.stat().st_size == 0:
            raise UsageError(f"audio file {label} is empty")
    try:
        pcm, rate = soundfile.read(data, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        raise UsageError(f"{label} is not an audio file this machine can read ({failure_reason(exc)})") from None
    if len(pcm) == 0:
        raise UsageError(f"{label} holds no audio samples")
    mono = pcm.mean(axis=1, dtype=np.float32) if pcm.shape[1] > 1 else pcm[:, 0]
    return AudioClip(np.ascontiguousarray(mono, dtype=np.float32), int(rate), label)


def failure_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[-1] if text.startswith("Error opening") else text


def read_image(source: str | os.PathLike | bytes, name: str | None = None):
    """An image file (a path, or its bytes) as an RGB `PIL.Image` (a one-line UsageError for what Pillow
    cannot open)."""
    path: io.BytesIO | Path  # what Pillow opens
    if isinstance(source, bytes):
        path, source = io.BytesIO(source), name or "the image"
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise UsageError(f"image file {source} does not exist")
        if path.is_dir():
            raise UsageError(f"image file {source} is a folder")
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise UsageError("images need Pillow: pip install pillow") from None
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise UsageError(f"{source} is not an image Pillow can open ({failure_reason(exc)})") from None
