"""Audio and images given as input. Audio (a file, stdin's bytes, or samples): read, checked, made mono
and resampled to the 16 kHz the models' audio encoders hear. Images: opened with Pillow as RGB.

Any format libsndfile reads (WAV, FLAC, Ogg, MP3, ...) at any rate; the resampler is soxr's (high
quality). A file that is missing, empty, not audio, or holds no samples is a one-line `UsageError`.
Both are checked against `Limits` before they are decoded (limits.py): only a regular file of at most
`attachment_bytes` is opened, an audio header's length and an image header's pixels are checked first,
so a sparse file with a huge header or a decompression bomb costs a header's read.
`AudioClip` is the one audio clip type: a file read here, a recording from the microphone
(audio/microphone.py fills in how its turn ended) and a clip sent over the API are all one.

It knows no model (the features and the prompt's audio and image tokens are the family's) and imports
no torch; numpy is imported when samples are read (the microphone's module imports this one).
"""

from __future__ import annotations

import io
import os
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from .errors import UsageError
from .limits import DEFAULT, LimitError, Limits, open_regular_file

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


def read_audio(source: str | os.PathLike | bytes, name: str | None = None, limits: Limits = DEFAULT) -> AudioClip:
    """An audio file (a path, or its bytes: stdin's, a request's) as a mono clip at its own rate.

    Checked before it is decoded: a path must be a regular file of at most `limits.attachment_bytes`
    (`limits.open_regular_file`), and the header's length at most `limits.audio_seconds` and its samples
    at most what that length holds at 96 kHz (a header may claim any rate and channel count; decoding
    allocates frames x channels floats). Over a cap: a `LimitError`."""
    import numpy as np
    import soundfile

    data: io.BytesIO | BinaryIO  # what soundfile reads
    if isinstance(source, bytes):
        label, data = name or "stdin", io.BytesIO(source)
        if not source:
            raise UsageError(f"no audio on {label}: it was empty")
    else:
        label = name or str(source)
        data = _open(source, label, "audio file", limits)
    with data:
        try:
            frames, rate, _ = _audio_header(soundfile, data, label, limits)
            pcm, rate = soundfile.read(data, frames=frames, dtype="float32", always_2d=True)
        except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
            raise UsageError(f"{label} is not an audio file this machine can read ({failure_reason(exc)})") from None
    if len(pcm) == 0:
        raise UsageError(f"{label} holds no audio samples")
    mono = pcm.mean(axis=1, dtype=np.float32) if pcm.shape[1] > 1 else pcm[:, 0]
    return AudioClip(np.ascontiguousarray(mono, dtype=np.float32), int(rate), label)


# A clip's samples (frames x channels) may be at most its longest length at this many samples a second
# (96 kHz mono, 48 kHz stereo): what bounds the decoder's allocation whatever rate a header claims.
SAMPLES_PER_SECOND = 96_000


def _audio_header(soundfile, data: BinaryIO, label: str, limits: Limits) -> tuple[int, int, int]:
    """(frames, rate, channels) from the header alone, checked against the caps; the file is left at its
    start for the decoder."""
    info = soundfile.info(data)
    data.seek(0)
    frames, rate, channels = int(info.frames), int(info.samplerate), int(info.channels)
    if frames < 0 or rate <= 0:  # libsndfile's "unknown length" (a stream): refused, it cannot be bounded
        raise UsageError(f"{label} does not say how long it is: give a file with a length in its header")
    if frames / rate > limits.audio_seconds:
        raise LimitError(f"{label} is {frames / rate:.0f} s of audio, more than the {limits.audio_seconds:.0f} s "
                         "one clip may be: cut it first, e.g. sox IN OUT trim 0 60")
    if frames * max(channels, 1) > limits.audio_seconds * SAMPLES_PER_SECOND:
        raise LimitError(f"{label} holds {frames * channels} samples ({channels} channels at {rate} Hz), more than "
                         f"{limits.audio_seconds:.0f} s at 96 kHz: resample or mix it down first")
    return frames, rate, channels


def _open(source: str | os.PathLike, label: str, what: str, limits: Limits) -> BinaryIO:
    """A media file opened for its decoder: a regular file within the attachment cap (one-line errors)."""
    path = Path(source).expanduser()
    try:
        file = open_regular_file(path, limits.attachment_bytes, what, label)
    except FileNotFoundError:
        raise UsageError(f"{what} {label} does not exist") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {label}: {(exc.strerror or str(exc)).lower()}") from None
    if os.fstat(file.fileno()).st_size == 0:
        file.close()
        raise UsageError(f"{what} {label} is empty")
    return file


def failure_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[-1] if text.startswith("Error opening") else text


def read_image(source: str | os.PathLike | bytes, name: str | None = None, limits: Limits = DEFAULT):
    """An image file (a path, or its bytes) as an RGB `PIL.Image` (a one-line UsageError for what Pillow
    cannot open). Its size is read from the header (Pillow opens lazily) and checked against
    `limits.image_pixels` before it is decoded; Pillow's own decompression-bomb refusal is the same
    `LimitError`. A path must be a regular file within `limits.attachment_bytes`."""
    data: io.BytesIO | BinaryIO  # what Pillow opens
    if isinstance(source, bytes):
        data, label = io.BytesIO(source), name or "the image"
    else:
        label = name or str(source)
        data = _open(source, label, "image file", limits)
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        data.close()
        raise UsageError("images need Pillow: pip install pillow") from None
    with data, warnings.catch_warnings():
        # Pillow warns above its own 89 MP and refuses above twice that; the cap here is ours.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(data) as image:
                _check_pixels(image.size, label, limits)
                image.load()
                return image.convert("RGB")
        except Image.DecompressionBombError as exc:  # over twice Pillow's limit: refused in open(), so no size
            found = re.search(r"\((\d+) pixels\)", str(exc))
            size = f"{int(found.group(1)) / 1e6:.0f} MP" if found else "a decompression bomb"
            raise LimitError(f"{label} is {size}, more than the {limits.image_pixels / 1e6:.0f} MP an image may "
                             "be: scale it down first") from None
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise UsageError(f"{label} is not an image Pillow can open ({failure_reason(exc)})") from None


def _check_pixels(size: tuple[int, int], label: str, limits: Limits) -> None:
    width, height = size
    if width * height > limits.image_pixels:
        raise LimitError(f"{label} is {width}x{height} pixels ({width * height / 1e6:.0f} MP), more than the "
                         f"{limits.image_pixels / 1e6:.0f} MP an image may be: scale it down first")
