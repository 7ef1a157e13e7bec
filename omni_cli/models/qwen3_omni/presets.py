"""Qwen3-Omni for `omni-bench`: its presets, a random-weight model at true size, transformers' reference.

What it knows: Qwen3-Omni-30B-A3B-Instruct's config, every field set (transformers' defaults for the class
are not the real model), checked against the real checkpoint's parameter count on the meta device; the
built-in tiny checkpoint; a random talker MoE that routes by its input; the benchmark prompt (a user turn
and the assistant opener, as the talker needs); and `Qwen3OmniMoeForConditionalGeneration.generate` at
forced lengths, timed per stage. What it does not: measuring our engine, the table, the flags
(omni_cli/bench.py, which reaches every family through the same names here). There is one decode-step
variant (eager) and no vocoder schedule to choose. Torch and transformers are imported when a function runs.
"""

from __future__ import annotations


import time
from typing import Any

from . import CODES_PER_SECOND, DEFAULT_VOICE, TALKER_SAMPLING, TITLE  # noqa: F401 (bench reads them here)

FAMILY = "qwen3-omni"  # as the bench's JSON names it
UNIT = "frames"  # a talker step: one 16-id frame (codebook 0 from the talker, 1-15 from the code predictor)
PROMPT_FRAME = 8  # <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n: the rest is the user's
GRAPHS = True  # the steps follow --graphs
READY_NOTE = "graphs captured"  # what the engine's warm-up did (the bench adds whether it compiled)

PRESETS: dict[str, dict[str, Any]] = {
    # True sizes of Qwen3-Omni-30B-A3B-Instruct, every field set (`_config_30b`); `parameters`: the real
    # checkpoint's total (thinker with its encoders, talker, code2wav).
    "qwen3-omni-30b-a3b": dict(approximate=False, parameters=35.26e9),
    # The built-in tiny checkpoint (assets/), loaded with from_pretrained in float32.
    "tiny-qwen3": dict(asset="tiny-qwen3-omni", approximate=False),
}

VARIANTS: dict[str, dict[str, Any]] = {"eager": {}}  # one variant: nothing for --variants to compare
SCHEDULES: dict[str, int] = {}  # code2wav's chunks are fixed: nothing for --schedules to compare

# The table's rows in this family's words: a talker step is a frame, the vocoder is code2wav.
LABELS = {
    "talker_ms_per_step": "talker + code predictor ms/frame",
    "talker_gap_us": "idle between frames (µs)",
    "vocoder_ms_per_chunk": "code2wav ms/chunk (steady chunk)",
    "vocoder_s_per_audio_s": "code2wav s per s of audio",
}


def build_config(name: str):
    """The preset's Qwen3OmniMoeConfig: the 30B-A3B's (`_config_30b`), or the tiny checkpoint's config.json."""
    if "asset" in PRESETS[name]:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(_asset_folder(name)), local_files_only=True)
    return _config_30b()


def _asset_folder(name: str):
    from .. import BUILTIN_TINY_DIRS

    return next(d for d in BUILTIN_TINY_DIRS if d.name == PRESETS[name]["asset"])


def _config_30b():
    """Qwen3-Omni-30B-A3B-Instruct's config, field by field: transformers' defaults for this class are not
    the real model (thinker layers and heads, head_dim, talker top-k and shared expert, 16 code groups,
    accept_hidden_layer 24, the codec and speaker ids)."""
    from transformers import Qwen3OmniMoeConfig

    def mrope():  # interleaved M-RoPE, 24:20:20 over head_dim/2 = 64 pairs
        return {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
                "interleaved": True, "mrope_interleaved": True}

    mm = dict(audio_token_id=151675, image_token_id=151655, video_token_id=151656, audio_start_token_id=151669,
              audio_end_token_id=151670, vision_start_token_id=151652, position_id_per_seconds=13, seconds_per_chunk=2)
    text = dict(vocab_size=152064, hidden_size=2048, intermediate_size=768, moe_intermediate_size=768,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                max_position_embeddings=65536, rms_norm_eps=1e-6, rope_parameters=mrope(), tie_word_embeddings=False,
                attention_bias=False, hidden_act="silu")
    audio = dict(num_mel_bins=128, d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                 downsample_hidden_size=480, output_dim=2048, max_source_positions=1500, n_window=50,
                 n_window_infer=800, conv_chunksize=500, activation_function="gelu", scale_embedding=False)
    vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304,
                  deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision, user_token_id=872,
                   vision_end_token_id=151653, **mm)
    predictor = dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_code_groups=16,
                     max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu",
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    talker_text = dict(vocab_size=3072, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384,
                       shared_expert_intermediate_size=768, num_hidden_layers=20, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=128, num_experts=128, num_experts_per_tok=6,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=65536,
                       rms_norm_eps=1e-6, rope_parameters=mrope(), hidden_act="silu")
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=16,
                  thinker_hidden_size=2048, accept_hidden_layer=24, codec_pad_id=2148, codec_bos_id=2149,
                  codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
                  speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303}, spatial_merge_size=2, **mm)
    code2wav = dict(codebook_size=2048, num_quantizers=16, hidden_size=1024, intermediate_size=3072,
                    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, sliding_window=72,
                    max_position_embeddings=8000, rms_norm_eps=1e-5, layer_scale_initial_scale=0.01,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, upsample_rates=[8, 5, 4, 3],
                    upsampling_ratios=[2, 2], decoder_dim=1536, hidden_act="silu")
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, enable_audio_output=True,
        im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671, tts_bos_token_id=151672,
        tts_eos_token_id=151673, system_token_id=8948, user_token_id=872, assistant_token_id=77091,
    )


def count_parameters(config) -> int:
    """Parameters of the model `config` describes, built on the meta device (no memory, a fraction of a second)."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from ..weights import quiet_transformers

    with quiet_transformers(), torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def build_model(name: str, device, dtype, progress=lambda message: None, quantize: str | None = None,
                group_size: int | None = None):
    """(model, voices): random weights allocated and initialised on the device, the voices those of the
    config (name -> codec id); the parameter count is checked first on the meta device (the tiny preset:
    its checkpoint, in float32 whatever `dtype` says). transformers' config warnings stay quiet (the
    special ids lie outside the talker's codec vocabulary, as in the real checkpoint). `quantize`: the
    decoder layers packed as they are made, one at a time (models/random_packed.py: the float model never
    is on the device; the tiny preset: loaded on the CPU and packed)."""
    from ..weights import quiet_transformers

    with quiet_transformers():
        return _build_model(name, device, dtype, progress, quantize, group_size)


def _build_model(name: str, device, dtype, progress, quantize=None, group_size=None):
    p = PRESETS[name]
    if "asset" in p:  # the tiny model is made and checked in float32
        from ..random_packed import load_asset
        from .checkpoint import load

        model, voices = load_asset(load, _asset_folder(name), device, name, quantize, group_size, progress)
        return model.eval(), voices
    config = build_config(name)
    total = count_parameters(config)
    progress(f"{name}: {total / 1e9:.2f} B parameters (config checked on the meta device)")
    expected = p["parameters"]
    assert abs(total - expected) < 0.01e9, f"{name} has {total / 1e9:.3f} B parameters, not {expected / 1e9:.2f} B"
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from ..random_packed import build

    model = build(lambda: Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=dtype), device, dtype,
                  quantize, group_size, progress)
    if quantize is None:  # packed, the routers and expert banks got random values as they were made
        _init_talker_moe(model, device)
    voices = {str(n).capitalize(): int(i) for n, i in model.config.talker_config.speaker_id.items()}
    return model.eval(), voices


def _init_talker_moe(model, device, std: float = 0.02) -> None:
    """transformers' random init (5.17-5.24) leaves the Qwen3 talker's expert weights uninitialised
    (torch.empty) and its router at zero (every expert tied: routing by index, not by the input). Normal
    noise of the library's initializer_range in all three makes the routing real."""
    import torch
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for module in model.talker.modules():
            if isinstance(module, m.Qwen3OmniMoeTalkerTextSparseMoeBlock):
                for param in (module.experts.gate_up_proj, module.experts.down_proj, module.gate.weight):
                    param.normal_(0.0, std, generator=g)


def text_eos_ids(model) -> list[int]:
    return [model.config.im_end_token_id]


def prompt(model, prompt_tokens: int) -> list[int]:
    """One user turn of random ordinary ids, then the assistant opener, `prompt_tokens` ids in all (more
    than PROMPT_FRAME), as the talker needs: its prompt is the user turns, and the reply starts after
    `<|im_start|>assistant` + one more token. The newline positions of the chat template are random
    ordinary ids too."""
    import torch

    g = torch.Generator().manual_seed(1)
    cfg = model.config
    ordinary = cfg.im_start_token_id - 1  # the ids below <|endoftext|> (the specials follow it)
    ids = torch.randint(0, ordinary, (prompt_tokens - PROMPT_FRAME + 1,), generator=g).tolist()
    nl, body = ids[0], ids[1:]
    start, end = cfg.im_start_token_id, cfg.im_end_token_id
    return [start, cfg.user_token_id, nl] + body + [end, nl, start, cfg.assistant_token_id, nl]


def spoken_turn(model, audio_tokens: int, seed: int) -> list[int]:
    """A user turn for `omni-bench --turns`: `<|im_start|>user`, a clip's `audio_tokens` placeholders
    between its start and end ids, eight random words, `<|im_end|>`, then the assistant opener (the talker
    reads the chat's turns by these ids)."""
    import torch

    cfg = model.config
    g = torch.Generator().manual_seed(100 + seed)
    words = torch.randint(0, cfg.im_start_token_id - 1, (8,), generator=g).tolist()
    nl, t = _newline(model), cfg.thinker_config
    clip = [t.audio_start_token_id] + [t.audio_token_id] * audio_tokens + [t.audio_end_token_id]
    return ([cfg.im_start_token_id, cfg.user_token_id, nl] + clip + words
            + [cfg.im_end_token_id, nl, cfg.im_start_token_id, cfg.assistant_token_id, nl])


def reply_end(model) -> list[int]:
    """What follows a reply's text in the next prompt: `<|im_end|>` and the newline."""
    return [model.config.im_end_token_id, _newline(model)]


def _newline(model) -> int:
    return prompt(model, PROMPT_FRAME + 1)[2]  # the newline id `prompt` uses


def spoken_inputs(clips, kept=None) -> tuple[dict, list[int]]:
    """The clips' encoder inputs as the processor makes them (the built-in checkpoint's feature extractor:
    the real one's settings), and each clip's placeholder count; `kept` as models/audio_features.py says."""
    from .. import qwen3_omni as family
    from ..audio_features import spoken_inputs as inputs

    return inputs(family, _asset_folder("tiny-qwen3"), clips, kept)


def steps(model, voices: dict, *, max_context: int, max_codes: int, graphs: bool = True, variant: str | None = None,
          compile: bool = True, runtime=None):
    """The engine's steps (`max_codes`: frames) under `runtime` (omni-bench's RuntimeOptions; else `graphs`
    and `compile`) with these cache sizes; the one variant."""
    from dataclasses import replace

    from ...config import RuntimeOptions
    from .steps import Qwen3Steps

    runtime = runtime or RuntimeOptions(graphs=graphs, compile=compile)
    runtime = replace(runtime, max_context=max_context, max_codes=max_codes, compile=runtime.compile and runtime.graphs)
    return Qwen3Steps(model, voices, runtime)


def reference(model, prompt_ids, text_tokens: int, frames: int, device, progress=lambda message: None) -> dict:
    """`Qwen3OmniMoeForConditionalGeneration.generate` at forced lengths: `thinker_min_new_tokens` holds text
    EOS (<|im_end|>, passed as `thinker_eos_token_id`) off until the last token; the talker's
    `suppress_tokens` is generate's own list (the top 1024 ids but codec EOS) plus codec EOS, so only audio
    codes can be sampled and it runs to `talker_max_new_tokens` = frames + 1 (the last codebook-0 id gets no
    residuals). Thinker sampling as ours; talker and code predictor at generate's defaults (= ours).
    Nothing streams: the time to first audio is the whole call, timed after one short untimed call (2 text
    tokens, 2 frames) that takes the first-call costs. Stage times are the wrapped calls' wall
    times, synchronised (thinker.generate, talker.generate with its nested code predictor generate per
    frame, code2wav.chunked_decode), the code predictor's summed over its calls."""
    import warnings

    import torch

    cfg = model.config
    tcfg = cfg.talker_config
    vocab = tcfg.text_config.vocab_size
    suppress = list(range(vocab - 1024, vocab))  # generate's list has every one of them but codec EOS
    from ...runtime.stats import CallTimer

    timer = CallTimer(device)
    times, calls = timer.times, timer.calls

    def generate(text: int, frames: int):
        with torch.no_grad(), warnings.catch_warnings():
            # Its talker's penalty covers generated codes only (it is given inputs_embeds): expected.
            warnings.filterwarnings("ignore", message="Passing `repetition_penalty` with `inputs_embeds`")
            return model.generate(
                torch.tensor([prompt_ids], device=device), speaker=DEFAULT_VOICE,
                thinker_max_new_tokens=text, thinker_min_new_tokens=text,
                thinker_eos_token_id=cfg.im_end_token_id,  # its default is the literal 151645
                thinker_do_sample=True, thinker_temperature=0.7, thinker_top_k=20, thinker_top_p=0.8,
                thinker_repetition_penalty=1.05,
                talker_max_new_tokens=frames + 1, talker_suppress_tokens=suppress,
            )

    # One short untimed call first (ours has its warm-up run too): first-call costs are not the reference's.
    progress("transformers generate: warm-up call (2 text tokens, 2 frames) ...")
    generate(min(2, text_tokens), 2)
    progress("transformers generate ...")
    with timer.wrapping((model.thinker, "generate", "thinker"), (model.talker, "generate", "talker"),
                        (model.talker.code_predictor, "generate", "code_predictor"),
                        (model.code2wav, "chunked_decode", "code2wav")):
        timer.sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        sequences, wav = generate(text_tokens, frames)
        timer.sync()
        wall = time.perf_counter() - t
    audio_s = wav.shape[-1] / 24000
    made = calls.get("code_predictor", 0)  # one call a frame
    progress(f"transformers generate: {wall:.1f} s, {sequences.shape[1] - len(prompt_ids)} text tokens, "
             f"{made} frames, {audio_s:.2f} s of audio")
    return {
        "time_to_first_text_ms": None,  # nothing is streamed: text and audio appear at the end
        "time_to_first_audio_ms": 1000 * wall,
        "thinker_ms_per_token": 1000 * times["thinker"] / text_tokens,
        # talker + code predictor per frame (the talker's generate makes frames + 1 codebook-0 ids)
        "talker_ms_per_step": 1000 * times["talker"] / frames,
        "code_predictor_ms_per_frame": 1000 * times["code_predictor"] / made if made else None,
        "vocoder_ms_per_chunk": 1000 * times["code2wav"],  # one call: the whole utterance
        "vocoder_s_per_audio_s": times["code2wav"] / audio_s,
        "real_time_factor": wall / audio_s,
        "total_s": wall,
        "audio_s": audio_s,
        "text_tokens": sequences.shape[1] - len(prompt_ids),
        "codes": made,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
