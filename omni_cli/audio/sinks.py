"""Where the reply's PCM goes: a small sink protocol and the sinks.

A sink is driven by one thread at a time, in this order: `start(sample_rate)` once, `write(block)`
any number of times (float32 mono 1-D blocks, values nominally in [-1, 1]), then exactly one of
`close()` (the reply ended normally: make the result final) or `abort()` (error or interrupt: leave
nothing partial behind). `close()` and `abort()` are idempotent, and `abort()` after `close()` keeps
what was finished. Every sink is also a context manager: an exception inside the block aborts it.

- `AudioFileSink(path, format=None)`: an audio file (WAV, FLAC, Ogg Vorbis, Ogg Opus, MP3; by the
  extension or `format`). What `path` names decides how (omni_cli/atomic.py): a file or a new name (a
  symlink's target) is written to a temp file in the same folder and renamed into place at `close()`,
  so a file that exists is always whole; a character device or a FIFO (/dev/null, a terminal, a named
  pipe) is written directly as the audio comes, never replaced; a folder or a socket is a UsageError.
  The format, the target and whether it is writable are checked in the constructor, before any model
  is loaded. `WavSink(path)`: the same, always WAV.
- `WavStreamSink(file)`: streaming WAV (16-bit) on a binary file object, e.g. stdout for `-o -`: a
  header with unknown sizes first, then the PCM as it is produced, flushed block by block. If the
  file can seek (stdout redirected to a file), the sizes are patched at `close()`.
- `SpeakerSink(device)`: plays through a sound device (speaker.py).
- `TeeSink(sinks)`: the same audio to several sinks (`--play -o FILE`).
- `NullSink`: counts samples (benchmarks).

16-bit samples (WAV and FLAC files, the WAV stream) are made by the one PCM16 rule of audio/format.py and
handed to libsndfile as int16, so every 16-bit output of the same float audio holds the same samples.

It knows nothing about models, torch or threads of the engine, nor sound devices (speaker.py); numpy
and soundfile are imported when a sink is used.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, Sequence, runtime_checkable

from .. import atomic
from ..config import SAMPLE_RATE
from ..errors import OutputError, UsageError
from .format import UNKNOWN_SIZE, pcm16, to_int16, wav_header  # wav_header, UNKNOWN_SIZE: re-exported

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


class SinkBase:
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

    def close(self) -> None:  # each sink ends its own way (`Sink`)
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

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


# What each format can do on a STREAM target (a FIFO, a terminal, a device), which cannot seek: WAV
# through the streaming writer (WavStreamSink; 16-bit only); Ogg Vorbis and Opus through libsndfile, whose
# Ogg pages are written as they fill and never revisited. FLAC and MP3 are refused: libsndfile goes back
# to finish their headers (measured with libsndfile 1.2.2 on a pipe: a FLAC that libsndfile cannot read
# back, an MP3 that decodes to a fifth of its samples).
_STREAMABLE = ("ogg", "opus")


class AudioFileSink(SinkBase):
    """An audio file (WAV, FLAC, Ogg Vorbis, Ogg Opus, MP3: see FILE_FORMATS) written to what `path`
    names (atomic.output_target): a regular file or a new name (a symlink's target) appears whole at
    `close()` or not at all, through a hidden temp file in the same folder renamed into place; a
    character device or FIFO is written directly, block by block (WAV as a stream, Ogg through
    libsndfile; FLAC and MP3 need a file). The format comes from `format` (a FILE_FORMATS name), else
    the file's extension (none: WAV). A format nothing here can write, a folder, a socket, or a format a
    stream cannot carry is a UsageError; an unwritable place an OutputError: all raised by the
    constructor, before any audio exists.

    `subtype` overrides the format's sample encoding (soundfile's names; e.g. "FLOAT" for a lossless
    32-bit WAV). PCM_16 samples are made by audio/format.py's rule; other integer encodings are clipped
    to [-1, 1] and converted by libsndfile.

    Calls may come from several threads (an interrupt's `abort()` while the writer is inside `write()`):
    a lock makes each call whole, so `abort()` never closes the file under a write in progress.
    """

    def __init__(self, path: str | os.PathLike, format: str | None = None, subtype: str | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        # What the path names: REGULAR/NEW (temp file and rename) or STREAM (written directly). First:
        # "it is a folder" says more than a folder name's extension would.
        self.target = atomic.output_target(self.path)
        # The FILE_FORMATS name, and libsndfile's format and subtype for it.
        self.format = file_format(self.path, format)
        self.major, default_subtype, _ = FILE_FORMATS[self.format]
        self.subtype = subtype or default_subtype
        self._replacement: atomic.Replacement | None = None
        self._fd: int | None = None  # a STREAM target's descriptor
        self._file: Any = None  # the soundfile.SoundFile, or for a streamed WAV the WavStreamSink
        # Re-entrant: a signal handler in the writing thread may call abort() from inside write().
        self._lock = threading.RLock()
        if not self.target.atomic:
            self._check_streamable()
        atomic.check_writable(self.target)

    @property
    def _wav_stream(self) -> bool:
        """Whether this is a 16-bit WAV on a STREAM target (written by WavStreamSink, not libsndfile,
        which refuses to write WAV where it cannot seek back to the header)."""
        return not self.target.atomic and self.format == "wav"

    def _check_streamable(self) -> None:
        where = f"{self.path} is a {self.target.what}, written as the audio comes"
        if self.format == "wav":
            if self.subtype.upper() != "PCM_16":
                raise UsageError(f"cannot write {self.subtype} WAV to {self.path}: {where}, and a streamed WAV "
                                 "is 16-bit")
        elif self.format not in _STREAMABLE:
            raise UsageError(f"cannot write {self.format.upper()} to {self.path}: {where}, and a "
                             f"{self.format.upper()} file needs seeking back to finish it; write WAV, Ogg or "
                             "Opus there, or a file")

    def start(self, sample_rate: int) -> None:
        with self._lock:
            self._check_start(sample_rate)
            import soundfile

            if self.subtype == "OPUS" and self.sample_rate not in _OPUS_RATES:
                self.abort()
                raise OutputError(f"cannot write {self.path}: Opus takes 8, 12, 16, 24 or 48 kHz, not "
                                  f"{self.sample_rate} Hz; write .flac, .ogg or .wav instead")
            try:
                if self.target.atomic:
                    # The temp file's name is remembered before it exists (atomic.temp_path), and it is
                    # made here (not by libsndfile) with the mode a plain open() would give it, or the
                    # mode of the file it replaces.
                    self._replacement = atomic.Replacement(self.target)
                    fd = self._replacement.create()
                else:
                    self._fd = fd = atomic.open_stream(self.target)  # a FIFO: waits here for its reader
                if self._wav_stream:
                    self._file = WavStreamSink(os.fdopen(fd, "wb", closefd=False), name=str(self.path))
                    self._file.start(self.sample_rate)
                else:
                    self._file = soundfile.SoundFile(
                        fd, mode="w", samplerate=self.sample_rate, channels=1, format=self.major,
                        subtype=self.subtype, closefd=False,
                    )
            except Exception as exc:
                error = self._failure(exc)
                self.abort()
                raise error from exc

    def write(self, block: "np.ndarray") -> None:
        with self._lock:
            self._check_write()
            import numpy as np

            arr = as_block(block)
            if self._wav_stream:
                data: Any = arr  # WavStreamSink applies the PCM16 rule
            elif self.subtype.upper() == "PCM_16":
                data = to_int16(arr)  # the one rule; libsndfile writes int16 as they are
            elif self.subtype.upper() not in ("FLOAT", "DOUBLE"):
                # libsndfile wraps around (not clips) out-of-range floats when converting to integers;
                # the lossy encoders would clip anyway.
                data = np.clip(arr, -1.0, 1.0)
            else:
                data = arr
            try:
                self._file.write(data)
            except Exception as exc:
                error = self._failure(exc)
                self.abort()
                raise error from exc
            self.samples += int(arr.shape[0])

    def close(self) -> None:
        """Finish the file: rename it into place (an empty file if nothing was ever started), or for a
        stream, end it. The rename is made under the sink's lock: an `abort()` from another thread (a
        signal's handler) waits for it, so the file is then whole, or it was never renamed and is gone."""
        with self._lock:
            staged = self._finish_bytes()
            if staged is not None:
                try:
                    staged.commit()
                except BaseException:
                    staged.discard()
                    self.closed, self.aborted = False, True  # no file came of it
                    raise

    def close_staged(self) -> "atomic.Replacement | None":
        """Finish the file's bytes but leave it under its temporary name: its Replacement, for the caller to
        rename (atomic.commit_all, with files that belong with it) or discard. None for a stream (ended
        here) or a sink already closed or aborted."""
        with self._lock:
            return self._finish_bytes()

    def _finish_bytes(self) -> "atomic.Replacement | None":
        """close_staged's work, for close() to do under the lock it already holds."""
        with self._lock:
            if self.closed or self.aborted:
                return None
            if not self.started:
                self.start(self.sample_rate)
            staged = None
            try:
                self._file.close()
                self._file = None
                if self._replacement is not None:
                    staged, self._replacement = self._replacement, None
                else:
                    fd, self._fd = self._fd, None
                    assert fd is not None  # start() opened the stream's descriptor
                    os.close(fd)
            except Exception as exc:
                error = self._failure(exc)
                self.abort()
                raise error from exc
            self.closed = True
            return staged

    def _failure(self, exc: BaseException) -> OutputError:
        """The one-line OutputError for a failure of libsndfile or of the file under it (a full disk is
        "no space left on MOUNT", not libsndfile's "System error.")."""
        if isinstance(exc, OutputError):
            return exc
        fd = self._replacement.fd if self._replacement is not None else self._fd
        return atomic.write_failure(self.path, _system_cause(exc, fd))

    def abort(self) -> None:
        """Drop the temp file (a stream just stops); an already finished file stays."""
        with self._lock:
            if self.closed or self.aborted:
                return
            self.aborted = True
            if self._file is not None:
                try:
                    if isinstance(self._file, WavStreamSink):
                        self._file.abort()
                    else:
                        self._file.close()
                except Exception:
                    pass
                self._file = None
            if self._replacement is not None:
                self._replacement.discard()
                self._replacement = None
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None


class WavSink(AudioFileSink):
    """A WAV file whatever its name, which appears whole at `close()` or not at all (AudioFileSink; to a
    FIFO, a device or a descriptor's name it is streamed, 16-bit).

    `subtype` is soundfile's sample format: "PCM_16" (default, plays everywhere; samples are clipped
    to [-1, 1]) or "FLOAT" (32-bit float, lossless).
    """

    def __init__(self, path: str | os.PathLike, subtype: str = "PCM_16") -> None:
        super().__init__(path, format="wav", subtype=subtype)


class NullSink(SinkBase):
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

class WavStreamSink(SinkBase):
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
        return OutputError(f"cannot write the WAV to {self.name}: {failure_reason(exc)}")

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
        data = pcm16(as_block(block))
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


class TeeSink(SinkBase):
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


def _system_cause(exc: BaseException, fd: int | None) -> BaseException:
    """libsndfile's "System error." (SF_ERR_SYSTEM) says nothing of the system's error: it is the errno
    of libsndfile's last call, which cffi keeps for this thread, or else (that errno lost) a full disk
    seen on the file's own file system. Any other `exc` as it is."""
    if type(exc).__name__ != "LibsndfileError" or getattr(exc, "code", None) != 2:
        return exc
    import soundfile

    ffi = getattr(soundfile, "_ffi", None)
    code = getattr(ffi, "errno", 0) if ffi is not None else 0
    if not code and fd is not None:
        try:
            if os.fstatvfs(fd).f_bavail == 0:
                code = errno.ENOSPC
        except (OSError, AttributeError):
            pass
    return OSError(code, os.strerror(code)) if code else exc


def failure_reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
