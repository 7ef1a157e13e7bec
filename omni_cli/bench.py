"""`omni-bench`: a random-weight Qwen-Omni at true size, our engine timed beside transformers' generate.

Two families: Qwen2.5-Omni (7B, 3B; the talker makes one code a step, 50 a second) and Qwen3-Omni
(30B-A3B; a step is one 16-id frame, codebook 0 from the MoE talker and 15 from the code predictor,
12.5 a second). Weights are random and built directly on the device (no checkpoint, no download), so
only speed is measured, never quality; the `tiny` and `tiny-qwen3` presets load the built-in tiny
checkpoints instead (float32, they run on a CPU). Reply lengths are forced (`--text-tokens`,
`--codes`/`--frames`): text EOS is ignored and only audio codes may be sampled, on our side and,
through the same constraints, on the reference's.

Metrics: time to first text token, time to first audio (first PCM block handed to the sink), thinker
ms/token and talker ms/step (Qwen3: talker + code predictor ms/frame; device time per step, from CUDA
events), device idle between consecutive talker steps, vocoder ms per chunk, real-time factor, peak GPU
memory. `--compare-hf` runs the family's `*ForConditionalGeneration.generate` on the same model and
lengths in the same process and prints each ratio. It knows nothing about the terminal UI; it prints a
table (or `--json`) on stdout, progress and errors on stderr. Without `--preset` it benchmarks the 7B
sizes on an accelerator and the tiny model on a CPU (the full sizes in float32 would exhaust a CPU
machine's memory).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Optional

import typer

from .cli import VersionOpt, _OneLineErrors  # imports neither torch nor numpy

QWEN25, QWEN3 = "qwen2.5-omni", "qwen3-omni"

PRESETS = {
    # True sizes of Qwen2.5-Omni-7B (see shared notes).
    "qwen2.5-omni-7b": dict(
        family=QWEN25,
        text=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  intermediate_size=18944, vocab_size=152064),
        talker=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=12, num_key_value_heads=4,
                    head_dim=128, intermediate_size=18944, embedding_size=3584),
        audio=dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16),
        approximate=False,
    ),
    # The 3B thinker is public; its talker sizes are not: the 7B talker's are assumed (approximate).
    "qwen2.5-omni-3b": dict(
        family=QWEN25,
        text=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                  intermediate_size=11008, vocab_size=151936),
        talker=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=12, num_key_value_heads=4,
                    head_dim=128, intermediate_size=18944, embedding_size=2048),
        audio=dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16),
        approximate=True,
    ),
    # True sizes of Qwen3-Omni-30B-A3B-Instruct, every field set (`_qwen3_30b_config`): 35.26 B parameters.
    "qwen3-omni-30b-a3b": dict(family=QWEN3, approximate=False),
    # The built-in tiny checkpoints (assets/), loaded with from_pretrained in float32.
    "tiny": dict(family=QWEN25, asset="tiny-qwen2.5-omni", approximate=False),
    "tiny-qwen3": dict(family=QWEN3, asset="tiny-qwen3-omni", approximate=False),
}
TINY_PRESETS = tuple(name for name, p in PRESETS.items() if "asset" in p)  # those that run on a CPU
QWEN3_30B_PARAMETERS = 35.26e9  # the real checkpoint's total (thinker with its encoders, talker, code2wav)

# Talker steps a second of audio, per family, and the default reply: 15 s of audio.
STEPS_PER_SECOND = {QWEN25: 50.0, QWEN3: 12.5}
DEFAULT_AUDIO_S = 15


def family_of(preset: str) -> str:
    return PRESETS[preset]["family"]


def build_config(preset: str):
    p = PRESETS[preset]
    if "asset" in p:
        return _asset_config(preset)
    if p["family"] == QWEN3:
        return _qwen3_30b_config()
    from transformers import Qwen2_5OmniConfig

    width = p["text"]["hidden_size"]
    text = dict(p["text"], rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                            "mrope_section": [16, 24, 24]}, max_position_embeddings=32768)
    talker = dict(p["talker"], rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                "mrope_section": [16, 24, 24]}, vocab_size=8448)
    return Qwen2_5OmniConfig(
        thinker_config={"text_config": text, "audio_config": dict(p["audio"], output_dim=width),
                        "vision_config": dict(p["vision"], out_hidden_size=width),
                        # the real checkpoint's special ids (the library's defaults lack some of them)
                        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654},
        talker_config=talker,
        token2wav_config={},  # the library's DiT / BigVGAN defaults are the real sizes
        enable_audio_output=True,
    )


def _asset_folder(preset: str):
    from .loader import BUILTIN_TINY_DIRS

    name = PRESETS[preset]["asset"]
    return next(d for d in BUILTIN_TINY_DIRS if d.name == name)


def _asset_config(preset: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(_asset_folder(preset)), local_files_only=True)


def _qwen3_30b_config():
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

    from .loader import _quiet_transformers

    cls = _model_class(config)
    with _quiet_transformers(), torch.device("meta"):
        model = cls._from_config(config, dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def _model_class(config):
    if config.model_type == "qwen3_omni_moe":
        from transformers import Qwen3OmniMoeForConditionalGeneration

        return Qwen3OmniMoeForConditionalGeneration
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration


def build_model(preset: str, device, dtype):
    """Random weights, allocated and initialised on the device (the tiny presets: their checkpoints)."""
    from .loader import _quiet_transformers

    # The configs' special ids (vision, audio, tts text) lie outside the talker's codec vocabulary as in
    # the real checkpoint, and transformers warns about each of them: nothing the user can act on.
    with _quiet_transformers():
        return _build_model(preset, device, dtype)


def _build_model(preset: str, device, dtype):
    import torch

    p = PRESETS[preset]
    if "asset" in p:  # float32 whatever --dtype says: the tiny models are made and checked in float32
        folder = _asset_folder(preset)
        if p["family"] == QWEN3:
            from .models.qwen3_omni.checkpoint import load
        else:
            from .models.qwen2_5_omni.checkpoint import load
        model, _voices = load(folder, device, torch.float32, preset)
        return model.eval()
    config = build_config(preset)
    if p["family"] == QWEN3:
        total = count_parameters(config)
        progress(f"{preset}: {total / 1e9:.2f} B parameters (config checked on the meta device)")
        assert abs(total - QWEN3_30B_PARAMETERS) < 0.01e9, f"{preset} has {total / 1e9:.3f} B parameters, not 35.26 B"
        from transformers import Qwen3OmniMoeForConditionalGeneration

        with torch.device(device):
            model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=dtype)
        _init_talker_moe(model, device)
        return model.eval()
    from transformers import Qwen2_5OmniForConditionalGeneration

    with torch.device(device):
        model = Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=dtype)
    model.token2wav.float()
    g = torch.Generator(device=device).manual_seed(0)
    mel = config.token2wav_config.dit_config.mel_dim
    enc = config.token2wav_config.dit_config.enc_emb_dim
    model.speaker_map = {
        "Chelsie": {"bos_token": 151872, "cond": torch.randn(1, enc, device=device, generator=g),
                    "ref_mel": torch.randn(1, 300, mel, device=device, generator=g)},
    }
    return model.eval()


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


def voices_of(model) -> dict:
    """The voices the steps take: Qwen2.5, name -> spk_dict entry; Qwen3, name -> codec id (config.json)."""
    if model.config.model_type == "qwen3_omni_moe":
        return {str(n).capitalize(): int(i) for n, i in model.config.talker_config.speaker_id.items()}
    return model.speaker_map


class _BenchTokenizer:
    """Text for the producer thread without a vocabulary file: one character per token."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


@dataclass
class _Loaded:
    model: object
    tokenizer: object
    speakers: dict
    generation_config: object
    is_demo: bool = False
    name: str = "bench"


# How the decode steps run: (fast_decode, graphs, compile). The vocoder follows `graphs` only: in both
# graph rows its windows are graphs with the DiT compiled (the switch for it is OMNI_NO_COMPILE=1).
VARIANTS = {
    "eager": (False, False, False),  # the library's layers, one kernel launch at a time
    "fused": (True, False, False),  # fused QKV / gate-up fixed-shape step, still launched op by op
    "graphs": (True, True, False),  # ... replayed as CUDA graphs
    "graphs+compile": (True, True, True),  # ... with inductor-fused layers (the default on CUDA)
}


@dataclass
class _Subject:
    """What a run needs beside the weights: the family, its voice, text EOS ids and talker sampling."""

    model: object
    family: str
    voice: str
    eos_ids: list
    talker_sampling: object


def _subject(model) -> _Subject:
    if model.config.model_type == "qwen3_omni_moe":
        from .models.qwen3_omni import DEFAULT_VOICE, TALKER_SAMPLING

        return _Subject(model, QWEN3, DEFAULT_VOICE, [model.config.im_end_token_id], TALKER_SAMPLING)
    from .models.qwen2_5_omni import TALKER_SAMPLING

    return _Subject(model, QWEN25, "Chelsie", [151645, 151643], TALKER_SAMPLING)


def _ours(subject: _Subject, prompt_ids, text_tokens, codes, device, graphs: bool, runs: int,
          variant: str | None = None) -> dict:
    from .runtime.engine import Engine

    model = subject.model
    context = max(1024, len(prompt_ids) + text_tokens + 8)
    t0 = time.perf_counter()
    if subject.family == QWEN3:
        from .models.qwen3_omni.steps import Qwen3Steps

        steps = Qwen3Steps(model, voices_of(model), max_context=context, max_codes=codes, graphs=graphs)
    else:
        from .models.qwen2_5_omni.steps import Qwen25Steps

        fast, graphs, compile = VARIANTS[variant] if variant else (None, graphs, None)
        steps = Qwen25Steps(model, model.speaker_map, max_context=context, max_codes=codes, fast_decode=fast,
                            graphs=graphs, compile=compile)
    engine = Engine(steps, _BenchTokenizer(), eos_ids=subject.eos_ids)
    engine.warmup()
    setup = time.perf_counter() - t0
    progress(f"engine ready in {setup:.1f} s" + (" (eager steps: nothing to capture)" if subject.family == QWEN3
                                                 else " (graphs captured, layers compiled)"))
    out = _measure(engine, subject, prompt_ids, text_tokens, codes, device, runs)
    out["setup_s"] = setup
    return out


SCHEDULES = {"chunk48": 48, "chunk96": 96, "chunk192": 192}  # the vocoder's steady chunk, in codes


def _schedules(subject: _Subject, prompt_ids, text_tokens, codes, device, runs: int) -> dict:
    """Each vocoder schedule on one engine, one after the other in this process (side by side; Qwen2.5)."""
    from .models.qwen2_5_omni.steps import Qwen25Steps
    from .runtime.engine import Engine

    model = subject.model
    steps = Qwen25Steps(model, model.speaker_map, max_context=max(1024, len(prompt_ids) + text_tokens + 8),
                        max_codes=codes)
    engine = Engine(steps, _BenchTokenizer(), eos_ids=[151645, 151643])
    engine.warmup()
    table = {}
    for name, chunk in SCHEDULES.items():
        steps.vocoder_chunk_codes = chunk
        steps.warmup_vocoder()  # windows of this chunk size (captured once, kept on the model)
        progress(f"schedule {name}")
        table[name] = _measure(engine, subject, prompt_ids, text_tokens, codes, device, runs)
    return table


def _measure(engine, subject: _Subject, prompt_ids, text_tokens, codes, device, runs: int) -> dict:
    """`runs` timed replies (after one warm-up reply) on a ready engine; medians of the stats."""
    import torch

    from .config import SamplingOptions
    from .runtime.events import TurnRequest

    thinker = SamplingOptions(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
    results = []
    for i in range(runs + 1):  # the first run warms up (graph capture, kernel selection)
        sink = _TimedSink()
        req = TurnRequest(prompt_ids, subject.voice, thinker, subject.talker_sampling, text_tokens, codes, seed=i,
                          sink=sink, force_lengths=True, step_events=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for event in engine.stream(req):
            pass
        wall = time.perf_counter() - t
        reply = event.reply
        s = reply.stats
        progress(f"{'warm-up run' if i == 0 else f'run {i}'}: {wall:.2f} s, first audio "
                 f"{1000 * (s['time_to_first_audio'] or 0):.0f} ms, {s['audio_seconds']:.1f} s of audio")
        results.append({
            "time_to_first_text_ms": 1000 * s["time_to_first_text"],
            "time_to_first_audio_ms": 1000 * s["time_to_first_audio"],
            "thinker_ms_per_token": s.get("thinker_step_ms"),
            "talker_ms_per_step": s.get("talker_step_ms"),
            "talker_gap_us": s.get("talker_gap_us_median"),
            "talker_gap_us_mean": s.get("talker_gap_us_mean"),
            "time_to_prefill_issued_ms": 1000 * s["time_to_prefill_issued"],
            "time_to_first_token_ms": 1000 * s["time_to_first_token"],
            "thinker_prefill_ms": s.get("thinker_prefill_step_ms"),
            "talker_prefill_ms": s.get("talker_prefill_step_ms"),
            "vocoder_ms_per_chunk": s.get("vocoder_steady_chunk_ms"),
            "vocoder_chunk_codes": s.get("vocoder_steady_chunk_codes"),
            "vocoder_first_chunk_ms": s.get("vocoder_first_chunk_ms"),
            "vocoder_s_per_audio_s": s.get("vocoder_s_per_audio_s"),
            "sink_block_interval_ms": sink.ms_per_chunk(),
            "real_time_factor": wall / s["audio_seconds"],
            "total_s": wall,
            "audio_s": s["audio_seconds"],
            "text_tokens": len(reply.text_ids),
            "codes": len(reply.codes),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        })
        del sink
    best = results[1:] or results
    out = {k: _median([r[k] for r in best]) for k in best[0]}
    out["warmup_total_s"] = results[0]["total_s"]
    return out


class _TimedSink:
    """A null sink that notes when each block arrives (the vocoder's chunk cadence)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def start(self, sample_rate):
        self.times.clear()

    def write(self, block):
        self.times.append(time.perf_counter())

    def close(self):
        pass

    def abort(self):
        pass

    def ms_per_chunk(self):
        if len(self.times) < 3:
            return None
        steps = [b - a for a, b in zip(self.times[1:], self.times[2:])]
        return 1000 * _median(steps)


def progress(message: str) -> None:
    """A line on stderr as each phase ends: a run cut short by a time limit still shows how far it got."""
    print(f"[omni-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _median(values):
    """The median of the values that are not None (None if none are): the middle value of an odd count,
    the mean of the two middle values of an even count (the same value, unchanged, when those are equal,
    so integer counts stay integers)."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    if len(values) % 2:
        return values[mid]
    low, high = values[mid - 1], values[mid]
    return low if low == high else (low + high) / 2


def _reference(subject: _Subject, prompt_ids, text_tokens, codes, device) -> dict:
    """transformers' own generate on the same model and lengths (sampling as in its defaults)."""
    if subject.family == QWEN3:
        return _reference_qwen3(subject.model, prompt_ids, text_tokens, codes, device)
    return _reference_qwen25(subject.model, prompt_ids, text_tokens, codes, device)


def _reference_qwen25(model, prompt_ids, text_tokens, codes, device) -> dict:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class AudioOnly(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 8192:] = float("-inf")
            return scores

    times = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name] = time.perf_counter() - t
            return out
        return wrapper

    progress("transformers generate ...")
    originals = (model.thinker.generate, model.talker.generate, model.token2wav.forward)
    model.thinker.generate = timed("thinker", model.thinker.generate)
    model.talker.generate = timed("talker", model.talker.generate)
    model.token2wav.forward = timed("token2wav", model.token2wav.forward)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        with torch.no_grad():
            _, wav = model.generate(
                torch.tensor([prompt_ids], device=device), speaker="Chelsie",
                thinker_max_new_tokens=text_tokens, thinker_min_new_tokens=text_tokens, thinker_do_sample=True,
                talker_max_new_tokens=codes, talker_min_new_tokens=codes,
                talker_logits_processor=LogitsProcessorList([AudioOnly()]),
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        model.thinker.generate, model.talker.generate, model.token2wav.forward = originals
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



def _reference_qwen3(model, prompt_ids, text_tokens, frames, device) -> dict:
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
    times: dict[str, float] = {}
    calls: dict[str, int] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name] = times.get(name, 0.0) + time.perf_counter() - t
            calls[name] = calls.get(name, 0) + 1
            return out
        return wrapper

    def generate(text: int, frames: int):
        with torch.no_grad(), warnings.catch_warnings():
            # Its talker's penalty covers generated codes only (it is given inputs_embeds): expected.
            warnings.filterwarnings("ignore", message="Passing `repetition_penalty` with `inputs_embeds`")
            return model.generate(
                torch.tensor([prompt_ids], device=device), speaker="Ethan",
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
    predictor = model.talker.code_predictor
    originals = (model.thinker.generate, model.talker.generate, predictor.generate, model.code2wav.chunked_decode)
    model.thinker.generate = timed("thinker", model.thinker.generate)
    model.talker.generate = timed("talker", model.talker.generate)
    predictor.generate = timed("code_predictor", predictor.generate)
    model.code2wav.chunked_decode = timed("code2wav", model.code2wav.chunked_decode)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        sequences, wav = generate(text_tokens, frames)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        (model.thinker.generate, model.talker.generate, predictor.generate,
         model.code2wav.chunked_decode) = originals
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

ROWS = [
    ("time to first text (ms)", "time_to_first_text_ms", "{:.1f}"),
    ("time to first audio (ms)", "time_to_first_audio_ms", "{:.1f}"),
    ("thinker ms/token", "thinker_ms_per_token", "{:.2f}"),
    ("talker ms/step", "talker_ms_per_step", "{:.3f}"),
    ("code predictor ms/frame", "code_predictor_ms_per_frame", "{:.3f}"),
    ("idle between talker steps (µs)", "talker_gap_us", "{:.1f}"),
    ("vocoder ms/chunk (steady chunk)", "vocoder_ms_per_chunk", "{:.1f}"),
    ("vocoder s per s of audio", "vocoder_s_per_audio_s", "{:.3f}"),
    ("real-time factor", "real_time_factor", "{:.3f}"),
    ("total (s)", "total_s", "{:.2f}"),
    ("audio (s)", "audio_s", "{:.2f}"),
    ("peak GPU memory (GiB)", "peak_gib", "{:.1f}"),
]

# Qwen3-Omni's talker step is a frame: codebook 0 from the talker, 1-15 from the code predictor.
QWEN3_LABELS = {
    "talker_ms_per_step": "talker + code predictor ms/frame",
    "talker_gap_us": "idle between frames (µs)",
    "vocoder_ms_per_chunk": "code2wav ms/chunk (steady chunk)",
    "vocoder_s_per_audio_s": "code2wav s per s of audio",
}


def _table(ours: dict, ref: dict | None, family: str = QWEN25) -> str:
    def fmt(value, spec):
        return "-" if value is None else spec.format(value)

    head = f"{'metric':34} {'omni_cli':>12}" + (f" {'transformers':>14} {'ratio':>8}" if ref else "")
    lines = [head, "-" * len(head)]
    for label, key, spec in ROWS:
        if family == QWEN3:
            label = QWEN3_LABELS.get(key, label)
        elif key == "code_predictor_ms_per_frame":
            continue  # Qwen2.5-Omni has none
        line = f"{label:34} {fmt(ours.get(key), spec):>12}"
        if ref:
            r = ref.get(key)
            ratio = (r / ours[key]) if (r is not None and ours.get(key)) else None
            line += f" {fmt(r, spec):>14} {fmt(ratio, '{:.1f}x'):>8}"
        lines.append(line)
    return "\n".join(lines)


def _variants_table(table: dict) -> str:
    keys = [("thinker ms/token", "thinker_ms_per_token"), ("talker ms/step", "talker_ms_per_step"),
            ("idle between talker steps (µs)", "talker_gap_us"), ("time to first audio (ms)", "time_to_first_audio_ms"),
            ("real-time factor", "real_time_factor")]
    head = f"{'variant':16}" + "".join(f"{label:>32}" for label, _ in keys)
    lines = [head]
    for name, row in table.items():
        lines.append(f"{name:16}" + "".join(f"{'-' if row.get(k) is None else format(row[k], '.3f'):>32}" for _, k in keys))
    return "\n".join(lines)


app = typer.Typer(add_completion=False, help=__doc__.split("\n")[0])

DEFAULT_PRESET = "qwen2.5-omni-7b"  # on an accelerator; on a CPU the default is "tiny"


def _pick_preset(preset: str | None, device) -> str:
    """The preset to build on `device` from the one asked for (None or a key of PRESETS), or a UsageError:
    the full sizes are refused on a CPU (in float32 they need more memory than a CPU machine has, and
    building them runs out of it after a minute)."""
    from .errors import UsageError

    if preset is None:
        if device.type != "cpu":
            return DEFAULT_PRESET
        print("note: no accelerator here, so the tiny preset (the full-size presets need a GPU)",
              file=sys.stderr, flush=True)
        return "tiny"
    if preset not in TINY_PRESETS and device.type == "cpu":
        raise UsageError(f"the {preset} preset does not fit a CPU run (float32 at full size): "
                         "use --preset tiny (or tiny-qwen3), or a GPU with --device cuda")
    return preset


def _prompt(model, family: str, prompt_tokens: int) -> list[int]:
    """A random prompt of `prompt_tokens` ids. Qwen2.5: plain random ids. Qwen3: one user turn of random
    ordinary ids, then the assistant opener, as its talker needs (the prompt of the talker is the user
    turns, and the reply starts after `<|im_start|>assistant` + one more token); the newline positions of
    the chat template are random ordinary ids too."""
    import torch

    g = torch.Generator().manual_seed(1)
    if family == QWEN25:
        vocab = model.config.thinker_config.text_config.vocab_size
        return torch.randint(0, min(vocab, 150000), (prompt_tokens,), generator=g).tolist()
    cfg = model.config
    ordinary = cfg.im_start_token_id - 1  # the ids below <|endoftext|> (the specials follow it)
    ids = torch.randint(0, ordinary, (prompt_tokens - QWEN3_PROMPT_FRAME + 1,), generator=g).tolist()
    nl, body = ids[0], ids[1:]
    start, end = cfg.im_start_token_id, cfg.im_end_token_id
    return [start, cfg.user_token_id, nl] + body + [end, nl, start, cfg.assistant_token_id, nl]


QWEN3_PROMPT_FRAME = 8  # <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n: the rest is the user's


@app.command(cls=_OneLineErrors)
def main(
    preset: Optional[str] = typer.Option(None, "--preset", show_default=False,
                                         help=f"{' | '.join(PRESETS)} (default: {DEFAULT_PRESET} on an accelerator, "
                                              "tiny on a CPU)"),
    prompt_tokens: int = typer.Option(60, "--prompt-tokens", min=1),
    text_tokens: int = typer.Option(64, "--text-tokens", min=1),
    codes: Optional[int] = typer.Option(None, "--codes", "--frames", min=1, show_default=False,
                                        help="talker steps: Qwen2.5 codes (50 = 1 s of audio), Qwen3 16-id frames "
                                             f"(12.5 = 1 s); default {DEFAULT_AUDIO_S} s of audio (750 codes, "
                                             "188 frames)"),
    runs: int = typer.Option(2, "--runs", min=1, help="measured runs after one warm-up run; each metric is their "
                                                      "median (an even count: the mean of the middle two)"),
    device: str = typer.Option("auto", "--device"),
    dtype: str = typer.Option("auto", "--dtype", help="the full-size presets' LLMs (the tiny ones: float32)"),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="CUDA graphs for the decode steps (Qwen2.5; "
                                                                   "Qwen3's steps are all eager for now)"),
    compare_hf: bool = typer.Option(False, "--compare-hf", help="also run transformers' generate"),
    variants: bool = typer.Option(False, "--variants", help="time each decode-step variant (eager, fused, graphs, "
                                                            "graphs+compile; Qwen2.5)"),
    schedules: bool = typer.Option(False, "--schedules", help="time the vocoder's steady chunk sizes side by side "
                                                              "(Qwen2.5)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    version: VersionOpt = False,
) -> None:
    """Benchmark one reply at forced lengths on random weights."""
    import torch

    from .errors import UsageError
    from .loader import pick_device, pick_dtype

    if preset is not None and preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    dev = pick_device(device)  # a device that is not here: the same one-line UsageError as omni-say's
    preset = _pick_preset(preset, dev)
    family = family_of(preset)
    if family == QWEN3 and (variants or schedules):
        raise UsageError(f"--{'variants' if variants else 'schedules'} is for the Qwen2.5-Omni presets "
                         "(the Qwen3-Omni steps have one variant, eager)")
    if family == QWEN3 and prompt_tokens <= QWEN3_PROMPT_FRAME:
        raise UsageError(f"--prompt-tokens must be more than {QWEN3_PROMPT_FRAME} for {preset} (a user turn and "
                         "the assistant opener)")
    if codes is None:
        codes = int(DEFAULT_AUDIO_S * STEPS_PER_SECOND[family] + 0.5)
    unit = "frames" if family == QWEN3 else "codes"
    dt = pick_dtype(dtype, dev)
    t = time.perf_counter()
    model = build_model(preset, dev, dt)
    build_s = time.perf_counter() - t
    progress(f"built {preset} on {dev} in {build_s:.1f} s")
    subject = _subject(model)
    prompt = _prompt(model, family, prompt_tokens)
    if variants:
        table = {name: _ours(subject, prompt, text_tokens, codes, dev, graphs, runs, variant=name) for name in VARIANTS}
        typer.echo(json.dumps(table, indent=2) if as_json else _variants_table(table))
        return
    if schedules:
        table = _schedules(subject, prompt, text_tokens, codes, dev, runs)
        typer.echo(json.dumps(table, indent=2) if as_json else _variants_table(table))
        return
    ours = _ours(subject, prompt, text_tokens, codes, dev, graphs, runs)
    ref = _reference(subject, prompt, text_tokens, codes, dev) if compare_hf else None
    meta = {
        "preset": preset, "family": family, "approximate": PRESETS[preset]["approximate"],
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "dtype": str(next(model.thinker.parameters()).dtype), "torch": torch.__version__,
        "transformers": _transformers_version(), "prompt_tokens": prompt_tokens,
        # talker steps asked for, in the family's unit (`unit`: codes, or 16-id frames), and per second
        "text_tokens": text_tokens, "codes": codes, "unit": unit, "steps_per_second": STEPS_PER_SECOND[family],
        "graphs": graphs and family == QWEN25, "build_s": build_s,
        "date": time.strftime("%Y-%m-%d"),
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
    }
    if as_json:
        typer.echo(json.dumps({"meta": meta, "omni_cli": ours, "transformers": ref}, indent=2))
        return
    note = " (approximate: talker sizes assumed)" if meta["approximate"] else ""
    print(f"{preset}{note} on {meta['device']}, {meta['dtype']}, {meta['parameters_b']:.3g} B parameters; "
          f"prompt {prompt_tokens}, text {text_tokens}, {unit} {codes}", file=sys.stderr)
    typer.echo(_table(ours, ref, family))


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def bench_app(argv: list[str] | None = None) -> None:
    """The `omni-bench` program (`argv`: the arguments, default sys.argv[1:]). Every usage error, typer's
    own included (an unknown flag, a value that is not a number), is one `error: ...` line on stderr and
    exit code 2; a failure with a known cause is one line and exit code 1; anything else is a bug and
    keeps its traceback."""
    from .errors import OmniError, known_failure

    try:
        # Not standalone: the command (cli._OneLineErrors, as omni-say's) prints click's usage errors
        # as one line and returns their code, and our own errors come out here.
        code = app(args=argv, prog_name="omni-bench", standalone_mode=False)
    except OmniError as exc:
        _fail(str(exc), exc.exit_code)
    except Exception as exc:
        if known_failure(exc) is exc:  # not a failure with a known cure: a bug, with its traceback
            raise
        _fail("out of device memory: try a smaller --preset, fewer --codes or --text-tokens, or --dtype bfloat16", 1)
    else:
        # Not standalone, the command returns its exit code (2 for a usage error, 130 after Ctrl-C).
        if isinstance(code, int) and code:
            raise SystemExit(code)


def _fail(message: str, code: int) -> None:
    # Local to this face for now: omni-say's and omni-chat's equivalent lives in cli.py.
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    raise SystemExit(code)


if __name__ == "__main__":
    bench_app()
