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
