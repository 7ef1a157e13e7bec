"""Echo cancellation: take the assistant's own voice, as the speakers played it, out of the microphone.

`make_echo_canceller(kind, rate)` gives an object with `process(mic, reference) -> cleaned`: two blocks
of float32 mono at `rate` (16 kHz in talk mode), of the same length, the reference being what the
speaker played over the same stretch of time. The block is cut into 10 ms frames for the canceller
(a remainder waits for the next call), so the output may lag the input by up to 10 ms.

- "webrtc": WebRTC's audio processing module (AEC3) through the `livekit` package's binary wheel
  (`livekit.rtc.AudioProcessingModule`; no network, no room: only its local FFI library is used). It
  estimates the echo's delay itself, which matters here: what the speaker's callback hands out reaches
  the microphone after the device's buffers and the room, a delay this module cannot know.
  Measured (scripts/measure_talk.py echo; ten speech-like replies, echo at half level): ERLE from
  11-12 dB in the first reply to 43-64 dB once converged, median 37-39 dB, for echo 60 or 260 ms late;
  libspeexdsp's canceller (500 ms filter) on the same signals: median 12-18 dB, and it needs a system
  library. It does let a stretch of echo through at times (late in a long reply of a harmonic voice: one
  false interruption in ten such replies, until the listener checked what it kept: `EchoResemblance`).
- "off" (`--headphones`): passes the microphone through; no reference is needed.

`EchoResemblance` is a second opinion on what the canceller left: how much of the last 64 ms of its
output a short filter over the reference explains (the best of the lags up to `max_delay_ms`). AEC3 now
and then passes a stretch of echo through almost whole (kept at 0 dB where it had taken 60 dB a moment
before: late in a long reply of a harmonic voice); that stretch is the reference filtered and delayed, so
nearly all of it is explained, where the user's voice, with or without echo under it, is not.

It knows nothing of devices, threads or the VAD. `livekit` is imported only when "webrtc" is asked for,
so the rest of the package never loads it; a missing or broken package is an AudioDeviceError that
says what to install (or to use headphones).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..errors import AudioDeviceError, UsageError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

ECHO_KINDS = ("webrtc", "off")
FRAME_MS = 10  # WebRTC's processing frame


class EchoCanceller(Protocol):
    rate: int

    def process(self, mic: "np.ndarray", reference: "np.ndarray") -> "np.ndarray": ...


class NoEcho:
    """Headphones: nothing of the speaker reaches the microphone, so it passes as it is."""

    def __init__(self, rate: int) -> None:
        self.rate = rate

    def process(self, mic: "np.ndarray", reference: "np.ndarray") -> "np.ndarray":
        return mic


class WebRtcEcho:
    """WebRTC's AEC3 (livekit's build): 10 ms frames of 16-bit PCM, the reference first, then the mic."""

    def __init__(self, rate: int) -> None:
        import numpy as np

        try:
            from livekit.rtc import AudioFrame, AudioProcessingModule
        except Exception as exc:  # ImportError, or its FFI library failing to load
            raise AudioDeviceError("cannot cancel the echo: the livekit package (WebRTC's audio processing) is "
                                   "missing or broken: pip install livekit, or use headphones (--headphones)") from exc
        if rate not in (8000, 16000, 32000, 48000):
            raise UsageError(f"the echo canceller takes 8, 16, 32 or 48 kHz, not {rate} Hz")
        self.rate = rate
        self.frame = rate * FRAME_MS // 1000
        self._frame_type = AudioFrame
        # Only the echo canceller: noise suppression would also eat the soft start of the user's words,
        # which the VAD needs to hear.
        self._apm = AudioProcessingModule(echo_cancellation=True)
        self._mic = np.zeros(0, np.float32)  # samples of the next, unfinished frame
        self._ref = np.zeros(0, np.float32)

    def process(self, mic: "np.ndarray", reference: "np.ndarray") -> "np.ndarray":
        import numpy as np

        from .format import to_int16

        mic = np.concatenate([self._mic, np.asarray(mic, np.float32)])
        ref = np.concatenate([self._ref, np.asarray(reference, np.float32)])
        whole = min(mic.shape[0], ref.shape[0]) // self.frame * self.frame
        self._mic, self._ref = mic[whole:], ref[whole:]
        out = []
        for at in range(0, whole, self.frame):
            far = self._frame_type(to_int16(ref[at:at + self.frame]).tobytes(), self.rate, 1, self.frame)
            self._apm.process_reverse_stream(far)
            near = self._frame_type(to_int16(mic[at:at + self.frame]).tobytes(), self.rate, 1, self.frame)
            # The delay is the module's to find (see the module docstring): it is told none.
            self._apm.set_stream_delay_ms(0)
            self._apm.process_stream(near)
            out.append(np.frombuffer(bytes(near.data), np.int16).astype(np.float32) / 32768.0)
        return np.concatenate(out) if out else np.zeros(0, np.float32)


class EchoResemblance:
    """How much of the canceller's recent output is the reference again (see the module docstring).

    `push(clean, reference)` every block, the two of the same length on the microphone's clock (the
    reference as the speaker's tap placed it there: the echo in `clean` comes up to `max_delay_ms` later);
    `explained()` on demand: the share (0..1) of the last `window_ms` of `clean`'s power that a `taps`-long
    filter over the reference explains, least squares, around the lag where the two correlate best. By
    chance a filter of `taps` explains about taps/window of an unrelated signal (32 / 1024 here: 3 %);
    a canceller's output that is echo reshaped by its spectral gain, 90 % and more. A room's reverberation
    longer than the filter leaves part of an echo unexplained, so a stretch passed through is then judged
    as less like the echo than it is (the judgement errs towards hearing the user)."""

    def __init__(self, rate: int, window_ms: int = 64, max_delay_ms: int = 400, taps: int = 32) -> None:
        import numpy as np

        self.window = round(rate * window_ms / 1000)
        self.reach = round(rate * max_delay_ms / 1000)
        self.taps = taps
        self._clean = np.zeros(self.window, np.float32)
        self._ref = np.zeros(self.window + self.reach, np.float32)
        self._fft = 1 << (self._ref.shape[0] + self.window).bit_length()

    def push(self, clean: "np.ndarray", reference: "np.ndarray") -> None:
        self._clean = _shift_in(self._clean, clean)
        self._ref = _shift_in(self._ref, reference)

    def explained(self) -> float:
        import numpy as np

        c, r = self._clean.astype(np.float64), self._ref.astype(np.float64)
        power = float(np.dot(c, c))
        if power <= 1e-12:
            return 0.0
        w, n = self.window, self._fft
        # corr[k] = sum_i c[i] r[i + k] for every start k of a reference window: the echo at lag reach - k.
        corr = np.fft.irfft(np.fft.rfft(r, n) * np.conj(np.fft.rfft(c, n)), n)[: r.shape[0] - w + 1]
        sums = np.concatenate([[0.0], np.cumsum(r * r)])
        energy = sums[w:] - sums[: sums.shape[0] - w]
        # A window of near-silent reference would make any small correlation look perfect.
        energy = np.maximum(energy, 0.1 * float(energy.max()) + 1e-12)
        k = int(np.argmax(np.abs(corr) / np.sqrt(energy)))
        lo = max(0, min(k - self.taps // 2, r.shape[0] - w - self.taps + 1))  # up to the last window: no delay
        shifted = np.stack([r[j:j + w] for j in range(lo, lo + self.taps)], axis=1)
        fit, *_ = np.linalg.lstsq(shifted, c, rcond=None)
        rest = c - shifted @ fit
        return max(0.0, 1.0 - float(np.dot(rest, rest)) / power)


def _shift_in(ring: "np.ndarray", block: "np.ndarray") -> "np.ndarray":
    """`ring` with `block` appended at its end and as many of its oldest samples dropped."""
    import numpy as np

    n = min(block.shape[0], ring.shape[0])
    return np.concatenate([ring[n:], np.asarray(block[block.shape[0] - n:], np.float32)]) if n else ring


def make_echo_canceller(kind: str, rate: int) -> EchoCanceller:
    """The canceller called `kind` ("webrtc" or "off") at `rate`; a UsageError for any other name."""
    if kind == "off":
        return NoEcho(rate)
    if kind == "webrtc":
        return WebRtcEcho(rate)
    raise UsageError(f"unknown echo canceller '{kind}': choose {' or '.join(ECHO_KINDS)}")


def erle_db(echo: "np.ndarray", residual: "np.ndarray") -> float:
    """Echo return loss enhancement: how much quieter (dB) the echo is after cancelling than before."""
    import numpy as np

    n = min(echo.shape[0], residual.shape[0])
    before = float(np.mean(np.square(echo[:n], dtype=np.float64)))
    after = float(np.mean(np.square(residual[:n], dtype=np.float64)))
    return 10.0 * float(np.log10(before / max(after, 1e-12)))
