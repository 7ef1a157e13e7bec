"""Regenerate the built-in tiny random-weight Qwen3-Omni checkpoint (assets/tiny-qwen3-omni).

Usage: python scripts/make_tiny_qwen3_omni.py [OUT_DIR]   (default: assets/tiny-qwen3-omni)

What it writes is what a real Qwen3-Omni-30B-A3B folder holds (config.json with model_type
`qwen3_omni_moe`, model.safetensors, generation_config.json, tokenizer files with a chat template,
preprocessor_config.json), loadable with `Qwen3OmniMoeForConditionalGeneration.from_pretrained`, but every
width is tiny, the weights are seeded noise and the tokenizer is a small byte-level BPE trained here.
Two runs give byte-identical files; tests/test_tiny_qwen3_assets.py checks the committed folder.

Kept from the real model: every sub-model (MoE thinker with audio and vision encoders; MoE talker with a
shared expert, text_projection / hidden_projection MLPs and a code predictor with the real 16 code
groups; code2wav with the real upsampling 8*5*4*3 * 2*2 = 1920 samples a frame at 24 kHz), the codec
ids of the real config (talker vocab 3072, codebooks of 2048, pad 2148 / bos 2149 / eos 2150, nothink
2155 / think_bos 2156 / think_eos 2157, voices chelsie 2301 / ethan 2302 / aiden 2303), interleaved
M-RoPE with the real 24:20:20 split, the special-token names and their offsets from <|endoftext|>
(real ids minus 151643 plus the BPE size), routing (thinker renormalises its top-k weights, the talker
does not) and an accept_hidden_layer in the middle of the thinker, as the real 24 of 48.

Deliberately different: the sizes (thinker 2 layers x 64 wide, talker 2 x 16, code predictor 2 x 16,
code2wav one transformer layer 8 wide and a 32-channel decoder); 4 experts with 2 active in both MoEs
(real 128 with 8 / 6); the tokenizer (768 BPE entries, so the ids of the role words differ: they are
read from it). The code predictor's and the codecs' tables keep their real row counts (15 x 2048,
16 x 2048, 3072), which is most of the folder's size. Text is
gibberish and speech is noise. The heads are shaped in the weights (no engine-side masking): the thinker
emits printable text or, now and then, <|im_end|>; the talker's codebook-0 head has zero rows for every
id >= 2048 except codec EOS, which gets a row rare enough that speech runs for a while.

NB for callers of transformers' `generate`: its `thinker_eos_token_id` defaults to the literal 151645 and
its talker sampling does not come from generation_config.json, so pass `thinker_eos_token_id` (the tiny
<|im_end|>) and the talker options yourself.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from omni_cli.runtime import compat  # noqa: E402  (parameter names across transformers versions)
from omni_dev.tokenizer_kit import (  # noqa: E402  (the project's tokenizer toolkit; no family in it)
    CORPUS,
    WHISPER_FEATURES,
    chat_template,
    folder_size,
    qwen2_tokenizer,
    save_legacy_tokenizer_files,
    stop_row,
    train_bpe,
    unprintable_byte_ids,
)

DEFAULT_OUT = ROOT / "assets" / "tiny-qwen3-omni"

# --- token layout -----------------------------------------------------------------------------------
# Real Qwen3-Omni: the BPE vocabulary ends at 151642, <|endoftext|> is 151643, the added tokens follow up
# to <|audio_pad|> = 151675, and the thinker's embedding has 152064 rows. Here the BPE has BPE_SIZE entries
# and every special id keeps its offset from <|endoftext|>.
BPE_SIZE = 768
THINKER_VOCAB = 1024  # real: 152064 (= endoftext + 421); here 768 + 256
REAL_ENDOFTEXT = 151643

# (name, special) in id order from BPE_SIZE on, as in the real tokenizer (151643 ... 151675)
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),  # 151643
    ("<|im_start|>", True),  # 151644
    ("<|im_end|>", True),  # 151645
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),  # 151652
    ("<|vision_end|>", True),  # 151653
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),  # 151655
    ("<|video_pad|>", True),  # 151656
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),  # 151669
    ("<|audio_end|>", True),  # 151670
    ("<tts_pad>", True),  # 151671
    ("<tts_text_bos>", True),  # 151672
    ("<tts_text_eod>", True),  # 151673
    ("<tts_text_bos_single>", True),  # 151674
    ("<|audio_pad|>", True),  # 151675
)

# Codec side (talker vocabulary), exactly as the real config: codes 0..2047 are audio (codebook size
# 2048); the top 1024 ids of the 3072 are control ids, which `generate` suppresses except EOS.
CODEBOOK_SIZE = 2048
TALKER_VOCAB = CODEBOOK_SIZE + 1024
NUM_CODE_GROUPS = 16
CODEC_PAD, CODEC_BOS, CODEC_EOS = 2148, 2149, 2150
CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = 2155, 2156, 2157
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920  # 8*5*4*3 * 2*2: 12.5 frames/s

# How much a stop row is scaled against an ordinary row (stopping rare but possible).
_TEXT_STOP_SCALE = 1.3
_CODEC_STOP_SCALE = 1.6
# Random code2wav residual units each add a full-size signal and the output is clamped to [-1, 1]: damp
# the residual units' last convolutions and the output convolution so the noise stays well inside.
_RESIDUAL_SCALE = 0.1
_WAVE_SCALE = 0.5

_MODEL_SPECIFIC_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}


def token_id(name: str) -> int:
    """Id of a special token of the tiny tokenizer (by its real name)."""
    names = [n for n, _ in SPECIAL_TOKENS]
    return BPE_SIZE + names.index(name)


# --- config ---------------------------------------------------------------------------------------

_SIZES: dict[str, Any] = {
    "thinker_hidden": 64,
    "thinker_layers": 2,
    "thinker_heads": 4,
    "thinker_kv_heads": 2,
    "thinker_head_dim": 32,  # explicit, heads * head_dim != hidden as in the real thinker (32 x 128 on 2048)
    "thinker_experts": 4,
    "thinker_top_k": 2,
    "thinker_moe_intermediate": 32,
    "accept_hidden_layer": 1,  # hidden_states[1] = output of layer 0 (real: 24 of 48)
    "talker_hidden": 16,  # also the code predictor's width: it reads the talker's hidden state and its
    # embeddings are summed into the talker's input, so the two must match (real: both 1024)
    "talker_layers": 2,
    "talker_heads": 2,
    "talker_kv_heads": 1,
    "talker_head_dim": 32,
    "talker_intermediate": 64,  # also the middle width of text_projection / hidden_projection
    "talker_experts": 4,
    "talker_top_k": 2,
    "talker_moe_intermediate": 16,
    "talker_shared_intermediate": 32,
    "predictor_layers": 2,
    "predictor_heads": 2,
    "predictor_kv_heads": 1,
    "predictor_head_dim": 8,
    "predictor_intermediate": 32,
    "audio_hidden": 32,
    "audio_layers": 2,
    "audio_heads": 2,
    "audio_downsample": 8,
    "vision_hidden": 32,
    "vision_layers": 2,
    "vision_heads": 2,
    "code2wav_hidden": 8,
    "code2wav_layers": 1,
    "code2wav_heads": 2,
    "code2wav_intermediate": 16,
    "code2wav_decoder_dim": 32,  # halved at each of the 4 decoder blocks: 16, 8, 4, 2
}


def _mrope_section(head_dim: int) -> list[int]:
    """Temporal/height/width split of head_dim/2 rotary pairs in the real 24:20:20 proportion."""
    half = head_dim // 2
    t = round(half * 24 / 64)
    h = (half - t) // 2
    return [t, h, half - t - h]


def _rope(head_dim: int, theta: float = 1000000.0) -> dict[str, Any]:
    return {
        "rope_type": "default",
        "rope_theta": theta,
        "mrope_section": _mrope_section(head_dim),
        "interleaved": True,
        "mrope_interleaved": True,
    }


def tiny_qwen3_config(**overrides: Any):
    """A tiny but structurally faithful `Qwen3OmniMoeConfig`; keyword overrides by the names in `_SIZES`."""
    from transformers import Qwen3OmniMoeConfig

    unknown = set(overrides) - set(_SIZES)
    if unknown:
        raise TypeError(f"unknown tiny_qwen3_config overrides: {sorted(unknown)}; known: {sorted(_SIZES)}")
    s = {**_SIZES, **overrides}
    if not 1 <= s["accept_hidden_layer"] <= s["thinker_layers"]:
        raise ValueError("accept_hidden_layer must be in 1..thinker_layers (hidden_states[k] = layer k-1's output)")
    if s["code2wav_decoder_dim"] % 16:
        raise ValueError("code2wav_decoder_dim must be a multiple of 16 (halved at each of 4 decoder blocks)")
    vocab = _bpe()[0]
    endoftext, im_end = token_id("<|endoftext|>"), token_id("<|im_end|>")
    mm_ids = {
        "audio_token_id": token_id("<|audio_pad|>"),
        "image_token_id": token_id("<|image_pad|>"),
        "video_token_id": token_id("<|video_pad|>"),
        "audio_start_token_id": token_id("<|audio_start|>"),
        "audio_end_token_id": token_id("<|audio_end|>"),
        "vision_start_token_id": token_id("<|vision_start|>"),
        "vision_end_token_id": token_id("<|vision_end|>"),
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
    }
    text_config = {
        "vocab_size": THINKER_VOCAB,
        "hidden_size": s["thinker_hidden"],
        "intermediate_size": s["thinker_moe_intermediate"],
        "moe_intermediate_size": s["thinker_moe_intermediate"],
        "num_hidden_layers": s["thinker_layers"],
        "num_attention_heads": s["thinker_heads"],
        "num_key_value_heads": s["thinker_kv_heads"],
        "head_dim": s["thinker_head_dim"],
        "num_experts": s["thinker_experts"],
        "num_experts_per_tok": s["thinker_top_k"],
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _rope(s["thinker_head_dim"]),
        "tie_word_embeddings": False,
        "bos_token_id": endoftext,
        "eos_token_id": im_end,
        "pad_token_id": endoftext,
    }
    audio_config = {
        "num_mel_bins": 128,
        "d_model": s["audio_hidden"],
        "encoder_layers": s["audio_layers"],
        "encoder_attention_heads": s["audio_heads"],
        "encoder_ffn_dim": 2 * s["audio_hidden"],
        "downsample_hidden_size": s["audio_downsample"],
        "output_dim": s["thinker_hidden"],
        "max_source_positions": 1500,
        "n_window": 50,
        "n_window_infer": 800,
        "conv_chunksize": 500,
    }
    vision_config = {
        "depth": s["vision_layers"],
        "hidden_size": s["vision_hidden"],
        "intermediate_size": 2 * s["vision_hidden"],
        "num_heads": s["vision_heads"],
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": s["thinker_hidden"],
        "num_position_embeddings": 256,  # real 2304 (48 x 48 grid); interpolated for other sizes
        "deepstack_visual_indexes": list(range(s["vision_layers"])),
    }
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        "user_token_id": vocab["user"],
        **mm_ids,
    }
    predictor_config = {
        "vocab_size": CODEBOOK_SIZE,
        "hidden_size": s["talker_hidden"],
        "intermediate_size": s["predictor_intermediate"],
        "num_hidden_layers": s["predictor_layers"],
        "num_attention_heads": s["predictor_heads"],
        "num_key_value_heads": s["predictor_kv_heads"],
        "head_dim": s["predictor_head_dim"],
        "num_code_groups": NUM_CODE_GROUPS,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }
    talker_text_config = {
        "vocab_size": TALKER_VOCAB,
        "hidden_size": s["talker_hidden"],
        "intermediate_size": s["talker_intermediate"],
        "moe_intermediate_size": s["talker_moe_intermediate"],
        "shared_expert_intermediate_size": s["talker_shared_intermediate"],
        "num_hidden_layers": s["talker_layers"],
        "num_attention_heads": s["talker_heads"],
        "num_key_value_heads": s["talker_kv_heads"],
        "head_dim": s["talker_head_dim"],
        "num_experts": s["talker_experts"],
        "num_experts_per_tok": s["talker_top_k"],
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _rope(s["talker_head_dim"]),
    }
    talker_config = {
        "text_config": talker_text_config,
        "code_predictor_config": predictor_config,
        "num_code_groups": NUM_CODE_GROUPS,
        "thinker_hidden_size": s["thinker_hidden"],
        "accept_hidden_layer": s["accept_hidden_layer"],
        "codec_pad_id": CODEC_PAD,
        "codec_bos_id": CODEC_BOS,
        "codec_eos_token_id": CODEC_EOS,
        "codec_nothink_id": CODEC_NOTHINK,
        "codec_think_bos_id": CODEC_THINK_BOS,
        "codec_think_eos_id": CODEC_THINK_EOS,
        "speaker_id": dict(SPEAKERS),
        "spatial_merge_size": 2,
        **mm_ids,
    }
    code2wav_config = {
        "codebook_size": CODEBOOK_SIZE,
        "num_quantizers": NUM_CODE_GROUPS,
        "hidden_size": s["code2wav_hidden"],
        "intermediate_size": s["code2wav_intermediate"],
        "num_hidden_layers": s["code2wav_layers"],
        "num_attention_heads": s["code2wav_heads"],
        "num_key_value_heads": s["code2wav_heads"],
        "sliding_window": 72,
        "max_position_embeddings": 8000,
        "rms_norm_eps": 1e-5,
        "layer_scale_initial_scale": 0.01,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": s["code2wav_decoder_dim"],
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker_config,
        talker_config=talker_config,
        code2wav_config=code2wav_config,
        enable_audio_output=True,
        im_start_token_id=token_id("<|im_start|>"),
        im_end_token_id=im_end,
        tts_pad_token_id=token_id("<tts_pad>"),
        tts_bos_token_id=token_id("<tts_text_bos>"),
        tts_eos_token_id=token_id("<tts_text_eod>"),
        system_token_id=vocab["system"],
        user_token_id=vocab["user"],
        assistant_token_id=vocab["assistant"],
    )


# --- weights --------------------------------------------------------------------------------------


def _fill_all(model, seed: int) -> None:
    """Re-fill every parameter in sorted-name order from one seeded generator (independent of HF init):
    embeddings N(0, 1); matrices, kernels and expert stacks N(0, 1/fan_in); norm scales 1; biases and
    SnakeBeta log-scales 0; layer scales at the config's initial value (0.01; ConvNeXt's gamma 1e-6 too)."""
    import torch

    embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    layer_scale = model.config.code2wav_config.layer_scale_initial_scale
    gen = torch.Generator().manual_seed(seed)
    # Checkpoint names (5.21 renamed the thinker's parameters): the fill order, and so the files, stay put.
    for name, param in sorted(model.named_parameters(), key=lambda kv: compat.checkpoint_name(kv[0])):
        leaf = name.rsplit(".", 1)[-1]
        if param.ndim == 1:
            if leaf in ("bias", "alpha", "beta"):
                param.zero_()
            elif leaf == "scale":  # code2wav LayerScale
                param.fill_(layer_scale)
            elif leaf == "gamma":  # ConvNeXt
                param.fill_(1e-6)
            else:
                param.fill_(1.0)
        elif name in embeddings:
            param.copy_(torch.randn(param.shape, generator=gen))
        elif param.ndim == 3 and ".experts." in name:  # [experts, out, in]
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
        else:
            param.copy_(torch.randn(param.shape, generator=gen) / param[0].numel() ** 0.5)


def _shape_outputs(model) -> None:
    """Heads emit only sensible ids (stop rows possible but rare); code2wav gives quiet, unclipped noise."""
    lm_head = model.thinker.lm_head.weight  # [vocab, hidden]
    endoftext, im_end = token_id("<|endoftext|>"), token_id("<|im_end|>")
    lm_head[endoftext:] = 0.0  # specials and unused rows never appear as text
    lm_head[unprintable_byte_ids(_bpe()[0])] = 0.0  # lone bytes that would print as control chars or U+FFFD
    lm_head[im_end] = stop_row(lm_head, 11) * _TEXT_STOP_SCALE

    codec_head = model.talker.codec_head.weight  # [3072, talker_hidden]
    codec_head[CODEBOOK_SIZE:] = 0.0  # control ids: suppressed by generate anyway, never favoured here
    codec_head[CODEC_EOS] = stop_row(codec_head, 17) * _CODEC_STOP_SCALE

    code2wav = model.code2wav
    for name, param in code2wav.decoder.named_parameters():
        if name.endswith(".conv2.conv.weight"):  # the 1x1 convolution closing each residual unit
            param.mul_(_RESIDUAL_SCALE)
    code2wav.decoder[-1].conv.weight.mul_(_WAVE_SCALE)


def build_tiny_qwen3_model(seed: int = 0, config=None):
    """The tiny `Qwen3OmniMoeForConditionalGeneration`, float32, seeded weights, generation config set."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    config = config if config is not None else tiny_qwen3_config()
    torch.manual_seed(seed)  # HF's own init (overwritten below) must not depend on the caller's RNG state
    model = Qwen3OmniMoeForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        _fill_all(model, seed)
        _shape_outputs(model)
    model.generation_config = make_generation_config()
    return model


def make_generation_config():
    """Thinker-side defaults as the real generation_config.json; NB transformers' Qwen3 `generate` reads none
    of it for the talker, and takes its thinker EOS from its own argument (default: the literal 151645)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=token_id("<|endoftext|>"),
        eos_token_id=[token_id("<|im_end|>"), token_id("<|endoftext|>")],
        pad_token_id=token_id("<|endoftext|>"),
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
    )


# --- tokenizer ------------------------------------------------------------------------------------

# The role words must be single BPE tokens (as in the real tokenizer: system 8948, user 872, assistant
# 77091): a few chat-shaped lines on top of the project's corpus make them so.
_ROLE_LINES = "".join(f"{role}\n" for _ in range(12) for role in ("system", "user", "assistant"))
_QWEN3CORPUS = CORPUS + _ROLE_LINES


@functools.lru_cache(maxsize=1)
def _bpe() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """The tiny Qwen3-Omni BPE: BPE_SIZE entries trained on the project's corpus plus the role lines."""
    vocab, merges = train_bpe(_QWEN3CORPUS, BPE_SIZE)
    for role in ("system", "user", "assistant"):
        if role not in vocab:
            raise RuntimeError(f"tiny BPE: role word {role!r} is not a single token")
    return vocab, merges


# Our own Jinja chat template in the Qwen3-Omni prompt form (no default system turn is added).
CHAT_TEMPLATE = chat_template("<|audio_start|><|audio_pad|><|audio_end|>",
                              "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>")


def make_tokenizer():
    """The tiny `Qwen2TokenizerFast`: trained BPE + Qwen3-Omni's special tokens, names and chat template."""
    return qwen2_tokenizer(_bpe(), SPECIAL_TOKENS, CHAT_TEMPLATE, _MODEL_SPECIFIC_TOKENS, 65536)


# --- files ----------------------------------------------------------------------------------------

PREPROCESSOR_CONFIG: dict[str, Any] = {**WHISPER_FEATURES, "processor_class": "Qwen3OmniMoeProcessor"}


def save_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint in the on-disk form of a real Qwen3-Omni folder; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_tiny_qwen3_model(seed=seed)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(folder)
    save_legacy_tokenizer_files(folder, tokenizer, _bpe(), SPECIAL_TOKENS)
    text = json.dumps(PREPROCESSOR_CONFIG, indent=2, sort_keys=True) + "\n"
    (folder / "preprocessor_config.json").write_text(text, encoding="utf-8")
    return folder


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0] in ("-h", "--help")):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    out = Path(argv[0]) if argv else DEFAULT_OUT
    save_checkpoint(out)
    print(f"wrote {out} ({folder_size(out) / 1e6:.2f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
