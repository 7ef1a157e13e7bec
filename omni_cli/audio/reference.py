"""The echo canceller's reference, laid on the microphone's sample clock.

The speaker's tap hands over what it gave the device, block by block, at the moment it gave it; the
microphone hands over what it heard, block by block, when it heard it. Pairing the two in the order
they come (the next microphone block takes the next reference samples) drifts: whenever the
microphone's blocks run ahead of the speaker's, the gap is filled with silence and every later
reference sample pairs with a later microphone sample than before, until the reference lags the echo
and no canceller can follow it (seen: the room test's echo leaked through and interrupted replies).

So each speaker stream (one reply) is placed once: its first sample goes at the microphone sample
that had been delivered when the tap gave it (`mark`, the microphone's count then), and every later
sample follows it without a gap, as the speaker's device plays them without one. The echo of a sample
reaches the microphone later than that (the speaker's buffers, the room, the microphone's buffers), so
the reference leads the echo by a steady delay that the canceller finds itself (WebRTC's AEC3 follows
leads of at least 600 ms). A block's reference is then read by its position: a late or missing part is
silence, and it shifts nothing after it.

It knows sample rates and positions only: no device, no thread (the listener serialises the calls).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

# Reference kept ahead of the microphone at most (seconds): an unpaced device may run far ahead.
KEEP_AHEAD_SECONDS = 10.0


class ReferenceLine:
    """What the speaker played, by microphone sample position, at the microphone's `rate`."""

    def __init__(self, rate: int) -> None:
        import numpy as np

        self.rate = rate
        self._buf = np.zeros(0, np.float32)
        self._start = 0  # microphone position of self._buf[0]
        self._placed = False  # the current stream's first sample has its position
        self._resampler: Any = None
        self._from_rate: int | None = None

    def new_stream(self) -> None:
        """A new speaker stream (a reply) begins: its first block is placed afresh."""
        self._placed = False
        self._resampler = None
        self._from_rate = None

    def add(self, block: "np.ndarray", rate: int, mark: int) -> None:
        """A block the speaker handed its device at `rate`, when the microphone had delivered `mark` samples."""
        import numpy as np

        block = np.asarray(block, np.float32)
        if rate != self.rate:
            if self._from_rate != rate:
                import soxr

                self._resampler = soxr.ResampleStream(rate, self.rate, 1, dtype="float32")
                self._from_rate = rate
            block = self._resampler.resample_chunk(block)
        if not self._placed:
            self._placed = True
            end = self._start + self._buf.shape[0]
            if mark >= end:  # silence up to the new stream's first sample
                self._buf = np.concatenate([self._buf, np.zeros(mark - end, np.float32)])
            else:  # an earlier stream's queued tail overlaps it: the new stream is what plays from `mark`
                self._buf = self._buf[:max(0, mark - self._start)]
        self._buf = np.concatenate([self._buf, block])
        limit = round(KEEP_AHEAD_SECONDS * self.rate)
        if self._buf.shape[0] > limit:  # keep the newest: positions stay right
            self._start += self._buf.shape[0] - limit
            self._buf = self._buf[-limit:]

    def placed_end(self) -> int | None:
        """The microphone position just past the current stream's reference so far; None before it is placed."""
        return self._start + self._buf.shape[0] if self._placed else None

    def take(self, position: int, n: int) -> "np.ndarray":
        """The reference for microphone samples [position, position + n): silence where none was played.
        What lies before `position + n` is then forgotten (the microphone moves only forward)."""
        import numpy as np

        out = np.zeros(n, np.float32)
        lo, hi = max(position, self._start), min(position + n, self._start + self._buf.shape[0])
        if hi > lo:
            out[lo - position:hi - position] = self._buf[lo - self._start:hi - self._start]
        drop = min(self._buf.shape[0], max(0, position + n - self._start))
        self._buf = self._buf[drop:]
        self._start += drop
        return out
