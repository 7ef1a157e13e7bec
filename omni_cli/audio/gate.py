"""The echo gate of talk mode over a server (`--talk --server` with speakers): what of the microphone a
server's VAD may hear while this side's own speaker plays a reply.

Why here and not on the server: the server hears only the echo-cancelled signal, so it cannot tell what
the canceller left of the assistant's own voice (loudest at a reply's start, before the canceller has
converged) from the user, and it took that residue for speech and cut replies with nobody speaking. This
side can: the listener's barge-in judge (audio/listener.py) sees the microphone before and after
cancelling. So while a reply plays the audio waits here, and goes out as digital silence unless the
judge hears the user:

- `shut()`: a reply starts. Blocks pushed from now on are held, at most `hold_seconds` of them; a block
  pushed out of the hold by newer ones goes out as zeros of its length (no speech was heard in time).
- `open(speech_seconds)`: the judge heard the user, whose speech began `speech_seconds` before the newest
  audio pushed; or (0) the reply ended with nobody speaking over it. The newest `speech_seconds` of the
  hold, and `pre_roll_seconds` before them, go out as they are; anything older as zeros. Then blocks pass.

Every sample pushed goes out once, in order, as itself or as zeros of its length, so the server's input
timeline (its `audio_start_ms` / `audio_end_ms`) stays the microphone's; only, while the gate is shut,
it goes out up to the hold late. `push` and `flush` hand back what is to be sent now and are called on
one thread (the sender's); `shut` and `open` may come from any thread (they change state under a lock;
what they release goes out with the next `push` or `flush`).

It knows numpy blocks at one rate; no server, no device and no VAD: what is speech is the judge's to say.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np


class EchoGate:
    """See the module docstring."""

    def __init__(self, rate: int, hold_seconds: float, pre_roll_seconds: float) -> None:
        self.rate = rate
        self.most = max(1, round(hold_seconds * rate))  # samples held at most while shut
        self.pre_roll = round(pre_roll_seconds * rate)  # let through before the speech's start
        self.shut_now = False
        self.zeroed = 0  # samples sent as zeros in place of the microphone's (for tests and --verbose)
        self._held: collections.deque = collections.deque()  # the microphone's blocks, oldest first
        self._held_samples = 0
        self._out: list = []  # what goes out with the next push or flush, in order
        self._lock = threading.Lock()

    def shut(self) -> None:
        """A reply starts playing: hold what comes from now on."""
        with self._lock:
            self.shut_now = True

    def open(self, speech_seconds: float = 0.0) -> None:
        """Let blocks pass again; of the hold, the newest `speech_seconds` (and the pre-roll before them,
        when there is speech) go out as they are, the rest as zeros."""
        with self._lock:
            keep = round(speech_seconds * self.rate) + self.pre_roll if speech_seconds > 0 else 0
            self._release(keep)
            self.shut_now = False

    def push(self, block: np.ndarray) -> list[np.ndarray]:
        """One block from the microphone; what is to be sent now (maybe nothing, maybe several)."""
        with self._lock:
            if not self.shut_now:
                self._out.append(block)
            else:
                self._held.append(block)
                self._held_samples += block.shape[0]
                while self._held_samples > self.most:
                    oldest = self._held.popleft()
                    self._held_samples -= oldest.shape[0]
                    self._out.append(self._zeros(oldest))
            return self._take()

    def flush(self) -> list[np.ndarray]:
        """What `open` released, to be sent now without waiting for the next block."""
        with self._lock:
            return self._take()

    def _release(self, keep: int) -> None:
        """The whole hold onto the way out: its newest `keep` samples as they are, older ones as zeros
        (the block across the line split there)."""
        import numpy as np

        silence = max(0, self._held_samples - keep)
        for block in self._held:
            cut = min(silence, block.shape[0])
            silence -= cut
            if cut == block.shape[0]:
                self._out.append(self._zeros(block))
            elif cut:
                self.zeroed += cut
                self._out.append(np.concatenate([np.zeros(cut, block.dtype), block[cut:]]))
            else:
                self._out.append(block)
        self._held.clear()
        self._held_samples = 0

    def _zeros(self, block: np.ndarray) -> np.ndarray:
        import numpy as np

        self.zeroed += block.shape[0]
        return np.zeros_like(block)

    def _take(self) -> list[np.ndarray]:
        out, self._out = self._out, []
        return out
