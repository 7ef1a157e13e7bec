"""transformers' own `Qwen2_5OmniForConditionalGeneration.generate`, greedy, as the parity reference:
the reply's text ids and the talker's codes before its stop code; and `tiny_model`, a tiny asset loaded by
the library's own class."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from omni_cli.runtime import compat

STOP_CODES = (8292, 8294)  # the reference's talker stops on codec pad and codec EOS
ASSETS = Path(__file__).resolve().parent.parent / "assets"


def tiny_model(family: str):
    """The tiny asset of `family` ("qwen2.5" or "qwen3") as the library's ForConditionalGeneration,
    float32, on the CPU, in eval mode."""
    import transformers
    from transformers.utils import logging as hf_logging

    cls, folder = {
        "qwen2.5": (transformers.Qwen2_5OmniForConditionalGeneration, "tiny-qwen2.5-omni"),
        "qwen3": (transformers.Qwen3OmniMoeForConditionalGeneration, "tiny-qwen3-omni"),
    }[family]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the tiny configs' id warnings are expected
    try:
        return cls.from_pretrained(str(ASSETS / folder)).eval()
    finally:
        hf_logging.set_verbosity(verbosity)


def reference_generate(model, ids: list[int], *, voice: str = "Chelsie", n_text: int, n_codes: int,
                       eos: list[int], repetition_penalty: float | None = None, forced: bool = False,
                       inputs: dict | None = None):
    """`forced`: no text EOS before `n_text` and audio codes only (what `TurnRequest.force_lengths` does).
    `inputs`: the processor's outputs (input_ids with the audio features ...), used instead of `ids`."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class AudioOnly(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 8192:] = float("-inf")
            return scores

    extra = {}
    if repetition_penalty is not None:
        extra["thinker_repetition_penalty"] = repetition_penalty
    if forced:
        extra.update(thinker_min_new_tokens=n_text, talker_min_new_tokens=n_codes,
                     talker_logits_processor=LogitsProcessorList([AudioOnly()]))
    captured = {}
    original = model.talker.generate

    def capture(*args, **kwargs):
        captured["codes"] = out = original(*args, **kwargs)
        return out

    model.talker.generate = capture
    try:
        with torch.no_grad(), qwen2_5_talker_keeps_its_mask(model):
            device = next(model.parameters()).device
            given = inputs if inputs is not None else {"input_ids": torch.tensor([ids], device=device)}
            ids = given["input_ids"][0].tolist()
            sequences, _ = model.generate(
                **given, speaker=voice,
                thinker_max_new_tokens=n_text, thinker_do_sample=False, thinker_eos_token_id=eos,
                talker_max_new_tokens=n_codes, talker_do_sample=False, **extra,
            )
    finally:
        model.talker.generate = original
    codes = []
    for code in captured["codes"][0, len(ids) + 2:].tolist():
        if code in STOP_CODES:
            break
        codes.append(code)
    return sequences[0, len(ids):].tolist(), codes


# transformers 5.18 on: `generate` drops an all-ones `attention_mask`; Qwen2.5's talker `forward` adds the codec
# pad/BOS embeddings to its prompt (and sets its rope deltas) only when it gets a mask, so transformers' own
# generate on an unpadded prompt speaks from another talker prompt than 5.17's (and ours).
@contextlib.contextmanager
def qwen2_5_talker_keeps_its_mask(model):
    """Within the block, `model.talker` (Qwen2.5-Omni) gets the all-ones attention mask that `generate` drops
    from 5.18 on, so its prompt has the codec pad/BOS embeddings as on 5.17 (a no-op where a mask is passed)."""
    talker = model.talker
    own = talker.__dict__.get("forward")
    forward = talker.forward
    name = compat.cache_kwarg_name(talker)

    @functools.wraps(forward)  # generate checks its model kwargs against the forward's signature
    def with_mask(*args, attention_mask=None, **kwargs):
        if attention_mask is None:
            tokens = kwargs.get("inputs_embeds")
            tokens = kwargs["input_ids"] if tokens is None else tokens
            cache = kwargs.get(name)
            past = cache.get_seq_length() if cache is not None else 0
            attention_mask = torch.ones(tokens.shape[0], past + tokens.shape[1], dtype=torch.long, device=tokens.device)
        return forward(*args, attention_mask=attention_mask, **kwargs)

    talker.forward = with_mask
    try:
        yield
    finally:
        if own is None:
            del talker.forward
        else:
            talker.forward = own
