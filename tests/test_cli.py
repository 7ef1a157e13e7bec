"""omni-say: --help is instant, every bad input is one `error:` line with the right exit code and no
file left behind, and a real run with the tiny model writes a whole WAV and prints the text."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
from typer.testing import CliRunner

from conftest import cli_env

HEAVY = ("torch", "transformers", "numpy", "soundfile", "huggingface_hub", "sounddevice")


# -- startup ------------------------------------------------------------------------------------


def test_help_is_instant_and_exits_0(run_cli):
    start = time.perf_counter()
    result = run_cli("--help", timeout=60)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert "omni-say" in result.stdout and "--output" in result.stdout and "--voice" in result.stdout
    assert result.stderr == ""
    assert elapsed < 5, f"--help took {elapsed:.1f} s"


def test_importing_the_cli_imports_no_torch():
    code = (
        "import sys, omni_cli, omni_cli.cli, omni_cli.config, omni_cli.errors, omni_cli.sinks, omni_cli.loader\n"
        f"print(','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_help_imports_no_torch():
    code = (
        "import sys, runpy\n"
        "sys.argv = ['omni-say', '--help']\n"
        "try:\n"
        "    runpy.run_module('omni_cli.cli', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('HEAVY:' + ','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "HEAVY:"


def test_missing_output_is_a_usage_error(run_cli, tmp_path):
    result = run_cli("hello", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert "--output" in result.stderr
    assert result.stdout == ""
    assert os.listdir(tmp_path) == []


# -- bad inputs: one error line, exit code, nothing left behind ---------------------------------


def assert_one_error_line(result, code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def bad_input_cases():
    # (id, extra args builder, expected exit code, words in the message)
    return [
        ("missing-model-folder", lambda d, tiny: ["-m", d / "nope"], 1, ["does not exist", "nope"]),
        ("folder-without-config", lambda d, tiny: ["-m", _folder(d / "empty")], 1, ["no config.json"]),
        ("not-omni", lambda d, tiny: ["-m", _llama(d / "llama")], 1, ["llama", "not Qwen2.5-Omni"]),
        ("hub-id-offline", lambda d, tiny: ["-m", "nobody/no-such-omni"], 1, ["nobody/no-such-omni", "hf download"]),
        ("unknown-voice", lambda d, tiny: ["-m", tiny, "-v", "Bob"], 2, ["Bob", "Chelsie", "Ethan"]),
        ("bad-device", lambda d, tiny: ["-m", tiny, "--device", "tpu"], 2, ["tpu"]),
        ("bad-dtype", lambda d, tiny: ["-m", tiny, "--dtype", "int4"], 2, ["int4"]),
    ]


def _folder(path):
    path.mkdir()
    return path


def _llama(path):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path


@pytest.mark.parametrize("case", bad_input_cases(), ids=lambda c: c[0])
def test_bad_input(run_cli, tmp_path, tiny_model_dir, case):
    _, build, code, words = case
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "reply.wav"
    result = run_cli("hello", "-o", out, *build(tmp_path, tiny_model_dir), cwd=tmp_path)
    line = assert_one_error_line(result, code)
    for word in words:
        assert word in line
    assert os.listdir(out_dir) == []


def test_empty_prompt(run_cli, tmp_path):
    out = tmp_path / "reply.wav"
    result = run_cli("   ", "-o", out, cwd=tmp_path)
    assert assert_one_error_line(result, 2) == "error: empty prompt"
    assert os.listdir(tmp_path) == []


def test_unwritable_output_before_loading(run_cli, tmp_path):
    # An invalid model too: the output is checked first, so this fails on the output alone and fast.
    result = run_cli("hello", "-o", "/nonexistent/dir/x.wav", "-m", tmp_path / "nope", cwd=tmp_path)
    line = assert_one_error_line(result, 1)
    assert "/nonexistent/dir/x.wav" in line
    assert not os.path.exists("/nonexistent")


def test_output_is_a_folder(run_cli, tmp_path):
    result = run_cli("hello", "-o", tmp_path, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_stdout_output_not_yet(run_cli, tmp_path):
    result = run_cli("hello", "-o", "-", cwd=tmp_path)
    assert "not available yet" in assert_one_error_line(result, 2)


def test_omni_model_env_is_the_default(run_cli, tmp_path):
    result = run_cli("hello", "-o", tmp_path / "x.wav", env=cli_env(OMNI_MODEL=str(tmp_path / "gone")), cwd=tmp_path)
    assert "gone does not exist" in assert_one_error_line(result, 1)


def test_default_model_says_it_is_a_demo(run_cli, tmp_path, tiny_model_dir):
    result = run_cli("hello", "-o", tmp_path / "x.wav", "-v", "Nobody", cwd=tmp_path)
    assert result.returncode == 2
    notice, error = result.stderr.splitlines()
    assert notice.startswith("note: ") and "random" in notice and "OMNI_MODEL" in notice
    assert error.startswith("error: unknown voice 'Nobody'")
    assert os.listdir(tmp_path) == []


# -- the CLI's own logic, against a fake assistant (fast, no model) -----------------------------


class FakeAssistant:
    voices = ["Chelsie", "Ethan"]
    is_demo = False
    sample_rate = 24_000

    def __init__(self, fail: BaseException | None = None, seconds: float = 0.5):
        self.fail = fail
        self.seconds = seconds
        self.calls = []

    def say(self, prompt, voice="Chelsie", greedy=False, seed=None, max_text_tokens=None, max_codes=None,
            sink=None, text_only=False):
        self.calls.append(dict(prompt=prompt, voice=voice, greedy=greedy, seed=seed,
                               max_text_tokens=max_text_tokens, max_codes=max_codes))
        audio = np.full(int(self.seconds * self.sample_rate), 0.25, dtype=np.float32)
        sink.start(self.sample_rate)
        sink.write(audio[: audio.size // 2])
        if self.fail is not None:
            sink.abort()
            raise self.fail
        sink.write(audio[audio.size // 2:])
        sink.close()
        return SimpleNamespace(text="Hi there.", text_ids=[], codes=[], audio=audio,
                               sample_rate=self.sample_rate, stats={})


@pytest.fixture
def fake(monkeypatch):
    import omni_cli

    state = SimpleNamespace(assistant=FakeAssistant(), load_args=None)

    def load(model=None, device="auto", dtype="auto", **kwargs):
        state.load_args = (model, device, dtype)
        return state.assistant

    monkeypatch.setattr(omni_cli, "load", load)
    return state


def invoke(*args):
    from omni_cli.cli import say_app

    return CliRunner().invoke(say_app, [str(a) for a in args], prog_name="omni-say")


def test_flags_reach_the_assistant(fake, tmp_path):
    out = tmp_path / "r.wav"
    result = invoke("Hello", "-o", out, "-v", "ethan", "-m", "some/model", "--device", "cpu", "--dtype",
                    "float32", "--seed", "7", "--greedy", "--max-text-tokens", "9", "--max-codes", "11")
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hi there.\n"
    assert result.stderr == f"wrote {out} (0.5 s audio)\n"
    assert fake.load_args == ("some/model", "cpu", "float32")
    assert fake.assistant.calls == [dict(prompt="Hello", voice="Ethan", greedy=True, seed=7,
                                         max_text_tokens=9, max_codes=11)]
    data, rate = sf.read(out, dtype="float32")
    assert rate == 24_000 and data.shape == (12_000,)


def test_defaults(fake, tmp_path):
    result = invoke("Hello", "-o", tmp_path / "r.wav")
    assert result.exit_code == 0, result.output
    assert fake.load_args == (None, "auto", "auto")
    assert fake.assistant.calls[0] == dict(prompt="Hello", voice="Chelsie", greedy=False, seed=None,
                                           max_text_tokens=None, max_codes=None)


@pytest.mark.parametrize("flag", ["--max-codes", "--max-text-tokens"])
def test_caps_must_be_positive(fake, tmp_path, flag):
    result = invoke("Hello", "-o", tmp_path / "r.wav", flag, "0")
    assert result.exit_code == 2
    assert fake.load_args is None


def test_keyboard_interrupt_exits_130_and_leaves_no_file(fake, tmp_path):
    fake.assistant = FakeAssistant(fail=KeyboardInterrupt())
    result = invoke("Hello", "-o", tmp_path / "r.wav")
    assert result.exit_code == 130
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []


def test_internal_error_is_one_line(fake, tmp_path):
    fake.assistant = FakeAssistant(fail=RuntimeError("boom\nsecond line"))
    result = invoke("Hello", "-o", tmp_path / "r.wav")
    assert result.exit_code == 1
    assert result.stderr == "error: internal error: RuntimeError: boom second line (run with --debug for the traceback)\n"
    assert result.stdout == ""
    assert os.listdir(tmp_path) == []


def test_debug_shows_the_traceback(fake, tmp_path):
    fake.assistant = FakeAssistant(fail=RuntimeError("boom"))
    result = invoke("Hello", "-o", tmp_path / "r.wav", "--debug")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1] == "error: internal error: RuntimeError: boom"


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


def test_real_run_writes_a_whole_wav(run_cli, tmp_path, tiny_model_dir):
    out = tmp_path / "hello.wav"
    result = run_cli("Hello there", "-o", out, "-m", tiny_model_dir, "--seed", "0",
                     "--max-text-tokens", "8", "--max-codes", "60", cwd=tmp_path)
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
    assert os.listdir(tmp_path) == ["hello.wav"]


def test_real_run_same_seed_same_reply(run_cli, tmp_path, tiny_model_dir):
    runs = []
    for name in ("a.wav", "b.wav"):
        result = run_cli("Tell me a story", "-o", tmp_path / name, "-m", tiny_model_dir, "--seed", "3",
                         "--max-text-tokens", "6", "--max-codes", "30", "-v", "Ethan", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        runs.append((result.stdout, sf.read(tmp_path / name, dtype="float32")[0]))
    (text_a, audio_a), (text_b, audio_b) = runs
    assert text_a == text_b
    np.testing.assert_array_equal(audio_a, audio_b)


def test_real_run_default_model_and_greedy(run_cli, tmp_path, tiny_model_dir):
    out = tmp_path / "g.wav"
    result = run_cli("Hi", "-o", out, "--greedy", "--max-text-tokens", "4", "--max-codes", "24", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("note: ") and lines[-1].startswith(f"wrote {out}")
    assert sf.info(out).frames > 0
