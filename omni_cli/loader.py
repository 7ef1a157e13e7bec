"""Find and load a checkpoint of a supported family; pick the device and dtype it runs in.

A model is named by a local folder, a Hugging Face hub id (looked up in the local hub cache first,
downloaded otherwise), `$OMNI_MODEL`, or nothing at all: then the built-in tiny random-weight model
that ships with a source checkout is used, with a one-line notice. A folder holds `config.json`, whose
`model_type` names the family (`omni_cli/models/`), the weights, the tokenizer files, optionally
`generation_config.json` (the thinker's sampling defaults), and what the family needs beside them
(Qwen2.5-Omni: `spk_dict.pt`, the voices).

Every failure a person can fix is raised as a one-line `ModelError` / `UsageError` / `OmniError`.
It does not know a family's weights layout or voices (models/<family>/), how a reply is generated
(runtime/), how prompts are built (prompt) or where audio goes (audio/). torch, transformers and
huggingface_hub are imported inside the functions that need them, so importing this module stays
cheap. It never prints: notices go to the `omni_cli.loader` logger (INFO: the demo model, a download;
WARNING: weights left random), and the faces decide what a person sees.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .errors import ModelError, UsageError
from .models.weights import from_pretrained, one_line, quiet_transformers  # noqa: F401 - re-exported

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from .models.base import Family

log = logging.getLogger(__name__)

# The built-in random-weight models (models/__init__.py says where they are).
from .models import BUILTIN_TINY_DIRS, TINY_MODEL_DIR  # noqa: E402, F401 - re-exported

# The environment variable that names the default model (a folder or a hub id).
MODEL_ENV = "OMNI_MODEL"

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

# transformers' VERY_LARGE_INTEGER: a tokenizer's model_max_length meaning "no limit".
_NO_LIMIT = int(1e30)

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

DEMO_NOTICE = (
    "no model given, using the built-in tiny demo model: its weights are random, so it prints "
    "gibberish and speaks noise; pass -m FOLDER_OR_HUB_ID (e.g. -m Qwen/Qwen2.5-Omni-7B) or set "
    "OMNI_MODEL for a real one"
)


# ---------------------------------------------------------------------------------------------
# Finding the checkpoint
# ---------------------------------------------------------------------------------------------


def resolve_model(model: str | os.PathLike | None) -> tuple[Path, bool]:
    """Where the checkpoint named by `model` lives, and whether it is the built-in demo model.

    None means `$OMNI_MODEL` if set, else the built-in tiny model (with a one-line notice, logged).
    A local folder is checked (config.json of a supported family, its parts); anything shaped like
    `owner/name` that is not an existing path is a hub id: the local hub cache first, then a download.
    """
    path, is_demo, _name = _resolve(model)
    return path, is_demo


def _resolve(model: str | os.PathLike | None, notice: bool = True) -> tuple[Path, bool, str]:
    """(folder, is_demo, short display name). `notice`: log the demo-model notice when it applies."""
    if model is None:
        env = os.environ.get(MODEL_ENV, "").strip()
        if env:
            return _resolve(env)
        if not TINY_MODEL_DIR.is_dir():
            raise ModelError(
                f"the built-in tiny model is missing ({TINY_MODEL_DIR} does not exist): it lives in the "
                "source checkout's assets/ folder, which `pip install .` does not copy; install with "
                "`pip install -e .` from the checkout for it, or pass -m FOLDER_OR_HUB_ID or set OMNI_MODEL"
            )
        if notice:
            log.info(DEMO_NOTICE)
        path = _check_folder(TINY_MODEL_DIR)
        return path, True, TINY_MODEL_DIR.name

    text = os.fspath(model)
    if not text.strip():
        raise ModelError("empty model name: pass a model folder or a hub id such as Qwen/Qwen2.5-Omni-7B")
    path = Path(text).expanduser()
    if path.exists():
        folder = _check_folder(path)
        tiny = _is_tiny(folder)
        if tiny and notice:
            log.info("%s", demo_notice(text, folder.name))
        return folder, tiny, folder.name
    if _looks_like_hub_id(text):
        return _from_hub(text), False, text
    raise ModelError(f"model folder {text} does not exist")


def _looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and not text.startswith((".", "~"))


def _is_tiny(folder: Path) -> bool:
    """A built-in random-weight model (either family's), however it is named."""
    try:
        return folder.resolve() in BUILTIN_TINY_DIRS
    except OSError:
        return False


class IncompleteModel(ModelError):
    """A model folder that lacks weights, tokenizer or voices (a partial download, say)."""


def missing_parts(folder: Path, family: Family | None = None) -> list[str]:
    """What a model folder lacks of weights, tokenizer and what its family needs beside them
    (config.json is checked apart)."""
    missing = []
    if not any((folder / name).is_file() for name in _WEIGHT_FILES):
        missing.append("weights (model.safetensors)")
    has_tokenizer = (folder / "tokenizer.json").is_file() or (
        (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
    )
    if not has_tokenizer:
        missing.append("tokenizer (tokenizer.json)")
    if family is not None:
        missing += family.missing_parts(folder)
    return missing


def _check_folder(path: Path, label: str | None = None) -> Path:
    """The folder, resolved, if it holds a checkpoint of a supported family; else a one-line ModelError."""
    label = label or str(path)
    if not path.exists():
        raise ModelError(f"model folder {label} does not exist")
    if not path.is_dir():
        raise ModelError(f"{label} is a file, not a model folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{label} has no config.json: not a model folder")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelError(f"{label}/config.json cannot be read: {one_line(exc)}") from exc
    fam = family_of(config, label)
    missing = missing_parts(path, fam)
    if missing:
        raise IncompleteModel(f"{label} has no {' and no '.join(missing)}: not a complete {fam.TITLE} checkpoint")
    return path.resolve()


def family_of(config: Any, label: str) -> Family:
    """The family (omni_cli/models/<family>/, its `FAMILY`) of a decoded config.json."""
    from .models import family

    return family(config.get("model_type") if isinstance(config, dict) else None, label)


def read_family(folder: Path) -> Family:
    """The family of a folder `_check_folder` accepted."""
    return family_of(json.loads((folder / "config.json").read_text(encoding="utf-8")), str(folder))


def _from_hub(repo_id: str) -> Path:
    """A hub id's snapshot folder: the local cache first, then a download."""
    from huggingface_hub import snapshot_download

    hint = f"run `hf download {repo_id}` where there is internet, or pass a local folder with -m"
    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError) or a broken cache entry
        folder = None
    if folder is not None and (folder / "config.json").is_file():
        try:
            return _check_folder(folder, label=f"{repo_id} (cached at {folder})")
        except IncompleteModel:
            pass  # a partial download: try to complete it below
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        raise ModelError(
            f"model {repo_id} is neither a local folder nor in the Hugging Face cache, and HF_HUB_OFFLINE "
            f"is set: {hint}"
        )
    log.info("downloading %s from the Hugging Face Hub (this can take a while)...", repo_id)
    try:
        folder = Path(snapshot_download(repo_id))
    except KeyboardInterrupt:
        raise
    except GatedRepoError as exc:
        raise ModelError(
            f"model {repo_id} is gated: accept its terms on the hub, log in with `hf auth login`, "
            "or pass a local folder with -m"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelError(
            f"model {repo_id} is neither a local folder nor a hub repository (if it is private: "
            "`hf auth login`); pass a model folder or a hub id such as Qwen/Qwen2.5-Omni-7B"
        ) from exc
    except Exception as exc:
        reason = one_line(str(exc).splitlines()[0] if str(exc) else exc, limit=120)
        raise ModelError(
            f"model {repo_id} is neither a local folder nor in the Hugging Face cache, and downloading it "
            f"failed ({reason}): {hint}"
        ) from exc
    return _check_folder(folder, label=f"{repo_id} (at {folder})")


# ---------------------------------------------------------------------------------------------
# Device and dtype
# ---------------------------------------------------------------------------------------------


def _npu_available(torch: Any) -> bool:
    if not hasattr(torch, "npu"):
        try:  # Ascend's plug-in registers torch.npu when imported
            import torch_npu  # noqa: F401
        except Exception:
            return False
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:
        return False


def _mps_available(torch: Any) -> bool:
    mps = getattr(torch.backends, "mps", None)
    try:
        return bool(mps is not None and mps.is_available())
    except Exception:
        return False


def available_devices() -> list[str]:
    """Names of the devices this machine has, for messages ("cpu", "cuda:0", ...)."""
    import torch

    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if _npu_available(torch):
        names += [f"npu:{i}" for i in range(torch.npu.device_count())]
    if _mps_available(torch):
        names.append("mps")
    return names


def pick_device(name: str = "auto") -> "torch.device":
    """"auto" = CUDA, then NPU, then MPS, then CPU; an explicit name must exist here (else UsageError)."""
    import torch

    name = (name or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _npu_available(torch):
            return torch.device("npu", torch.npu.current_device())
        if _mps_available(torch):
            return torch.device("mps")
        return torch.device("cpu")

    known = "auto, cpu, cuda, cuda:N, npu, npu:N, mps"
    if name.partition(":")[0] == "npu" and not _npu_available(torch):
        # torch only knows the "npu" type once torch_npu is imported.
        raise UsageError(f"device '{name}' is not available here: available: {', '.join(available_devices())}")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"unknown device '{name}': use one of {known}") from exc
    kind = device.type
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        ok = torch.cuda.is_available() and (device.index is None or device.index < torch.cuda.device_count())
    elif kind == "npu":
        ok = _npu_available(torch) and (device.index is None or device.index < torch.npu.device_count())
    elif kind == "mps":
        ok = _mps_available(torch)
    else:
        raise UsageError(f"unknown device '{name}': use one of {known}")
    if not ok:
        raise UsageError(f"device '{name}' is not available here: available: {', '.join(available_devices())}")
    if device.index is None and kind in ("cuda", "npu"):
        device = torch.device(kind, getattr(torch, kind).current_device())
    return device


def pick_dtype(name: str, device: "torch.device") -> "torch.dtype":
    """"auto" = bfloat16 on accelerators, float32 on CPU; else float32 / bfloat16 / float16."""
    import torch

    key = (name or "auto").strip().lower()
    if key == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if key not in _DTYPES:
        raise UsageError(f"unknown dtype '{name}': use auto, float32, bfloat16 or float16")
    return getattr(torch, _DTYPES[key])


# ---------------------------------------------------------------------------------------------
# Voices
# ---------------------------------------------------------------------------------------------


def check_voice(speakers: Mapping[str, Any] | Iterable[str], voice: str) -> str:
    """The voice's name as the checkpoint spells it (matched case-insensitively), else UsageError."""
    names = list(speakers)
    if voice in names:
        return voice
    folded = {n.lower(): n for n in names}
    if isinstance(voice, str) and voice.lower() in folded:
        return folded[voice.lower()]
    listed = ", ".join(names) if names else "none"
    raise UsageError(f"unknown voice '{voice}': this model's voices are {listed}")


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    """A checkpoint on its device, with what the engine needs beside the weights."""

    # The family's *ForConditionalGeneration in eval mode on `device`: LLMs in `dtype`, the vocoder
    # as the family runs it (Qwen2.5-Omni's token2wav in float32, in `dtype` when the model is packed).
    model: Any
    # The checkpoint's tokenizer (AutoTokenizer from the folder).
    tokenizer: Any
    # Voices: name -> what the family's talker needs for it (Qwen2.5-Omni: spk_dict.pt's entries
    # {"bos_token", "cond", "ref_mel"}; Qwen3-Omni: the codec id from the config's speaker map).
    speakers: dict
    # The thinker's generation defaults (generation_config.json; library defaults if absent).
    generation_config: Any
    # The checkpoint folder (a hub snapshot folder for a hub id).
    path: Path
    device: "torch.device"
    # dtype of thinker and talker (token2wav: float32, or this when the model is packed).
    dtype: "torch.dtype"
    # True for the built-in random-weight model.
    is_demo: bool
    # Short display name: the hub id, or the folder's name.
    name: str
    # The family (omni_cli/models/<family>/: its `FAMILY`, a models.base.Family).
    family: "Family | None" = None
    # Seconds each loading phase took ("weights", "tokenizer", ...), for `--verbose`.
    timings: dict | None = None
    # What `--quantize` packed at load ("int4", "fp8"), None for weights as stored.
    quantize: str | None = None

    @property
    def voices(self) -> list[str]:
        return list(self.speakers)


def load_model(model: str | os.PathLike | None = None, device: str = "auto", dtype: str = "auto",
               quantize: str | None = None, group_size: int | None = None, progress=None) -> LoadedModel:
    """Resolve, check and load a checkpoint of a supported family onto a device (see `LoadedModel`).

    `quantize` ("int4", "fp8"; RuntimeOptions.quantize): the weights are read into host memory, and the
    decoder layers packed one at a time on the device (`load_packed`), so only the packed model has to fit
    there; `group_size`: int4's (None: 128); `progress(done, total)`: after each layer packed."""
    import time

    import torch

    t0 = time.perf_counter()
    torch_device = pick_device(device)
    if torch_device.type == "cuda":
        torch.cuda.init()  # the driver and the context: seconds on a GPU machine, shown on their own
    timings = {} if torch_device.type == "cpu" else {"start the device (driver, context)": time.perf_counter() - t0}
    t0 = time.perf_counter()
    torch_dtype = pick_dtype(dtype, torch_device)
    path, is_demo, name = _resolve(model)
    fam = read_family(path)
    if quantize is not None:
        refuse_quantized(path, name, quantize)
    early = None
    if torch_device.type == "cuda" and fam.READS_WEIGHTS_EARLY and quantize is None and not _quantized(path, name):
        from .early_weights import EarlyWeights

        early = EarlyWeights.start(path, torch_device, torch_dtype)  # during the import below

    with quiet_transformers():
        from transformers import AutoTokenizer, GenerationConfig

        timings["import transformers, find the model" + (" (reading the weights meanwhile)" if early else "")] = (
            time.perf_counter() - t0)
        t = time.perf_counter()
        if quantize is None:
            omni, speakers = fam.load(path, torch_device, torch_dtype, name, **({"early": early} if early else {}))
            timings["read the weights and move them to the device"] = time.perf_counter() - t
        else:
            omni, speakers = fam.load(path, torch.device("cpu"), torch_dtype, name)
            timings["read the weights into host memory"] = time.perf_counter() - t
            t = time.perf_counter()
            load_packed(omni, path, torch_device, torch_dtype, name, quantize, group_size, progress)
            timings[f"pack the decoder layers ({quantize}) on the device, move the rest"] = time.perf_counter() - t
        omni.eval()
        t = time.perf_counter()
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            raise ModelError(f"cannot load the tokenizer of {name} ({path}): {one_line(exc)}") from exc
        # The tokenizer's model_max_length only makes it log "Token indices sequence length is longer
        # than the specified maximum..." for a long prompt, ahead of our own one-line error: what fits
        # is decided by the context check (prompt.fit), so lift the tokenizer's limit (to the value
        # transformers itself uses for "no limit"); nothing here truncates by it.
        tokenizer.model_max_length = _NO_LIMIT
        if not getattr(tokenizer, "chat_template", None):
            raise ModelError(f"the tokenizer of {name} ({path}) has no chat template (tokenizer_config.json)")

        if (path / "generation_config.json").is_file():
            try:
                generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
            except Exception as exc:
                raise ModelError(f"{name}: bad generation_config.json: {one_line(exc)}") from exc
        else:
            generation_config = GenerationConfig()
        timings["tokenizer and generation config"] = time.perf_counter() - t

    if is_demo and torch_device.type == "cpu" and torch.get_num_threads() > 1:
        # The demo model's operations are far too small to gain from a second thread, and each one
        # waits for all its threads: with another program busy on a core, a two-thread vocoder chunk
        # took 6x as long (64 s against 11 s for a test's worth of windows on 2 cores). One thread.
        log.debug("the built-in demo model runs on one CPU thread (was %d)", torch.get_num_threads())
        torch.set_num_threads(1)

    return LoadedModel(
        model=omni,
        tokenizer=tokenizer,
        speakers=speakers,
        generation_config=generation_config,
        path=path,
        device=torch_device,
        dtype=torch_dtype,
        is_demo=is_demo,
        name=name,
        family=fam,
        timings=timings,
        quantize=quantize,
    )


def refuse_quantized(path: Path, name: str, quantize: str) -> None:
    """A one-line UsageError when the checkpoint's config.json says it is quantized already: its weights
    load as stored, and packing packed weights again would only lose more (quant/detect.py reads it; a
    format it does not know is quantized too)."""
    from .quant.detect import detect

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # _check_folder read it already: nothing new to say here
    try:
        found = detect(config)
        quantized, what = bool(found), ", ".join(sorted({f"{q.method} {q.kind}" for q in found}))
    except ModelError:
        quantized, what = True, "a format of its own"
    if quantized:
        raise UsageError(f"{name} is quantized already ({what}): leave out --quantize {quantize}")


def int4_group(omni, largest: int = 128) -> int:
    """int4's group size for `omni` when none is asked for: 128 (the official checkpoints'), halved until it
    divides the input width of every layer that gets packed (the built-in tiny models' 48 and 64 wide
    layers: 16), logged when it is not 128."""
    from torch import nn

    from .quant.apply import decoder_layers, is_expert_bank, keep

    g = largest
    for _, layer in decoder_layers(omni):
        for name, sub in layer.named_modules():
            if isinstance(sub, nn.Linear) and not keep(name):
                widths = [sub.in_features]
            elif is_expert_bank(sub):  # the bank's two matrices, whichever of their dims is the input
                widths = [d for t in (sub.gate_up_proj, sub.down_proj) for d in t.shape[1:]]
            else:
                continue
            for w in widths:
                while g > 1 and w % g:
                    g //= 2
    if g != largest:
        log.info("int4 group size %d: %d does not divide every packed layer's input width", g, largest)
    return g


def load_packed(omni, path: Path | None, device, dtype, name: str, quantize: str, group_size: int | None,
                progress=None):
    """Pack the decoder layers of `omni` (in host memory, in `dtype`) one at a time on `device`
    (quant/apply.quantize_model), then move the rest there (Qwen2.5-Omni's token2wav in `dtype`: the model
    is packed, apply.cast_token2wav) but the vision tower, which waits in host memory for the first image
    (runtime/vision_place.py). Out of memory: a one-line error saying what would fit (models/weights.py)."""
    from .models.weights import oom_error, to_device
    from .models.weights import is_oom
    from .quant.apply import cast_token2wav, quantize_model, spec_for
    from .runtime import vision_place

    if quantize == "int4" and group_size is None:
        group_size = int4_group(omni)
    spec = spec_for(quantize, dtype, group_size)
    try:
        quantize_model(omni, spec, device, progress=progress)
    except ValueError as exc:  # a group size that does not divide a layer's width
        raise UsageError(f"--quantize {quantize}" + (f" --group-size {group_size}" if group_size else "")
                         + f" does not fit {name}: {one_line(exc)}") from exc
    except Exception as exc:
        if is_oom(exc):
            raise oom_error(name, path, device, dtype, quantize) from exc
        raise
    cast_token2wav(omni, dtype)
    to_device(omni, lambda m: vision_place.place(m, device), device, name, path=path, dtype=dtype,
              quantize=quantize)


def _quantized(path: Path, name: str) -> bool:
    """A folder whose weights are packed (quant/checkpoint.py reads them, not early_weights.py)."""
    from .quant.checkpoint import folder_quantization

    return folder_quantization(path, name) is not None


def model_voices(model: str | os.PathLike | None = None, notice: bool = True) -> list[str]:
    """The voice names of a checkpoint without loading its weights or importing torch (what
    `omni-say --list-voices` prints, and what the CLI checks `-v` against before loading). Same
    resolution and errors as `load_model`; `notice=False` leaves the demo notice to the load that
    follows."""
    path, _is_demo, name = _resolve(model, notice=notice)
    return read_family(path).voices(path, name)


# ---------------------------------------------------------------------------------------------
# What the faces ask before anything is loaded (no torch)
# ---------------------------------------------------------------------------------------------


def model_name_problem(model: str | os.PathLike) -> str | None:
    """Why `model` (as typed after -m) can name no checkpoint, found without the network or torch: a path
    that does not exist and is not shaped like a hub id; None when it may (a folder that exists, or
    `owner/name`, which is looked up when it is loaded)."""
    text = os.fspath(model)
    if not text.strip():
        return "empty model name: pass a model folder or a hub id such as Qwen/Qwen2.5-Omni-7B"
    if Path(text).expanduser().exists() or _looks_like_hub_id(text):
        return None
    return f"model folder {text} does not exist (pass a model folder or a hub id such as Qwen/Qwen2.5-Omni-7B)"


def canonical_dtype(name: str) -> str:
    """A --dtype as torch names it ("bf16" -> "bfloat16"); an unknown name as it is."""
    return _DTYPES.get(name.strip().lower(), name)


def demo_notice(model: str | os.PathLike | None, name: str) -> str:
    """What is said of a built-in tiny model: the demo notice when no model was given, else (`-m` naming
    one, by its folder `name`) only what it is."""
    if model is None:
        return DEMO_NOTICE
    return f"{name} is a built-in tiny model: its weights are random, so it prints gibberish and speaks noise"
