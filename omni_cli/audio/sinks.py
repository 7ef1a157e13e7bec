"""Where the reply's PCM goes: a small sink protocol and the sinks.

A sink is driven by one thread at a time, in this order: `start(sample_rate)` once, `write(block)`
any number of times (float32 mono 1-D blocks, values nominally in [-1, 1]), then exactly one of
`close()` (the reply ended normally: make the result final) or `abort()` (error or interrupt: leave
nothing partial behind). `close()` and `abort()` are idempotent, and `abort()` after `close()` keeps
what was finished. Every sink is also a context manager: an exception inside the block aborts it.

- `AudioFileSink(path, format=None)`: an audio file (WAV, FLAC, Ogg Vorbis, Ogg Opus, MP3; by the
  extension or `format`), written to a temp file in the same folder and renamed into place at
  `close()`, so a file that exists is always whole. The format and whether the folder is writable are
  checked in the constructor, before any model is loaded. `WavSink(path)`: the same, always WAV.
- `WavStreamSink(file)`: streaming WAV (16-bit) on a binary file object, e.g. stdout for `-o -`: a
  header with unknown sizes first, then the PCM as it is produced, flushed block by block. If the
  file can seek (stdout redirected to a file), the sizes are patched at `close()`.
- `SpeakerSink(device)`: plays through a sound device (speaker.py).
- `TeeSink(sinks)`: the same audio to several sinks (`--play -o FILE`).
- `NullSink`: counts samples (benchmarks).

It knows nothing about models, torch or threads of the engine, nor sound devices (speaker.py); numpy
and soundfile are imported when a sink is used.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, Sequence, runtime_checkable

from ..config import SAMPLE_RATE
from ..errors import OutputError, UsageError

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


# Audio file formats a file sink writes, by name: (libsndfile major format, subtype, file name
# extensions). Each takes the model's 24 kHz as it is (libsndfile 1.2: Opus accepts 8, 12, 16, 24 and
# 48 kHz, Vorbis and MP3 24 kHz too), so nothing is resampled. A file without an extension is WAV.
FILE_FORMATS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "wav": ("WAV", "PCM_16", (".wav", ".wave")),
    "flac": ("FLAC", "PCM_16", (".flac",)),
    "ogg": ("OGG", "VORBIS", (".ogg", ".oga")),
    "opus": ("OGG", "OPUS", (".opus",)),
    "mp3": ("MP3", "MPEG_LAYER_III", (".mp3",)),
}

# The sample rates an Opus stream can carry (anything else is refused by the encoder).
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def writable_formats() -> list[str]:
    """The names in FILE_FORMATS that the installed libsndfile can write (MP3 needs libsndfile >= 1.1
    built with LAME and mpg123; Opus >= 1.0.29), in FILE_FORMATS' order."""
    import soundfile

    majors = soundfile.available_formats()
    names = []
    for name, (major, subtype, _ext) in FILE_FORMATS.items():
        if major in majors and subtype in soundfile.available_subtypes(major):
            names.append(name)
    return names


def file_format(path: str | os.PathLike, format: str | None = None) -> str:
    """The FILE_FORMATS name to write `path` in: `format` if given, else by the extension (none: WAV).

    A UsageError (one line, naming what this machine can write) for a format or extension that nothing
    here writes: callers check this before any model is loaded."""
    available = writable_formats()
    listed = ", ".join(available)
    if format is not None:
        name = format.strip().lower().lstrip(".")
        if name not in available:
            raise UsageError(f"cannot write audio format '{format}': supported formats are {listed}")
        return name
    suffix = Path(path).suffix.lower()
    if not suffix:
        return "wav"
    for name, (_major, _subtype, extensions) in FILE_FORMATS.items():
        if suffix in extensions:
            if name not in available:
                raise UsageError(f"cannot write {Path(path).name}: this machine's libsndfile has no "
                                 f"{name.upper()} encoder; supported formats are {listed}")
            return name
    known = ", ".join(ext for name in available for ext in FILE_FORMATS[name][2])
    raise UsageError(f"cannot write {Path(path).name}: unknown audio file extension '{suffix}'; use one of "
                     f"{known} (or --format {'|'.join(available)})")


def _temp_path(path: Path, suffix: str) -> Path:
    """A fresh hidden name beside `path` (.NAME.<random>SUFFIX). The name is known before the file
    exists, so whoever records it first can always remove it: an interrupt that lands between creating
    the file and remembering its name cannot leave it behind."""
    import secrets

    return path.parent / f".{path.name}.{secrets.token_hex(8)}{suffix}"


def _create_exclusive(path: Path, mode: int) -> None:
    """Create `path`, empty; an error if it exists. `mode` is filtered by the umask as open() does."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))


class AudioFileSink(_SinkBase):
    """An audio file (WAV, FLAC, Ogg Vorbis, Ogg Opus, MP3: see FILE_FORMATS) that appears whole at
    `close()` or not at all: it is written to a hidden temp file in the same folder and renamed into
    place. The format comes from `format` (a FILE_FORMATS name), else the file's extension (none: WAV);
    one nothing here can write is a UsageError, and an unwritable folder an OutputError, both raised by
    the constructor, before any audio exists.

    `subtype` overrides the format's sample encoding (soundfile's names; e.g. "FLOAT" for a lossless
    32-bit WAV). Integer encodings are clipped to [-1, 1].

    Calls may come from several threads (an interrupt's `abort()` while the writer is inside `write()`):
    a lock makes each call whole, so `abort()` never closes the file under a write in progress.
    """

    def __init__(self, path: str | os.PathLike, format: str | None = None, subtype: str | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        # The FILE_FORMATS name, and libsndfile's format and subtype for it.
        self.format = file_format(self.path, format)
        self.major, default_subtype, _ = FILE_FORMATS[self.format]
        self.subtype = subtype or default_subtype
        self._tmp: Path | None = None
        self._file: Any = None
        # Re-entrant: a signal handler in the writing thread may call abort() from inside write().
        self._lock = threading.RLock()
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
        # A real probe: os.access() says yes to root on read-only file systems and the like. The
        # probe is removed whatever happens, an interrupt included (its name exists before it does).
        probe = _temp_path(path, ".probe")
        try:
            _create_exclusive(probe, 0o600)
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
        finally:
            try:
                probe.unlink()
            except OSError:
                pass

    def start(self, sample_rate: int) -> None:
        with self._lock:
            self._check_start(sample_rate)
            import soundfile

            if self.subtype == "OPUS" and self.sample_rate not in _OPUS_RATES:
                self.abort()
                raise OutputError(f"cannot write {self.path}: Opus takes 8, 12, 16, 24 or 48 kHz, not "
                                  f"{self.sample_rate} Hz; write .flac, .ogg or .wav instead")
            try:
                self._tmp = _temp_path(self.path, ".part")  # remembered before it exists: see _temp_path
                # Made here (not by libsndfile) so that it gets the mode a plain open() would give.
                _create_exclusive(self._tmp, 0o666)
                self._file = soundfile.SoundFile(
                    self._tmp, mode="w", samplerate=self.sample_rate, channels=1, format=self.major,
                    subtype=self.subtype,
                )
            except Exception as exc:
                self.abort()
                raise OutputError(f"cannot write {self.path}: {_reason(exc)}") from exc

    def write(self, block: "np.ndarray") -> None:
        with self._lock:
            self._check_write()
            import numpy as np

            arr = as_block(block)
            if self.subtype.upper() not in ("FLOAT", "DOUBLE"):
                # libsndfile wraps around (not clips) out-of-range floats when converting to integers;
                # the lossy encoders would clip anyway.
                arr = np.clip(arr, -1.0, 1.0)
            try:
                self._file.write(arr)
            except Exception as exc:
                self.abort()
                raise OutputError(f"cannot write {self.path}: {_reason(exc)}") from exc
            self.samples += int(arr.shape[0])

    def close(self) -> None:
        """Finish the file and rename it into place (an empty file if nothing was ever started)."""
        with self._lock:
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
        """Drop the temp file; an already finished file stays."""
        with self._lock:
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
                except OSError:  # never created, or already renamed into place
                    pass
                self._tmp = None


class WavSink(AudioFileSink):
    """A WAV file whatever its name, which appears whole at `close()` or not at all (AudioFileSink).

    `subtype` is soundfile's sample format: "PCM_16" (default, plays everywhere; samples are clipped
    to [-1, 1]) or "FLOAT" (32-bit float, lossless).
    """

    def __init__(self, path: str | os.PathLike, subtype: str = "PCM_16") -> None:
        super().__init__(path, format="wav", subtype=subtype)


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


# ---------------------------------------------------------------------------------------------
# Streaming WAV (stdout)
# ---------------------------------------------------------------------------------------------

UNKNOWN_SIZE = 0xFFFFFFFF  # what a streaming WAV header says for sizes not known yet


def wav_header(sample_rate: int, data_bytes: int = UNKNOWN_SIZE) -> bytes:
    """A 44-byte header of a mono 16-bit PCM WAV; `data_bytes` UNKNOWN_SIZE for a stream."""
    riff = UNKNOWN_SIZE if data_bytes >= UNKNOWN_SIZE - 36 else 36 + data_bytes
    data = UNKNOWN_SIZE if data_bytes >= UNKNOWN_SIZE - 36 else data_bytes
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " + fmt + b"data" + struct.pack("<I", data)


def pcm16(block: Any) -> bytes:
    """Little-endian 16-bit samples of a float block, converted as libsndfile 1.2 does (x * 32768, rounded
    down, clipped), so `-o -` and `-o FILE` (WavSink) carry the same samples."""
    import numpy as np

    arr = np.floor(np.clip(as_block(block), -1.0, 1.0) * np.float32(32768))
    return np.clip(arr, -32768, 32767).astype("<i2").tobytes()


class WavStreamSink(_SinkBase):
    """A 16-bit WAV streamed to a binary file object (stdout for `-o -`), flushed block by block.

    The header goes out at `start()` with sizes 0xFFFFFFFF ("until the end of the stream"), which
    soundfile/libsndfile, sox, ffmpeg and aplay read. If the file can seek and is not in append mode
    (stdout redirected to a file), `close()` patches the real sizes in. Nothing can be taken back
    from a pipe: `abort()` just stops writing.
    """

    def __init__(self, file: BinaryIO, name: str = "stdout") -> None:
        super().__init__()
        self.file = file
        self.name = name
        self._header_at: int | None = None  # file offset of the header, if sizes can be patched

    def _fail(self, exc: BaseException) -> OutputError:
        self.aborted = True
        if isinstance(exc, BrokenPipeError):
            return OutputError(f"{self.name} was closed while the WAV was being written")
        return OutputError(f"cannot write the WAV to {self.name}: {_reason(exc)}")

    def start(self, sample_rate: int) -> None:
        self._check_start(sample_rate)
        self._header_at = _patchable_offset(self.file)
        try:
            self.file.write(wav_header(self.sample_rate))
            self.file.flush()
        except OSError as exc:
            raise self._fail(exc) from exc

    def write(self, block: "np.ndarray") -> None:
        self._check_write()
        data = pcm16(block)
        try:
            self.file.write(data)
            self.file.flush()
        except OSError as exc:
            raise self._fail(exc) from exc
        self.samples += len(data) // 2

    def close(self) -> None:
        if self.closed or self.aborted:
            return
        if not self.started:
            self.start(self.sample_rate)
        try:
            if self._header_at is not None and self.samples * 2 < UNKNOWN_SIZE - 36:
                end = self.file.tell()
                self.file.seek(self._header_at)
                self.file.write(wav_header(self.sample_rate, self.samples * 2))
                self.file.seek(end)
            self.file.flush()
        except OSError as exc:
            raise self._fail(exc) from exc
        self.closed = True

    def abort(self) -> None:
        if self.closed or self.aborted:
            return
        self.aborted = True
        try:
            self.file.flush()
        except Exception:
            pass


def _patchable_offset(file: Any) -> int | None:
    """Where the header will be, if the file can seek back to it (a regular file, not O_APPEND)."""
    try:
        if not file.seekable():
            return None
        fd = file.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    try:
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            return None
    except (ImportError, OSError):
        pass
    try:
        return file.tell()
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# Fan-out
# ---------------------------------------------------------------------------------------------


class TeeSink(_SinkBase):
    """The same audio to several sinks. `close()` closes them in the order given (put files before
    the speaker, so a file is whole even if its playback is cut short); any failure aborts the rest."""

    def __init__(self, sinks: Sequence[Any]) -> None:
        super().__init__()
        self.sinks = list(sinks)

    def start(self, sample_rate: int) -> None:
        self._check_start(sample_rate)
        try:
            for sink in self.sinks:
                sink.start(self.sample_rate)
        except BaseException:
            self.abort()
            raise

    def write(self, block: "np.ndarray") -> None:
        self._check_write()
        arr = as_block(block)
        try:
            for sink in self.sinks:
                sink.write(arr)
        except BaseException:
            self.abort()
            raise
        self.samples += int(arr.shape[0])

    def close(self) -> None:
        if self.closed or self.aborted:
            return
        try:
            for sink in self.sinks:
                sink.close()
        except BaseException:
            self.abort()
            raise
        self.closed = True

    def abort(self) -> None:
        if self.closed or self.aborted:
            return
        self.aborted = True
        for sink in self.sinks:
            try:
                sink.abort()
            except Exception:
                pass


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
