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
- `SpeakerSink(device)`: plays through a sound device (sounddevice/PortAudio). A callback stream
  copies from a FIFO, fills silence and counts underruns when the FIFO runs dry, ends with
  `CallbackStop` and an event (`close()` waits on it, it never polls). `abort()` silences at once
  and may be called from any thread (a Ctrl-C handler, say).
- `TeeSink(sinks)`: the same audio to several sinks (`--play -o FILE`).
- `NullSink`: counts samples (benchmarks).

It knows nothing about models, torch or threads of the engine; numpy and soundfile are imported
when a sink is used, and sounddevice only when something is played or devices are listed (so a
machine without PortAudio or without a sound card can do everything else).
"""

from __future__ import annotations

import collections
import os
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, Sequence, runtime_checkable

from ..config import SAMPLE_RATE
from ..errors import AudioDeviceError, OutputError, UsageError

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


# ---------------------------------------------------------------------------------------------
# The sound device
# ---------------------------------------------------------------------------------------------

# What to say after "cannot play audio: ..." (the CLI passes its own: omni-chat says --mute).
PLAY_HINT = "to write the speech to a file instead, use -o FILE"


def import_sounddevice(hint: str = PLAY_HINT):
    """The `sounddevice` module, or an AudioDeviceError that says what to install.

    PortAudio is loaded (and reads the ALSA configuration) at this import, so it happens only when
    something is about to be played or listed.
    """
    try:
        import sounddevice
    except ImportError as exc:
        raise AudioDeviceError(f"cannot play audio: the sounddevice package is missing: pip install sounddevice; {hint}") from exc
    except OSError as exc:
        raise AudioDeviceError(
            "cannot play audio: the PortAudio library is missing: install it (apt-get install libportaudio2, "
            f"or brew install portaudio on macOS); {hint}"
        ) from exc
    except Exception as exc:  # e.g. PortAudioError from a broken ALSA configuration
        raise AudioDeviceError(
            f"cannot play audio: PortAudio failed to start ({_reason(exc)}): check the sound setup; {hint}"
        ) from exc
    return sounddevice


def output_devices(sd: Any = None, hint: str = PLAY_HINT) -> list[dict]:
    """The output devices PortAudio sees: dicts with index, name, hostapi, channels, samplerate, default."""
    sd = sd if sd is not None else import_sounddevice(hint)
    try:
        devices = list(sd.query_devices())
    except Exception as exc:
        raise AudioDeviceError(f"cannot list the audio devices ({_reason(exc)}); {hint}") from exc
    try:
        hostapis = [h["name"] for h in sd.query_hostapis()]
    except Exception:
        hostapis = []
    try:
        default = int(sd.query_devices(kind="output")["index"])
    except Exception:  # no default output device (PortAudioError: Error querying device -1)
        default = None
    out = []
    for i, dev in enumerate(devices):
        if int(dev.get("max_output_channels", 0)) <= 0:
            continue
        index = int(dev.get("index", i))
        api = dev.get("hostapi", 0)
        out.append({
            "index": index,
            "name": str(dev.get("name", f"device {index}")),
            "hostapi": hostapis[api] if isinstance(api, int) and 0 <= api < len(hostapis) else "",
            "channels": int(dev["max_output_channels"]),
            "samplerate": float(dev.get("default_samplerate", 0) or 0),
            "default": index == default,
        })
    return out


def find_output_device(spec: str | int | None, sd: Any = None, hint: str = PLAY_HINT) -> dict:
    """The output device named by `spec`: None = the default; an index; or (part of) a name."""
    devices = output_devices(sd, hint)
    listing = "see --list-audio-devices"
    if not devices:
        raise AudioDeviceError(f"cannot play audio: no sound output device found (no sound card?); {hint}")
    text = "" if spec is None else str(spec).strip()
    if not text:
        for dev in devices:
            if dev["default"]:
                return dev
        raise AudioDeviceError(f"cannot play audio: there is no default sound output device: choose one with --audio-device ({listing}); {hint}")
    if text.isdigit():
        for dev in devices:
            if dev["index"] == int(text):
                return dev
        raise UsageError(f"audio device {text} is not an output device here ({listing})")
    exact = [d for d in devices if d["name"].lower() == text.lower()]
    if exact:
        return exact[0]
    partial = [d for d in devices if text.lower() in d["name"].lower()]
    if len(partial) == 1:
        return partial[0]
    if not partial:
        raise UsageError(f"no audio output device is called '{text}' ({listing})")
    names = ", ".join(f"{d['index']}: {d['name']}" for d in partial[:5])
    raise UsageError(f"audio device '{text}' is ambiguous ({names}): give its index")


# Streams that abort() stopped but did not close; closed on the caller's thread at the next open().
_ABORTED_STREAMS: list = []


def _close_aborted_streams() -> None:
    while _ABORTED_STREAMS:
        stream = _ABORTED_STREAMS.pop()
        try:
            stream.close()
        except Exception:
            pass


class SpeakerSink(_SinkBase):
    """Plays the reply through a sound device as it is produced.

    A PortAudio callback stream pulls fixed-size buffers from a FIFO of the written blocks (a block
    may be split across callbacks). The callback only copies: it plays silence until the start-up
    buffer is full (the adaptive start below, or the reply has ended), and when the FIFO runs dry
    mid-reply it fills silence; a dry spell that the reply's sound then resumes after is one
    underrun (`underruns`, `underrun_frames`: the silent gaps a listener hears inside the reply; a
    spell the end of input follows is only the reply's end). `close()` marks the end of input; the callback then plays out
    what is left and raises `CallbackStop`, PortAudio calls `finished_callback` once the last buffer
    has been played, and that sets the event `close()` waits on. `abort()` stops the sound at once
    (Pa_AbortStream) and may be called from any thread, e.g. a Ctrl-C handler; later `write()`s are
    dropped, and the stopped stream is closed at the next `open()` (closing can wait on the driver).

    Adaptive start: playback starts at the first `write()` after which the queued audio B covers
    what playing through needs, `B >= clamp(max(horizon * (1 - rate), next_wait), prebuffer, max_prebuffer)`:
    - `rate`: seconds of audio produced per second since `start()` (when the producer began), from
      the blocks' arrival times; below 1 the producer is slower than the device. Audio made at `rate`
      and played at 1 falls behind by (1 - rate) s per second played, so a reply that goes on for
      `horizon` more seconds needs `horizon * (1 - rate)` in hand to never run dry. The sink does not
      know the reply's length: `horizon` is a typical spoken reply's (3 s); a longer one from a producer
      that stays slower than real time can still run dry later (no finite buffer saves it).
    - `next_wait`: how long the next block may take, from the last wait between blocks, grown as the
      last block grew over the one before (at most doubled). Producers deliver in bursts: a chunked
      vocoder's blocks grow (0.04, 0.48, 0.96, ... s) and each takes its length times the real-time
      factor to make, so a producer faster than real time on average (rate above 1) can still keep
      the device waiting for a block longer than what it has queued.
    - `prebuffer` (floor): jitter room even for a fast producer; `max_prebuffer` (cap): the most it
      waits for. The end of input (`close()`) starts playback whatever is queued.
    A fast producer thus starts at the floor; one only just faster than real time starts later and
    plays through. `stats` says when and why: `start_wait` (seconds from the first block to the start),
    `start_reason` ("buffer filled": the floor; "production rate" / "block gaps": the term that asked
    for more; "reply ended"), `start_buffered` / `start_needed` (seconds), `production_rate`.

    The device is checked in the constructor (sounddevice imported here, lazily), so a missing
    PortAudio or sound card is reported before a model is loaded. `backend` replaces the
    sounddevice module (tests pass a fake with OutputStream, CallbackStop and query_devices).
    """

    def __init__(self, device: str | int | None = None, *, prebuffer: float = 0.2, max_prebuffer: float = 4.0,
                 horizon: float = 3.0, latency: Any = "high", blocksize: int = 0, hint: str = PLAY_HINT,
                 backend: Any = None) -> None:
        super().__init__()
        self._sd = backend if backend is not None else import_sounddevice(hint)
        self.hint = hint
        # The chosen device: index, name, hostapi, channels, samplerate, default.
        self.device = find_output_device(device, self._sd, hint)
        # The adaptive start (see the class docstring): the least and the most audio (seconds) queued
        # before playback starts, and the reply length (seconds to come) the producer's rate is judged over.
        self.prebuffer = float(prebuffer)
        self.max_prebuffer = max(float(max_prebuffer), self.prebuffer)
        self.horizon = float(horizon)
        # PortAudio's suggested latency ("low", "high" or seconds) and frames per callback (0 = its choice).
        self.latency = latency
        self.blocksize = int(blocksize)
        self._lock = threading.Lock()
        self._fifo: collections.deque = collections.deque()
        self._head = 0  # samples of _fifo[0] already played
        self._queued = 0  # samples in the FIFO
        self._primed = False  # the start-up buffer is full (or the input ended): play from the FIFO
        self._eof = False  # close() was called: no more input
        self._starving = False  # the FIFO ran dry and no sound has been played since
        self._dry_frames = 0  # silence of the current dry spell: an underrun once the sound resumes
        self._arrivals: list[tuple[float, int]] = []  # (perf_counter, samples) of the last two writes
        self._longest_wait = 0.0  # longest time between two writes so far (seconds)
        self._stream: Any = None
        self._stream_rate: int | None = None
        # Set when the stream has stopped: played out, aborted, or died.
        self.finished = threading.Event()
        # Times the FIFO ran dry while more audio was still to come (one per dry spell).
        self.underruns = 0
        # Samples of silence played during those dry spells.
        self.underrun_frames = 0
        # Buffers PortAudio itself reported as late (output_underflow status flag).
        self.device_underflows = 0
        # Samples of the reply handed to the device so far, and the FIFO's high-water mark.
        self.played = 0
        self.max_queued = 0
        # time.perf_counter() of start(), of the first audible buffer, of abort(); None until then.
        self.start_time: float | None = None
        self.first_write_time: float | None = None
        self.play_time: float | None = None  # when the start-up buffer was judged full
        # Why playback started then, how much was queued and asked for, and the producer's rate (audio
        # seconds per second) at that moment; None until it started.
        self.start_reason: str | None = None
        self.start_buffered: float | None = None
        self.start_needed: float | None = None
        self.production_rate: float | None = None
        self.first_sound_time: float | None = None
        self.abort_time: float | None = None
        # time.perf_counter() when abort() had stopped the stream (the sound is off from then on).
        self.silent_time: float | None = None

    # -- the stream ----------------------------------------------------------------------------
    def open(self, sample_rate: int = SAMPLE_RATE) -> None:
        """Open the device now (not started), so that a failure shows before any work is done."""
        if self._stream is not None and self._stream_rate == int(sample_rate):
            return
        self._close_stream()
        _close_aborted_streams()
        try:
            self._stream = self._sd.OutputStream(
                samplerate=int(sample_rate), channels=1, dtype="float32", device=self.device["index"],
                blocksize=self.blocksize, latency=self.latency, callback=self._callback,
                finished_callback=self._on_finished,
            )
        except Exception as exc:
            self._stream = None
            raise AudioDeviceError(f"cannot play on audio device '{self.device['name']}': {_reason(exc)}; {self.hint}") from exc
        self._stream_rate = int(sample_rate)

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.close()
            except Exception:
                pass

    def start(self, sample_rate: int) -> None:
        self._check_start(sample_rate)
        self.start_time = time.perf_counter()
        try:
            self.open(self.sample_rate)
            self._stream.start()
        except AudioDeviceError:
            self.abort()
            raise
        except Exception as exc:
            self.abort()
            raise AudioDeviceError(f"cannot play on audio device '{self.device['name']}': {_reason(exc)}; {self.hint}") from exc

    def _callback(self, outdata, frames, time_info, status) -> None:
        # The audio thread: copy, fill silence, count; never block, never allocate much.
        if status and getattr(status, "output_underflow", False):
            self.device_underflows += 1
        out = outdata[:, 0] if outdata.ndim == 2 else outdata
        if self.aborted:
            outdata.fill(0)
            raise self._sd.CallbackAbort
        with self._lock:
            if not self._primed:
                outdata.fill(0)
                return
            n = 0
            while n < frames and self._fifo:
                head = self._fifo[0]
                k = min(frames - n, head.shape[0] - self._head)
                out[n:n + k] = head[self._head:self._head + k]
                n += k
                self._head += k
                if self._head >= head.shape[0]:
                    self._fifo.popleft()
                    self._head = 0
            self._queued -= n
            self.played += n
            if n:
                if self.first_sound_time is None:
                    self.first_sound_time = time.perf_counter()
                if self._starving:  # the sound resumes after a dry spell: a gap inside the reply
                    self.underruns += 1
                    self.underrun_frames += self._dry_frames
                    self._starving = False
                    self._dry_frames = 0
            if n < frames:
                out[n:] = 0
                if self._eof:
                    raise self._sd.CallbackStop  # this buffer still plays; then finished_callback
                # Counted when the sound resumes: a spell that the end of input follows is no gap.
                self._starving = True
                self._dry_frames += frames - n

    def _on_finished(self) -> None:
        self.finished.set()

    # -- the sink protocol (writer thread) ------------------------------------------------------
    def write(self, block: "np.ndarray") -> None:
        if self.aborted:
            return  # abort() came from another thread (Ctrl-C): the rest of the reply is dropped
        self._check_write()
        if self.finished.is_set():
            raise AudioDeviceError(f"the audio device '{self.device['name']}' stopped playing (was it unplugged?); {self.hint}")
        arr = as_block(block).copy()
        now = time.perf_counter()
        with self._lock:
            if self.aborted:
                return
            self._fifo.append(arr)
            self._queued += arr.shape[0]
            self.max_queued = max(self.max_queued, self._queued)
            self.samples += int(arr.shape[0])
            self._note_arrival(now, int(arr.shape[0]))
            if not self._primed:
                needed, reason = self._start_needed(now)
                if self._queued >= needed * self.sample_rate:
                    self._prime(now, reason, needed)

    def _note_arrival(self, now: float, samples: int) -> None:
        if self.first_write_time is None:
            self.first_write_time = now
        if self._arrivals:
            self._longest_wait = max(self._longest_wait, now - self._arrivals[-1][0])
        self._arrivals = (self._arrivals + [(now, samples)])[-2:]

    def _start_needed(self, now: float) -> tuple[float, str]:
        """Seconds of audio to queue before playing, and which term asks for them (class docstring)."""
        rate = self.production_rate = self.samples / self.sample_rate / max(now - (self.start_time or now), 1e-6)
        by_rate = self.horizon * (1.0 - rate)
        next_wait = 0.0
        if len(self._arrivals) == 2:
            (t0, n0), (t1, n1) = self._arrivals
            next_wait = max(self._longest_wait, (t1 - t0) * min(2.0, max(1.0, n1 / max(n0, 1))))
        needed, reason = self.prebuffer, "buffer filled"
        if by_rate > needed:
            needed, reason = by_rate, "production rate"
        if next_wait > needed:
            needed, reason = next_wait, "block gaps"
        if needed > self.max_prebuffer:
            needed, reason = self.max_prebuffer, reason + " (capped)"
        return needed, reason

    def _prime(self, now: float, reason: str, needed: float) -> None:
        """Start playing from the FIFO (the callback reads `_primed`); the caller holds the lock."""
        self._primed = True
        self.play_time = now
        self.start_reason = reason
        self.start_needed = needed
        self.start_buffered = self._queued / self.sample_rate

    def close(self) -> None:
        """Play out what is queued and wait (on the finished event) until the device has played it."""
        if self.closed or self.aborted:
            return
        if not self.started:
            self.closed = True
            return
        # No lock here: a Ctrl-C handler may call abort() on this thread at any moment, and abort()
        # takes the lock. Unprimed, the callback only reads `_primed`, so the fields are set first.
        self._eof = True
        if not self._primed:
            self.play_time = time.perf_counter()
            self.start_reason = "reply ended"
            self.start_buffered = self._queued / self.sample_rate
            self._primed = True
        latency = getattr(self._stream, "latency", 0.0) or 0.0
        timeout = self._queued / self.sample_rate + float(latency) + 5.0
        try:
            done = self.finished.wait(timeout)
        except BaseException:
            self.abort()
            raise
        if self.aborted:
            return
        if not done or self._fifo:
            self.abort()
            raise AudioDeviceError(f"the audio device '{self.device['name']}' stopped playing before the end; {self.hint}")
        self._close_stream()
        self.closed = True

    def abort(self) -> None:
        """Silence now: drop the FIFO and what the device has queued. Safe from any thread."""
        if self.closed or self.aborted:
            return
        self.aborted = True  # first: write() drops from now on, the callback plays silence
        self.abort_time = time.perf_counter()
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.abort()  # Pa_AbortStream: stops at once, pending buffers are discarded
            except Exception:
                pass
            # Closing can wait on the driver; an interrupt should not: the next open() closes it.
            _ABORTED_STREAMS.append(stream)
        self.silent_time = time.perf_counter()
        with self._lock:
            self._fifo.clear()
            self._queued = 0
        self.finished.set()

    @property
    def stats(self) -> dict:
        """Playback figures: underruns, underrun_seconds, device_underflows, played_seconds, max_queued_seconds;
        start_delay (start() to the first sound); the adaptive start: start_wait (first block to the
        start), start_reason, start_buffered, start_needed, production_rate (see the class docstring)."""
        rate = self.sample_rate or SAMPLE_RATE
        return {
            "underruns": self.underruns,
            "underrun_seconds": self.underrun_frames / rate,
            "device_underflows": self.device_underflows,
            "played_seconds": self.played / rate,
            "max_queued_seconds": self.max_queued / rate,
            "start_delay": (self.first_sound_time - self.start_time)
            if self.first_sound_time is not None and self.start_time is not None else None,
            "start_wait": (self.play_time - self.first_write_time)
            if self.play_time is not None and self.first_write_time is not None else None,
            "start_reason": self.start_reason,
            "start_buffered": self.start_buffered,
            "start_needed": self.start_needed,
            "production_rate": self.production_rate,
        }




def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
