"""early_weights.py: a folder's weights read on a thread and handed to transformers as the state dict give
the model that loading from the files gives (every parameter and buffer, bit for bit, and the generation
config), for the built-in tiny Qwen2.5-Omni on the CPU (the commands do it on a GPU only; tests/test_gpu.py
has no copy of this); and the cases where nothing is read early."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from omni_cli.early_weights import EarlyWeights, weight_files
from omni_cli.loader import TINY_MODEL_DIR, from_pretrained


def _load(early):
    from transformers import Qwen2_5OmniForConditionalGeneration

    base = super(Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniForConditionalGeneration)
    return from_pretrained(base, TINY_MODEL_DIR, torch.bfloat16, "tiny", torch.device("cpu"), early=early)


def test_early_weights_load_the_model_the_files_load():
    plain = _load(None)
    early = EarlyWeights.start(TINY_MODEL_DIR, torch.device("cpu"))
    assert early is not None
    model = _load(early)
    a, b = dict(plain.state_dict()), dict(model.state_dict())
    assert a.keys() == b.keys() and len(a) > 100
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    buffers_a, buffers_b = dict(plain.named_buffers()), dict(model.named_buffers())
    assert buffers_a.keys() == buffers_b.keys()
    for key in buffers_a:  # the non-persistent ones too (rotary frequencies, filters): computed, not read
        assert torch.equal(buffers_a[key], buffers_b[key]), key
    assert model.generation_config.to_dict() == plain.generation_config.to_dict()
    assert early.take() is None  # handed over once


@pytest.mark.unit
def test_shards_are_read_from_the_index(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"")
    (tmp_path / "b.safetensors").write_bytes(b"")
    (tmp_path / "stray.safetensors").write_bytes(b"")  # not in the index: not the model's
    index = {"weight_map": {"x.weight": "b.safetensors", "y.weight": "a.safetensors", "z.bias": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]


@pytest.mark.parametrize("layout", ["bin", "missing shard", "bad index"])
@pytest.mark.unit
def test_nothing_is_read_early_from_other_layouts(tmp_path, layout):
    if layout == "bin":
        (tmp_path / "pytorch_model.bin").write_bytes(b"")
    elif layout == "missing shard":
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    else:
        (tmp_path / "model.safetensors.index.json").write_text("{not json")
    assert weight_files(tmp_path) is None
    assert EarlyWeights.start(tmp_path, torch.device("cpu")) is None


@pytest.mark.unit
def test_a_failed_read_hands_over_nothing(tmp_path):
    shutil.copy(TINY_MODEL_DIR / "config.json", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    early = EarlyWeights.start(tmp_path, torch.device("cpu"))
    assert early is not None and early.take() is None  # the caller then reads the files, and says what is wrong


class _Cuda:
    type = "cuda"


@pytest.mark.parametrize("free_gb, dtype, read", [(100, torch.bfloat16, True), (40, torch.bfloat16, False),
                                                   (100, torch.float32, True), (60, torch.float32, False)])
@pytest.mark.unit
def test_read_early_only_when_the_files_and_the_model_fit_beside_each_other(tmp_path, monkeypatch, free_gb,
                                                                             dtype, read):
    """22 GB of 16-bit files: a bfloat16 model needs 44 GB with them, a float32 one 66 GB; 90% of the free
    memory may go to that."""
    monkeypatch.setattr(EarlyWeights, "__init__", lambda self, files, device: None)  # no thread, no reading
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free_gb * 10**9, 141 * 10**9))
    f = tmp_path / "model.safetensors"
    with open(f, "wb") as out:
        out.truncate(22 * 10**9)  # sparse: no disk used
    assert (EarlyWeights.start(tmp_path, _Cuda(), dtype) is not None) is read


@pytest.mark.unit
def test_a_failure_to_ask_about_memory_reads_nothing(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"")

    def fail(device):
        raise RuntimeError("no driver")

    monkeypatch.setattr(torch.cuda, "mem_get_info", fail)
    assert EarlyWeights.start(tmp_path, _Cuda(), torch.bfloat16) is None
