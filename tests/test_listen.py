"""omni-chat's /listen through the real PortAudio path: an ALSA capture device that reads a WAV stands in
for the microphone (tests/audio_device.py), omni-chat records a spoken turn from it, voice-activity
detection ends the turn at the clip's end, and the recorded clip is what the engine hears: /save writes
it beside the transcript, and its samples equal the file's. A reply comes back. A silent microphone is
one error line, and the silent recording is kept in a file whose name is said.

The capture itself (levels, stop, Ctrl-C, devices) is test_microphone.py's; the model's side of audio
input (parity with transformers) is test_audio_input.py's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from audio_device import alsa_capture_device, have_portaudio
from conftest import REPO_ROOT, cli_env, invoke_chat
from test_microphone import RATE, SPEECH_END, speech_wav, write_wav

pytestmark = pytest.mark.skipif(not have_portaudio(), reason="PortAudio is not installed (apt-get install libportaudio2)")


def chat(env: dict, script: str, tmp_path) -> subprocess.CompletedProcess:
    """omni-chat (muted: no output device is needed) reading `script` as its input."""
    return subprocess.run([sys.executable, "-m", "omni_cli.faces.chat.main", "--mute", "--seed", "1", "--input-rate", str(RATE)],
                          input=script, text=True, capture_output=True, env=cli_env(**env, XDG_DATA_HOME=str(tmp_path / "data")),
                          cwd=REPO_ROOT, timeout=300)


def test_listen_hears_the_clip_and_answers(tmp_path, fake, monkeypatch):
    spoken = speech_wav(tmp_path)  # speech, a pause, speech, then a quiet tail (float32, as the device gives it)
    env, _ = alsa_capture_device(tmp_path / "alsa", tmp_path / "speech.wav")
    base = tmp_path / "session"
    r = chat(env, f"/listen\n/save {base}\n", tmp_path)
    assert r.returncode == 0, r.stderr
    heard = float(re.search(r"heard (\d+\.\d) s", r.stderr)[1])
    saved = json.loads(base.with_suffix(".json").read_text())
    assert saved["attachments"] == [{"turn": 0, "audio": ["session.listen-1.wav"]}]
    assert len(saved["turns"]) == 2 and saved["turns"][1]["content"]  # the reply came back
    clip, rate = soundfile.read(tmp_path / "session.listen-1.wav", dtype="float32")
    assert rate == RATE and abs(len(clip) / rate - heard) < 0.06
    # What the engine heard is the file, sample for sample (16-bit both ways: exact), up to where VAD cut.
    assert np.array_equal(clip, spoken[: len(clip)])
    # /load keeps what went with each message: a later /save still names the recording. (omni-chat's own
    # transcript handling: in this process, on the fake assistant; it was a second program run.)
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    r = invoke_chat("--mute", "--seed", "1", "--input-rate", str(RATE), input=f"/load {base}\n/save {tmp_path / 'again'}\n")
    assert r.exit_code == 0, r.stderr
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["attachments"] == [{"turn": 0, "audio": [str(tmp_path / "session.listen-1.wav")]}]
    # VAD ended the turn at the speech's end (2.3 s, then 3 s of quiet noise in the file): the clip keeps
    # the 0.3 s tail after the last speech the detector heard (it hears ~0.1 s past the voice).
    assert SPEECH_END + 0.2 <= heard <= SPEECH_END + 0.3 + 0.2, (heard, SPEECH_END)


def test_a_silent_microphone_is_one_line_and_the_recording_is_kept(tmp_path):
    write_wav(tmp_path / "quiet.wav", np.zeros(RATE * 2, np.float32), RATE)
    env, _ = alsa_capture_device(tmp_path / "alsa", tmp_path / "quiet.wav", pad_seconds=1.0)
    env = {**env}
    r = subprocess.run([sys.executable, "-m", "omni_cli.faces.chat.main", "--mute", "--input-rate", str(RATE)],
                       input="/listen\n", text=True, capture_output=True, timeout=300, cwd=REPO_ROOT,
                       env=cli_env(**env, XDG_DATA_HOME=str(tmp_path / "data")))
    lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "silence" in lines[0] and "kept in" in lines[0], r.stderr
    kept = re.search(r"kept in (\S+\.wav)", lines[0])[1]
    assert soundfile.info(kept).frames > 0 and "Traceback" not in r.stderr
