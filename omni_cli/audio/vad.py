"""Voice activity: which stretches of a stream are speech, and where a spoken turn ends.

`WebRtcVad` gives one yes/no per 30 ms frame of a stream fed in blocks at any rate; `Endpoint` turns
those flags into a turn (speech heard, then ended by silence). The microphone's recorder uses both.

Voice activity: WebRTC's VAD (the `webrtcvad-wheels` build of py-webrtcvad): a small C library with
binary wheels, no model file, 16-bit PCM in and a yes/no per 10-30 ms frame out; it takes 8, 16, 32 or
48 kHz, so a stream at any other rate is resampled to 16 kHz for the VAD only, with soxr's streaming
resampler (its output stays aligned in time with its input, so frame times are the stream's times).

It knows no device, no model and no terminal, and imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import AudioDeviceError
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
        self._voiced = 0  # voiced frames in the current stretch
        self._quiet = 0  # unvoiced frames in a row

    def push(self, speech: bool) -> bool:
        """One frame's flag; True when this frame ends the turn."""
        self.frames += 1
        if speech:
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
