"""Qwen2.5-Omni for `omni-bench`: its presets, a random-weight model at true size, transformers' reference.

What it knows: the true sizes of Qwen2.5-Omni-7B and -3B (the 3B talker's are assumed: approximate) and
the built-in tiny checkpoint; how to build each (random weights allocated on the device, or the tiny
checkpoint in float32); a benchmark prompt; the decode-step variants and vocoder schedules `--variants`
and `--schedules` time; and `Qwen2_5OmniForConditionalGeneration.generate` at forced lengths, timed per
stage. What it does not: measuring our engine, the table, the flags (omni_cli/bench.py, which reaches
every family through the same names here). Torch and transformers are imported when a function runs.
"""

from __future__ import annotations


import time
from typing import Any

from . import CODES_PER_SECOND, DEFAULT_VOICE, TALKER_SAMPLING, TITLE  # noqa: F401 (bench reads them here)

FAMILY = "qwen2.5-omni"  # as the bench's JSON names it
UNIT = "codes"  # a talker step: one code (CODES_PER_SECOND of them a second of audio)
PROMPT_FRAME = 0  # prompt ids that are not the user's: none (the prompt is plain random ids)
GRAPHS = True  # the steps follow --graphs
READY_NOTE = "graphs captured"  # what the engine's warm-up did (the bench adds whether it compiled)

_ENCODERS = dict(
    audio=dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16),
)

PRESETS: dict[str, dict[str, Any]] = {
    # True sizes of Qwen2.5-Omni-7B (see shared notes).
    "qwen2.5-omni-7b": dict(
        text=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  intermediate_size=18944, vocab_size=152064),
        talker=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=12, num_key_value_heads=4,
                    head_dim=128, intermediate_size=18944, embedding_size=3584),
        **_ENCODERS,
        approximate=False,
    ),
    # The 3B thinker is public; its talker sizes are not: the 7B talker's are assumed (approximate).
    "qwen2.5-omni-3b": dict(
        text=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                  intermediate_size=11008, vocab_size=151936),
        talker=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=12, num_key_value_heads=4,
                    head_dim=128, intermediate_size=18944, embedding_size=2048),
        **_ENCODERS,
        approximate=True,
    ),
    # The built-in tiny checkpoint (assets/), loaded with from_pretrained in float32.
    "tiny": dict(asset="tiny-qwen2.5-omni", approximate=False),
}

# How the decode steps run (Qwen25Steps' fast_decode, graphs, compile). The vocoder follows `graphs` and
# `compile`: "graphs" replays its ODE steps as graphs of the plain DiT, "graphs+compile" each window's whole
# ODE as one graph of the compiled DiT.
VARIANTS = {
    "eager": dict(fast_decode=False, graphs=False, compile=False),  # the library's layers, one launch at a time
    "fused": dict(fast_decode=True, graphs=False, compile=False),  # fused QKV / gate-up fixed-shape step
    "graphs": dict(fast_decode=True, graphs=True, compile=False),  # ... replayed as CUDA graphs
    "graphs+compile": dict(fast_decode=True, graphs=True, compile=True),  # ... inductor-fused (default on CUDA)
}

SCHEDULES = {"chunk48": 48, "chunk96": 96, "chunk192": 192}  # the vocoder's steady chunk, in codes

# Relabelled table rows (None: a row this family has not).
LABELS = {"code_predictor_ms_per_frame": None}


def build_config(name: str):
    """The preset's Qwen2_5OmniConfig: true sizes (the library's defaults where they are the real ones),
    or the tiny checkpoint's config.json."""
    p = PRESETS[name]
    if "asset" in p:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(_asset_folder(name)), local_files_only=True)
    from transformers import Qwen2_5OmniConfig

    width = p["text"]["hidden_size"]
    text = dict(p["text"], rope_parameters=_mrope(), max_position_embeddings=32768)
    talker = dict(p["talker"], rope_parameters=_mrope(), vocab_size=8448)
    return Qwen2_5OmniConfig(
        thinker_config={"text_config": text, "audio_config": dict(p["audio"], output_dim=width),
                        "vision_config": dict(p["vision"], out_hidden_size=width),
                        # the real checkpoint's special ids (the library's defaults lack some of them)
                        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654},
        talker_config=talker,
        token2wav_config={},  # the library's DiT / BigVGAN defaults are the real sizes
        enable_audio_output=True,
    )


def _mrope() -> dict:
    return {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}


def _asset_folder(name: str):
    from .. import BUILTIN_TINY_DIRS

    return next(d for d in BUILTIN_TINY_DIRS if d.name == PRESETS[name]["asset"])


def build_model(name: str, device, dtype, progress=lambda message: None, quantize: str | None = None,
                group_size: int | None = None):
    """(model, voices): random weights allocated and initialised on the device with one random voice,
    Chelsie (the tiny preset: its checkpoint, in float32 whatever `dtype` says). transformers' config
    warnings stay quiet: nothing a user can act on. `quantize`: the decoder layers packed as they are made,
    one at a time (models/random_packed.py; the tiny preset: loaded on the CPU and packed)."""
    from ..weights import quiet_transformers

    with quiet_transformers():
        return _build_model(name, device, dtype, progress, quantize, group_size)


def _build_model(name: str, device, dtype, progress=lambda message: None, quantize=None, group_size=None):
    import torch

    if "asset" in PRESETS[name]:  # the tiny model is made and checked in float32
        from ..random_packed import load_asset
        from .checkpoint import load

        model, voices = load_asset(load, _asset_folder(name), device, name, quantize, group_size, progress)
        return model.eval(), voices
    from transformers import Qwen2_5OmniForConditionalGeneration

    config = build_config(name)
    from ...quant.apply import cast_token2wav
    from ..random_packed import build

    model = build(lambda: Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=dtype), device, dtype,
                  quantize, group_size, progress)
    # BigVGAN's filters are made in float32 whatever the constructor's dtype: the cast covers buffers too.
    cast_token2wav(model, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    mel = config.token2wav_config.dit_config.mel_dim
    enc = config.token2wav_config.dit_config.enc_emb_dim
    model.speaker_map = {
        "Chelsie": {"bos_token": 151872, "cond": torch.randn(1, enc, device=device, generator=g),
                    "ref_mel": torch.randn(1, 300, mel, device=device, generator=g)},
    }
    return model.eval(), model.speaker_map


def text_eos_ids(model) -> list[int]:
    return [151645, 151643]  # <|im_end|>, <|endoftext|>


def prompt(model, prompt_tokens: int) -> list[int]:
    """`prompt_tokens` plain random ids (below the special ids)."""
    import torch

    g = torch.Generator().manual_seed(1)
    vocab = model.config.thinker_config.text_config.vocab_size
    return torch.randint(0, min(vocab, 150000), (prompt_tokens,), generator=g).tolist()


def spoken_turn(model, audio_tokens: int, seed: int) -> list[int]:
    """A user turn for `omni-bench --turns`: a clip's `audio_tokens` placeholders between its start and end
    ids, eight random words around it (the template's ids random too, as in `prompt`)."""
    import torch

    cfg = model.config.thinker_config
    g = torch.Generator().manual_seed(100 + seed)
    words = torch.randint(0, min(cfg.text_config.vocab_size, cfg.audio_start_token_id), (8,), generator=g).tolist()
    return words[:3] + [cfg.audio_start_token_id] + [cfg.audio_token_index] * audio_tokens + [cfg.audio_end_token_id] + words[3:]


def reply_end(model) -> list[int]:
    """What follows a reply's text in the next prompt (random ids, as the template's are here)."""
    return [7, 11]


def spoken_inputs(clips, kept=None) -> tuple[dict, list[int]]:
    """The clips' encoder inputs as the processor makes them (the built-in checkpoint's feature extractor:
    the real one's settings), and each clip's placeholder count; `kept` as models/audio_features.py says."""
    from .. import qwen2_5_omni as family
    from ..audio_features import spoken_inputs as inputs

    return inputs(family, _asset_folder("tiny"), clips, kept)


def steps(model, voices: dict, *, max_context: int, max_codes: int, graphs: bool = True, variant: str | None = None,
          compile: bool = True, runtime=None):
    """The engine's steps: `runtime` (omni-bench's RuntimeOptions; else `graphs` and `compile`) with these
    cache sizes, or one of VARIANTS over it."""
    from dataclasses import replace

    from ...config import RuntimeOptions
    from .steps import Qwen25Steps

    runtime = runtime or RuntimeOptions(graphs=graphs, compile=compile)
    options = dict(VARIANTS[variant]) if variant else dict(fast_decode=None, graphs=runtime.graphs,
                                                           compile=runtime.compile and runtime.graphs)
    fast_decode = options.pop("fast_decode")
    runtime = replace(runtime, max_context=max_context, max_codes=max_codes, **options)
    return Qwen25Steps(model, voices, runtime, fast_decode=fast_decode)


def use_schedule(steps, name: str) -> None:
    """The vocoder's steady chunk of SCHEDULES[name] from now on (its windows captured once, kept on the model)."""
    steps.vocoder_chunk_codes = SCHEDULES[name]
    steps.warmup_vocoder()


def reference(model, prompt_ids, text_tokens: int, codes: int, device, progress=lambda message: None) -> dict:
    """`Qwen2_5OmniForConditionalGeneration.generate` at forced lengths (text: min = max new tokens; talker:
    min = max codes, only audio codes sampled), thinker and talker sampling at its defaults. Nothing
    streams: the time to first audio is the whole call. Stage times are the wrapped calls' wall times,
    synchronised (thinker.generate, talker.generate, token2wav.forward)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class AudioOnly(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 8192:] = float("-inf")
            return scores

    from ...runtime.stats import CallTimer

    timer = CallTimer(device)
    times = timer.times
    progress("transformers generate ...")
    with timer.wrapping((model.thinker, "generate", "thinker"), (model.talker, "generate", "talker"),
                        (model.token2wav, "forward", "token2wav")):
        timer.sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        with torch.no_grad():
            _, wav = model.generate(
                torch.tensor([prompt_ids], device=device), speaker=DEFAULT_VOICE,
                thinker_max_new_tokens=text_tokens, thinker_min_new_tokens=text_tokens, thinker_do_sample=True,
                talker_max_new_tokens=codes, talker_min_new_tokens=codes,
                talker_logits_processor=LogitsProcessorList([AudioOnly()]),
            )
        timer.sync()
        wall = time.perf_counter() - t
    audio_s = wav.shape[-1] / 24000
    progress(f"transformers generate: {wall:.1f} s")
    return {
        "time_to_first_text_ms": None,  # nothing is streamed: text and audio appear at the end
        "time_to_first_audio_ms": 1000 * wall,
        "thinker_ms_per_token": 1000 * times["thinker"] / text_tokens,
        "talker_ms_per_step": 1000 * times["talker"] / codes,
        "vocoder_ms_per_chunk": 1000 * times["token2wav"],  # one call: the whole utterance
        "vocoder_s_per_audio_s": times["token2wav"] / audio_s,
        "real_time_factor": wall / audio_s,
        "total_s": wall,
        "audio_s": audio_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
