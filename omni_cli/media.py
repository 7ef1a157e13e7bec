"""Audio and images given as input. Audio (a file, stdin's bytes, or samples): read, checked, made mono
and resampled to the 16 kHz the models' audio encoders hear. Images: opened with Pillow as RGB.

Any format libsndfile reads (WAV, FLAC, Ogg, MP3, ...) at any rate; the resampler is soxr's (high
quality). A file that is missing, empty, not audio, or holds no samples is a one-line `UsageError`.
It knows no model (the features and the prompt's audio and image tokens are the family's) and imports
no torch.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import UsageError

ENCODER_RATE = 16_000  # what Qwen-Omni's Whisper-style audio encoders take


@dataclass(frozen=True)
class AudioClip:
    """Mono float32 samples at `sample_rate`, and where they came from (for messages and transcripts)."""

    pcm: np.ndarray
    sample_rate: int
    source: str = "audio"

    @property
    def seconds(self) -> float:
        return len(self.pcm) / self.sample_rate

    def at(self, rate: int = ENCODER_RATE) -> "AudioClip":
        """The clip resampled to `rate` (itself when it is already there)."""
        if self.sample_rate == rate:
            return self
        import soxr

        pcm = soxr.resample(self.pcm, self.sample_rate, rate, quality="HQ").astype(np.float32)
        return AudioClip(pcm, rate, self.source)


def read_audio(source: str | os.PathLike | bytes, name: str | None = None) -> AudioClip:
    """An audio file (a path, or its bytes: stdin's) as a mono clip at its own rate."""
    import soundfile

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
        raise UsageError(f"{label} is not an audio file this machine can read ({_reason(exc)})") from None
    if len(pcm) == 0:
        raise UsageError(f"{label} holds no audio samples")
    mono = pcm.mean(axis=1, dtype=np.float32) if pcm.shape[1] > 1 else pcm[:, 0]
    return AudioClip(np.ascontiguousarray(mono, dtype=np.float32), int(rate), label)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[-1] if text.startswith("Error opening") else text


def read_image(source: str | os.PathLike | bytes, name: str | None = None):
    """An image file (a path, or its bytes) as an RGB `PIL.Image` (a one-line UsageError for what Pillow
    cannot open)."""
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
        raise UsageError(f"{source} is not an image Pillow can open ({_reason(exc)})") from None
