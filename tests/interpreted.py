"""The Triton kernels' tests on a CPU (test_kernels.py, test_quant_kernels.py, test_quant_linear.py): the
kernel module through Triton's interpreter, or the reason it cannot run here, and the unit their errors
are measured in.

Triton is not a dependency of the CPU package; CI (.ci/run) installs it, and there a missing triton fails
these tests instead of skipping them. On a machine with a GPU, tests/test_gpu.py runs the kernels."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

# float16: the interpreter rounds a cast to bfloat16 toward zero where a GPU rounds to nearest; its float16
# casts round as a GPU's. The kernels do the same with either: they cast to the activations' dtype.
DT = torch.float16


def kernel_module(name: str) -> ModuleType:
    """The module `name` (omni_cli.runtime.kernels, ...), to be run by Triton's interpreter; skips (fails
    in CI) where that cannot be."""
    if os.environ.get("TRITON_INTERPRET") != "1":  # set by conftest.py where there is no GPU
        pytest.skip("a machine with a GPU: tests/test_gpu.py runs the kernels there")
    try:
        import triton  # noqa: F401
    except ImportError:
        if os.environ.get("OMNI_CI", "") not in ("", "0"):
            pytest.fail("triton is missing: .ci/run installs it for these tests")
        pytest.skip("triton is not installed")
    return importlib.import_module(name)


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in units of b's spacing in DT (at least that of 1/64)."""
    spacing = torch.maximum(b.float().abs(), torch.tensor(1 / 64)) * torch.finfo(DT).eps
    return ((a.float() - b.float()).abs() / spacing).max().item()
