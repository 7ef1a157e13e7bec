"""Real playback through PortAudio into an ALSA file device, sample by sample (no sound card needed).

Each test runs the program in a subprocess whose ALSA configuration (ALSA_CONFIG_PATH, read by
PortAudio when sounddevice is imported) makes the default device write what it plays to a file, paced
at the real-time rate by a reader process (tests/audio_device.py). So the device pulls audio at 24 kHz
like a sound card.

The tests judge what a person hears, not a sample count that depends on the machine's load: once the
silence before, after and inside the sound is set apart (`audio_device.heard`), every sample of the
reply must have played, once, in order — bit for bit against the reply's float32 samples (Python API),
within one 16-bit step against the WAV written beside it (omni-say --play -o, omni-chat /save). A busy
machine may still make the speaker run dry: each silent gap inside the sound must then be an underrun
the speaker counted and reported (--verbose), with its length. Ctrl-C must silence the device and stop
generation within 200 ms. omni-say's playback and Ctrl-C in omni-chat run for both model families.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import soundfile as sf

from audio_device import alsa_file_device, assert_no_zeros, assert_underruns_reported, have_portaudio, heard, read_played
from conftest import REPO_ROOT, cli_env

QWEN3 = REPO_ROOT / "assets" / "tiny-qwen3-omni"

pytestmark = pytest.mark.skipif(not have_portaudio(), reason="PortAudio is not installed (apt-get install libportaudio2)")

ONE_STEP = 1 / 32768 + 1e-7  # a 16-bit WAV sample against the float it came from


def device_env(tmp_path, paced=True, **extra):
    env, raw = alsa_file_device(tmp_path / "alsa", paced=paced)
    return cli_env(**env, **extra), raw


def reported_playback(stderr: str) -> dict:
    """The speaker's figures from the --verbose block: {"underruns": N, "underrun_seconds": S}."""
    line = next(l for l in stderr.splitlines() if l.startswith("underruns "))
    count, ms = re.fullmatch(r"underruns\s+(\d+) \((\d+) ms of silence\)", line.strip()).groups()
    return {"underruns": int(count), "underrun_seconds": int(ms) / 1000}


def assert_gaps_reported(sound, stderr: str) -> None:
    """The silent gaps in the sound are the underruns --verbose reported, to the millisecond."""
    said = reported_playback(stderr)
    assert sound.gaps == said["underruns"], (sound.gap_lengths, said)
    assert abs(sound.gap_samples / 24 - said["underrun_seconds"] * 1000) <= 0.5 + 1e-6, (sound.gap_lengths, said)


def wait_for_growth(raw, nbytes, timeout=120.0):
    deadline = time.monotonic() + timeout
    while raw.stat().st_size < nbytes:
        assert time.monotonic() < deadline, "no sound reached the device"
        time.sleep(0.01)


def test_api_plays_every_sample_of_the_reply_in_order(tmp_path):
    env, raw = device_env(tmp_path)
    script = (
        "import json, sys, numpy as np, omni_cli\n"
        "from omni_cli.audio.speaker import SpeakerSink\n"
        "a = omni_cli.load()\n"
        "sink = SpeakerSink()\n"
        "reply = a.say('Hello there', seed=0, sink=sink)\n"
        f"np.save(r'{tmp_path / 'reply.npy'}', reply.audio)\n"
        "print(json.dumps({**sink.stats, 'device': sink.device['name'], 'closed': sink.closed}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout.splitlines()[-1])
    audio = np.load(tmp_path / "reply.npy")
    assert audio.size == 150 * 480  # the demo limit: 150 codes, 3 s
    assert_no_zeros(audio)
    sound = heard(read_played(raw))
    np.testing.assert_array_equal(sound.samples, audio)
    assert stats["device"] == "default" and stats["closed"]
    assert_underruns_reported(sound, stats)
    assert stats["played_seconds"] == audio.size / 24_000
    assert stats["start_reason"] in ("buffer filled", "production rate", "block gaps", "reply ended"), stats


# Both families: the default model (Qwen2.5-Omni, its demo limit of 150 codes: 3 s) and the tiny
# Qwen3-Omni (12 frames of 1920 samples, less the 555 its code2wav holds back at the end).
MODELS = {"qwen2.5": ([], 72_000), "qwen3": (["-m", str(QWEN3), "--max-codes", "12"], 12 * 1920 - 555)}


@pytest.mark.parametrize("family", list(MODELS))
def test_omni_say_plays_what_it_writes(tmp_path, run_cli, family):
    env, raw = device_env(tmp_path)
    out = tmp_path / "reply.wav"
    model_args, samples = MODELS[family]
    result = run_cli("Hello there", "--play", "-o", out, "--seed", "0", "--verbose", *model_args, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    err = result.stderr
    assert f"wrote {out} ({samples / 24_000:.1f} s audio)" in err
    assert "playback waited" in err, err
    wav, rate = sf.read(out, dtype="float32")
    sound = heard(read_played(raw))
    assert rate == 24_000 and sound.samples.size == wav.size == samples
    assert np.abs(sound.samples - wav).max() <= ONE_STEP
    assert_gaps_reported(sound, err)


def test_omni_say_plays_by_default_takes_stdin_and_picks_a_device_by_name(tmp_path, run_cli):
    # No -o: it plays, on the device named (the default one is picked by omni-say's other runs here).
    env, raw = device_env(tmp_path)
    result = run_cli("--seed", "0", "--max-codes", "50", "--audio-device", "default", input="Hi\n", env=env,
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert np.count_nonzero(read_played(raw)) > 20_000  # about 1 s of speech
    assert os.listdir(tmp_path) == ["alsa"]


def test_omni_say_list_and_pick_devices(tmp_path, run_cli):
    # (A reply played on the device picked by name is the test above's.)
    env, raw = device_env(tmp_path)
    result = run_cli("--list-audio-devices", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split()[:2] == ["0", "default"] and "(default)" in result.stdout
    result = run_cli("hi", "--audio-device", "5", env=env)
    assert (result.returncode, result.stderr) == (2, "error: audio device 5 is not an output device here (see --list-audio-devices)\n")


def test_omni_chat_turn_plays_what_it_saves(tmp_path, run_chat):
    env, raw = device_env(tmp_path, OMNI_NOHISTORY="1")
    result = run_chat("--seed", "0", "--max-codes", "100", "--verbose", input="Hello there\n/save talk\n", env=env,
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1  # the reply's text and nothing else
    wav, _ = sf.read(tmp_path / "talk.wav", dtype="float32")
    sound = heard(read_played(raw))
    assert sound.samples.size == wav.size == 100 * 480
    assert np.abs(sound.samples - wav).max() <= ONE_STEP
    assert_gaps_reported(sound, result.stderr)
    assert json.loads((tmp_path / "talk.json").read_text())["turns"][0]["content"] == "Hello there"


def _popen(module, args, env, tmp_path, stdin=subprocess.PIPE):
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, cwd=tmp_path, stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_ctrl_c_silences_omni_say_within_200_ms(tmp_path):
    env, raw = device_env(tmp_path)
    out = tmp_path / "story.wav"
    proc = _popen("omni_cli.faces.say", ["Tell me a long story", "--seed", "1", "--max-codes", "1500",
                                   "--max-text-tokens", "300", "--verbose", "--play", "-o", str(out)], env, tmp_path,
                  stdin=subprocess.DEVNULL)
    try:
        wait_for_growth(raw, 24_000 * 4)  # a second of sound (with the silence before it)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    err = stderr.decode()
    assert proc.returncode == 130, err
    last = err.splitlines()[-1]
    assert last.startswith("interrupted: silent after "), err
    silent_ms = int(last.split("silent after ")[1].split()[0])
    stopped_ms = int(last.split("generation stopped after ")[1].split()[0])
    assert silent_ms < 200 and stopped_ms < 200, last
    assert "Traceback" not in err and not out.exists() and os.listdir(tmp_path) == ["alsa"]
    size = raw.stat().st_size
    time.sleep(0.3)
    assert raw.stat().st_size == size  # nothing more reached the device
    assert size < 24_000 * 4 * 5  # and far less than the 30 s reply


# A 30 s reply of each family: 1500 Qwen2.5-Omni codes, 375 Qwen3-Omni frames.
LONG_REPLY = {"qwen2.5": ["--max-codes", "1500"], "qwen3": ["-m", str(QWEN3), "--max-codes", "375"]}


@pytest.mark.parametrize("family", list(LONG_REPLY))
def test_ctrl_c_in_omni_chat_then_the_next_turn(tmp_path, family):
    env, raw = device_env(tmp_path, OMNI_NOHISTORY="1")
    proc = _popen("omni_cli.faces.chat.main", ["--seed", "1", *LONG_REPLY[family], "--max-text-tokens", "300", "--verbose"],
                  env, tmp_path)
    try:
        proc.stdin.write(b"Tell me a long story\n")
        proc.stdin.flush()
        wait_for_growth(raw, 24_000 * 4)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        size = raw.stat().st_size
        time.sleep(0.3)
        assert raw.stat().st_size == size  # silent
        stdout, stderr = proc.communicate(b"/mute\nNext one\n/stats\n/save talk\n", timeout=120)
    finally:
        proc.kill()
    err = stderr.decode()
    assert proc.returncode == 0, err
    line = next(l for l in err.splitlines() if l.startswith("interrupted"))
    silent_ms = int(line.split("silent after ")[1].split()[0])
    back_ms = int(line.split("back at the prompt after ")[1].split()[0])
    assert silent_ms < 200 and back_ms < 200, line
    # The session goes on: the next turn is answered; the interrupted one is not part of the conversation.
    assert "session: 1 reply," in err
    turns = json.loads((tmp_path / "talk.json").read_text())["turns"]
    assert [t["content"] for t in turns[:1]] == ["Next one"] and len(turns) == 2
    # The partial reply's text (its line ended), then the next reply's. (The tiny Qwen3-Omni's random text
    # has newlines of its own, so the lines are not counted.)
    out = stdout.decode()
    assert out.endswith("\n" + turns[1]["content"] + "\n") and out[: -len(turns[1]["content"]) - 2].strip(), out
