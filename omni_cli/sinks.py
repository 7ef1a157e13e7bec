"""Where the reply's PCM goes: a small sink protocol and the sinks that need no sound card.

A sink is driven by one thread at a time, in this order: `start(sample_rate)` once, `write(block)`
any number of times (float32 mono 1-D blocks, values nominally in [-1, 1]), then exactly one of
`close()` (the reply ended normally: make the result final) or `abort()` (error or interrupt: leave
nothing partial behind). `close()` and `abort()` are idempotent, and `abort()` after `close()` keeps
what was finished. Every sink is also a context manager: an exception inside the block aborts it.

- `WavSink(path)`: a WAV file, written to a temp file in the same folder and renamed into place at
  `close()`, so a WAV that exists is always whole. Whether the folder is writable is checked in the
  constructor, before any model is loaded.
- `NullSink`: counts samples (benchmarks).
- `RecordingSink`: keeps every block with its arrival time (tests).

It knows nothing about models, torch or threads; numpy and soundfile are imported when a sink is
used, not when this module is imported.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .config import SAMPLE_RATE
from .errors import OutputError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np


@runtime_checkable
class Sink(Protocol):
    """What the engine writes PCM to (see the module docstring for the call order)."""

    def start(self, sample_rate: int) -> None: ...

    def write(self, block: "np.ndarray") -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


def as_block(block: Any) -> "np.ndarray":
    """A float32 mono 1-D numpy view/copy of `block` (numpy array, list, or a CPU tensor)."""
    import numpy as np

    arr = np.asarray(block, dtype=np.float32)
    if arr.ndim != 1:
        if arr.ndim == 2 and 1 in arr.shape:
            arr = arr.reshape(-1)
        else:
            raise ValueError(f"a PCM block must be mono 1-D, got shape {arr.shape}")
    return arr


class _SinkBase:
    """Shared bookkeeping and the context-manager protocol."""

    def __init__(self) -> None:
        # Set by start(); SAMPLE_RATE until then.
        self.sample_rate: int = SAMPLE_RATE
        # Samples written so far.
        self.samples: int = 0
        self.started = False
        self.closed = False
        self.aborted = False

    @property
    def seconds(self) -> float:
        """Seconds of audio written so far."""
        return self.samples / self.sample_rate if self.sample_rate else 0.0

    def _check_start(self, sample_rate: int) -> None:
        if self.started:
            raise RuntimeError(f"{type(self).__name__}.start() called twice")
        if self.closed or self.aborted:
            raise RuntimeError(f"{type(self).__name__} already finished")
        if int(sample_rate) <= 0:
            raise ValueError(f"bad sample rate {sample_rate}")
        self.sample_rate = int(sample_rate)
        self.started = True

    def _check_write(self) -> None:
        if not self.started:
            raise RuntimeError(f"{type(self).__name__}.write() before start()")
        if self.closed or self.aborted:
            raise RuntimeError(f"{type(self).__name__}.write() after the end")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class WavSink(_SinkBase):
    """A WAV file that appears whole at `close()` or not at all.

    `subtype` is soundfile's sample format: "PCM_16" (default, plays everywhere; samples are clipped
    to [-1, 1]) or "FLOAT" (32-bit float, lossless).
    """

    def __init__(self, path: str | os.PathLike, subtype: str = "PCM_16") -> None:
        super().__init__()
        self.path = Path(path)
        self.subtype = subtype
        self._tmp: Path | None = None
        self._file: Any = None
        self._check_writable()

    def _check_writable(self) -> None:
        path = self.path
        if str(path) in ("", "-"):
            raise OutputError(f"bad output file name '{path}'")
        if path.is_dir():
            raise OutputError(f"cannot write {path}: it is a folder")
        parent = path.parent
        if not parent.exists():
            raise OutputError(f"cannot write {path}: folder {parent} does not exist")
        if not parent.is_dir():
            raise OutputError(f"cannot write {path}: {parent} is not a folder")
        # A real probe: os.access() says yes to root on read-only file systems and the like.
        try:
            fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
        os.close(fd)
        os.unlink(probe)

    def start(self, sample_rate: int) -> None:
        self._check_start(sample_rate)
        import soundfile

        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".part")
            os.close(fd)
            self._tmp = Path(tmp)
            # mkstemp makes the file 0600; give the WAV the mode a plain open() would.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            self._file = soundfile.SoundFile(
                tmp, mode="w", samplerate=self.sample_rate, channels=1, format="WAV", subtype=self.subtype
            )
        except Exception as exc:
            self.abort()
            raise OutputError(f"cannot write {self.path}: {_reason(exc)}") from exc

    def write(self, block: "np.ndarray") -> None:
        self._check_write()
        import numpy as np

        arr = as_block(block)
        if self.subtype.upper().startswith("PCM"):
            # libsndfile wraps around (not clips) out-of-range floats when converting to integers.
            arr = np.clip(arr, -1.0, 1.0)
        try:
            self._file.write(arr)
        except Exception as exc:
            self.abort()
            raise OutputError(f"cannot write {self.path}: {_reason(exc)}") from exc
        self.samples += int(arr.shape[0])

    def close(self) -> None:
        """Finish the file and rename it into place (an empty WAV if nothing was ever started)."""
        if self.closed or self.aborted:
            return
        if not self.started:
            self.start(self.sample_rate)
        try:
            self._file.close()
            self._file = None
            os.replace(self._tmp, self.path)
        except Exception as exc:
            self.abort()
            raise OutputError(f"cannot write {self.path}: {_reason(exc)}") from exc
        self._tmp = None
        self.closed = True

    def abort(self) -> None:
        """Drop the temp file; an already finished WAV stays."""
        if self.closed or self.aborted:
            return
        self.aborted = True
        if self._file is not None:
            try:
                self._file.close()
            except Exception:
                pass
            self._file = None
        if self._tmp is not None:
            try:
                self._tmp.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                pass
            self._tmp = None


class NullSink(_SinkBase):
    """Throws the audio away and counts it (for benchmarks)."""

    def __init__(self) -> None:
        super().__init__()
        # Number of write() calls.
        self.blocks: int = 0

    def start(self, sample_rate: int) -> None:
        self._check_start(sample_rate)

    def write(self, block: "np.ndarray") -> None:
        self._check_write()
        self.samples += int(len(block))
        self.blocks += 1

    def close(self) -> None:
        if not self.aborted:
            self.closed = True

    def abort(self) -> None:
        if not self.closed:
            self.aborted = True


class RecordingSink(_SinkBase):
    """Keeps every block (a copy) and the `time.perf_counter()` at which it arrived (for tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list = []
        # perf_counter() of each write(), parallel to `blocks`.
        self.times: list[float] = []
        # perf_counter() of start(), close() and abort(); None until they happen.
        self.start_time: float | None = None
        self.end_time: float | None = None

    def start(self, sample_rate: int) -> None:
        self._check_start(sample_rate)
        self.start_time = time.perf_counter()

    def write(self, block: "np.ndarray") -> None:
        now = time.perf_counter()
        self._check_write()
        arr = as_block(block).copy()
        self.blocks.append(arr)
        self.times.append(now)
        self.samples += int(arr.shape[0])

    def close(self) -> None:
        if self.closed or self.aborted:
            return
        self.closed = True
        self.end_time = time.perf_counter()

    def abort(self) -> None:
        if self.closed or self.aborted:
            return
        self.aborted = True
        self.end_time = time.perf_counter()

    @property
    def audio(self) -> "np.ndarray":
        """All blocks joined (float32, empty if none)."""
        import numpy as np

        if not self.blocks:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(self.blocks).astype(np.float32, copy=False)

    @property
    def first_block_time(self) -> float | None:
        return self.times[0] if self.times else None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
