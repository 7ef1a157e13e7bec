"""omni-say and omni-chat with a Qwen3-Omni model: the built-in tiny random-weight Qwen3-Omni
(assets/tiny-qwen3-omni: real weights and code, not fakes) through the programs as a person runs them.

- omni-say -o FILE and -o - (a whole 24 kHz WAV; a streamed WAV and nothing else on stdout; the same
  samples both ways), --verbose naming the talker's steps frames;
- every bad input of the Qwen2.5-Omni list gives the same one-line error and exit code for this family
  (the voices aside), before the model loads;
- omni-chat piped: the default voice Ethan, /voice listing and switching (case-insensitively), a
  spoken turn through the sound device, /show, /save then /load and a turn that follows on.

Elsewhere, parametrised over both families: --list-voices and an unknown voice without torch
(test_cli.py); playback of omni-say -o FILE --play and Ctrl-C during an omni-chat reply
(test_playback.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import wave

import numpy as np
import pytest
import soundfile as sf

from audio_device import alsa_file_device, have_portaudio, read_played
from conftest import REPO_ROOT, TINY_MODEL, cli_env, invoke, invoke_chat

QWEN3 = REPO_ROOT / "assets" / "tiny-qwen3-omni"
SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 frames a second


def one_error_line(result, code: int) -> str:
    """One `error:` line and exit `code`: a subprocess's CompletedProcess or CliRunner's Result."""
    returncode = result.returncode if hasattr(result, "returncode") else result.exit_code
    assert returncode == code, (returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == b"" or result.stdout == ""
    return lines[0]


# -- bad inputs: the same one line and exit code as for Qwen2.5-Omni -----------------------------

# (id, program, arguments): each is refused before the model loads, for either family.
BAD_INPUTS = [
    ("unknown-voice", "omni-say", ["hi", "-v", "nobody", "-o", "x.wav"]),
    ("max-codes-0", "omni-say", ["hi", "--max-codes", "0", "-o", "x.wav"]),
    ("empty-prompt", "omni-say", ["   ", "-o", "x.wav"]),
    ("bad-extension", "omni-say", ["hi", "-o", "x.txt"]),
    ("unknown-device", "omni-say", ["hi", "--device", "tpu", "-o", "x.wav"]),
    ("chat-unknown-voice", "omni-chat", ["--mute", "-v", "nobody"]),
    ("chat-max-codes-0", "omni-chat", ["--mute", "--max-codes", "0"]),
]


@pytest.mark.cli
@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c[0])
def test_bad_inputs_give_the_same_error_for_both_families(tmp_path, monkeypatch, case):
    # In this process (CliRunner) with the real loader, whose first checks (the device) come before any weights.
    _, program, args = case
    lines = {}
    for name, model in (("qwen2.5", TINY_MODEL), ("qwen3", QWEN3)):
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.chdir(folder)
        run = invoke if program == "omni-say" else invoke_chat
        lines[name] = one_error_line(run("-m", str(model), *args), 2)  # stdin empty, as /dev/null
        assert os.listdir(folder) == []  # no file, not even a temp one
    voices = {"qwen2.5": "Chelsie, Ethan", "qwen3": "Aiden, Chelsie, Ethan"}
    if "unknown-voice" in case[0]:
        for name, line in lines.items():
            assert line == f"error: unknown voice 'nobody': this model's voices are {voices[name]}"
    else:
        assert lines["qwen3"] == lines["qwen2.5"]


# -- omni-say: a file, and WAV on stdout ---------------------------------------------------------


def _say(*args, cwd):
    return subprocess.run([sys.executable, "-m", "omni_cli.faces.say", "-m", str(QWEN3), *map(str, args)], env=cli_env(),
                          cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)


def test_say_writes_a_whole_wav_and_streams_the_same_one_to_stdout(tmp_path):
    reply = ["Hello", "--seed", "0", "--max-text-tokens", "6", "--max-codes", "10", "--verbose"]
    out = tmp_path / "hello.wav"
    result = _say(*reply, "-o", out, cwd=tmp_path)
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert result.stdout.strip() and result.stdout.endswith(b"\n") and "Traceback" not in err
    info = sf.info(out)
    assert (info.format, info.samplerate, info.channels) == ("WAV", 24_000, 1)
    data, _ = sf.read(out, dtype="float32")
    assert 0 < data.size == info.frames <= 10 * SAMPLES_PER_FRAME  # whole: the header says what it holds
    assert np.isfinite(data).all() and np.abs(data).max() > 0
    assert f"wrote {out} ({data.size / 24_000:.1f} s audio)" in err.splitlines()
    # --verbose counts this family's talker steps as frames, not codes.
    frames = int(re.search(r"^speech frames +(\d+) \(", err, re.M)[1])
    assert 0 < frames <= 10 and "speech codes" not in err, err
    assert data.size <= frames * SAMPLES_PER_FRAME
    assert os.listdir(tmp_path) == ["hello.wav"]

    # -o -: stdout is a pipe here, so the header is a streaming one; the text moves to stderr.
    streamed = _say(*reply, "-o", "-", cwd=tmp_path)
    err2 = streamed.stderr.decode()
    assert streamed.returncode == 0, err2
    wav = streamed.stdout
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt " and wav[36:40] == b"data"
    assert wav[4:8] == wav[40:44] == b"\xff\xff\xff\xff"
    assert int.from_bytes(wav[24:28], "little") == 24_000
    assert len(wav) == 44 + 2 * data.size  # nothing but the WAV on stdout
    np.testing.assert_array_equal(np.frombuffer(wav[44:], dtype="<i2"), sf.read(out, dtype="int16")[0])
    assert result.stdout.decode().strip() in err2  # the same reply's text, on stderr
    assert f"wrote {data.size / 24_000:.1f} s of WAV audio to stdout" in err2.splitlines()
    assert os.listdir(tmp_path) == ["hello.wav"]


# -- omni-chat, piped --------------------------------------------------------------------------


@pytest.mark.skipif(not have_portaudio(), reason="PortAudio is not installed (apt-get install libportaudio2)")
def test_chat_voice_turns_save_and_load(tmp_path):
    alsa, raw = alsa_file_device(tmp_path / "alsa", paced=False)
    work = tmp_path / "work"
    work.mkdir()
    script = "/voice\n/voice chelsie\nHello\n/save talk\n/load talk\n/show\nAnd then?\n/save again\n"
    result = subprocess.run([sys.executable, "-m", "omni_cli.faces.chat.main", "-m", str(QWEN3), "--seed", "0",
                             "--max-text-tokens", "5", "--max-codes", "10"], input=script.encode(), env=cli_env(**alsa,
                            OMNI_NOHISTORY="1"), cwd=work, capture_output=True, timeout=300)
    err = result.stderr.decode()
    assert result.returncode == 0, err
    lines = err.splitlines()
    assert "voice: Ethan (voices: Aiden, Chelsie, Ethan)" in lines  # the family's default voice
    assert "voice: Chelsie" in lines  # matched case-insensitively, spelled as the checkpoint does
    replies = result.stdout.decode().splitlines()
    assert len(replies) == 2 and all(r.strip() for r in replies), result.stdout

    # /save: the transcript names the voice that spoke and this family's (empty) system prompt; the
    # WAV holds the spoken reply, at 24 kHz, and the device played it.
    saved = json.loads((work / "talk.json").read_text())
    assert (saved["voice"], saved["system"], saved["model"], saved["audio"]) == ("Chelsie", "", "tiny-qwen3-omni",
                                                                                 "talk.wav")
    assert [t["content"] for t in saved["turns"]] == ["Hello", replies[0]]
    audio, rate = sf.read(work / "talk.wav", dtype="float32")
    assert rate == 24_000 and 0 < audio.size <= 10 * SAMPLES_PER_FRAME
    (segment,) = saved["audio_segments"]
    assert segment == {"turn": 1, "start": 0.0, "seconds": audio.size / 24_000}
    with wave.open(str(work / "talk.wav")) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getnframes()) == (1, 2, audio.size)
    assert np.count_nonzero(read_played(raw)) >= audio.size * 0.9

    # /load resumes it: the next reply follows on, and the next /save holds all of it.
    assert "loaded talk.json (1 exchange); it replaces this session's 1 exchange" in lines, err
    assert re.search(r"^  model +tiny-qwen3-omni \(Qwen3-Omni\) on cpu", err, re.M), err
    assert re.search(r"^  voice +Chelsie$", err, re.M) and re.search(r"^  system +\(none\)$", err, re.M), err
    assert re.search(r"^  max_codes +10 frames, 0\.8 s$", err, re.M), err
    again = json.loads((work / "again.json").read_text())
    assert [t["content"] for t in again["turns"]] == ["Hello", replies[0], "And then?", replies[1]]
    assert again["voice"] == "Chelsie" and [s["turn"] for s in again["audio_segments"]] == [3]
    assert sorted(os.listdir(work)) == ["again.json", "again.wav", "talk.json", "talk.wav"]
    assert "Traceback" not in err and "error" not in err
