"""Sound devices for tests on machines with no sound card.

`alsa_file_device(folder, paced=True)`: an ALSA configuration whose default device writes every
sample played into `folder/played.raw` (float32 mono, bit for bit). Paced, the samples go through a
small reader process that takes them at the real-time rate (24 kHz), so the device behaves like a
sound card: a stream is pulled at real speed, underruns can happen, a long reply takes its time.
Unpaced, the null device swallows audio as fast as it is written (fast, but an idle stream spins).
PortAudio reads the configuration when sounddevice is imported: use the returned environment for a
subprocess. `no_alsa_device(folder)`: a configuration with no device at all.
`alsa_capture_device(folder, wav)`: a default device that, opened for capture, hears a WAV file (a
microphone), paced at the WAV's rate.

`FakeSoundDevice`: a stand-in for the sounddevice module (OutputStream, CallbackStop, CallbackAbort,
query_devices), whose stream calls the callback from its own thread, paced at real time times
`speed`, and keeps what was played. It lets the tests time and starve a SpeakerSink without PortAudio.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

RATE = 24_000

READER = r'''
import fcntl, os, signal, sys, time

signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is for the program, not the "sound card"

F_SETPIPE_SZ = 1031
out = open(sys.argv[1], "ab", buffering=0)
# Keep the pipe short (4 KiB, 43 ms), so that a stream that stops goes silent at once, as a sound
# card does. A pipe cannot shrink below what it holds: drain it (unpaced, the stream's first
# buffers) until the shrink succeeds.
flags = fcntl.fcntl(0, fcntl.F_GETFL)
fcntl.fcntl(0, fcntl.F_SETFL, flags | os.O_NONBLOCK)
eof = False
for _ in range(10000):
    try:
        while True:
            data = os.read(0, 65536)
            if not data:
                eof = True
                break
            out.write(data)
    except BlockingIOError:
        pass
    if eof:
        break
    try:
        fcntl.fcntl(0, F_SETPIPE_SZ, 4096)
        break
    except OSError:
        time.sleep(0.001)
fcntl.fcntl(0, fcntl.F_SETFL, flags)
rate = float(sys.argv[2]) * 4  # bytes per second of float32 mono
start = None
got = 0
while not eof:
    data = os.read(0, 4096)
    if not data:
        break
    if start is None:
        start = time.monotonic()
    out.write(data)
    got += len(data)
    ahead = got / rate - (time.monotonic() - start)
    if ahead > 0:
        time.sleep(ahead)
'''


def alsa_file_device(folder: Path, paced: bool = True, rate: int = RATE) -> tuple[dict, Path]:
    """(environment for a subprocess, path of the raw float32 file that receives what is played)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = folder / "played.raw"
    raw.write_bytes(b"")
    if paced:
        reader = folder / "reader.py"
        reader.write_text(READER)
        target = f'"|{sys.executable} {reader} {raw} {rate}"'
    else:
        target = f'"{raw}"'
    conf = folder / "asound.conf"
    conf.write_text(
        "pcm.!default {\n"
        "    type file\n"
        "    slave.pcm { type null }\n"
        f"    file {target}\n"
        "    format \"raw\"\n"
        f"    truncate {'false' if paced else 'true'}\n"
        "}\n"
    )
    return {"ALSA_CONFIG_PATH": str(conf)}, raw


def no_alsa_device(folder: Path) -> dict:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "asound-none.conf"
    conf.write_text("pcm.!default { type hw card 99 }\nctl.!default { type hw card 99 }\n")
    return {"ALSA_CONFIG_PATH": str(conf)}


def read_played(raw: Path) -> np.ndarray:
    return np.fromfile(raw, dtype=np.float32)


def trim_silence(x: np.ndarray) -> np.ndarray:
    """Without the exact zeros at both ends (the silence a stream plays before and after the reply)."""
    nz = np.flatnonzero(x)
    return x[nz[0]:nz[-1] + 1] if nz.size else x[:0]


@dataclass
class Heard:
    """What a listener got from a device's output, told apart from the silence around and inside it."""

    samples: np.ndarray  # the sound, in order, without any silence (exact zeros) that was played
    gaps: int  # silent stretches between two samples of sound: each one a break a person hears
    gap_samples: int  # samples of silence in those gaps
    gap_lengths: list[int]


def heard(played: np.ndarray) -> Heard:
    """Split what a device played into the sound and the silent gaps inside it.

    A speaker fills exact zeros before the reply (start-up buffer), after it (the rest of the last
    buffer, an idle stream) and wherever it ran dry in between (an underrun). Speech, even noise out of
    a vocoder, has no run of exact float zeros, so every zero inside the sound is inserted silence:
    comparing `samples` with the reply's audio checks that every sample played, once, in order, and
    `gaps` is what the speaker should have counted as underruns. (A caller checks that its reply has no
    exact zeros of its own, which would break that premise: `assert_no_zeros`.)
    """
    played = np.asarray(played)
    at = np.flatnonzero(played)
    if at.size == 0:
        return Heard(played[:0], 0, 0, [])
    between = np.diff(at) - 1  # zeros between consecutive samples of sound
    lengths = [int(n) for n in between[between > 0]]
    return Heard(played[at], len(lengths), int(sum(lengths)), lengths)


def assert_no_zeros(reply: np.ndarray, what: str = "the reply") -> None:
    zeros = reply.size - np.count_nonzero(reply)
    assert zeros == 0, f"{what} has {zeros} exact zero samples: silence inserted by underruns cannot be told from them"


def assert_underruns_reported(sound: Heard, stats: dict, rate: int = RATE) -> None:
    """The speaker's underrun count and silence equal the gaps found in what the device played.

    PortAudio may itself fill a buffer the callback was late for (it then flags `output_underflow`,
    counted as `device_underflows`): only then may there be more gaps than the speaker counted.
    """
    detail = f"gaps in the sound {sound.gap_lengths} samples; the speaker said {stats}"
    extra = stats.get("device_underflows", 0)
    assert stats["underruns"] <= sound.gaps <= stats["underruns"] + extra, detail
    if sound.gaps == stats["underruns"]:
        assert round(stats["underrun_seconds"] * rate) == sound.gap_samples, detail


def _required() -> bool:
    """CI (.ci/run sets OMNI_CI=1) installs PortAudio and tmux: there a missing one fails, not skips."""
    return os.environ.get("OMNI_CI", "") not in ("", "0")


def have_portaudio() -> bool:
    import ctypes.util

    return _required() or ctypes.util.find_library("portaudio") is not None


def have_tmux() -> bool:
    return _required() or shutil.which("tmux") is not None


# -- a fake sounddevice ------------------------------------------------------------------------


class CallbackStop(Exception):
    pass


class CallbackAbort(Exception):
    pass


class _Status:
    output_underflow = False

    def __bool__(self):
        return False


class FakeStream:
    """Calls `callback` every `blocksize` frames from a thread, paced at real time x speed."""

    def __init__(self, owner, samplerate, channels, dtype, device, blocksize, latency, callback, finished_callback):
        self.owner = owner
        self.samplerate = samplerate
        self.channels = channels
        self.blocksize = blocksize or owner.blocksize
        self.latency = 0.01
        self.callback = callback
        self.finished_callback = finished_callback
        self.played: list[np.ndarray] = []
        self.calls = 0
        self.active = False
        self.closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.callback_times: list[float] = []
        owner.streams.append(self)

    def start(self):
        if self.owner.fail_start:
            raise RuntimeError("Error starting stream: Device unavailable [PaErrorCode -9985]")
        self.active = True
        self._thread = threading.Thread(target=self._run, name="fake-audio", daemon=True)
        self._thread.start()

    def _run(self):
        period = self.blocksize / self.samplerate / self.owner.speed
        next_at = time.perf_counter()
        try:
            while not self._stop.is_set():
                buf = np.full((self.blocksize, self.channels), np.nan, dtype=np.float32)
                self.calls += 1
                self.callback_times.append(time.perf_counter())
                try:
                    self.callback(buf, self.blocksize, self.owner.time_info(), _Status())
                except CallbackStop:
                    self.played.append(buf[:, 0].copy())
                    break
                except CallbackAbort:
                    break
                self.played.append(buf[:, 0].copy())
                next_at += period
                delay = next_at - time.perf_counter()
                if delay > 0:
                    self._stop.wait(delay)
        finally:
            self.active = False
            self.finished_callback()  # PortAudio calls it after a stop and after an abort alike

    def abort(self):
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def stop(self):
        self.abort()

    def close(self):
        self.abort()
        self.closed = True

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.played) if self.played else np.zeros(0, np.float32)


class FakeSoundDevice:
    """Enough of the sounddevice module for SpeakerSink."""

    CallbackStop = CallbackStop
    CallbackAbort = CallbackAbort

    def __init__(self, speed: float = 1.0, blocksize: int = 480, devices=None, default: int | None = 0,
                 fail_start: bool = False, wall_clock: bool = False):
        self.speed = speed
        # A device that gives its DAC time as the wall clock, as ALSA's unpaced null device does; by
        # default no time info at all (None), as from a host API that has none.
        self.wall_clock = wall_clock
        self.blocksize = blocksize
        self.fail_start = fail_start
        self.streams: list[FakeStream] = []
        self.devices = devices if devices is not None else [
            {"index": 0, "name": "Fake Speakers", "hostapi": 0, "max_input_channels": 0,
             "max_output_channels": 2, "default_samplerate": 48000.0},
            {"index": 1, "name": "Fake Microphone", "hostapi": 0, "max_input_channels": 1,
             "max_output_channels": 0, "default_samplerate": 48000.0},
            {"index": 2, "name": "USB Headset", "hostapi": 0, "max_input_channels": 1,
             "max_output_channels": 2, "default_samplerate": 48000.0},
        ]
        self.default = default

    def query_devices(self, device=None, kind=None):
        if kind == "output":
            if self.default is None:
                raise RuntimeError("Error querying device -1")
            return self.devices[self.default]
        return list(self.devices)

    def time_info(self):
        if not self.wall_clock:
            return None
        now = time.perf_counter()
        return SimpleNamespace(currentTime=now, outputBufferDacTime=now, inputBufferAdcTime=0.0)

    def query_hostapis(self):
        return [{"name": "Fake API"}]

    def OutputStream(self, **kwargs):  # noqa: N802 - the sounddevice name
        return FakeStream(self, **kwargs)


# The pace of a capture device: the file plugin writes what it captured into this reader's pipe, and
# blocks while the pipe is full. The reader starts before capture does, with the pipe still empty, so it
# can shrink the pipe to 4 KiB at once (23 ms of float32 at 44.1 kHz), and it paces from the first byte
# (READER first drains the pipe unpaced until it can shrink it, for a random while): the device then
# runs a steady 0.3 s ahead of the clock (measured at 44.1 kHz: ALSA's buffers, as the plugin writes
# its copy a buffer behind what it hands out), reached in a first burst. When the stream closes, the reader
# hears the pipe hang up and takes the rest unpaced, so closing does not wait on the pace.
CAPTURE_READER = r'''
import fcntl, os, select, signal, sys, time

signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the program, not the "sound card"
F_SETPIPE_SZ = 1031
try:
    fcntl.fcntl(0, F_SETPIPE_SZ, 4096)
except OSError:  # the pipe already holds more: still paced, only with a longer first burst
    pass
out = open(sys.argv[1], "ab", buffering=0)
rate = float(sys.argv[2]) * 4  # bytes per second of float32 mono
hangup = select.poll()
hangup.register(0, 0)  # no events asked for: poll() wakes only when the writer has closed the pipe
closed = False
start = None  # the clock starts with the first byte: the stream opens a while before it starts
got = 0
while True:
    data = os.read(0, 4096)
    if not data:
        break
    if start is None:
        start = time.monotonic()
    out.write(data)
    got += len(data)
    ahead = got / rate - (time.monotonic() - start)
    if ahead > 0 and not closed:
        closed = bool(hangup.poll(ahead * 1000))
'''


def alsa_capture_device(folder: Path, wav: Path, paced: bool = True, pad_seconds: float = 10.0) -> tuple[dict, Path]:
    """A microphone that hears `wav`: (environment for a subprocess, path of the raw float32 file that
    receives every sample the device handed out).

    ALSA's file plugin, opened for capture, reads its `infile` in the stream's own format: the app must
    record float32 mono at the WAV's rate (the WAV is converted to raw float32 here, exactly: a 16-bit
    sample k becomes k / 32768). After the WAV come `pad_seconds` of exact zeros, because past the end of
    its input the plugin hands out stale buffer contents, not silence. Each stream opened reads the
    file from its start. Paced, the plugin's copy of what it captured goes to a reader that takes it at
    the WAV's rate (CAPTURE_READER): the pipe fills and blocks the capture, so the device delivers in
    real time like a sound card, a steady 0.3 s ahead of the clock (a first burst). Unpaced, capture runs as fast as it is read (hundreds of times real time).
    """
    import soundfile

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data, rate = soundfile.read(str(wav), dtype="float32", always_2d=True)
    mic = folder / "mic.raw"
    np.concatenate([data[:, 0], np.zeros(round(pad_seconds * rate), np.float32)]).tofile(mic)
    captured = folder / "captured.raw"
    captured.write_bytes(b"")
    if paced:
        reader = folder / "capture_reader.py"
        reader.write_text(CAPTURE_READER)
        target = f'"|{sys.executable} {reader} {captured} {rate}"'
    else:
        target = f'"{captured}"'
    conf = folder / "asound-capture.conf"
    conf.write_text(
        "pcm.!default {\n"
        "    type file\n"
        "    slave.pcm { type null }\n"
        f"    file {target}\n"
        f"    infile \"{mic}\"\n"
        "    format \"raw\"\n"
        f"    truncate {'false' if paced else 'true'}\n"
        "}\n"
    )
    return {"ALSA_CONFIG_PATH": str(conf)}, captured


def room_device(folder: Path, rate: int = 16000) -> dict:
    """A full-duplex default device for tests/room.py: playback into FOLDER/spk.fifo (24 kHz float32 as the
    speaker opens it), capture from FOLDER/mic.fifo (the app's own format: `rate` float32, 16 kHz in talk
    mode), paced at that rate by CAPTURE_READER, which takes the capture's copy.
    The FIFOs are made here; the room process opens both ends' other side. The environment is returned."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("spk.fifo", "mic.fifo"):
        if not (folder / name).exists():
            os.mkfifo(folder / name)
    reader = folder / "capture_reader.py"
    reader.write_text(CAPTURE_READER)
    conf = folder / "asound-room.conf"
    conf.write_text(
        "pcm.spk {\n"
        "    type file\n"
        "    slave.pcm { type null }\n"
        f"    file \"{folder / 'spk.fifo'}\"\n"
        "    format \"raw\"\n"
        # true: an existing file is opened as it is (a FIFO is not truncated); false would make a new
        # file beside it, spk.fifo.0001, unpaced.
        "    truncate true\n"
        "}\n"
        "pcm.mic {\n"
        "    type file\n"
        "    slave.pcm { type null }\n"
        f"    file \"|{sys.executable} {reader} /dev/null {rate}\"\n"
        f"    infile \"{folder / 'mic.fifo'}\"\n"
        "    format \"raw\"\n"
        "    truncate false\n"
        "}\n"
        "pcm.!default {\n"
        "    type asym\n"
        "    playback.pcm \"spk\"\n"
        "    capture.pcm \"mic\"\n"
        "}\n"
    )
    return {"ALSA_CONFIG_PATH": str(conf)}
