"""The built-in tiny Qwen2.5-Omni: a random-weight checkpoint with the real one's structure and files.

`save_checkpoint` writes what a real Qwen2.5-Omni folder holds (config.json, model.safetensors,
generation_config.json, tokenizer files with the chat template, preprocessor_config.json, spk_dict.pt),
but every width is tiny, the weights are seeded noise and the tokenizer is a small byte-level BPE trained
here on a fixed English text. Everything is deterministic: the same seed gives the same files.

What it keeps from the real model: all sub-models (thinker with audio and vision encoders, talker,
token2wav DiT + BigVGAN), the special-token names and their relative ids (the real ids minus 151643 plus
the BPE size), the codec ids (8448 talker codes, pad 8292 / bos 8293 / eos 8294 / mask 8296), M-RoPE,
the DiT block window and BigVGAN's hop of 240 (24 kHz at 100 mel frames/s).

What it deliberately does not know: anything a trained model knows. Text is gibberish and speech is
noise. The weights are shaped so that the talker only emits audio codes (< 8192) or, rarely, its
end codes (8294, 8292), and the thinker only emits printable text or, now and then, <|im_end|> — built
into the weights, so no engine-side masking is needed. The random values come from torch's seeded CPU
generator: a torch release that changed it would change the files (tests/test_tiny_assets.py notices).
torch, transformers and tokenizers are imported inside the functions.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from omni_cli.runtime import compat

from .tokenizer_kit import (CORPUS, WHISPER_FEATURES, chat_template, folder_size,  # noqa: F401 (folder_size: scripts)
                            qwen2_tokenizer, save_legacy_tokenizer_files, stop_row, train_bpe, unprintable_byte_ids)

# --- token layout -----------------------------------------------------------------------------------
# Real Qwen2.5-Omni: the BPE vocabulary ends at 151642 and <|endoftext|> is 151643. Here the BPE has
# BPE_SIZE entries and every special id keeps its offset from <|endoftext|>.
BPE_SIZE = 768
THINKER_VOCAB = 1024  # real: 152064 (= endoftext + 421); here 768 + 256

# (name, special) in id order from BPE_SIZE on, as in the real tokenizer (151643 ... 151664)
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|AUDIO|>", True),
    ("<|audio_bos|>", True),
    ("<|audio_eos|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_bos|>", True),
    ("<|vision_eos|>", True),
    ("<|vision_pad|>", True),
    ("<|IMAGE|>", True),
    ("<|VIDEO|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)

# Offsets from <|endoftext|> of ids that live in the thinker's embedding but not in the tokenizer.
_TTS_TEXT_PAD_OFFSET = 216  # real 151859
_TTS_TEXT_START_OFFSET = 217  # real 151860
_TTS_TEXT_END_OFFSET = 218  # real 151861
_VOICE_OFFSETS = {"Ethan": 227, "Chelsie": 229}  # real 151870, 151872

CODEC_VOCAB = 8448
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 8292, 8293, 8294, 8296
AUDIO_CODES = 8192  # codes below this are audio; token2wav's code embedding has 8193(+1) rows

# How much a stop row of a head is scaled against an ordinary row (makes stopping rare but possible):
# with these, greedy text replies end after ~10-100 tokens and speech usually runs past 10 s.
_TEXT_STOP_SCALE = 1.3
_CODEC_STOP_SCALE = 1.4
# Random BigVGAN residual blocks each double the signal (output clipped at full scale): damp their second
# convolutions and the output convolution so the noise comes out at a std of about 0.09, peaks under 0.8.
_RESIDUAL_SCALE = 0.1
_WAVE_SCALE = 0.5

_MODEL_SPECIFIC_TOKENS = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
}

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


def token_id(name: str) -> int:
    """Id of a special token of the tiny tokenizer (by its real name), without building the tokenizer."""
    names = [n for n, _ in SPECIAL_TOKENS]
    return BPE_SIZE + names.index(name)


def tts_text_ids() -> dict[str, int]:
    """The talker's text-side ids (thinker vocabulary, outside the tokenizer): start / end / pad."""
    base = token_id("<|endoftext|>")
    return {
        "start": base + _TTS_TEXT_START_OFFSET,
        "end": base + _TTS_TEXT_END_OFFSET,
        "pad": base + _TTS_TEXT_PAD_OFFSET,
    }


def voice_bos_ids() -> dict[str, int]:
    """Per voice, the text-side id the talker prompt starts with (spk_dict's `bos_token`)."""
    base = token_id("<|endoftext|>")
    return {name: base + off for name, off in _VOICE_OFFSETS.items()}


# --- config ---------------------------------------------------------------------------------------

_SIZES: dict[str, Any] = {
    "thinker_hidden": 64,
    "thinker_layers": 2,
    "thinker_heads": 4,
    "thinker_kv_heads": 2,
    "thinker_intermediate": 128,
    "talker_hidden": 48,
    "talker_layers": 2,
    "talker_heads": 4,
    "talker_kv_heads": 2,
    "talker_head_dim": 16,  # explicit and != hidden / heads, as in the real talker (896 wide, 12 x 128)
    "talker_intermediate": 96,
    "audio_hidden": 32,
    "audio_layers": 2,
    "audio_heads": 2,
    "vision_hidden": 32,
    "vision_layers": 2,
    "vision_heads": 2,
    # The vocoder is most of a reply's CPU time (36 DiT evaluations a window, BigVGAN at up to 24 kHz),
    # and at these widths it is per-operation overhead, so depth and BigVGAN's stages are what cost.
    # Two DiT layers keep the real window (layer 0 looks one block back, layer 1 one back and one
    # ahead: 48 frames of past, 24 of future); four BigVGAN stages (real: six) still multiply to 240.
    # Measured on one core (StreamingVocoder alone, 150 codes pushed one by one, engine chunk sizes):
    # 4 layers x 64 wide + 6 stages x 64 channels cost 0.30 s of CPU per second of audio, these 0.13.
    "dit_hidden": 32,
    "dit_layers": 2,
    "dit_heads": 2,
    "dit_head_dim": 16,
    "dit_emb_dim": 32,
    "bigvgan_channels": 16,  # halved at each upsampling stage: 8, 4, 2, 1
    "bigvgan_upsample_rates": (5, 4, 4, 3),
}


def _mrope_section(head_dim: int) -> list[int]:
    """Temporal/height/width split of head_dim/2 rotary pairs in the real 16:24:24 proportion."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def _upsample_kernel(rate: int) -> int:
    """BigVGAN's transposed-conv kernel for an upsampling rate: about twice the rate, and rate plus an even
    number, so each stage gives exactly `rate` samples a frame (the real model: 5 -> 11, 3 -> 7, 2 -> 4)."""
    return 2 * rate + rate % 2


def tiny_config(**overrides: Any):
    """A tiny but structurally faithful `Qwen2_5OmniConfig`; keyword overrides by the names in `_SIZES`."""
    from transformers import Qwen2_5OmniConfig

    unknown = set(overrides) - set(_SIZES)
    if unknown:
        raise TypeError(f"unknown tiny_config overrides: {sorted(unknown)}; known: {sorted(_SIZES)}")
    s = {**_SIZES, **overrides}
    if s["thinker_hidden"] % s["thinker_heads"]:
        raise ValueError("thinker_hidden must be a multiple of thinker_heads")
    endoftext, im_end = token_id("<|endoftext|>"), token_id("<|im_end|>")
    tts = tts_text_ids()
    mm_ids = {
        "audio_token_index": token_id("<|AUDIO|>"),
        "image_token_index": token_id("<|IMAGE|>"),
        "video_token_index": token_id("<|VIDEO|>"),
        "audio_start_token_id": token_id("<|audio_bos|>"),
        "audio_end_token_id": token_id("<|audio_eos|>"),
    }
    thinker_head_dim = s["thinker_hidden"] // s["thinker_heads"]
    text_config = {
        "vocab_size": THINKER_VOCAB,
        "hidden_size": s["thinker_hidden"],
        "intermediate_size": s["thinker_intermediate"],
        "num_hidden_layers": s["thinker_layers"],
        "num_attention_heads": s["thinker_heads"],
        "num_key_value_heads": s["thinker_kv_heads"],
        "max_position_embeddings": 32768,
        "max_window_layers": s["thinker_layers"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": _mrope_section(thinker_head_dim),
        },
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
        "max_source_positions": 1500,
        "n_window": 100,
        "output_dim": s["thinker_hidden"],
    }
    vision_config = {
        "depth": s["vision_layers"],
        "hidden_size": s["vision_hidden"],
        "intermediate_size": 2 * s["vision_hidden"],
        "num_heads": s["vision_heads"],
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "out_hidden_size": s["thinker_hidden"],
        "fullatt_block_indexes": [s["vision_layers"] - 1],
    }
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        "user_token_id": _bpe()[0]["user"],
        "vision_start_token_id": token_id("<|vision_bos|>"),
        "vision_end_token_id": token_id("<|vision_eos|>"),
        "vision_token_id": token_id("<|vision_pad|>"),
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        **mm_ids,
    }
    talker_config = {
        "vocab_size": CODEC_VOCAB,
        "embedding_size": s["thinker_hidden"],
        "hidden_size": s["talker_hidden"],
        "intermediate_size": s["talker_intermediate"],
        "num_hidden_layers": s["talker_layers"],
        "num_attention_heads": s["talker_heads"],
        "num_key_value_heads": s["talker_kv_heads"],
        "head_dim": s["talker_head_dim"],
        "max_window_layers": s["talker_layers"],
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": _mrope_section(s["talker_head_dim"]),
        },
        "tts_text_start_token_id": tts["start"],
        "tts_text_end_token_id": tts["end"],
        "tts_text_pad_token_id": tts["pad"],
        "tts_codec_start_token_id": CODEC_BOS,
        "tts_codec_end_token_id": CODEC_EOS,
        "tts_codec_pad_token_id": CODEC_PAD,
        "tts_codec_mask_token_id": CODEC_MASK,
        "vision_start_token_id": token_id("<|vision_bos|>"),
        "vision_end_token_id": token_id("<|vision_eos|>"),
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "spatial_merge_size": 2,
        **mm_ids,
    }
    dit_config = {
        "hidden_size": s["dit_hidden"],
        "num_hidden_layers": s["dit_layers"],
        "num_attention_heads": s["dit_heads"],
        "head_dim": s["dit_head_dim"],
        "ff_mult": 2,
        "emb_dim": s["dit_emb_dim"],
        "block_size": 24,
        "look_ahead_layers": [s["dit_layers"] // 2],
        "look_backward_layers": [0, s["dit_layers"] - 1],
        "repeats": 2,
        "num_embeds": 8193,
        "mel_dim": 80,
        "dropout": 0.1,
        "enc_emb_dim": 192,
        "enc_dim": 32,
        "enc_channels": [32, 32, 32, 32, 96],  # last == sum of the middle three (multi-layer aggregation)
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1],
        "enc_attention_channels": 16,
        "enc_res2net_scale": 2,
        "enc_se_channels": 16,
    }
    rates = tuple(s["bigvgan_upsample_rates"])
    if math.prod(rates) != 240:
        raise ValueError(f"bigvgan_upsample_rates must multiply to 240 (24 kHz from 100 mel frames/s), got {rates}")
    if s["bigvgan_channels"] >> len(rates) < 1:
        raise ValueError("bigvgan_channels must be at least 2 ** len(bigvgan_upsample_rates) (halved at each stage)")
    bigvgan_config = {
        "mel_dim": 80,
        "upsample_initial_channel": s["bigvgan_channels"],
        "resblock_kernel_sizes": [3],
        "resblock_dilation_sizes": [[1, 3, 5]],
        "upsample_rates": list(rates),  # product 240: 100 mel frames/s -> 24 kHz
        "upsample_kernel_sizes": [_upsample_kernel(r) for r in rates],
    }
    return Qwen2_5OmniConfig(
        thinker_config=thinker_config,
        talker_config=talker_config,
        token2wav_config={"dit_config": dit_config, "bigvgan_config": bigvgan_config},
        enable_audio_output=True,
    )


# --- weights --------------------------------------------------------------------------------------


def _fill(param, gen, embedding: bool) -> None:
    """Seeded values for one parameter: embeddings N(0, 1), other matrices and kernels N(0, 1/fan_in),
    norm scales 1, biases 0 (SnakeBeta's log-scale alpha/beta are 1-D non-biases: set to 0 by the caller)."""
    import torch

    if param.ndim == 1:
        param.fill_(1.0)
    elif embedding:
        param.copy_(torch.randn(param.shape, generator=gen))
    else:
        param.copy_(torch.randn(param.shape, generator=gen) / param[0].numel() ** 0.5)


def _fill_all(model, seed: int) -> None:
    """Re-fill every parameter in sorted-name order from one seeded generator (independent of HF init)."""
    import torch

    embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    gen = torch.Generator().manual_seed(seed)
    # Checkpoint names (5.21 renamed the thinker's parameters): the fill order, and so the files, stay put.
    for name, param in sorted(model.named_parameters(), key=lambda kv: compat.checkpoint_name(kv[0])):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("bias", "alpha", "beta") and param.ndim == 1:  # alpha/beta: BigVGAN SnakeBeta log-scales
            param.zero_()
        else:
            _fill(param, gen, name in embeddings)


def _shape_outputs(model) -> None:
    """Heads emit only sensible ids (stop rows possible but rare); the vocoder gives quiet, unclipped noise."""
    lm_head = model.thinker.lm_head.weight  # [vocab, hidden]
    endoftext, im_end = token_id("<|endoftext|>"), token_id("<|im_end|>")
    lm_head[endoftext:] = 0.0  # specials, tts/voice ids and unused rows never appear as text
    lm_head[unprintable_byte_ids(_bpe()[0])] = 0.0  # lone bytes that would print as control chars or U+FFFD
    lm_head[im_end] = stop_row(lm_head, 11) * _TEXT_STOP_SCALE  # a chat reply ends with <|im_end|> only

    codec_head = model.talker.codec_head.weight  # [8448, talker_hidden]
    codec_head[AUDIO_CODES:] = 0.0  # ids >= 8192 would overflow token2wav's code embedding
    talker = model.config.talker_config
    codec_head[talker.tts_codec_end_token_id] = stop_row(codec_head, 17) * _CODEC_STOP_SCALE
    codec_head[talker.tts_codec_pad_token_id] = stop_row(codec_head, 19)

    vocoder = model.token2wav.code2wav_bigvgan_model
    for name, param in vocoder.named_parameters():
        if ".convs2." in name and name.endswith(".weight"):
            param.mul_(_RESIDUAL_SCALE)
    vocoder.conv_post.weight.mul_(_WAVE_SCALE)


def build_tiny_model(config=None, seed: int = 0):
    """The tiny `Qwen2_5OmniForConditionalGeneration`, float32, seeded weights, voices in `speaker_map`."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    config = config if config is not None else tiny_config()
    model = Qwen2_5OmniForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        _fill_all(model, seed)
        _shape_outputs(model)
    model.speaker_map.update(make_speakers(seed))
    model.generation_config = make_generation_config()
    return model


def make_speakers(seed: int = 0) -> dict:
    """Two voices as in spk_dict.pt: `bos_token` (text-side id), `cond` (1x192), `ref_mel` (1xTx80)."""
    import torch

    gen = torch.Generator().manual_seed(10_000 + seed)
    bos = voice_bos_ids()
    speakers = {}
    for name, frames in (("Chelsie", 160), ("Ethan", 240)):
        cond = torch.randn(1, 192, generator=gen)
        # smooth log-mel-like values: a per-bin spectral tilt plus slowly varying noise
        tilt = torch.linspace(-3.0, -8.0, 80)
        noise = torch.randn(1, frames // 8 + 2, 80, generator=gen)
        noise = torch.nn.functional.interpolate(noise.transpose(1, 2), size=frames, mode="linear")
        ref_mel = (tilt + 1.5 * noise.transpose(1, 2)).float()
        speakers[name] = {"bos_token": bos[name], "cond": cond.float(), "ref_mel": ref_mel.contiguous()}
    return speakers


def make_generation_config():
    """Thinker-side generation defaults (Qwen2.5 chat-style sampling), as generation_config.json."""
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

@functools.lru_cache(maxsize=4)
def _bpe() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """The Qwen2.5 tiny model's BPE: BPE_SIZE entries trained on `CORPUS`."""
    return train_bpe(CORPUS, BPE_SIZE)


# Our own Jinja chat template in the Qwen2.5-Omni form. A conversation that doesn't start with a system
# turn gets the default system prompt, as Qwen's templates do.
CHAT_TEMPLATE = chat_template("<|audio_bos|><|AUDIO|><|audio_eos|>", "<|vision_bos|><|IMAGE|><|vision_eos|>",
                              "<|vision_bos|><|VIDEO|><|vision_eos|>", default_system=DEFAULT_SYSTEM_PROMPT)


def make_tokenizer():
    """The tiny `Qwen2TokenizerFast`: trained BPE + the real special tokens, names and chat template."""
    return qwen2_tokenizer(_bpe(), SPECIAL_TOKENS, CHAT_TEMPLATE, _MODEL_SPECIFIC_TOKENS, 32768)


# --- files ----------------------------------------------------------------------------------------

PREPROCESSOR_CONFIG: dict[str, Any] = {
    **WHISPER_FEATURES,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "max_pixels": 12845056,
    "merge_size": 2,
    "min_pixels": 3136,
    "patch_size": 14,
    "processor_class": "Qwen2_5OmniProcessor",
    "temporal_patch_size": 2,
}


def save_checkpoint(folder: str | Path, config=None, seed: int = 0) -> Path:
    """Write the tiny checkpoint in the on-disk form of a real Qwen2.5-Omni folder; returns the folder."""
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(config, seed=seed)
    model.save_pretrained(folder, safe_serialization=True)
    torch.save(model.speaker_map, folder / "spk_dict.pt")
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(folder)
    save_legacy_tokenizer_files(folder, tokenizer, _bpe(), SPECIAL_TOKENS)
    text = json.dumps(PREPROCESSOR_CONFIG, indent=2, sort_keys=True) + "\n"
    (folder / "preprocessor_config.json").write_text(text, encoding="utf-8")
    return folder

