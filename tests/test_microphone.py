"""The microphone through the real PortAudio path: an ALSA capture device that hears a WAV file.

The WAV is made here (in the test's temp folder): a voiced, speech-like signal (the harmonics of a
~120 Hz glottal source, shaped by vowel formants, in 250 ms syllables) in two words with a 0.3 s
pause, between stretches of faint noise (-70 dBFS, a quiet room). WebRTC's VAD hears it as speech.
`audio_device.alsa_capture_device` turns it into the default ALSA device, paced at its rate like a
sound card. PortAudio reads the ALSA setup when sounddevice is imported, so every recording runs in a
subprocess (`RUNNER`) with that setup; one subprocess runs several recordings in turn (each stream
reads the file from its start), to keep the file's run time short on a 2-core machine.

What is held to account:
- the samples: bit for bit. The WAV is 16-bit; a 16-bit sample k is the float k / 32768 exactly, the
  device hands PortAudio float32 and PortAudio hands it on unconverted, so the bound is 0.
- the VAD's end: the turn ends `end_silence_ms` (in whole 30 ms frames) after the speech ends, late by
  WebRTC's own hangover (it keeps saying "speech" a few frames after the voice stops): within 0-200 ms.
- on_level: once per 100 ms of audio, at rising times, each level the RMS of exactly that 100 ms of
  the file (to 0.01 dB), spread over the recording's real time (a live meter, not a burst at the end).
- `stop` and Ctrl-C stop the stream within 50 ms, record() returns (or raises) within 200 ms (the
  test device is slow to close: see TO_RETURN), and the clip holds all that came before them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from audio_device import FakeSoundDevice, alsa_capture_device, have_portaudio, no_alsa_device
from conftest import REPO_ROOT, cli_env
from omni_cli.audio.vad import Endpoint
from omni_cli.audio.microphone import (Clip, RecordOptions, SilentMicrophone, find_input_device,
                                       save_clip)
from omni_cli.errors import AudioDeviceError, OutputError, UsageError

needs_portaudio = pytest.mark.skipif(not have_portaudio(), reason="PortAudio is not installed (apt-get install libportaudio2)")

RATE = 44_100  # the ALSA plugin device's default rate (PortAudio's choice): the VAD resamples to 16 kHz
LEAD, WORD, PAUSE, TAIL = 0.5, 0.75, 0.3, 3.0  # seconds: noise, word, pause, word, noise
SPEECH_END = LEAD + WORD + PAUSE + WORD  # 2.3 s
NOISE_DBFS = -70.0
VAD_LATE = 0.2  # how late the VAD's end may be (hangover + a frame), seconds
# "At once": from `stop` set (or SIGINT sent) to record() stopping the stream: one POLL_SECONDS (20 ms)
# and a block's work. Then to its return: aborting and closing the stream too, which on this test device
# take 50-90 ms (as it stops, ALSA's file plugin flushes its copy of the capture into the paced pipe).
TO_ABORT = 0.05
TO_RETURN = 0.2


# -- the signal ----------------------------------------------------------------------------------

VOWELS = [(700, 1220, 2600), (300, 2300, 3000), (500, 900, 2400), (400, 1900, 2550)]  # formants, Hz


def speech_like(rate: int, seconds: float, seed: int = 0, peak: float = 0.3) -> np.ndarray:
    """Voiced syllables: harmonics of a wavering ~120 Hz pitch, each weighted by the current vowel's
    three formant resonances (bandwidths 80-120 Hz), under a 4 Hz syllable envelope, plus a breath of noise."""
    rng = np.random.default_rng(seed)
    n = int(rate * seconds)
    t = np.arange(n) / rate
    f0 = 120 * (1 + 0.08 * np.sin(2 * np.pi * 0.7 * t + seed))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    vowel = (t // 0.25).astype(int) % len(VOWELS)
    out = np.zeros(n)
    for k in range(1, 40):
        fk = k * f0
        gain = np.zeros(n)
        for v, formants in enumerate(VOWELS):
            at = vowel == v
            gain[at] = sum(1 / (1 + ((fk[at] - fm) / bw) ** 2) for fm, bw in zip(formants, (80, 100, 120)))
        out += gain / math.sqrt(k) * np.sin(k * phase)
    envelope = np.sin(np.pi * (t % 0.25) / 0.25) ** 0.6
    out = out * envelope + 0.01 * rng.standard_normal(n) * envelope
    return (peak * out / np.abs(out).max()).astype(np.float32)


def noise(rate: int, seconds: float, seed: int) -> np.ndarray:
    return (10 ** (NOISE_DBFS / 20) * np.random.default_rng(seed).standard_normal(int(rate * seconds))).astype(np.float32)


def write_wav(path, x: np.ndarray, rate: int) -> np.ndarray:
    """Write a 16-bit WAV; return its samples as the device will give them (float32 k / 32768)."""
    sf.write(str(path), x, rate, subtype="PCM_16")
    return sf.read(str(path), dtype="float32")[0]


def speech_wav(folder, rate: int = RATE):
    x = np.concatenate([noise(rate, LEAD, 1), speech_like(rate, WORD, 0), noise(rate, PAUSE, 2),
                        speech_like(rate, WORD, 1), noise(rate, TAIL, 3)])
    return write_wav(folder / "speech.wav", x, rate)


def dbfs(x: np.ndarray) -> float:
    return 10 * math.log10(float(np.mean(x.astype(np.float64) ** 2)))


# -- recording in a subprocess -------------------------------------------------------------------

RUNNER = r'''
import json, os, signal, sys, threading, time
import numpy as np
from omni_cli.audio import microphone as mic
from omni_cli.errors import OmniError

def threads():
    return len(os.listdir("/proc/self/task"))

def run(job, out):
    stop = threading.Event()
    levels, marks, timer = [], {}, None
    def on_level(level, seconds):
        levels.append((level, seconds, time.perf_counter()))
        if "threads_during" not in marks:  # not counting the timer's thread
            marks["threads_during"] = threads() - (timer is not None and timer.is_alive())
    backend = None
    if job.get("timed"):  # sounddevice, with the moment record() stops the stream noted
        import sounddevice
        class Timed:
            def __getattr__(self, name):
                return getattr(sounddevice, name)
            def InputStream(self, **kwargs):
                stream = sounddevice.InputStream(**kwargs)
                abort = stream.abort
                def timed_abort(*args, **kw):
                    marks.setdefault("abort", time.perf_counter())
                    return abort(*args, **kw)
                stream.abort = timed_abort
                return stream
        backend = Timed()
    def press():  # the user pressing Enter, from another thread
        marks["at"] = time.perf_counter()
        stop.set()
    def interrupt():  # Ctrl-C: SIGINT to this process, raised on the main thread
        marks["at"] = time.perf_counter()
        os.kill(os.getpid(), signal.SIGINT)
    if "stop_after" in job:
        timer = threading.Timer(job["stop_after"], press)
    elif "sigint_after" in job:
        timer = threading.Timer(job["sigint_after"], interrupt)
    result, clip = {}, None
    before = threads()
    start = time.perf_counter()
    if timer:
        timer.start()
    try:
        clip = mic.record(mic.RecordOptions(**job.get("options", {})), stop=stop, on_level=on_level, backend=backend)
    except KeyboardInterrupt as exc:
        result["raised"], clip = "KeyboardInterrupt", getattr(exc, "clip", None)
    except OmniError as exc:
        result["raised"], result["message"], clip = type(exc).__name__, str(exc), getattr(exc, "clip", None)
    returned = time.perf_counter()
    if timer:
        timer.join()
    result.update(threads_before=before, threads_during=marks.get("threads_during"), threads_after=threads(),
                  wall=returned - start, stop_at=marks["at"] - start if "at" in marks else None,
                  latency=returned - marks["at"] if "at" in marks else None,
                  to_abort=marks["abort"] - marks["at"] if "abort" in marks and "at" in marks else None,
                  levels=[(l, s, t - start) for l, s, t in levels])
    if clip is not None:
        np.save(out, clip.pcm)
        result.update(ended_by=clip.ended_by, sample_rate=clip.sample_rate, seconds=clip.seconds,
                      recorded_seconds=clip.recorded_seconds, speech_end=clip.speech_end, overflows=clip.overflows)
    return result

jobs = json.loads(sys.argv[1])
print(json.dumps([run(job, f"{sys.argv[2]}/clip{i}.npy") for i, job in enumerate(jobs)]))
'''


def run_jobs(env: dict, jobs: list[dict], folder) -> list[dict]:
    """Each job ({"options": {...}, "stop_after": s | "sigint_after": s}) records once, in order, in one
    subprocess; its result has the clip's fields (and `pcm`), what was raised, on_level's calls."""
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs), str(folder)], env=cli_env(**env),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    for i, result in enumerate(results):
        if "ended_by" in result:
            result["pcm"] = np.load(folder / f"clip{i}.npy")
    return results


@pytest.fixture(scope="module")
def speech_runs(tmp_path_factory):
    """One subprocess, five recordings of the speech WAV: the default turn (VAD on), VAD off up to a
    3 s limit, `stop` after 1 s, Ctrl-C after 1 s, and a short one after the Ctrl-C (the device is free)."""
    if not have_portaudio():
        pytest.skip("PortAudio is not installed (apt-get install libportaudio2)")
    folder = tmp_path_factory.mktemp("mic")
    wav = speech_wav(folder)
    env, _ = alsa_capture_device(folder / "alsa", folder / "speech.wav")
    results = run_jobs(env, [
        {},
        {"options": {"vad": False, "max_seconds": 3.0}},
        {"stop_after": 1.0, "timed": True},
        {"sigint_after": 1.0, "timed": True},
        {"options": {"vad": False, "max_seconds": 0.3}},
    ], folder)
    names = ["vad", "limit", "stop", "ctrl_c", "after"]
    return wav, dict(zip(names, results))


# -- through PortAudio ---------------------------------------------------------------------------


@needs_portaudio
def test_record_returns_the_devices_samples_bit_for_bit(speech_runs):
    wav, runs = speech_runs
    for name in ("vad", "limit", "stop", "ctrl_c", "after"):
        clip = runs[name]["pcm"]
        assert runs[name]["sample_rate"] == RATE, name
        assert clip.dtype == np.float32 and clip.ndim == 1, name
        assert clip.size > 0 and np.array_equal(clip, wav[:clip.size]), name  # bound: 0 (module docstring)
        assert runs[name]["overflows"] == 0, name


@needs_portaudio
def test_vad_ends_the_turn_after_the_speech_and_the_silence(speech_runs):
    _, runs = speech_runs
    run = runs["vad"]
    assert "raised" not in run and run["ended_by"] == "silence"
    silence = math.ceil(800 / 30) * 0.03  # the default 800 ms, in whole 30 ms frames: 0.81 s
    # The 0.3 s pause inside the speech did not end it; the end came the silence after the speech's end.
    assert 0 <= run["speech_end"] - SPEECH_END <= VAD_LATE, run["speech_end"]
    assert 0 <= run["recorded_seconds"] - (SPEECH_END + silence) <= VAD_LATE, run["recorded_seconds"]
    assert run["recorded_seconds"] == pytest.approx(run["speech_end"] + silence, abs=1e-6)
    # Trailing silence beyond the 300 ms tail is cut off.
    assert run["seconds"] == pytest.approx(run["speech_end"] + 0.3, abs=1 / RATE)
    # The device delivers in real time: the recording took about as long as it lasted.
    assert run["wall"] >= run["recorded_seconds"] - 0.5, run["wall"]


@needs_portaudio
def test_without_vad_the_limit_ends_it_and_the_quiet_end_is_trimmed(speech_runs):
    _, runs = speech_runs
    run = runs["limit"]
    assert "raised" not in run and run["ended_by"] == "limit" and run["speech_end"] is None
    assert run["recorded_seconds"] == 3.0
    # Loud up to the 100 ms period that ends at the speech's end, then the 300 ms tail.
    assert run["seconds"] == pytest.approx(SPEECH_END + 0.3, abs=1 / RATE)


@needs_portaudio
def test_on_level_reports_each_tenth_of_a_second_as_it_is_recorded(speech_runs):
    wav, runs = speech_runs
    run = runs["vad"]
    levels = run["levels"]
    period = round(RATE * 0.1)
    assert len(levels) == int(run["recorded_seconds"] * RATE) // period
    for i, (level, seconds, _wall) in enumerate(levels):
        assert seconds == pytest.approx((i + 1) * period / RATE)
        assert level == pytest.approx(dbfs(wav[i * period:(i + 1) * period]), abs=0.01), i
    in_speech = [lv for lv, s, _ in levels if LEAD + 0.1 <= s <= LEAD + WORD]
    in_noise = [lv for lv, s, _ in levels if s <= LEAD or s > SPEECH_END + 0.1]
    assert min(in_speech) > -35 and max(in_noise) < -65, (in_speech, in_noise)
    # Live: the calls spread over the recording's real time, not a burst at its end.
    walls = [w for _, _, w in levels]
    assert walls[-1] - walls[0] >= 0.7 * (levels[-1][1] - levels[0][1]), walls


def assert_kept_until_the_stop(run: dict) -> None:
    """The clip holds all the device had delivered when the stop came (the last level report before
    it says how much), and hardly more: at most a level period and TO_ABORT's worth."""
    delivered = max(s for _, s, wall in run["levels"] if wall <= run["stop_at"])
    assert delivered <= run["seconds"] <= delivered + 0.1 + TO_ABORT, (delivered, run["seconds"])


@needs_portaudio
def test_stop_ends_the_recording_at_once_and_keeps_it(speech_runs):
    _, runs = speech_runs
    run = runs["stop"]
    assert "raised" not in run and run["ended_by"] == "stop"
    assert run["to_abort"] < TO_ABORT and run["latency"] < TO_RETURN, run
    assert_kept_until_the_stop(run)
    assert run["seconds"] == run["recorded_seconds"]  # mid-speech: no trailing silence to trim


@needs_portaudio
def test_ctrl_c_stops_the_stream_and_reraises_with_the_recording(speech_runs):
    _, runs = speech_runs
    run = runs["ctrl_c"]
    assert run["raised"] == "KeyboardInterrupt" and run["ended_by"] == "interrupted"
    assert run["to_abort"] < TO_ABORT and run["latency"] < TO_RETURN, run
    assert_kept_until_the_stop(run)
    assert run["seconds"] == run["recorded_seconds"]  # untrimmed
    # PortAudio's stream thread came and went, and the device records again.
    assert run["threads_during"] > run["threads_before"] == run["threads_after"], run
    assert runs["after"]["ended_by"] == "limit" and runs["after"]["recorded_seconds"] == pytest.approx(0.3)


@needs_portaudio
def test_a_silent_microphone_is_an_error_that_carries_the_clip(tmp_path):
    quiet = write_wav(tmp_path / "quiet.wav", noise(RATE, 4.0, 4), RATE)
    env, _ = alsa_capture_device(tmp_path / "alsa", tmp_path / "quiet.wav")
    vad, level = run_jobs(env, [{"options": {"max_seconds": 1.5}},
                                {"options": {"vad": False, "max_seconds": 1.0}}], tmp_path)
    for run, seconds in ((vad, 1.5), (level, 1.0)):
        assert run["raised"] == "SilentMicrophone", run
        assert run["message"].startswith("the microphone gave silence: ") and "\n" not in run["message"]
        assert run["ended_by"] == "limit" and run["seconds"] == pytest.approx(seconds)
        assert np.array_equal(run["pcm"], quiet[:run["pcm"].size])  # untrimmed: nothing recorded is lost
    assert "no speech was heard in 1.5 s" in vad["message"], vad["message"]
    assert "never rose above -50 dBFS in 1.0 s" in level["message"], level["message"]


@needs_portaudio
def test_a_device_at_48_khz_needs_no_resampling_for_the_vad(tmp_path):
    wav = speech_wav(tmp_path, 48_000)
    env, _ = alsa_capture_device(tmp_path / "alsa", tmp_path / "speech.wav")
    (run,) = run_jobs(env, [{"options": {"sample_rate": 48_000, "end_silence_ms": 500}}], tmp_path)
    assert run["ended_by"] == "silence" and run["sample_rate"] == 48_000
    assert 0 <= run["recorded_seconds"] - (SPEECH_END + 0.51) <= VAD_LATE, run["recorded_seconds"]
    assert np.array_equal(run["pcm"], wav[:run["pcm"].size])


DEVICES = r'''
import json, sys
from omni_cli.audio.microphone import input_devices, find_input_device, record
from omni_cli.errors import OmniError
out = {"devices": input_devices()}
for spec in (None, "def", "0", "Studio Mic", "7"):
    try:
        out[str(spec)] = find_input_device(spec)["name"]
    except OmniError as exc:
        out[str(spec)] = f"{type(exc).__name__}: {exc}"
if sys.argv[1:] == ["record"]:  # only where there is no device: a real one would record
    try:
        record()
    except OmniError as exc:
        out["record"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
'''


def list_devices(env: dict, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", DEVICES, *args], env=cli_env(**env), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@needs_portaudio
def test_input_devices_list_the_alsa_microphone_and_unknown_names_are_one_line_errors(tmp_path):
    write_wav(tmp_path / "quiet.wav", noise(RATE, 1.0, 5), RATE)
    env, _ = alsa_capture_device(tmp_path / "alsa", tmp_path / "quiet.wav")
    out = list_devices(env)
    assert out["devices"] == [{"index": 0, "name": "default", "hostapi": "ALSA", "channels": out["devices"][0]["channels"],
                               "samplerate": float(RATE), "default": True}]
    assert out["devices"][0]["channels"] >= 1
    assert out["None"] == out["def"] == out["0"] == "default"
    assert out["Studio Mic"] == "UsageError: no audio input device is called 'Studio Mic' (input devices: 0: default)"
    assert out["7"] == "UsageError: audio device 7 is not an input device here (input devices: 0: default)"
    none = list_devices(no_alsa_device(tmp_path / "none"), "record")
    assert none["devices"] == []
    for key in ("None", "Studio Mic", "record"):
        assert none[key].startswith("AudioDeviceError: cannot record audio: no sound input device found"), none[key]
        assert "\n" not in none[key]


# -- without PortAudio ---------------------------------------------------------------------------


def test_options_refuse_what_cannot_work():
    for bad in ({"vad_mode": 4}, {"end_silence_ms": -1}, {"max_seconds": 0}, {"sample_rate": 0}):
        with pytest.raises(UsageError):
            RecordOptions(**bad)
    with pytest.raises(AttributeError):
        RecordOptions().vad = False  # frozen


def test_endpoint_needs_enough_speech_and_then_the_whole_silence():
    def run(flags: str, min_speech=3, end_silence=4):
        ep = Endpoint(min_speech, end_silence)
        for i, f in enumerate(flags):
            if ep.push(f == "#"):
                return i + 1, ep.speech_end
        return None, ep.speech_end if ep.heard else None

    assert run("#.#....##....#.") == (None, None)  # clicks: no stretch has 3 voiced frames
    assert run("..###..##...##....xxxx") == (18, 14)  # pauses of 2 and 3 frames do not end it; 4 do
    assert run("##....###....") == (13, 9)  # the first 2 frames were a click: a stretch ended before speech


def test_save_clip_writes_a_whole_16_bit_wav_and_no_temp_file(tmp_path):
    x = np.concatenate([np.linspace(-1, 1, 1001, dtype=np.float32), np.array([1.5, -2.0], np.float32)])
    path = save_clip(Clip(pcm=x, sample_rate=22_050, ended_by="stop", recorded_seconds=x.size / 22_050), tmp_path / "me.wav")
    back, rate = sf.read(str(path), dtype="float32")
    assert sf.info(str(path)).subtype == "PCM_16" and rate == 22_050
    assert np.abs(back[:1001] - x[:1001]).max() <= 1 / 32768 + 1e-7  # one 16-bit step
    assert back[-2] > 0.99 and back[-1] == -1.0  # clipped at full scale, not wrapped around
    assert [p.name for p in tmp_path.iterdir()] == ["me.wav"]
    with pytest.raises(OutputError, match=r"^cannot write .*nowhere"):
        save_clip(Clip(pcm=x, sample_rate=22_050, ended_by="stop", recorded_seconds=0.0), tmp_path / "nowhere" / "me.wav")


class FakeMicrophones(FakeSoundDevice):
    """FakeSoundDevice whose default device answers for kind="input" too."""

    def query_devices(self, device=None, kind=None):
        return super().query_devices(device, "output" if kind == "input" else kind)


def test_find_input_device_by_default_index_and_name():
    devices = [
        {"index": 0, "name": "Built-in Microphone", "hostapi": 0, "max_input_channels": 2, "max_output_channels": 0,
         "default_samplerate": 48000.0},
        {"index": 1, "name": "Speakers", "hostapi": 0, "max_input_channels": 0, "max_output_channels": 2,
         "default_samplerate": 48000.0},
        {"index": 2, "name": "USB Microphone", "hostapi": 0, "max_input_channels": 1, "max_output_channels": 0,
         "default_samplerate": 44100.0},
    ]
    sd = FakeMicrophones(devices=devices, default=0)
    assert find_input_device(None, sd)["name"] == "Built-in Microphone"
    assert find_input_device("usb", sd)["index"] == 2 and find_input_device(2, sd)["samplerate"] == 44100.0
    listing = r"\(input devices: 0: Built-in Microphone, 2: USB Microphone\)"
    with pytest.raises(UsageError, match=rf"^audio device 1 is not an input device here {listing}$"):
        find_input_device("1", sd)
    with pytest.raises(UsageError, match=r"ambiguous \(0: Built-in Microphone, 2: USB Microphone\): give its index$"):
        find_input_device("microphone", sd)
    with pytest.raises(AudioDeviceError, match="no default sound input device"):
        find_input_device(None, FakeMicrophones(devices=devices, default=1))


def test_a_recording_is_the_one_audio_clip_type():
    """media.AudioClip is every audio input's type: a file's, a recording's (with how its turn ended)."""
    from omni_cli.audio.microphone import _Turn
    from omni_cli.media import AudioClip

    assert Clip is AudioClip
    turn = _Turn(RecordOptions(vad=False), 16_000, None)
    turn.arrived.extend([np.full(800, 0.25, np.float32), np.full(800, -0.25, np.float32)])
    turn.judge(2)
    clip = turn.clip("stop", trim=False)
    assert type(clip) is AudioClip and clip.source == "microphone" and clip.ended_by == "stop"
    assert clip.recorded_seconds == pytest.approx(0.1) and clip.seconds == pytest.approx(0.1)
    resampled = clip.at(24_000)  # for an encoder: the recording's facts go along
    assert (resampled.sample_rate, resampled.source, resampled.ended_by) == (24_000, "microphone", "stop")
    file_clip = AudioClip(np.zeros(10, np.float32), 8000)
    assert (file_clip.source, file_clip.ended_by, file_clip.recorded_seconds) == ("audio", None, None)


def test_the_clip_and_the_microphone_import_no_numpy():
    code = ("import sys, omni_cli.media, omni_cli.audio.microphone; "
            "print(','.join(m for m in ('numpy', 'torch', 'soundfile') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "", done.stderr + done.stdout


def test_silent_microphone_carries_its_clip():
    clip = Clip(pcm=np.zeros(10, np.float32), sample_rate=16_000, ended_by="stop", recorded_seconds=10 / 16_000)
    exc = SilentMicrophone("the microphone gave silence: no speech was heard in 0.0 s", clip)
    assert exc.clip is clip and exc.exit_code == 1
