"""Packed weights through the real runtime, greedy, against transformers' `generate` on the same model
holding the dequantized weights (float32, CPU): the reply's text ids and every code identical, for both
families, int4 (symmetric and with zero points) and FP8 (block scales), thinker and talker quantized
(`quant/apply.py`: attention, dense MLPs, expert banks, the talker's shared expert).

This proves the wiring (library prefill over `QuantLinear` / `QuantExperts`, the fused decode steps over
packed layers and banks, the reference paths of the picked products); the kernels themselves are checked
against dequantize-then-multiply in test_quant_kernels.py, the checkpoint formats in test_quant_checkpoints.py.
"""

from __future__ import annotations

import copy
import functools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qwen3_reference as ref  # noqa: E402  (tests/ is on sys.path)
from hf_reference import reference_generate  # noqa: E402

from omni_cli.assistant import Assistant  # noqa: E402
from omni_cli.config import RuntimeOptions  # noqa: E402
from omni_cli.loader import load_model  # noqa: E402
from omni_cli.prompt import Conversation, build_ids  # noqa: E402
from omni_cli.quant.apply import dequantized, packed_bytes, quantize_model  # noqa: E402
from omni_cli.quant.experts import QuantExperts  # noqa: E402
from omni_cli.quant.formats import QuantSpec  # noqa: E402

PROMPT = "Hello there! What is the weather like today?"
SPECS = {  # group and block sizes that divide the tiny models' widths
    "int4": QuantSpec("int4", group_size=16),
    "int4-zeros": QuantSpec("int4", group_size=16, symmetric=False),
    "fp8-block": QuantSpec("fp8", block=(16, 16)),
}
ASSETS = {"qwen2_5": None, "qwen3": str(ref.ASSET)}


@functools.lru_cache(maxsize=None)
def pair(family: str, spec_name: str):
    """(assistant over the packed model, the float model holding its dequantized weights, what was packed)."""
    loaded = load_model(ASSETS[family], device="cpu")
    reference = copy.deepcopy(loaded.model)
    done = quantize_model(loaded.model, SPECS[spec_name])
    with torch.no_grad():
        for name, tensors in dequantized(loaded.model):
            module = reference.get_submodule(name)
            for attr, value in tensors.items():
                getattr(module, attr).copy_(value)
    return Assistant(loaded, RuntimeOptions(max_context=512, max_codes=128)), reference, done


def _generate(family, a, reference, ids, voice, n_text, n_codes):
    eos, penalty = a.engine.eos_ids, a.thinker_sampling.repetition_penalty
    if family == "qwen3":
        text, codes = ref.reference_generate(reference, ids, voice=voice, frames=n_codes, text_tokens=n_text,
                                             eos=eos, repetition_penalty=penalty)
        return list(text), codes.tolist()
    text, codes = reference_generate(reference, ids, voice=voice, n_text=n_text, n_codes=n_codes, eos=eos,
                                     repetition_penalty=penalty)[:2]
    return list(text), list(codes)


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("family", list(ASSETS))
def test_packed_model_matches_generate_on_its_dequantized_weights(family, spec_name):
    a, reference, done = pair(family, spec_name)
    n_codes = 24 if family == "qwen3" else 48
    ids = build_ids(a.loaded.tokenizer, Conversation(system=a.default_system).messages(PROMPT))
    for voice in sorted(a.loaded.speakers)[:1]:
        reply = a.say(PROMPT, greedy=True, voice=voice, max_text_tokens=16, max_codes=n_codes)
        text, codes = _generate(family, a, reference, ids, voice, 16, n_codes)
        assert reply.text_ids == text
        assert list(reply.codes) == codes and len(codes) > 4
    # What was packed is what apply.py says: both stacks, every layer, expert banks on Qwen3.
    model = a.loaded.model
    assert done.layers == sum(len(s) for s in (ref_layers(model)))
    assert any(isinstance(m, QuantExperts) for m in model.modules()) == (family == "qwen3")
    assert 0 < packed_bytes(model) == done.bytes_after < done.bytes_before / 2


def ref_layers(model):
    from omni_cli.quant.apply import decoder_stacks

    return [layers for _name, layers in decoder_stacks(model)]


def test_quantization_changes_the_reply_so_the_comparison_can_fail():
    """The packed model's codes differ from the unquantized model's: the parity above is not vacuous."""
    a, _reference, _ = pair("qwen3", "int4")
    loaded = load_model(ASSETS["qwen3"], device="cpu")
    ids = build_ids(a.loaded.tokenizer, Conversation(system=a.default_system).messages(PROMPT))
    text, codes = ref.reference_generate(loaded.model, ids, voice="Chelsie", frames=24, text_tokens=16,
                                         eos=a.engine.eos_ids, repetition_penalty=a.thinker_sampling.repetition_penalty)
    reply = a.say(PROMPT, greedy=True, voice="Chelsie", max_text_tokens=16, max_codes=24)
    assert reply.codes != codes.tolist()
