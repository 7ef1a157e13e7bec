"""The sound device: `SpeakerSink` plays a reply while it is generated; the output devices, listed and found.

`SpeakerSink(device)` plays through sounddevice/PortAudio. A callback stream copies from a FIFO, fills
silence and counts underruns when the FIFO runs dry, ends with `CallbackStop` and an event (`close()`
waits on it, it never polls). `abort()` silences at once and may be called from any thread (a Ctrl-C
handler, say). Playback starts once enough audio is queued for the rate it arrives at (see the class).

sounddevice is imported only when something is played or devices are listed, so a machine without
PortAudio or a sound card can do everything else. It knows nothing about models or the engine.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Literal

from ..config import SAMPLE_RATE
from ..errors import AudioDeviceError, UsageError
from .sinks import failure_reason, SinkBase, as_block

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np


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
            f"cannot play audio: PortAudio failed to start ({failure_reason(exc)}): check the sound setup; {hint}"
        ) from exc
    return sounddevice


def output_devices(sd: Any = None, hint: str = PLAY_HINT) -> list[dict]:
    """The output devices PortAudio sees: dicts with index, name, hostapi, channels, samplerate, default."""
    return devices_of_kind("output", sd if sd is not None else import_sounddevice(hint), hint)


def devices_of_kind(kind: str, sd: Any, hint: str) -> list[dict]:
    """The devices PortAudio sees with channels of `kind` ("output" or "input"), as `output_devices` lists
    them; `hint` ends the error when they cannot be listed."""
    try:
        devices = list(sd.query_devices())
    except Exception as exc:
        raise AudioDeviceError(f"cannot list the audio devices ({failure_reason(exc)}); {hint}") from exc
    try:
        hostapis = [h["name"] for h in sd.query_hostapis()]
    except Exception:
        hostapis = []
    try:
        default = int(sd.query_devices(kind=kind)["index"])
    except Exception:  # no default device of that kind (PortAudioError: Error querying device -1)
        default = None
    channels = f"max_{kind}_channels"
    out = []
    for i, dev in enumerate(devices):
        if int(dev.get(channels, 0)) <= 0:
            continue
        index = int(dev.get("index", i))
        api = dev.get("hostapi", 0)
        out.append({
            "index": index,
            "name": str(dev.get("name", f"device {index}")),
            "hostapi": hostapis[api] if isinstance(api, int) and 0 <= api < len(hostapis) else "",
            "channels": int(dev[channels]),
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
    found = match_device(devices, text)
    if isinstance(found, dict):
        return found
    if found == "default":
        raise AudioDeviceError(f"cannot play audio: there is no default sound output device: choose one with --audio-device ({listing}); {hint}")
    if found == "index":
        raise UsageError(f"audio device {text} is not an output device here ({listing})")
    if found == "name":
        raise UsageError(f"no audio output device is called '{text}' ({listing})")
    names = ", ".join(f"{d['index']}: {d['name']}" for d in found[:5])
    raise UsageError(f"audio device '{text}' is ambiguous ({names}): give its index")


def match_device(devices: list[dict], text: str) -> dict | Literal["default", "index", "name"] | list[dict]:
    """The device `text` names among `devices`: "" the default, digits an index, else a name (exact, or
    the one that contains it, case aside). When there is none, what failed: "default", "index" or "name";
    the candidates (a list) when a part of a name fits several."""
    if not text:
        return next((dev for dev in devices if dev["default"]), "default")
    if text.isdigit():
        return next((dev for dev in devices if dev["index"] == int(text)), "index")
    exact = [d for d in devices if d["name"].lower() == text.lower()]
    if exact:
        return exact[0]
    partial = [d for d in devices if text.lower() in d["name"].lower()]
    if len(partial) == 1:
        return partial[0]
    return partial or "name"


# Streams that abort() stopped but did not close; closed on the caller's thread at the next open().
_ABORTED_STREAMS: list = []


def _close_aborted_streams() -> None:
    while _ABORTED_STREAMS:
        stream = _ABORTED_STREAMS.pop()
        try:
            stream.close()
        except Exception:
            pass


def _dac_time(time_info: Any) -> float | None:
    """When the callback's buffer reaches the DAC, on the stream's clock; None where the host API gives no
    time (PortAudio then reports 0) or the caller passes no time info (a fake stream)."""
    t = getattr(time_info, "outputBufferDacTime", 0.0) or 0.0
    return float(t) if t > 0 else None


# The adaptive start's defaults (SpeakerSink's docstring): the least and the most audio queued before playing,
# and the reply length the production rate is judged over (seconds).
PREBUFFER, MAX_PREBUFFER, HORIZON = 0.2, 4.0, 3.0


class Arrivals:
    """The writes the adaptive start judges by: the last two (time, samples) and the longest wait between
    two writes so far (seconds)."""

    def __init__(self) -> None:
        self.last: list[tuple[float, int]] = []
        self.longest_wait = 0.0

    def note(self, now: float, samples: int) -> None:
        if self.last:
            self.longest_wait = max(self.longest_wait, now - self.last[-1][0])
        self.last = (self.last + [(now, samples)])[-2:]


def start_needed(rate: float, arrivals: Arrivals, prebuffer: float = PREBUFFER, max_prebuffer: float = MAX_PREBUFFER,
                 horizon: float = HORIZON) -> tuple[float, str]:
    """`SpeakerSink`'s adaptive start (its docstring): seconds of audio to queue before playing, and the
    term that asks for them, from the producer's `rate` (audio seconds a second since it began) and the
    writes so far."""
    by_rate = horizon * (1.0 - rate)
    next_wait = 0.0
    if len(arrivals.last) == 2:
        (t0, n0), (t1, n1) = arrivals.last
        next_wait = max(arrivals.longest_wait, (t1 - t0) * min(2.0, max(1.0, n1 / max(n0, 1))))
    needed, reason = prebuffer, "buffer filled"
    if by_rate > needed:
        needed, reason = by_rate, "production rate"
    if next_wait > needed:
        needed, reason = next_wait, "block gaps"
    if needed > max_prebuffer:
        needed, reason = max_prebuffer, reason + " (capped)"
    return needed, reason


def start_after(began: float, blocks: list[tuple[float, int]], sample_rate: int, **rule) -> int | None:
    """The index of the block after whose arrival a `SpeakerSink` with the `rule`'s settings (defaults:
    the sink's) starts playing, for blocks (arrival time, samples) of a producer that began at `began`
    (all `time.perf_counter()`); None: only the end of the reply would start it. (No device is played.)"""
    queued, arrivals = 0, Arrivals()
    for i, (t, n) in enumerate(blocks):
        arrivals.note(t, n)
        queued += n
        needed, _ = start_needed(queued / sample_rate / max(t - began, 1e-6), arrivals, **rule)
        if queued >= needed * sample_rate:
            return i
    return None


class SpeakerSink(SinkBase):
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

    def __init__(self, device: str | int | None = None, *, prebuffer: float = PREBUFFER,
                 max_prebuffer: float = MAX_PREBUFFER, horizon: float = HORIZON, latency: Any = "high",
                 blocksize: int = 0, hint: str = PLAY_HINT, backend: Any = None) -> None:
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
        self._dry_from: float | None = None  # the device clock (DAC time) when that silence began
        self._arrivals = Arrivals()  # the writes' times (perf_counter) and sizes the start is judged by
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
        # Called on the audio thread with a copy of every buffer handed to the device, silence included
        # (so it keeps time): the echo canceller's reference in talk mode. It must only queue the copy.
        self.tap: Callable[[np.ndarray], None] | None = None

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
            raise AudioDeviceError(f"cannot play on audio device '{self.device['name']}': {failure_reason(exc)}; {self.hint}") from exc
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
            raise AudioDeviceError(f"cannot play on audio device '{self.device['name']}': {failure_reason(exc)}; {self.hint}") from exc

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
                    self.underrun_frames += self._silence_heard(_dac_time(time_info))
                    self._starving = False
                    self._dry_frames = 0
            if n < frames:
                out[n:] = 0
            if self.tap is not None:
                self.tap(out.copy())
            if n < frames:
                if self._eof:
                    raise self._sd.CallbackStop  # this buffer still plays; then finished_callback
                # Counted when the sound resumes: a spell that the end of input follows is no gap.
                if not self._starving:
                    dac = _dac_time(time_info)
                    self._dry_from = None if dac is None else dac + n / self.sample_rate
                self._starving = True
                self._dry_frames += frames - n

    def _silence_heard(self, resumed_at: float | None) -> int:
        """Samples of silence in the dry spell that ends now: those the device asked for, but no more than
        its clock says passed. A device that is not paced (ALSA's null device, a file) asks for buffers as
        fast as it can, hundreds of seconds of them a second, while its DAC clock keeps to the wall clock."""
        frames = self._dry_frames
        if resumed_at is not None and self._dry_from is not None:
            frames = min(frames, max(0, round((resumed_at - self._dry_from) * self.sample_rate)))
        return frames

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
        self._arrivals.note(now, samples)

    def _start_needed(self, now: float) -> tuple[float, str]:
        """Seconds of audio to queue before playing, and which term asks for them (class docstring)."""
        self.production_rate = self.samples / self.sample_rate / max(now - (self.start_time or now), 1e-6)
        return start_needed(self.production_rate, self._arrivals, self.prebuffer, self.max_prebuffer, self.horizon)

    def _prime(self, now: float, reason: str, needed: float) -> None:
        """Start playing from the FIFO (the callback reads `_primed`); the caller holds the lock."""
        self._primed = True
        self.play_time = now
        self.start_reason = reason
        self.start_needed = needed
        self.start_buffered = self._queued / self.sample_rate

    def close(self, wait: bool = True) -> None:
        """Play out what is queued and wait (on the finished event) until the device has played it.

        `wait=False`: mark the end of input and return at once; the sound plays out (`finished` is set
        then) and may still be stopped by `abort()`; a later `close()` waits for the end and closes."""
        if self.closed or self.aborted:
            return
        if not self.started:
            self.closed = True
            return
        # No lock here: a Ctrl-C handler may call abort() on this thread at any moment, and abort()
        # takes the lock. Unprimed, the callback only reads `_primed`, so the fields are set first.
        if not self._eof:
            self._eof = True
            if not self._primed:
                self.play_time = time.perf_counter()
                self.start_reason = "reply ended"
                self.start_buffered = self._queued / self.sample_rate
                self._primed = True
        if not wait:
            return
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
            # perf_counter() of the first sound, so that it can be counted from the reply's own start
            "first_sound_at": self.first_sound_time,
            "start_delay": (self.first_sound_time - self.start_time)
            if self.first_sound_time is not None and self.start_time is not None else None,
            "start_wait": (self.play_time - self.first_write_time)
            if self.play_time is not None and self.first_write_time is not None else None,
            "start_reason": self.start_reason,
            "start_buffered": self.start_buffered,
            "start_needed": self.start_needed,
            "production_rate": self.production_rate,
        }
