"""Greedy parity with the reference: our thinker/talker loops give exactly the token ids and codec codes
that transformers' `Qwen2_5OmniForConditionalGeneration.generate` gives for the same prompt.

Covered: the built-in tiny checkpoint and two more tiny configurations built here (other widths,
depths, head counts, KV heads, head dims and seeds), both voices, and the second turn of a conversation.
The thinker runs with the checkpoint's repetition penalty on both sides, the talker with the
reference's (1.05) and its codec-BOS suppression, so the penalty and suppression paths are exercised.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omni_dev import tiny_qwen2_5 as tiny
from omni_cli.assistant import Assistant
from omni_cli.config import RuntimeOptions
from omni_cli.models import qwen2_5_omni
from omni_cli.prompt import Conversation, build_ids

from hf_reference import reference_generate

N_TEXT, N_CODES = 16, 96

OTHER_CONFIGS = {
    "wide-shallow": dict(
        sizes=dict(thinker_hidden=96, thinker_layers=1, thinker_heads=6, thinker_kv_heads=3, thinker_intermediate=160,
                   talker_hidden=48, talker_layers=3, talker_heads=4, talker_kv_heads=2, talker_head_dim=12,
                   talker_intermediate=96),
        seed=11,
    ),
    "narrow-deep": dict(
        sizes=dict(thinker_hidden=32, thinker_layers=4, thinker_heads=2, thinker_kv_heads=1, thinker_intermediate=64,
                   talker_hidden=24, talker_layers=4, talker_heads=2, talker_kv_heads=2, talker_head_dim=8,
                   talker_intermediate=40),
        seed=24,
    ),
}


def _assistant_for(model) -> Assistant:
    loaded = SimpleNamespace(
        model=model, tokenizer=tiny.make_tokenizer(), speakers=model.speaker_map,
        generation_config=tiny.make_generation_config(), is_demo=True, name="tiny-test", family=qwen2_5_omni,
    )
    return Assistant(loaded, RuntimeOptions(max_context=512, max_codes=512))


@pytest.fixture(scope="module", params=["builtin", *OTHER_CONFIGS])
def assistant(request):
    torch.manual_seed(0)
    if request.param == "builtin":
        return Assistant.load(None, device="cpu")
    spec = OTHER_CONFIGS[request.param]
    model = tiny.build_tiny_model(tiny.tiny_config(**spec["sizes"]), seed=spec["seed"]).eval()
    return _assistant_for(model)


def reference(assistant: Assistant, ids: list[int], voice: str) -> tuple[list[int], list[int]]:
    """Text ids and codes (before the codec EOS) from transformers' own generate, greedy."""
    return reference_generate(assistant.loaded.model, ids, voice=voice, n_text=N_TEXT, n_codes=N_CODES,
                              eos=assistant.engine.eos_ids,
                              repetition_penalty=assistant.thinker_sampling.repetition_penalty)


@pytest.mark.parametrize("voice", ["Chelsie", "Ethan"])
def test_greedy_reply_matches_transformers(assistant, voice):
    prompt = "Hello there! What is the weather like today?"
    ids = build_ids(assistant.loaded.tokenizer, Conversation(qwen2_5_omni.DEFAULT_SYSTEM).messages(prompt))
    ref_text, ref_codes = reference(assistant, ids, voice)
    reply = assistant.say(prompt, voice=voice, greedy=True, max_text_tokens=N_TEXT, max_codes=N_CODES)
    assert reply.text_ids == ref_text
    assert reply.codes == ref_codes
    assert len(ref_codes) > 20  # a real stretch of speech was compared, not an immediate EOS


def test_second_turn_matches_transformers(assistant):
    chat = assistant.conversation()
    first = chat.say("Tell me a short story.", greedy=True, max_text_tokens=N_TEXT, max_codes=8)
    assert chat.history.turns[-1] == {"role": "assistant", "content": first.text}
    ids = build_ids(assistant.loaded.tokenizer, chat.history.messages("And then what happened?"))
    ref_text, ref_codes = reference(assistant, ids, "Chelsie")
    second = chat.say("And then what happened?", greedy=True, max_text_tokens=N_TEXT, max_codes=N_CODES)
    assert second.text_ids == ref_text
    assert second.codes == ref_codes
    assert len(chat.history.turns) == 4


def test_thinker_to_talker_proj_is_a_plain_linear_on_the_critical_path(assistant):
    """The design's promise: the talker's input goes through the checkpoint's own `thinker_to_talker_proj`,
    a plain torch.nn.Linear (no tensor-parallel or quantized wrapper, no hooks), called on every step."""
    proj = assistant.loaded.model.talker.thinker_to_talker_proj  # the library model's module, not our engine's
    assert type(proj) is torch.nn.Linear  # not a subclass
    assert not list(proj.children())
    assert not proj._forward_hooks and not proj._forward_pre_hooks
    x = torch.randn(3, proj.in_features, generator=torch.Generator().manual_seed(0), dtype=proj.weight.dtype)
    with torch.no_grad():  # plain: x W^T + b, computed here by hand
        by_hand = x @ proj.weight.T + (proj.bias if proj.bias is not None else 0)
        torch.testing.assert_close(proj(x), by_hand)
    # Every talker input passes through this very module: the prefill once (the prompt's positions, the
    # voice's BOS and the first reply vector: prompt length + 2), then one position per later code.
    widths = []
    handle = proj.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    try:
        reply = assistant.say("Hello there!", greedy=True, max_text_tokens=4, max_codes=6)
    finally:
        handle.remove()
    system = Conversation(qwen2_5_omni.DEFAULT_SYSTEM)
    prompt_len = len(build_ids(assistant.loaded.tokenizer, system.messages("Hello there!")))
    assert widths[0] == prompt_len + 2
    assert widths[1:] == [1] * (len(widths) - 1)
    assert len(widths) == reply.stats["talker_steps"] >= len(reply.codes) >= 1  # one call a talker step


def test_fused_decode_step_gives_the_same_tokens_and_codes(assistant):
    """The fixed-shape decode step (fused QKV / gate-up, RoPE table, masked span) that the engine runs
    by default (and CUDA graphs replay) must pick exactly what the library's own layers pick, step by
    step (the default engine is checked against transformers above)."""
    from omni_cli.models.qwen2_5_omni.steps import Qwen25Steps
    from omni_cli.runtime.engine import Engine

    assert assistant.engine.steps.talker.fused is not None and assistant.engine.steps.thinker.fused is not None
    prompt = "Hello there! What is the weather like today?"
    fused = assistant.say(prompt, greedy=True, max_text_tokens=N_TEXT, max_codes=N_CODES)
    layers = Assistant.__new__(Assistant)
    layers.__dict__.update(assistant.__dict__)
    steps = Qwen25Steps(assistant.loaded.model, assistant.loaded.speakers, assistant.asked, fast_decode=False)
    layers.engine = Engine(steps, assistant.loaded.tokenizer, eos_ids=assistant.engine.eos_ids)
    assert steps.talker.fused is None and steps.thinker.fused is None
    again = layers.say(prompt, greedy=True, max_text_tokens=N_TEXT, max_codes=N_CODES)
    assert again.text_ids == fused.text_ids
    assert again.codes == fused.codes
