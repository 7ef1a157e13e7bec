"""The model families omni_cli runs, one folder each, found by `config.json`'s `model_type`.

    qwen2_5_omni/   Qwen2.5-Omni (3B, 7B)          model_type "qwen2_5_omni"
    qwen3_omni/     Qwen3-Omni-30B-A3B             model_type "qwen3_omni_moe"

A family's package (its `__init__`) is cheap to import (no torch): it says what a complete folder
holds, lists voices without loading weights, and loads a checkpoint into the `ModelSteps` the runtime
calls (models/base.py). It exposes all that as one `Family` instance, `FAMILY` (models/base.py states
every capability with its default), which `family(model_type)` returns. Nothing else in omni_cli names a
family.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from ..errors import ModelError
from .base import Family

# The built-in random-weight model; present in a source checkout / `pip install -e .`.
TINY_MODEL_DIR = Path(__file__).resolve().parent.parent.parent / "assets" / "tiny-qwen2.5-omni"
# Every built-in random-weight model (the Qwen3-Omni one is named with -m assets/tiny-qwen3-omni).
BUILTIN_TINY_DIRS = (TINY_MODEL_DIR, TINY_MODEL_DIR.parent / "tiny-qwen3-omni")

# model_type -> the family's package (relative to this one)
FAMILIES = {
    "qwen2_5_omni": "qwen2_5_omni",
    "qwen3_omni_moe": "qwen3_omni",
}


def family(model_type: str | None, label: str = "the model") -> Family:
    """The family (its package's `FAMILY`) for a config.json `model_type`; a one-line ModelError for anything
    else."""
    name = FAMILIES.get(model_type or "")
    if name is None:
        what = f"a {model_type} model" if model_type else "not a model with a model_type"
        raise ModelError(f"{label} is {what}, not Qwen2.5-Omni (qwen2_5_omni) or Qwen3-Omni (qwen3_omni_moe): "
                         "omni-cli runs those two families")
    return importlib.import_module(f".{name}", __name__).FAMILY


def presets_modules() -> list[ModuleType]:
    """Each family's omni-bench presets (models/<family>/presets.py; torch is imported only when used)."""
    return [importlib.import_module(f".{name}.presets", __name__) for name in FAMILIES.values()]
