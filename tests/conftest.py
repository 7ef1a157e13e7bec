"""Shared test fixtures: the built-in tiny model, fake checkpoint folders, and running omni-say.

No test reaches the network: HF_HUB_OFFLINE is set here, before huggingface_hub is first imported,
and for every CLI subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# A shell that starts a job in the background (`cmd &` without job control, nohup, some CI runners)
# starts it with SIGINT ignored, and an ignored signal is inherited: the program would then rightly
# leave Ctrl-C alone, and the tests that press it would see nothing. Take SIGINT back, for this
# process and (a handler resets to the default at exec) for every program the tests start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Likewise SIGHUP under nohup: the programs rightly keep an ignored SIGHUP ignored, and the tests that
# close the "terminal" on them would see nothing.
if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

# One intra-op thread for torch in the tests and the programs they start: every model here is tiny,
# too small to gain from a second thread, and an operation waits for all its threads, so with another
# process busy on one of two cores a second thread made the vocoder tests 6x slower (11 s -> 64 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# runtime/kernels.py's Triton kernels run on a CPU through Triton's interpreter (tests/test_kernels.py).
# Triton chooses it once, when it is first imported, and torch.compile imports it wherever it is
# installed: so it is chosen here, before any test runs, on a machine without a GPU (with one, the GPU
# tests run the kernels for real).
import torch  # noqa: E402 (after OMP_NUM_THREADS, which torch reads at import)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Before anything imports huggingface_hub (it reads this once, at import).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("OMNI_MODEL", None)
# The commands use an omni-serve that answers on 127.0.0.1:8484: one running on this machine must not
# answer the tests' commands. The server tests say --server (and clear this) themselves.
os.environ["OMNI_LOCAL"] = "1"
# Commands run by tests leave Python's bytecode setting alone (ui.cache_bytecode): nothing is written to the
# user's ~/.cache; tests/test_bytecode.py turns it on where it checks it.
os.environ["OMNI_NO_PYCACHE"] = "1"
for name in ("OMNI_SERVER", "OMNI_API_KEY"):
    os.environ.pop(name, None)

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO_ROOT / "assets" / "tiny-qwen2.5-omni"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The built-in tiny checkpoint (shipped in the repo under assets/)."""
    if not (TINY_MODEL / "config.json").is_file():
        pytest.fail(f"the built-in tiny model is missing at {TINY_MODEL} (scripts/make_tiny_model.py makes it)")
    return TINY_MODEL


def make_model_dir(
    folder: Path,
    model_type: str | None = "qwen2_5_omni",
    files: tuple[str, ...] = ("model.safetensors", "tokenizer.json", "spk_dict.pt"),
) -> Path:
    """A fake checkpoint folder: config.json with `model_type` (None: no config.json) and empty `files`.

    Good for everything the loader checks before it reads the weights.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if model_type is not None:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    for name in files:
        (folder / name).write_bytes(b"")
    return folder


@pytest.fixture
def fake_model(tmp_path):
    """Factory: `fake_model(name, model_type=..., files=...)` -> a fake checkpoint folder under tmp_path."""

    def make(name: str = "model", **kwargs) -> Path:
        return make_model_dir(tmp_path / name, **kwargs)

    return make


def cli_env(**extra: str) -> dict[str, str]:
    """A clean environment for omni-say: offline, no OMNI_MODEL, this checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMNI_MODEL", "PYTHONSTARTUP")}
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONIOENCODING"] = "utf-8"
    env.update(extra)
    return env


def run_omni_say(*args: str, env: dict[str, str] | None = None, timeout: float = 600, cwd=None,
                 input: bytes | str | None = None, module: str = "omni_cli.faces.say", text: bool = True):
    """Run `python -m omni_cli.faces.say ARGS` in a subprocess; a CompletedProcess with text stdout/stderr.

    `input` is piped to stdin (else stdin is /dev/null); `text=False` keeps stdout/stderr as bytes.
    """
    if isinstance(input, str):
        input = input.encode("utf-8")
    result = subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        env=cli_env() if env is None else env,
        cwd=cwd or REPO_ROOT,
        stdin=subprocess.DEVNULL if input is None else None,
        input=input,
        capture_output=True,
        timeout=timeout,
    )
    if text:
        result.stdout = result.stdout.decode("utf-8", errors="replace")
        result.stderr = result.stderr.decode("utf-8", errors="replace")
    return result


def run_omni_chat(*args: str, **kwargs):
    """omni-chat in a subprocess (stdin a pipe, so it reads one message or command a line)."""
    return run_omni_say(*args, module="omni_cli.faces.chat.main", **kwargs)


@pytest.fixture
def run_cli():
    """`run_cli(*args, env=None, timeout=600, input=None)`: omni-say in a subprocess (see `run_omni_say`)."""
    return run_omni_say


@pytest.fixture
def run_chat():
    """`run_chat(*args, env=None, timeout=600, input=None)`: omni-chat in a subprocess."""
    return run_omni_chat


@pytest.fixture
def no_portaudio(tmp_path_factory) -> dict[str, str]:
    """An environment where `import sounddevice` fails as it does without PortAudio."""
    fake = tmp_path_factory.mktemp("no-portaudio")
    (fake / "sounddevice.py").write_text("raise OSError('PortAudio library not found')\n")
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(fake), env["PYTHONPATH"]])
    return env


# -- tiers ----------------------------------------------------------------------------------------
#
# Every test is in exactly one tier, so that `-m unit` (seconds), `-m "unit or cli"` (before a commit),
# `-m model` and `-m e2e` pick a part of the suite (a plain `pytest` still runs it all):
#   unit   in-process, milliseconds to a second: fakes, pure functions, the scripted engine
#   cli    a face driven in-process (CliRunner, ChatRepl) with a fake assistant: checks made before a model loads
#   model  the real tiny models in-process: parity, the vocoder, the engine on the tiny model
#   e2e    subprocesses, servers, tmux, ALSA playback
# A test file's tier is its entry here; a test that is of another tier says so with its own marker
# (`@pytest.mark.e2e`), or, in a file whose tests are not edited for it, by its name in the entry's
# exceptions. A test file missing from this table fails the collection (test_tiers_cover_every_file).

TIER_NAMES = ("unit", "cli", "model", "e2e")

# file -> tier, or (tier, {test function name: tier}) for the tests of a file that are of another tier.
TIERS: dict[str, str | tuple[str, dict[str, str]]] = {
    "test_adaptive_start.py": "unit",
    "test_atomic.py": "unit",
    "test_detokenize.py": "unit",
    "test_engine_scripted.py": "unit",
    "test_faces_defects.py": "cli",
    "test_files.py": ("cli", {"test_a_temporary_left_by_sigkill_is_removed_by_the_next_write_once_a_day_old": "e2e",
                              "test_a_signal_after_wrote_ends_quietly": "e2e",
                              "test_stale_temporaries_are_ours_only": "unit",
                              "test_an_oserror_naming_a_file_is_one_line": "unit"}),
    "test_terminal_text.py": "cli",
    "test_graph_policy.py": "model",
    "test_heard.py": "unit",
    "test_ownership.py": "cli",
    "test_paths.py": "unit",
    "test_pcm16.py": "unit",
    "test_quant_formats.py": "unit",
    "test_api_shapes.py": ("unit", {"test_client_side_imports_no_torch": "e2e"}),
    "test_bench.py": "model",
    "test_bytecode.py": "e2e",
    "test_chat.py": "cli",
    "test_cli.py": "cli",
    "test_compat.py": "model",
    "test_audio_graphs.py": "model",
    "test_early_weights.py": "model",
    "test_vision_place.py": "model",
    "test_engine.py": "model",
    "test_families.py": ("unit", {"test_voices_come_from_each_checkpoint_without_torch": "e2e"}),
    "test_gpu.py": "model",
    "test_keep_alive.py": ("e2e", {"test_durations": "unit"}),
    "test_kernels.py": "model",
    "test_prompt_ops.py": "model",
    "test_quant_kernels.py": "unit",
    "test_quant_linear.py": "unit",
    "test_quant_parity.py": "model",
    "test_quant_faces.py": "model",
    "test_quant_checkpoints.py": "model",
    "test_limits.py": "unit",
    "test_listen.py": "e2e",
    "test_loader.py": ("unit", {"test_load_tiny": "model", "test_load_tiny_bfloat16_keeps_token2wav_float32": "model",
                                "test_corrupt_weights": "model", "test_the_demo_model_runs_on_one_cpu_thread": "e2e"}),
    "test_media_input.py": ("model", {"test_dropping_old_turns_drops_their_media": "unit",
                                      "test_a_clip_longer_than_the_context_is_one_line": "e2e",
                                      "test_say_image_and_its_errors": "e2e",
                                      "test_say_audio_from_a_file_and_from_stdin": "e2e",
                                      "test_a_file_that_is_not_audio_is_one_line": "e2e",
                                      "test_qwen3_hears_a_file_too": "e2e"}),
    "test_microphone.py": ("unit", {name: "e2e" for name in (
        "test_record_returns_the_devices_samples_bit_for_bit", "test_vad_ends_the_turn_after_the_speech_and_the_silence",
        "test_without_vad_the_limit_ends_it_and_the_quiet_end_is_trimmed",
        "test_on_level_reports_each_tenth_of_a_second_as_it_is_recorded",
        "test_stop_ends_the_recording_at_once_and_keeps_it", "test_ctrl_c_stops_the_stream_and_reraises_with_the_recording",
        "test_a_silent_microphone_is_an_error_that_carries_the_clip", "test_a_device_at_48_khz_needs_no_resampling_for_the_vad",
        "test_input_devices_list_the_alsa_microphone_and_unknown_names_are_one_line_errors")}),
    "test_context.py": "model",
    "test_parity.py": "model",
    "test_playback.py": "e2e",
    "test_qwen3_cli.py": "e2e",
    "test_qwen3_code2wav.py": "model",
    "test_qwen3_parity.py": "model",
    "test_qwen3_steps.py": "model",
    "test_random_checkpoint.py": "model",
    "test_read_ahead.py": "unit",
    "test_realtime.py": ("e2e", {name: "unit" for name in (
        "test_the_turn_detector_finds_the_speech_its_end_and_not_a_click",
        "test_the_input_buffer_is_addressed_in_session_time",
        "test_the_handshake_refuses_another_site_a_wrong_key_another_model_and_one_session_too_many")}),
    "test_structure.py": "unit",
    "test_sampling.py": "unit",
    "test_serve.py": "e2e",
    "test_serve_fuzz.py": "cli",
    "test_serve_hostile.py": "unit",
    "test_sink_thread.py": ("unit", {"test_an_interrupted_turn_aborts_the_wav_on_its_own_thread": "model",
                                     "test_a_completed_turn_closes_the_wav_on_its_own_thread": "model"}),
    "test_sinks.py": "unit",
    "test_tiers.py": "unit",
    "test_tiny_assets.py": "model",
    "test_tiny_qwen3_assets.py": "model",
    "test_talk_remote.py": "unit",
    "test_talk.py": ("unit", {"test_three_spoken_turns_the_second_reply_cut_by_speech": "e2e",
                              "test_the_second_reply_stops_soon_after_the_speech_starts": "e2e"}),
    "test_tmux.py": "e2e",
    "test_vocoder.py": "model",
}


def tier_of(item) -> str:
    """The one tier of a collected test: its own tier marker, else its file's entry in TIERS."""
    own = [m.name for m in item.iter_markers() if m.name in TIER_NAMES]
    if len(set(own)) > 1:
        raise pytest.UsageError(f"{item.nodeid} is marked with more than one tier: {sorted(set(own))}")
    if own:
        return own[0]
    name = Path(str(item.fspath)).name
    entry = TIERS.get(name)
    if entry is None:
        raise pytest.UsageError(f"{name} is not in tests/conftest.py's TIERS: give it a tier ({', '.join(TIER_NAMES)})")
    if isinstance(entry, str):
        return entry
    default, exceptions = entry
    return exceptions.get(getattr(item, "originalname", item.name), default)


# The files that take longest (measured on two cores, longest first), collected first: `--dist loadfile`
# hands whole files to the two workers in collection order, so the long ones start at once and the
# short ones fill in at the end, and the workers finish together. (xdist's own order, by the number of
# tests in a file, sent the files of a few long tests last, test_tmux.py and test_listen.py among them,
# with one worker going on alone; pytest_configure below turns it off.)
LONGEST_FIRST = ("test_cli.py", "test_media_input.py", "test_serve.py", "test_keep_alive.py", "test_vocoder.py",
                 "test_playback.py", "test_loader.py", "test_bench.py", "test_chat.py", "test_listen.py", "test_tmux.py",
                 "test_kernels.py", "test_qwen3_cli.py", "test_microphone.py", "test_engine.py")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item)
        if not any(m.name == tier for m in item.iter_markers()):
            item.add_marker(getattr(pytest.mark, tier))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: a file's own order kept


# -- the faces in-process (typer's CliRunner), with a fake assistant and sound device ---------------


@pytest.fixture
def fake(monkeypatch):
    """omni_cli.load gives a FakeAssistant (tests/fakes.py) and the speaker a FakeSoundDevice: a face's
    own logic in milliseconds. `fake.load_args` stays None until something loads; `fake.assistant` and
    `fake.sd` may be replaced before the command runs."""
    from types import SimpleNamespace

    import omni_cli
    import omni_cli.audio.speaker
    from audio_device import FakeSoundDevice
    from fakes import FakeAssistant

    state = SimpleNamespace(assistant=FakeAssistant(), load_args=None, sd=FakeSoundDevice(speed=20.0))

    def load(model=None, device="auto", dtype="auto", runtime=None, progress=None):
        state.runtime = runtime  # the faces give the one RuntimeOptions whole
        state.load_args = (model, runtime.device, runtime.dtype)
        return state.assistant

    monkeypatch.setattr(omni_cli, "load", load)
    monkeypatch.setattr(omni_cli.audio.speaker, "import_sounddevice", lambda hint=None: state.sd)
    return state


def invoke(*args, input=None):
    """omni-say ARGS in this process (CliRunner): exit_code, stdout, stderr (apart), stdout_bytes."""
    from typer.testing import CliRunner

    from omni_cli.faces.say import say_app

    return CliRunner().invoke(say_app, [str(a) for a in args], prog_name="omni-say", input=input)


def invoke_chat(*args, input=None):
    """omni-chat ARGS in this process (CliRunner); its stdin is `input` (a pipe: one line a turn)."""
    from typer.testing import CliRunner

    from omni_cli.faces.chat.main import chat_app

    return CliRunner().invoke(chat_app, [str(a) for a in args], prog_name="omni-chat", input=input)


def pytest_configure(config):
    # pytest-xdist 3.8 and later order loadfile's files by their number of tests unless told
    # --no-loadscope-reorder (an option older versions lack, hence here and not in addopts): the order of
    # LONGEST_FIRST is the one wanted.
    if getattr(config.option, "loadscopereorder", None) is not None:
        config.option.loadscopereorder = False
