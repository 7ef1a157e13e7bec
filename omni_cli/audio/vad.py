"""Voice activity: which stretches of a stream are speech, and where a spoken turn ends.

`WebRtcVad` gives one yes/no per 30 ms frame of a stream fed in blocks at any rate; `Endpoint` turns
those flags into a turn (speech heard, then ended by silence). The microphone's recorder uses both.

Voice activity: WebRTC's VAD (the `webrtcvad-wheels` build of py-webrtcvad): a small C library with
binary wheels, no model file, 16-bit PCM in and a yes/no per 10-30 ms frame out; it takes 8, 16, 32 or
48 kHz, so a stream at any other rate is resampled to 16 kHz for the VAD only, with soxr's streaming
resampler (its output stays aligned in time with its input, so frame times are the stream's times).

`SileroVad` (talk mode's `--vad silero`) has the same `feed` and `frame_ms`: Silero's small neural VAD
from the `silero-vad` package, which ships its TorchScript model inside the package (offline), one
speech probability per 32 ms at 16 kHz. It needs torch, so it is imported only when asked for: a client
face (`--server`, no torch) keeps WebRTC's. `make_vad(kind, rate, ...)` picks one by name.

It knows no device, no model and no terminal; only `SileroVad` imports torch, and only when made.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ..errors import AudioDeviceError, UsageError
from .format import to_int16

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

# The rates WebRTC's VAD takes, and its frame length (30 ms: its steadiest decisions; 10 and 20 work too).
VAD_RATES = (8000, 16000, 32000, 48000)
VAD_FRAME_MS = 30


class WebRtcVad:
    """WebRTC VAD over the stream: blocks in at the device's rate, one yes/no per 30 ms frame out."""

    def __init__(self, rate: int, mode: int) -> None:
        try:
            import webrtcvad
        except ImportError as exc:
            raise AudioDeviceError("cannot detect speech: the webrtcvad-wheels package is missing: "
                                   "pip install webrtcvad-wheels (or record without VAD)") from exc
        import numpy as np

        self._vad = webrtcvad.Vad(mode)
        self._resampler = None
        self.rate = rate
        if rate not in VAD_RATES:  # resampled for the VAD only: the clip keeps the device's samples
            import soxr

            self.rate = 16000
            self._resampler = soxr.ResampleStream(rate, self.rate, 1, dtype="float32")
        self.frame = self.rate * VAD_FRAME_MS // 1000  # samples per frame at the VAD's rate
        self.frame_ms = VAD_FRAME_MS  # each flag `feed` returns stands for this much audio
        self._pending = np.zeros(0, np.int16)  # samples of the next, unfinished frame

    def feed(self, block: "np.ndarray") -> list[bool]:
        import numpy as np

        if self._resampler is not None:
            block = self._resampler.resample_chunk(block)
        pending = np.concatenate([self._pending, to_int16(block)])  # the one PCM16 rule
        whole = pending.shape[0] // self.frame * self.frame
        self._pending = pending[whole:]
        return [self._vad.is_speech(pending[i:i + self.frame].tobytes(), self.rate)
                for i in range(0, whole, self.frame)]


class Endpoint:
    """Turns per-frame speech flags into a turn: speech heard, then ended by silence.

    Voiced frames add up within a stretch; once they reach `min_speech` frames, speech was heard. A
    quiet run of `end_silence` frames then ends the turn; before speech was heard it only starts a new
    stretch, so clicks scattered over a long wait never add up to speech."""

    def __init__(self, min_speech: int, end_silence: int) -> None:
        self.min_speech = max(1, min_speech)
        self.end_silence = max(1, end_silence)
        self.frames = 0  # frames seen
        self.heard = False
        self.speech_end = 0  # frames up to the end of the last voiced frame (once heard)
        self.speech_start = 0  # frames before the first voiced frame of the current stretch
        self._voiced = 0  # voiced frames in the current stretch
        self._quiet = 0  # unvoiced frames in a row

    @property
    def voiced(self) -> int:
        """Voiced frames in the current stretch (talk mode's barge-in asks for more than `min_speech`)."""
        return self._voiced

    def push(self, speech: bool) -> bool:
        """One frame's flag; True when this frame ends the turn."""
        self.frames += 1
        if speech:
            if self._voiced == 0:
                self.speech_start = self.frames - 1
            self._voiced += 1
            self._quiet = 0
            self.heard = self.heard or self._voiced >= self.min_speech
            if self.heard:
                self.speech_end = self.frames
            return False
        self._quiet += 1
        if self._quiet >= self.end_silence:
            if self.heard:
                return True
            self._voiced = 0
        return False


# The names `make_vad` takes; Silero's frame (samples at 16 kHz: what its model is made for).
VAD_KINDS = ("webrtc", "silero")
SILERO_RATE = 16000
SILERO_FRAME = 512


class SileroVad:
    """Silero's VAD over the stream: blocks in at any rate, one yes/no per 32 ms frame out.

    A frame is speech when the model's probability reaches `threshold`. The model keeps state between
    frames (it is recurrent): one SileroVad per stream."""

    def __init__(self, rate: int, threshold: float = 0.5) -> None:
        if not 0.0 < threshold < 1.0:
            raise UsageError(f"the Silero VAD's threshold must be between 0 and 1 (got {threshold})")
        try:
            import torch
            from silero_vad import load_silero_vad
        except ImportError as exc:
            raise AudioDeviceError("cannot use Silero's VAD: the silero-vad package (and torch) are needed: "
                                   "pip install silero-vad, or use --vad webrtc") from exc
        import numpy as np

        self._torch = torch
        with warnings.catch_warnings():  # its loader's own deprecations (importlib.resources, torch.jit): not ours
            warnings.simplefilter("ignore", DeprecationWarning)
            self._model = load_silero_vad()  # from the package's own files: no download
        self.threshold = float(threshold)
        self.rate = SILERO_RATE
        self.frame = SILERO_FRAME
        self.frame_ms = SILERO_FRAME * 1000 / SILERO_RATE  # 32 ms
        self._resampler = None
        if rate != SILERO_RATE:
            import soxr

            self._resampler = soxr.ResampleStream(rate, SILERO_RATE, 1, dtype="float32")
        self._pending = np.zeros(0, np.float32)
        self.last_probability = 0.0  # of the last frame judged (for a meter or a test)

    def feed(self, block: "np.ndarray") -> list[bool]:
        import numpy as np

        block = np.asarray(block, np.float32)
        if self._resampler is not None:
            block = self._resampler.resample_chunk(block)
        pending = np.concatenate([self._pending, block])
        whole = pending.shape[0] // self.frame * self.frame
        self._pending = pending[whole:]
        flags = []
        with self._torch.inference_mode():
            for i in range(0, whole, self.frame):
                chunk = self._torch.from_numpy(np.ascontiguousarray(pending[i:i + self.frame]))
                self.last_probability = float(self._model(chunk, SILERO_RATE))
                flags.append(self.last_probability >= self.threshold)
        return flags


def make_vad(kind: str, rate: int, *, mode: int = 2, threshold: float = 0.5) -> "WebRtcVad | SileroVad":
    """The VAD called `kind` over a stream at `rate`: "webrtc" (aggressiveness `mode`, 0-3) or "silero"
    (speech at probability `threshold`); a UsageError for any other name."""
    if kind == "webrtc":
        return WebRtcVad(rate, mode)
    if kind == "silero":
        return SileroVad(rate, threshold)
    raise UsageError(f"unknown VAD '{kind}': choose {' or '.join(VAD_KINDS)}")
