"""Test helper: tiny Qwen3-Omni models (the committed one and configs built on the fly) and transformers'
own greedy `Qwen3OmniMoeForConditionalGeneration.generate` as the parity reference.

`reference_generate` returns the reply's text ids and every frame the talker made (all 16 codebooks),
caught on their way into code2wav. It knows nothing of our steps.
"""

from __future__ import annotations

import functools
import runpy
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ASSET = ROOT / "assets" / "tiny-qwen3-omni"
SCRIPT = ROOT / "scripts" / "make_tiny_qwen3_omni.py"

# Extra tiny configs (overrides of `tiny_qwen3_config`, and the weights' seed). Widths are kept at most 64
# where they feed `text_projection`'s matmuls (thinker_hidden, talker_intermediate): see talker.py's
# PROJECTION_ROWS for why wider ones need longer replies for exact parity on a CPU.
CONFIGS: dict[str, tuple[dict, int]] = {
    "wide": (
        dict(thinker_hidden=48, thinker_heads=3, thinker_kv_heads=1, thinker_head_dim=16, thinker_experts=6,
             thinker_top_k=3, thinker_moe_intermediate=24, talker_hidden=32, talker_heads=4, talker_kv_heads=2,
             talker_head_dim=16, talker_intermediate=48, talker_experts=5, talker_top_k=2,
             talker_moe_intermediate=24, talker_shared_intermediate=48, predictor_heads=4, predictor_kv_heads=2,
             predictor_head_dim=8, predictor_intermediate=48),
        1,
    ),
    "deep": (
        dict(thinker_hidden=32, thinker_layers=4, thinker_heads=2, thinker_kv_heads=2, thinker_head_dim=24,
             thinker_experts=8, thinker_top_k=2, thinker_moe_intermediate=16, accept_hidden_layer=2,
             talker_hidden=24, talker_layers=3, talker_heads=3, talker_kv_heads=1, talker_head_dim=8,
             talker_intermediate=32, talker_experts=3, talker_top_k=1, talker_moe_intermediate=32,
             talker_shared_intermediate=16, predictor_layers=3, predictor_intermediate=24),
        7,
    ),
}


@functools.lru_cache(maxsize=1)
def script() -> dict:
    """scripts/make_tiny_qwen3_omni.py as a namespace (a script, not part of the package)."""
    return runpy.run_path(str(SCRIPT), run_name="make_tiny_qwen3_omni")


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSET)


@functools.lru_cache(maxsize=None)
def model(name: str = "tiny"):
    """"tiny": the committed checkpoint; else a `CONFIGS` entry built from the script (float32, CPU, eval)."""
    if name == "tiny":
        from transformers import Qwen3OmniMoeForConditionalGeneration

        return Qwen3OmniMoeForConditionalGeneration.from_pretrained(ASSET).eval()
    overrides, seed = CONFIGS[name]
    s = script()
    return s["build_tiny_qwen3_model"](config=s["tiny_qwen3_config"](**overrides), seed=seed).eval()


def prompt_ids(messages: list[dict]) -> list[int]:
    """The chat template's generation prompt for `messages` (role/content dicts)."""
    tok = tokenizer()
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def im_end() -> int:
    return tokenizer().convert_tokens_to_ids("<|im_end|>")


def reference_generate(model, ids: list[int], *, voice: str, frames: int, text_tokens: int,
                       eos: list[int] | None = None, repetition_penalty: float = 1.0, with_wav: bool = False):
    """transformers' greedy generate with audio: (reply ids, codes [F, 16]); F <= frames (fewer at codec EOS).

    `eos`: the thinker's EOS ids (default <|im_end|>; generate's own default is the literal 151645);
    `repetition_penalty`: the thinker's (generate reads none from generation_config.json: 1.0 unless
    given). `with_wav`: also return generate's own waveform (float32 numpy, 1920 * F - 555 samples).
    """
    caught = {}
    hook = model.code2wav.register_forward_pre_hook(lambda _m, args: caught.setdefault("codes", args[0]))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # Its talker's penalty covers generated codes only (no input_ids): that is the behaviour we copy.
            warnings.filterwarnings("ignore", message="Passing `repetition_penalty` with `inputs_embeds`")
            sequences, wav = model.generate(
                torch.tensor([ids]),
                speaker=voice,
                thinker_max_new_tokens=text_tokens,
                thinker_eos_token_id=eos if eos is not None else im_end(),
                thinker_do_sample=False,
                thinker_repetition_penalty=repetition_penalty,
                talker_do_sample=False,
                talker_max_new_tokens=frames + 1,  # N new talker tokens give N-1 frames
            )
    finally:
        hook.remove()
    text, codes = sequences[0, len(ids):].tolist(), caught["codes"][0].T.contiguous()
    return (text, codes, wav.reshape(-1).numpy()) if with_wav else (text, codes)
