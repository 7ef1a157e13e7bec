"""omni-say (and omni-chat's flags): --help, --version and --list-voices are instant (no torch);
every bad input, click's own usage errors included, is one `error:` line with the right exit code and no
file left behind, the cheap checks (format, voice, flag values) before the model loads; stdin, -f FILE
and stdout piping (`echo hi | omni-say -o -`), a reader that goes away (`| head`) ends quietly with
141; audio files by extension or --format; the flags reach the assistant as one ReplyOptions (a fake
assistant, fast); the library's log records become `note:`/`warning:` lines; --verbose reports
underruns; real runs with the tiny model write whole files; SIGTERM and SIGHUP at each stage of a
run end it with 128+N and leave no file or a whole one, never a temp file.

Playback through a real PortAudio device is in test_playback.py."""

from __future__ import annotations

import io
import logging
import os
import shlex
import signal
import subprocess
import wave
import sys
import time

import numpy as np
import pytest
import soundfile as sf

from audio_device import FakeSoundDevice, no_alsa_device
from fakes import FakeAssistant
from conftest import REPO_ROOT, cli_env, invoke, invoke_chat

HEAVY = ("torch", "transformers", "numpy", "soundfile", "huggingface_hub", "sounddevice")


# -- startup ------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_help_is_instant_and_exits_0(run_cli):
    start = time.perf_counter()
    result = run_cli("--help", timeout=60)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    for word in ("omni-say", "--output", "--voice", "--play", "--text-only", "--list-voices", "--list-audio-devices",
                 "--audio-device", "--verbose", "--quiet", "--debug", "--file", "--format", "--temperature", "--top-p",
                 "--top-k", "--version", "thinker"):
        assert word in result.stdout
    assert result.stderr == ""
    assert elapsed < 5, f"--help took {elapsed:.1f} s"


@pytest.mark.e2e
def test_importing_the_cli_imports_no_torch():
    code = (
        "import sys, omni_cli, omni_cli.faces.say, omni_cli.config, omni_cli.errors, omni_cli.audio.sinks, omni_cli.audio.speaker, "
        "omni_cli.loader, "
        "omni_cli.faces.console, omni_cli.faces.chat.main\n"
        f"print(','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


@pytest.mark.e2e
def test_help_imports_no_torch():
    code = (
        "import sys, runpy\n"
        "sys.argv = ['omni-say', '--help']\n"
        "try:\n"
        "    runpy.run_module('omni_cli.faces.say', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('HEAVY:' + ','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "HEAVY:"


@pytest.mark.e2e
def test_chat_help_is_instant(run_chat):
    start = time.perf_counter()
    result = run_chat("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for word in ("omni-chat", "--model", "--voice", "--mute", "--system", "--history-file", "--no-history", "--load",
                 "--temperature", "--top-p", "--top-k", "--version"):
        assert word in result.stdout
    assert time.perf_counter() - start < 5


# -- bad inputs: one error line, exit code, nothing left behind ---------------------------------


def assert_one_error_line(result, code: int, stdout: str = "") -> str:
    """One `error:` line on stderr, exit `code`, `stdout` on stdout: a subprocess's CompletedProcess or
    CliRunner's Result."""
    returncode = result.returncode if hasattr(result, "returncode") else result.exit_code
    assert returncode == code, (returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    assert result.stdout == stdout
    return lines[0]


def _folder(path):
    path.mkdir()
    return path


def _llama(path):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path


def _copy_of_tiny(tiny, path, **replace: bytes):
    """The tiny checkpoint with some files replaced (symlinks for the rest)."""
    path.mkdir()
    for f in tiny.iterdir():
        if f.name in replace:
            (path / f.name).write_bytes(replace[f.name])
        else:
            (path / f.name).symlink_to(f)
    return path


def bad_input_cases():
    # (id, extra args builder, expected exit code, words in the message): each refused before the weights
    # are read (by the face, or by the loader's first checks; no server is asked, started or stopped), so
    # run in this process with the real loader. Weights that cannot be read are found by the load itself:
    # test_corrupt_weights_through_the_program.
    return [
        ("missing-model-folder", lambda d, tiny: ["-m", d / "nope"], 2, ["does not exist", "nope"]),
        ("folder-without-config", lambda d, tiny: ["-m", _folder(d / "empty")], 1, ["no config.json"]),
        ("not-omni", lambda d, tiny: ["-m", _llama(d / "llama")], 1, ["llama", "not Qwen2.5-Omni", "Qwen3-Omni"]),
        ("corrupt-config", lambda d, tiny: ["-m", _copy_of_tiny(tiny, d / "c", **{"config.json": b"{not json"})], 1,
         ["config.json cannot be read"]),
        ("hub-id-offline", lambda d, tiny: ["-m", "nobody/no-such-omni"], 1, ["nobody/no-such-omni", "hf download"]),
        ("unknown-voice", lambda d, tiny: ["-m", tiny, "-v", "Bob"], 2, ["Bob", "Chelsie", "Ethan"]),
        ("bad-device", lambda d, tiny: ["-m", tiny, "--device", "tpu"], 2, ["tpu"]),
        ("bad-dtype", lambda d, tiny: ["-m", tiny, "--dtype", "int4"], 2, ["int4"]),
    ]


@pytest.mark.parametrize("case", bad_input_cases(), ids=lambda c: c[0])
def test_bad_input(tmp_path, tiny_model_dir, monkeypatch, case):
    _, build, code, words = case
    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "reply.wav"
    result = invoke("hello", "-o", out, *build(tmp_path, tiny_model_dir))
    line = assert_one_error_line(result, code)
    for word in words:
        assert word in line
    assert os.listdir(out_dir) == []


@pytest.mark.e2e
def test_corrupt_weights_through_the_program(run_cli, tmp_path, tiny_model_dir):
    """The load itself fails: one line through the real program (the library's own logging included), no file."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    model = _copy_of_tiny(tiny_model_dir, tmp_path / "w", **{"model.safetensors": b"\0garbage" * 64})
    result = run_cli("hello", "-o", out_dir / "reply.wav", "-m", model, cwd=tmp_path)
    assert "cannot load the weights" in assert_one_error_line(result, 1)
    assert os.listdir(out_dir) == []


def test_empty_prompt(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("   ", "-o", tmp_path / "reply.wav")
    assert assert_one_error_line(result, 2) == 'error: empty prompt: say something, e.g. omni-say "Hello"'
    assert os.listdir(tmp_path) == []


def test_no_prompt_at_all(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("-o", tmp_path / "x.wav")  # stdin empty, as /dev/null
    line = assert_one_error_line(result, 2)
    assert line.startswith("error: no prompt") and "echo Hello | omni-say" in line
    assert os.listdir(tmp_path) == []


def test_empty_stdin_and_no_argument(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("-o", tmp_path / "x.wav", input=b"  \n\n")
    assert assert_one_error_line(result, 2).startswith("error: empty prompt")
    assert os.listdir(tmp_path) == []


def test_stdin_that_is_not_utf8(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("-o", tmp_path / "x.wav", input="caf\u00e9 au lait".encode("latin-1"))
    line = assert_one_error_line(result, 2)
    assert "not UTF-8" in line and "0xe9" in line and "offset 3" in line and "iconv" in line
    assert os.listdir(tmp_path) == []


@pytest.mark.e2e
def test_closed_stdin_is_no_stdin(tmp_path):
    # `<&-`: file descriptor 0 closed (sys.stdin is None): the argument alone is the prompt.
    cmd = f'exec "{sys.executable}" -m omni_cli.faces.say -o "{tmp_path / "x.wav"}" "   " <&-'
    result = subprocess.run(["sh", "-c", cmd], env=cli_env(), capture_output=True, text=True, timeout=60,
                            cwd=str(tmp_path.parent))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: empty prompt")
    cmd = f'exec "{sys.executable}" -m omni_cli.faces.say -o "{tmp_path / "x.wav"}" <&-'
    result = subprocess.run(["sh", "-c", cmd], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: no prompt"), result.stderr


@pytest.mark.e2e
def test_prompt_longer_than_the_context(run_cli, tmp_path):
    # Under the characters' cap (16 a token of the 4072 left), so it is tokenized: 10,000 tokens.
    # (A prompt over that cap is refused before tokenizing: tests/test_limits.py.)
    result = run_cli("-o", tmp_path / "x.wav", "--seed", "0", input="hello " * 10000, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("note: ")  # the demo model notice
    assert lines[-1].startswith("error: prompt is ") and "the context holds" in lines[-1] and "shorten it" in lines[-1]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert os.listdir(tmp_path) == []


def test_unwritable_output_before_loading(fake, tmp_path, monkeypatch):
    # An invalid model too: the output is checked first, so this fails on the output alone and fast.
    # A hub id passes the check of the model's name (a path that does not exist would not): the output's is first.
    monkeypatch.chdir(tmp_path)
    result = invoke("hello", "-o", "/nonexistent/dir/x.wav", "-m", "nobody/no-such-model")
    line = assert_one_error_line(result, 1)
    assert "/nonexistent/dir/x.wav" in line
    assert not os.path.exists("/nonexistent")
    assert fake.load_args is None


def test_output_is_a_folder(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("hello", "-o", tmp_path)
    assert result.exit_code == 2
    assert "Traceback" not in result.stderr
    assert fake.load_args is None


def test_text_only_with_an_output_is_a_usage_error(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for extra in (["-o", tmp_path / "x.wav"], ["--play"]):
        result = invoke("hello", "--text-only", *extra)
        assert "--text-only makes no speech" in assert_one_error_line(result, 2)
    assert os.listdir(tmp_path) == []


def test_omni_model_env_is_the_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the real loader: it reads OMNI_MODEL
    monkeypatch.setenv("OMNI_MODEL", str(tmp_path / "gone"))
    result = invoke("hello", "-o", tmp_path / "x.wav")
    assert "gone does not exist" in assert_one_error_line(result, 1)


def test_default_model_says_it_is_a_demo(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("--list-voices")
    assert (result.exit_code, result.stdout) == (0, "Chelsie\nEthan\n")
    (notice,) = result.stderr.splitlines()
    assert notice.startswith("note: ") and "random" in notice and "OMNI_MODEL" in notice
    assert fake.load_args is None


def _importtime_run(*args, cwd=None, input=None):
    """omni-say under `python -X importtime`: (CompletedProcess, the modules it imported, its other stderr)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "omni_cli.faces.say", *map(str, args)], env=cli_env(),
                            cwd=cwd, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL if input is None else None, input=input)
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    rest = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    return result, imported, rest


# Both families: the default model (Qwen2.5-Omni, voices in spk_dict.pt) and the tiny Qwen3-Omni
# (voices in config.json): (arguments, its voices).
VOICES = {"qwen2.5": ([], ["Chelsie", "Ethan"]),
          "qwen3": (["-m", REPO_ROOT / "assets" / "tiny-qwen3-omni"], ["Aiden", "Chelsie", "Ethan"])}


@pytest.mark.parametrize("family", list(VOICES))
@pytest.mark.e2e
def test_unknown_voice_is_refused_before_the_model_loads(tmp_path, family):
    # The voices are read without torch; the demo notice is left to the load that never happens.
    model_args, voices = VOICES[family]
    start = time.perf_counter()
    result, imported, rest = _importtime_run("hello", "-o", tmp_path / "x.wav", "-v", "Nobody", *model_args,
                                             cwd=tmp_path)
    elapsed = time.perf_counter() - start
    assert result.returncode == 2, rest
    assert rest == [f"error: unknown voice 'Nobody': this model's voices are {', '.join(voices)}"]
    assert "torch" not in imported and "transformers" not in imported
    assert os.listdir(tmp_path) == []
    assert elapsed < 10, f"{elapsed:.1f} s"


@pytest.mark.parametrize("family", list(VOICES))
@pytest.mark.e2e
def test_list_voices_imports_no_torch(tmp_path, family):
    model_args, voices = VOICES[family]
    result, imported, rest = _importtime_run("--list-voices", "-q", *model_args, cwd=tmp_path)
    assert (result.returncode, result.stdout, rest) == (0, "".join(f"{v}\n" for v in voices), [])
    if family == "qwen2.5":
        assert "zipfile" in imported  # it did read spk_dict.pt ...
    assert not imported & {"torch", "transformers", "numpy"}  # ... without torch


@pytest.mark.parametrize("module, name", [("omni_cli.faces.say", "omni-say"), ("omni_cli.faces.chat.main", "omni-chat")])
@pytest.mark.e2e
def test_version_is_instant(module, name):
    import omni_cli

    code = (
        "import sys, runpy\n"
        f"sys.argv = [{name!r}, '--version']\n"
        "try:\n"
        f"    runpy.run_module({module!r}, run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    print('EXIT', exc.code)\n"
        f"print('HEAVY:' + ','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == [f"{name} {omni_cli.__version__}", "EXIT 0", "HEAVY:"], result.stderr
    assert result.stderr == ""


# -- no sound: errors that say what to do -------------------------------------------------------


@pytest.mark.e2e
def test_no_portaudio(run_cli, tmp_path, no_portaudio):
    # An invalid model too: the sound device is checked before the model loads.
    result = run_cli("hello", "-m", "nobody/no-such-model", env=no_portaudio, cwd=tmp_path)
    line = assert_one_error_line(result, 1)
    assert "PortAudio library is missing" in line and "apt-get install libportaudio2" in line and "-o FILE" in line
    assert os.listdir(tmp_path) == []


@pytest.mark.e2e
def test_no_audio_device(run_cli, tmp_path):
    result = run_cli("hello", "-m", "nobody/no-such-model", env=cli_env(**no_alsa_device(tmp_path / "alsa")), cwd=tmp_path)
    line = assert_one_error_line(result, 1)
    assert "no sound output device" in line and "-o FILE" in line
    assert os.listdir(tmp_path) == ["alsa"]


@pytest.mark.e2e
def test_list_audio_devices_without_any(run_cli, tmp_path):
    result = run_cli("--list-audio-devices", env=cli_env(**no_alsa_device(tmp_path)))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "no audio output devices\n")


@pytest.mark.e2e
def test_list_audio_devices_without_portaudio(run_cli, no_portaudio):
    result = run_cli("--list-audio-devices", env=no_portaudio)
    assert "apt-get install libportaudio2" in assert_one_error_line(result, 1)


# -- the CLI's own logic, against a fake assistant and a fake sound device (fast, no model) -----


def test_flags_reach_the_assistant(fake, tmp_path, tiny_model_dir):
    out = tmp_path / "r.wav"
    # A real folder: its voices (spk_dict.pt) are checked before the (fake) load.
    result = invoke("Hello", "-o", out, "-v", "ethan", "-m", tiny_model_dir, "--device", "cpu", "--dtype",
                    "float32", "--seed", "7", "--greedy", "--max-text-tokens", "9", "--max-codes", "11",
                    "--temperature", "0.7", "--top-p", "0.8", "--top-k", "20")
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hi there.\n"
    assert result.stderr == f"wrote {out} (0.5 s audio)\n"
    assert fake.load_args == (str(tiny_model_dir), "cpu", "float32")
    assert fake.assistant.calls == [dict(prompt="Hello", voice="Ethan", greedy=True, seed=7, max_text_tokens=9,
                                         max_codes=11, text_only=False, temperature=0.7, top_p=0.8, top_k=20)]
    data, rate = sf.read(out, dtype="float32")
    assert rate == 24_000 and data.shape == (12_000,)
    assert fake.sd.streams == []  # -o alone does not play


def test_no_graphs_reaches_the_runtime_options(fake, tmp_path):
    result = invoke("Hello", "-o", tmp_path / "r.wav", "--device", "cuda", "--no-graphs")
    assert result.exit_code == 0, result.output
    assert fake.runtime is not None and fake.runtime.graphs is False and fake.runtime.device == "cuda"
    assert invoke("Hello", "-o", tmp_path / "s.wav").exit_code == 0
    from omni_cli.config import RuntimeOptions

    assert fake.runtime == RuntimeOptions()  # the defaults: graphs on, nothing compiled


def test_defaults_play_through_the_speakers(fake, tmp_path):
    result = invoke("Hello")
    assert result.exit_code == 0, result.output
    assert (result.stdout, result.stderr) == ("Hi there.\n", "")
    assert fake.load_args == (None, "auto", "auto")
    assert fake.assistant.calls[0] == dict(prompt="Hello", voice="Chelsie", greedy=False, seed=None,
                                           max_text_tokens=None, max_codes=None, text_only=False,
                                           temperature=None, top_p=None, top_k=None)
    (stream,) = fake.sd.streams
    assert stream.closed
    played = stream.audio
    expected = np.full(12_000, 0.25, dtype=np.float32)
    expected[::7] = -0.5
    start = np.flatnonzero(played)[0]
    np.testing.assert_array_equal(played[start:start + 12_000], expected)
    assert not played[start + 12_000:].any()


def test_play_and_write_a_file(fake, tmp_path):
    out = tmp_path / "r.wav"
    result = invoke("Hello", "-o", out, "--play")
    assert result.exit_code == 0, result.output
    assert sf.info(out).frames == 12_000
    assert len(fake.sd.streams) == 1 and np.count_nonzero(fake.sd.streams[0].audio) == 12_000


def test_stdin_then_the_argument(fake, tmp_path):
    result = invoke("What does it say?", "-o", tmp_path / "r.wav", input="Some text\nover two lines\n")
    assert result.exit_code == 0, result.output
    assert fake.assistant.calls[0]["prompt"] == "Some text\nover two lines\nWhat does it say?"
    result = invoke("-o", tmp_path / "r.wav", input="Only stdin\n")
    assert fake.assistant.calls[1]["prompt"] == "Only stdin"


def test_text_only(fake, tmp_path):
    fake.sd = None  # no sound device is touched
    result = invoke("Hello", "--text-only")
    assert result.exit_code == 0, result.output
    assert (result.stdout, result.stderr) == ("Hi there.\n", "")
    assert fake.assistant.calls[0]["text_only"] is True


def test_list_voices_reads_the_voices_without_loading_the_model(fake):
    result = invoke("--list-voices")  # the built-in tiny model's spk_dict.pt
    assert (result.exit_code, result.stdout) == (0, "Chelsie\nEthan\n")
    assert fake.load_args is None  # the weights were never loaded


def test_list_voices_of_a_missing_model_is_one_error_line(fake, tmp_path):
    result = invoke("--list-voices", "-m", tmp_path / "nowhere")
    assert result.exit_code != 0 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"error: model folder {tmp_path / 'nowhere'} does not exist (pass a "
                                                  "model folder or a hub id such as Qwen/Qwen2.5-Omni-7B)"]
    assert result.exit_code == 2


def test_list_audio_devices(fake):
    result = invoke("--list-audio-devices")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:3] == [
        "  0  Fake Speakers  [Fake API, 2 ch, 48000 Hz]  (default)",
        "  2  USB Headset  [Fake API, 2 ch, 48000 Hz]",
        "inputs:",  # then what /listen can record from
    ]
    assert [line.split("[")[0].strip() for line in lines[3:]] == ["1  Fake Microphone", "2  USB Headset"]
    assert fake.load_args is None  # no model needed


@pytest.mark.parametrize("spec, index", [("2", 2), ("usb", 2), ("Fake Speakers", 0), ("speak", 0)])
def test_audio_device_by_index_or_name(fake, spec, index):
    from omni_cli.audio.speaker import SpeakerSink

    seen = []
    real_open = SpeakerSink.open

    def spy(self, rate=24_000):
        seen.append(self.device["index"])
        return real_open(self, rate)

    SpeakerSink.open = spy
    try:
        result = invoke("Hello", "--audio-device", spec)
    finally:
        SpeakerSink.open = real_open
    assert result.exit_code == 0, result.output
    assert set(seen) == {index}


@pytest.mark.parametrize("spec, words", [("7", ["audio device 7 is not an output device", "--list-audio-devices"]),
                                         ("1", ["audio device 1 is not an output device"]),
                                         ("Bluetooth", ["no audio output device is called 'Bluetooth'"]),
                                         ("e", ["audio device 'e' is ambiguous", "0: Fake Speakers", "2: USB Headset"])])
def test_bad_audio_device(fake, spec, words):
    result = invoke("Hello", "--audio-device", spec)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    for word in words:
        assert word in result.stderr
    assert fake.load_args is None  # checked before the model loads


def test_no_default_device(fake):
    fake.sd.default = None
    result = invoke("Hello")
    assert result.exit_code == 1
    assert "no default sound output device" in result.stderr and "--audio-device" in result.stderr


def test_device_that_fails_to_start(fake, tmp_path):
    fake.sd.fail_start = True
    out = tmp_path / "r.wav"
    result = invoke("Hello", "--play", "-o", out)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: cannot play on audio device 'Fake Speakers': Error starting stream")
    assert os.listdir(tmp_path) == []


def test_verbose_timing_block(fake):
    result = invoke("Hello", "--verbose")
    assert result.exit_code == 0, result.output
    err = result.stderr
    for label in ("time to first text", "time to first audio", "time to first sound", "real-time factor", "underruns"):
        assert label in err
    assert "underruns            0 (0 ms of silence)" in err


def test_verbose_counts_underruns_of_a_slow_producer(fake):
    # 1.5 s of audio in 5 blocks of 0.3 s, one every 0.6 s, into a device paced at real time. The first
    # block fills the start-up buffer before any rate can be measured, so playback starts at once and
    # then runs dry before each of the four later blocks: the gaps a listener hears are reported.
    fake.sd = FakeSoundDevice(speed=1.0)
    fake.assistant = FakeAssistant(seconds=1.5, blocks=5, block_delay=0.6)
    result = invoke("Hello", "--verbose")
    assert result.exit_code == 0, result.output
    line = next(l for l in result.stderr.splitlines() if l.startswith("underruns"))
    count = int(line.split()[1])
    assert count >= 3, result.stderr
    silence_ms = int(line.split("(")[1].split()[0])
    assert 600 <= silence_ms <= 2500, line
    waited = next(l for l in result.stderr.splitlines() if l.startswith("playback waited"))
    assert "buffer filled" in waited, waited


def test_verbose_says_playback_waited_for_a_producer_slower_than_real_time(fake):
    # 1 s of audio in 10 blocks of 0.1 s, one every 0.25 s (real-time factor 2.5): the adaptive start
    # waits for the whole reply instead of breaking it up, and --verbose says so.
    fake.sd = FakeSoundDevice(speed=1.0)
    fake.assistant = FakeAssistant(seconds=1.0, blocks=10, block_delay=0.25)
    result = invoke("Hello", "--verbose")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert next(l for l in lines if l.startswith("underruns")).split()[1] == "0", result.stderr
    waited = next(l for l in lines if l.startswith("playback waited"))
    assert "reply ended" in waited, waited


def test_quiet(fake, tmp_path):
    result = invoke("Hello", "-q", "-o", tmp_path / "r.wav")
    assert result.exit_code == 0
    assert (result.stdout, result.stderr) == ("Hi there.\n", "")


def test_wav_to_stdout_in_process(fake):
    result = invoke("Hello", "-o", "-")
    assert result.exit_code == 0, result.output
    data = result.stdout_bytes
    assert data[:4] == b"RIFF" and len(data) == 44 + 2 * 12_000
    audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 24_000 and audio.shape == (12_000,)
    assert result.stderr == "Hi there.\nwrote 0.5 s of WAV audio to stdout\n"
    assert fake.sd.streams == []


@pytest.mark.parametrize("flag", ["--max-codes", "--max-text-tokens"])
def test_caps_must_be_positive(fake, tmp_path, flag):
    result = invoke("Hello", "-o", tmp_path / "r.wav", flag, "0")
    assert result.exit_code == 2
    assert fake.load_args is None


def test_keyboard_interrupt_exits_130_and_leaves_no_file(fake, tmp_path):
    fake.assistant = FakeAssistant(fail=KeyboardInterrupt())
    result = invoke("Hello", "-o", tmp_path / "r.wav", "--play")
    assert result.exit_code == 130
    assert result.stderr.endswith("interrupted\n")
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []
    assert not fake.sd.streams[0].active


def test_internal_error_is_one_line(fake, tmp_path):
    fake.assistant = FakeAssistant(fail=RuntimeError("boom\nsecond line"))
    result = invoke("Hello", "-o", tmp_path / "r.wav")
    assert result.exit_code == 1
    assert result.stderr == "error: internal error: RuntimeError: boom second line (run with --debug for the traceback)\n"
    assert result.stdout == "Hi \n"  # the text so far, ended
    assert os.listdir(tmp_path) == []


def test_debug_shows_the_traceback(fake, tmp_path):
    fake.assistant = FakeAssistant(fail=RuntimeError("boom"))
    result = invoke("Hello", "-o", tmp_path / "r.wav", "--debug")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1] == "error: internal error: RuntimeError: boom"


def test_out_of_memory(fake, tmp_path):
    import torch

    fake.assistant = FakeAssistant(fail=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    result = invoke("Hello", "-o", tmp_path / "r.wav")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: out of device memory while answering: try")
    assert result.stderr.count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_omni_error_from_the_engine(fake, tmp_path):
    from omni_cli.errors import OutputError

    fake.assistant = FakeAssistant(fail=OutputError("disk full"))
    result = invoke("Hello", "-o", tmp_path / "r.wav")
    assert result.exit_code == 1
    assert result.stderr == "error: disk full\n"
    assert os.listdir(tmp_path) == []


def test_load_failure_leaves_no_file(monkeypatch, tmp_path):
    import omni_cli
    from omni_cli.errors import ModelError

    def load(*args, **kwargs):
        raise ModelError("no such model")

    monkeypatch.setattr(omni_cli, "load", load)
    result = invoke("Hello", "-o", tmp_path / "r.wav")
    assert (result.exit_code, result.stderr) == (1, "error: no such model\n")
    assert os.listdir(tmp_path) == []


# -- real runs with the built-in tiny model (need the engine) -----------------------------------


@pytest.mark.e2e
def test_real_run_writes_a_whole_wav_and_the_same_seed_gives_the_same_reply(run_cli, tmp_path, tiny_model_dir,
                                                                           no_portaudio):
    """One command run three times, each in a process of its own: -o a.wav; -o b.wav without PortAudio,
    which writing a file does not need; and -o - redirected to c.wav (stdout can seek, so the header gets
    the real sizes). Each writes a whole WAV and nothing else, and the same seed gives the same reply,
    text and samples. (The -o - run was a test of its own, with a fourth run to compare with.)"""
    reply = ["Tell me a story", "-m", tiny_model_dir, "--seed", "3", "--max-text-tokens", "8", "--max-codes", "60",
             "-v", "Ethan"]
    runs = []
    for name, env in (("a.wav", None), ("b.wav", no_portaudio)):
        out = tmp_path / name
        result = run_cli(*reply[:1], "-o", out, *reply[1:], env=env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
        assert result.stdout.endswith("\n")
        last = result.stderr.splitlines()[-1]
        assert last.startswith(f"wrote {out} (") and last.endswith(" s audio)")
        info = sf.info(out)
        assert (info.format, info.samplerate, info.channels) == ("WAV", 24_000, 1)
        assert 0 < info.frames <= 60 * 480  # 50 codes = 1 s = 24000 samples
        data, _ = sf.read(out, dtype="float32")
        assert np.isfinite(data).all() and np.abs(data).max() > 0
        assert sorted(os.listdir(tmp_path)) == [r[0] for r in runs] + [name]  # no temp file left
        runs.append((name, result.stdout, data))
    (_, text_a, audio_a), (_, text_b, audio_b) = runs
    assert text_a == text_b
    np.testing.assert_array_equal(audio_a, audio_b)

    # omni-say -o - ... > c.wav
    quoted = " ".join(shlex.quote(str(a)) for a in reply)
    result = _run_shell(f"{OMNI_SAY} -o - {quoted} > c.wav", tmp_path)
    assert result.returncode == 0, result.stderr
    data = (tmp_path / "c.wav").read_bytes()
    with wave.open(str(tmp_path / "c.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24_000, 1, 2)
        frames = w.getnframes()
    assert 0 < frames <= 60 * 480 and len(data) == 44 + 2 * frames  # nothing but the WAV
    err = result.stderr.decode()
    assert err.splitlines()[-1] == f"wrote {frames / 24000:.1f} s of WAV audio to stdout"
    # The same samples as -o FILE with the same seed.
    np.testing.assert_array_equal(sf.read(tmp_path / "c.wav", dtype="int16")[0], sf.read(tmp_path / "a.wav", dtype="int16")[0])
    # The reply's text went to stderr, not into the WAV.
    assert text_a.strip() and text_a.strip() in err
    assert sorted(os.listdir(tmp_path)) == ["a.wav", "b.wav", "c.wav"]


@pytest.mark.e2e
def test_real_run_list_voices_and_text_only(run_cli, tmp_path, no_portaudio):
    result = run_cli("--list-voices", "-q")
    assert (result.returncode, result.stdout, result.stderr) == (0, "Chelsie\nEthan\n", "")
    result = run_cli("Hello", "--text-only", "--max-text-tokens", "5", "--seed", "0", env=no_portaudio, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and result.stdout.endswith("\n")
    assert os.listdir(tmp_path) == []


def _run_shell(cmd: str, tmp_path, timeout=300):
    return subprocess.run(["bash", "-c", "set -o pipefail; " + cmd], env=cli_env(), cwd=tmp_path, capture_output=True,
                          timeout=timeout)


OMNI_SAY = f'"{sys.executable}" -m omni_cli.faces.say'


@pytest.mark.e2e
def test_wav_on_stdout_through_a_pipe(tmp_path):
    # echo hi | omni-say -o - --greedy | python -c "read WAV from stdin": the prompt from a pipe, the default
    # model, greedy; a streaming header, then the samples. (The piped prompt to -o FILE was a run of its own.)
    reader = ("import sys, io, soundfile as sf; data = sys.stdin.buffer.read(); "
              "a, r = sf.read(io.BytesIO(data), dtype='float32'); "
              "print(data[:4].decode(), data[4:8].hex(), data[40:44].hex(), len(data), r, a.shape[0], float(abs(a).max()))")
    result = _run_shell(f'echo hi | {OMNI_SAY} -o - --greedy --max-text-tokens 4 --max-codes 24 | "{sys.executable}" -c "{reader}"',
                        tmp_path)
    assert result.returncode == 0, result.stderr
    riff, riff_size, data_size, length, rate, frames, peak = result.stdout.decode().split()
    assert (riff, riff_size, data_size, rate) == ("RIFF", "ffffffff", "ffffffff", "24000")
    assert int(length) == 44 + 2 * int(frames) and int(frames) > 0 and float(peak) > 0
    lines = result.stderr.decode().splitlines()
    assert lines[0].startswith("note: ") and lines[-1] == f"wrote {int(frames) / 24000:.1f} s of WAV audio to stdout"
    assert sum(line.startswith("note: ") for line in lines) == 1  # the voice check before loading says nothing
    assert os.listdir(tmp_path) == []


@pytest.mark.e2e
def test_wav_on_stdout_to_a_closed_pipe(tmp_path):
    # omni-say -o - x | head -c 100: as `yes | head` does, it ends quietly with 141 (128 + SIGPIPE).
    # -q: the reply's text (on stderr with -o -) and the notes off, so stderr must hold nothing of ours.
    result = _run_shell(f'{OMNI_SAY} -q -o - "hi" --seed 0 --max-codes 200 | head -c 100 > got.wav; '
                        'echo "status ${PIPESTATUS[0]}" >&2', tmp_path)
    assert result.stderr.decode().splitlines() == ["status 141"]  # no error line, no traceback
    assert (tmp_path / "got.wav").read_bytes()[:4] == b"RIFF" and (tmp_path / "got.wav").stat().st_size == 100


@pytest.mark.e2e
def test_text_to_a_closed_pipe_ends_quietly_and_leaves_no_file(tmp_path):
    # omni-say long-prompt -o s.wav | head -c 5: the reader goes away while the reply's text streams. The
    # reader here closes its end right after 5 bytes (where head exits), so the rest of the reply hits a
    # closed pipe for certain; the speech file is dropped as for any interrupted reply. Seeded: unseeded,
    # the random model once ended its reply after 3 bytes ("(0\n"), before the reader had its 5 (with
    # seed 1 the reply is ~760 bytes).
    proc = subprocess.Popen([sys.executable, "-m", "omni_cli.faces.say", "Tell me a long story", "-o", tmp_path / "s.wav",
                             "--max-text-tokens", "200", "--max-codes", "2000", "--seed", "1"],
                            env=cli_env(), cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert len(proc.stdout.read(5)) == 5
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(120) == 141, err
    finally:
        proc.kill()
        proc.wait()
    assert [line for line in err.splitlines() if not line.startswith("note: ")] == []
    assert os.listdir(tmp_path) == []


@pytest.mark.e2e
def test_list_voices_into_a_closed_pipe(run_cli, tmp_path):
    result = _run_shell(f'{OMNI_SAY} --list-voices -q | head -c 1; echo " status ${{PIPESTATUS[0]}}" >&2', tmp_path)
    assert result.stdout == b"C"
    assert result.stderr.decode().strip() in ("status 141", "status 0")  # 0 when both names fit before head left
    assert "error" not in result.stderr.decode()


# -- usage errors: one line, exit 2, before the model loads, for omni-say and omni-chat ----------


USAGE_ERRORS = [
    (["--max-codes", "-5"], "error: --max-codes must be at least 1 (got -5) "),
    (["--max-codes", "0"], "error: --max-codes must be at least 1 (got 0) "),
    (["--seed", "abc"], "error: invalid value for '--seed': "),
    (["--temperature", "warm"], "error: invalid value for '--temperature': "),
    (["--bogus"], "error: no such option: --bogus"),
    (["--voice"], "error: option '--voice' requires an argument"),
    (["--top-p", "1.5"], "error: top_p must be above 0 and at most 1 (got 1.5)"),
    (["--top-k", "-1"], "error: top_k must be 0 (off) or more (got -1)"),
    (["--temperature", "-0.5"], "error: temperature must be between 0 and 100 (got -0.5)"),
]


@pytest.mark.parametrize("args, start", USAGE_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
@pytest.mark.parametrize("command", ["omni-say", "omni-chat"])
def test_usage_errors_are_one_line(fake, command, args, start):
    result = invoke("Hello", *args) if command == "omni-say" else invoke_chat(*args, input="hi\n")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(start), line
    if not start.startswith(("error: top_", "error: temperature must")):  # click's own: point at --help
        assert line.endswith(f"(see {command} --help)"), line
    assert fake.load_args is None  # refused before any loading


@pytest.mark.e2e
def test_usage_errors_of_the_real_programs(run_cli, run_chat, tmp_path):
    """The same through `python -m` (the entry points' path), with an extra argument as well."""
    result = run_cli("hi", "there", "-o", tmp_path / "x.wav", cwd=tmp_path)
    assert assert_one_error_line(result, 2) == "error: got unexpected extra argument(s) (there) (see omni-say --help)"
    result = run_chat("--max-context", "ten", cwd=tmp_path)
    assert assert_one_error_line(result, 2).startswith("error: invalid value for '--max-context': ")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, words", [
    (["-o", "x.txt"], ["cannot write x.txt: unknown audio file extension '.txt'", ".wav", ".flac", ".opus"]),
    (["-o", "x.wav", "--format", "aiff"], ["cannot write audio format 'aiff': supported formats are wav, flac"]),
    (["--format", "flac"], ["--format is the format of -o FILE"]),
    (["-o", "-", "--format", "flac"], ["-o - streams WAV only"]),
])
def test_bad_format_is_a_usage_error_before_loading(fake, tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    result = invoke("Hello", *args)
    assert result.exit_code == 2
    assert result.stdout == "" and result.stderr.count("\n") == 1
    for word in words:
        assert word in result.stderr
    assert fake.load_args is None
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, name, major", [(["-o", "r.flac"], "r.flac", "FLAC"), (["-o", "r.ogg"], "r.ogg", "OGG"),
                                               (["-o", "r.opus"], "r.opus", "OGG"), (["-o", "r.mp3"], "r.mp3", "MP3"),
                                               (["-o", "r.audio", "--format", "FLAC"], "r.audio", "FLAC"),
                                               (["-o", "r.wav", "--format", "opus"], "r.wav", "OGG")])
def test_output_formats(fake, tmp_path, args, name, major):
    from omni_cli.audio.sinks import FILE_FORMATS, writable_formats

    wanted = (args[3] if "--format" in args else name.rsplit(".", 1)[1]).lower()
    if wanted in FILE_FORMATS and wanted not in writable_formats():
        pytest.skip(f"this libsndfile cannot write {wanted}")
    result = invoke("Hello", *[str(tmp_path / a) if a == name else a for a in args])
    assert result.exit_code == 0, result.output
    assert result.stderr == f"wrote {tmp_path / name} (0.5 s audio)\n"
    info = sf.info(tmp_path / name)
    assert (info.format, info.samplerate, info.channels) == (major, 24_000, 1)
    assert len(sf.read(tmp_path / name)[0]) == 12_000  # the whole reply, to the sample
    assert os.listdir(tmp_path) == [name]


# -- the prompt from a file ---------------------------------------------------------------------


def test_prompt_from_a_file_then_the_argument(fake, tmp_path):
    (tmp_path / "notes.txt").write_text("\ufeffFirst line\nsecond line\n", encoding="utf-8")
    result = invoke("-f", tmp_path / "notes.txt", "Summarize this.", "-o", tmp_path / "r.wav", input="ignored stdin\n")
    assert result.exit_code == 0, result.output
    assert fake.assistant.calls[-1]["prompt"] == "First line\nsecond line\nSummarize this."
    result = invoke("--file", "-", "-o", tmp_path / "r.wav", input="From stdin\n")
    assert result.exit_code == 0, result.output
    assert fake.assistant.calls[-1]["prompt"] == "From stdin"


@pytest.mark.parametrize("content, words", [(None, ["cannot read the prompt file", "no such file"]),
                                            (b"caf\xe9", ["the prompt file", "is not UTF-8 text (byte 0xe9 at offset 3)",
                                                          "iconv"]),
                                            (b" \n", ["empty prompt: the prompt file", "holds no text"]),
                                            ("folder", ["the prompt file", "is a folder, not a file"])])
def test_bad_prompt_file(fake, tmp_path, content, words):
    path = tmp_path / "prompt.txt"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    result = invoke("-f", path, "-o", tmp_path / "r.wav")
    assert result.exit_code == 2
    assert result.stdout == "" and result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    for word in words:
        assert word in result.stderr
    assert fake.load_args is None
    assert "r.wav" not in os.listdir(tmp_path)


# -- the library logs, the faces print ----------------------------------------------------------


def test_library_notes_and_warnings_become_lines_on_stderr(fake, tmp_path, monkeypatch):
    import omni_cli

    def load(*args, **kwargs):
        fake.load_args = args
        logging.getLogger("omni_cli.loader").info("no model given, using the demo")
        logging.getLogger("omni_cli.loader").warning("tiny lacks 3 weights\n(first: x): they are random")
        return fake.assistant

    monkeypatch.setattr(omni_cli, "load", load)
    result = invoke("Hello", "-o", tmp_path / "r.wav")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == ["note: no model given, using the demo",
                                          "warning: tiny lacks 3 weights (first: x): they are random",
                                          f"wrote {tmp_path / 'r.wav'} (0.5 s audio)"]
    result = invoke("Hello", "-q", "-o", tmp_path / "r.wav")  # --quiet: notes off, warnings stay
    assert result.stderr.splitlines() == ["warning: tiny lacks 3 weights (first: x): they are random"]


@pytest.mark.unit
def test_the_loader_does_not_print(tiny_model_dir, capsys, caplog):
    from omni_cli.loader import model_voices

    with caplog.at_level(logging.INFO, logger="omni_cli"):
        assert model_voices() == ["Chelsie", "Ethan"]
        assert model_voices(notice=False) == ["Chelsie", "Ethan"]
    assert capsys.readouterr() == ("", "")
    notes = [r for r in caplog.records if r.name == "omni_cli.loader"]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO and "demo model" in notes[0].getMessage()


@pytest.mark.unit
def test_list_voices_refuses_code_in_spk_dict(tmp_path, tiny_model_dir):
    """spk_dict.pt is read without torch by a restricted unpickler: a file that asks for anything but
    containers and tensors is handed to torch's own weights-only loader, which refuses it too; nothing
    in it runs."""
    import pickle
    import zipfile

    from omni_cli.errors import ModelError
    from omni_cli.loader import model_voices

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    folder = _copy_of_tiny(tiny_model_dir, tmp_path / "m")
    (folder / "spk_dict.pt").unlink()
    with zipfile.ZipFile(folder / "spk_dict.pt", "w") as z:
        z.writestr("spk_dict/data.pkl", pickle.dumps({"Chelsie": Evil()}))
    with pytest.raises(ModelError, match="cannot read spk_dict.pt"):
        model_voices(folder)
    assert not (tmp_path / "pwned").exists()


# -- omni-chat's new flags ----------------------------------------------------------------------


def test_chat_flags_become_one_reply_options_and_load_resumes(fake, monkeypatch, tmp_path):
    from omni_cli.faces.chat.loop import ChatRepl

    seen = []
    monkeypatch.setattr(ChatRepl, "load_transcript", lambda self, path: seen.append(("load", str(path))))
    real_run = ChatRepl.run
    monkeypatch.setattr(ChatRepl, "run", lambda self, read: seen.append(("run", self.options)) or real_run(self, read))
    result = invoke_chat("--mute", "--load", tmp_path / "saved", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "5",
                         "--seed", "3", "--max-codes", "40", "-v", "ethan", input="Hello\n")
    assert result.exit_code == 0, result.output
    assert seen[0] == ("load", str(tmp_path / "saved"))  # before the conversation runs
    options = seen[1][1]
    assert (options.temperature, options.top_p, options.top_k, options.seed, options.max_codes, options.voice) == (
        0.5, 0.9, 5, 3, 40, "Ethan")
    call = fake.assistant.calls[0]
    assert (call["prompt"], call["temperature"], call["top_p"], call["top_k"]) == ("Hello", 0.5, 0.9, 5)


def test_chat_load_of_a_missing_transcript_is_one_line(fake, tmp_path):
    result = invoke_chat("--mute", "--load", tmp_path / "nothing", input="Hello\n")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: cannot load ")
    assert fake.assistant.calls == []


# -- signals: SIGTERM (kill) and SIGHUP (terminal closed) at each stage of omni-say -o FILE ------

# Runs omni-say with AudioFileSink's close slowed down between finishing the file and renaming it (atomic),
# and a marker on stderr when it gets there, so a signal can be sent right inside the final close.
SLOW_CLOSE = r"""
import sys, time
from omni_cli import atomic
real_commit = atomic.Replacement.commit
def slow_commit(self):
    print("closing", file=sys.stderr, flush=True)  # the file is finished, not yet renamed into place
    time.sleep(1.5)
    real_commit(self)
atomic.Replacement.commit = slow_commit
sys.argv = ["omni-say", *sys.argv[1:]]
from omni_cli.faces.say import main as say_main
say_main()
"""


def _wait_for(stream, marker: bytes, limit: float = 120) -> bytes:
    """Read `stream` line by line (or, for an empty marker, one byte) until `marker` shows up."""
    seen = b""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        chunk = stream.read(1) if not marker else stream.readline()
        if not chunk:
            raise AssertionError(f"ended before {marker!r}: {seen!r}")
        seen += chunk
        if not marker or marker in chunk:
            return seen
    raise AssertionError(f"no {marker!r} within {limit} s")


def _signal_after(proc, ready, signum) -> str:
    """Wait for `ready()` (a marker from the program), send `signum`, wait for the program to end (60 s
    at most; it is killed if anything fails); its stderr."""
    try:
        ready()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return err.decode()


@pytest.mark.parametrize("stage, signum", [("loading", signal.SIGTERM), ("loading", signal.SIGHUP),
                                           ("generating", signal.SIGTERM), ("generating", signal.SIGHUP),
                                           ("closing", signal.SIGTERM)])
@pytest.mark.e2e
def test_signal_leaves_no_file_or_a_whole_one(tmp_path, stage, signum):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "reply.wav"
    # No -m: the default model, whose notice is logged when the load starts (after torch is imported).
    args = ["Tell me a long story", "-o", out, "--seed", "0", "--max-text-tokens", "40"]
    if stage == "closing":
        cmd = [sys.executable, "-c", SLOW_CLOSE, *map(str, args), "--max-codes", "30"]
    else:
        cmd = [sys.executable, "-m", "omni_cli.faces.say", *map(str, args), "--max-codes", "3000"]
    proc = subprocess.Popen(cmd, env=cli_env(), cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    stream, marker = {"loading": (proc.stderr, b"note: no model given"),
                      "generating": (proc.stdout, b""),  # the reply's first text: generation is under way
                      "closing": (proc.stderr, b"closing")}[stage]
    err = _signal_after(proc, lambda: _wait_for(stream, marker), signum)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err and "error" not in err
    assert err.splitlines()[-1] == f"terminated (signal {signum})"
    left = os.listdir(out_dir)
    if stage == "closing" and left:  # the file was finished before the signal: it stays, whole
        assert left == ["reply.wav"]
        assert 0 < sf.info(out).frames == len(sf.read(out)[0])
    else:
        assert left == []  # nothing, and above all no .part


@pytest.mark.e2e
def test_omni_chat_killed_in_a_long_reply_exits_143(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "omni_cli.faces.chat.main", "--mute", "--max-text-tokens", "3000"],
                            env=cli_env(), cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)

    def ready():
        proc.stdin.write(b"Tell me a very long story\n")
        proc.stdin.flush()  # stdin stays open: the chat would wait for the next line, not end
        _wait_for(proc.stdout, b"")

    err = _signal_after(proc, ready, signal.SIGTERM)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "error" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.unit
def test_omni_say_wraps_streamed_words_at_the_terminal_width(monkeypatch):
    """On a terminal, omni-say's text wraps between words as it streams (pieces split inside words);
    a pipe or a file gets the text unchanged."""
    import io

    from omni_cli.faces import console

    text = "the quick brown fox jumps over the lazy dog and keeps on running far away"
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # token-like pieces that cut words
    monkeypatch.setattr(console, "terminal_width", lambda stream: 20)
    out = console.TextOut(io.StringIO())
    for piece in pieces:
        out.write(piece)
    out.end()
    lines = out.stream.getvalue().split("\n")
    assert lines[-1] == "" and all(len(line) <= 20 for line in lines)
    assert " ".join(lines).split() == text.split()  # every word whole, in order
    assert len(lines) > 3

    monkeypatch.setattr(console, "terminal_width", lambda stream: None)
    plain = console.TextOut(io.StringIO())
    for piece in pieces:
        plain.write(piece)
    plain.end()
    assert plain.stream.getvalue() == text + "\n"


@pytest.mark.e2e
def test_process_start_is_read_from_proc():
    """`--verbose` counts from the process's start: a process that slept 0.5 s before asking is at least
    that old (and not much older: /proc's clock ticks are 10 ms)."""
    code = ("import time; time.sleep(0.5); from omni_cli.faces.program import process_started_at; "
            "t = process_started_at(); print('none' if t is None else time.perf_counter() - t)")
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc here")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert 0.5 <= float(out) < 5.0
