"""`omni-bench`: a random-weight Qwen2.5-Omni at true size, our engine timed beside transformers' generate.

Weights are random and built directly on the device (no checkpoint, no download), so only speed is
measured, never quality. Reply lengths are forced (`--text-tokens`, `--codes`): text EOS is ignored and
only audio codes may be sampled, on our side and, through the same constraints, on the reference's.

Metrics: time to first text token, time to first audio (first PCM block handed to the sink), thinker
ms/token and talker ms/step (device time per step, from CUDA events), device idle between consecutive
talker steps, vocoder ms per chunk, real-time factor, peak GPU memory. `--compare-hf` runs
`Qwen2_5OmniForConditionalGeneration.generate` on the same model and lengths in the same process and
prints each ratio. It knows nothing about the terminal UI; it prints a table (or `--json`) on stdout,
progress and errors on stderr. Without `--preset` it benchmarks the 7B sizes on an accelerator and the
tiny model on a CPU (the full sizes in float32 would exhaust a CPU machine's memory).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Optional

import typer

from .cli import VersionOpt, _OneLineErrors  # imports neither torch nor numpy

PRESETS = {
    # True sizes of Qwen2.5-Omni-7B (see shared notes).
    "qwen2.5-omni-7b": dict(
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
        text=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                  intermediate_size=11008, vocab_size=151936),
        talker=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=12, num_key_value_heads=4,
                    head_dim=128, intermediate_size=18944, embedding_size=2048),
        audio=dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16),
        approximate=True,
    ),
    "tiny": None,  # the built-in tiny model's config (omni_cli.tiny)
}


def build_config(preset: str):
    from transformers import Qwen2_5OmniConfig

    if preset == "tiny":
        from .tiny import tiny_config

        return tiny_config()
    p = PRESETS[preset]
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


def build_model(preset: str, device, dtype):
    """Random weights, allocated and initialised on the device."""
    from .loader import _quiet_transformers

    # The configs' special ids (vision, audio, tts text) lie outside the talker's codec vocabulary as in
    # the real checkpoint, and transformers warns about each of them: nothing the user can act on.
    with _quiet_transformers():
        return _build_model(preset, device, dtype)


def _build_model(preset: str, device, dtype):
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    config = build_config(preset)
    if preset == "tiny":
        from .tiny import build_tiny_model

        model = build_tiny_model(config).to(device)
    else:
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


def _ours(model, prompt_ids, text_tokens, codes, device, graphs: bool, runs: int, variant: str | None = None) -> dict:
    import torch

    from .models.qwen2_5_omni.steps import Qwen25Steps
    from .runtime.engine import Engine

    eos = [151645, 151643]
    t0 = time.perf_counter()
    fast, graphs, compile = VARIANTS[variant] if variant else (None, graphs, None)
    steps = Qwen25Steps(model, model.speaker_map, max_context=max(1024, len(prompt_ids) + text_tokens + 8),
                        max_codes=codes, fast_decode=fast, graphs=graphs, compile=compile)
    engine = Engine(steps, _BenchTokenizer(), eos_ids=eos)
    engine.warmup()
    setup = time.perf_counter() - t0
    progress(f"engine ready in {setup:.1f} s (graphs captured, layers compiled)")
    out = _measure(engine, prompt_ids, text_tokens, codes, device, runs)
    out["setup_s"] = setup
    return out


SCHEDULES = {"chunk48": 48, "chunk96": 96, "chunk192": 192}  # the vocoder's steady chunk, in codes


def _schedules(model, prompt_ids, text_tokens, codes, device, runs: int) -> dict:
    """Each vocoder schedule on one engine, one after the other in this process (side by side)."""
    from .models.qwen2_5_omni.steps import Qwen25Steps
    from .runtime.engine import Engine

    steps = Qwen25Steps(model, model.speaker_map, max_context=max(1024, len(prompt_ids) + text_tokens + 8),
                        max_codes=codes)
    engine = Engine(steps, _BenchTokenizer(), eos_ids=[151645, 151643])
    engine.warmup()
    table = {}
    for name, chunk in SCHEDULES.items():
        steps.vocoder_chunk_codes = chunk
        steps.warmup_vocoder()  # windows of this chunk size (captured once, kept on the model)
        progress(f"schedule {name}")
        table[name] = _measure(engine, prompt_ids, text_tokens, codes, device, runs)
    return table


def _measure(engine, prompt_ids, text_tokens, codes, device, runs: int) -> dict:
    """`runs` timed replies (after one warm-up reply) on a ready engine; medians of the stats."""
    import torch

    from .config import SamplingOptions
    from .models.qwen2_5_omni import TALKER_SAMPLING as TALKER_DEFAULTS
    from .runtime.events import TurnRequest

    thinker = SamplingOptions(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
    results = []
    for i in range(runs + 1):  # the first run warms up (graph capture, kernel selection)
        sink = _TimedSink()
        req = TurnRequest(prompt_ids, "Chelsie", thinker, TALKER_DEFAULTS, text_tokens, codes, seed=i,
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


def _reference(model, prompt_ids, text_tokens, codes, device) -> dict:
    """transformers' own generate on the same model and lengths (sampling as in its defaults)."""
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


ROWS = [
    ("time to first text (ms)", "time_to_first_text_ms", "{:.1f}"),
    ("time to first audio (ms)", "time_to_first_audio_ms", "{:.1f}"),
    ("thinker ms/token", "thinker_ms_per_token", "{:.2f}"),
    ("talker ms/step", "talker_ms_per_step", "{:.3f}"),
    ("idle between talker steps (µs)", "talker_gap_us", "{:.1f}"),
    ("vocoder ms/chunk (steady chunk)", "vocoder_ms_per_chunk", "{:.1f}"),
    ("vocoder s per s of audio", "vocoder_s_per_audio_s", "{:.3f}"),
    ("real-time factor", "real_time_factor", "{:.3f}"),
    ("total (s)", "total_s", "{:.2f}"),
    ("audio (s)", "audio_s", "{:.2f}"),
    ("peak GPU memory (GiB)", "peak_gib", "{:.1f}"),
]


def _table(ours: dict, ref: dict | None) -> str:
    def fmt(value, spec):
        return "-" if value is None else spec.format(value)

    head = f"{'metric':32} {'omni_cli':>12}" + (f" {'transformers':>14} {'ratio':>8}" if ref else "")
    lines = [head, "-" * len(head)]
    for label, key, spec in ROWS:
        line = f"{label:32} {fmt(ours.get(key), spec):>12}"
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
    if preset != "tiny" and device.type == "cpu":
        raise UsageError(f"the {preset} preset does not fit a CPU run (float32 at full size): "
                         "use --preset tiny, or a GPU with --device cuda")
    return preset


@app.command(cls=_OneLineErrors)
def main(
    preset: Optional[str] = typer.Option(None, "--preset", show_default=False,
                                         help=f"{' | '.join(PRESETS)} (default: {DEFAULT_PRESET} on an accelerator, "
                                              "tiny on a CPU)"),
    prompt_tokens: int = typer.Option(60, "--prompt-tokens", min=1),
    text_tokens: int = typer.Option(64, "--text-tokens", min=1),
    codes: int = typer.Option(750, "--codes", min=1, help="talker codes (50 = 1 s of audio)"),
    runs: int = typer.Option(2, "--runs", min=1, help="measured runs after one warm-up run; each metric is their "
                                                      "median (an even count: the mean of the middle two)"),
    device: str = typer.Option("auto", "--device"),
    dtype: str = typer.Option("auto", "--dtype"),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="CUDA graphs for the decode steps"),
    compare_hf: bool = typer.Option(False, "--compare-hf", help="also run transformers' generate"),
    variants: bool = typer.Option(False, "--variants", help="time each decode-step variant (eager, fused, graphs, graphs+compile)"),
    schedules: bool = typer.Option(False, "--schedules", help="time the vocoder's steady chunk sizes side by side"),
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
    dt = pick_dtype(dtype, dev)
    t = time.perf_counter()
    model = build_model(preset, dev, dt)
    build_s = time.perf_counter() - t
    progress(f"built {preset} on {dev} in {build_s:.1f} s")
    g = torch.Generator().manual_seed(1)
    vocab = model.config.thinker_config.text_config.vocab_size
    prompt = torch.randint(0, min(vocab, 150000), (prompt_tokens,), generator=g).tolist()
    if variants:
        table = {name: _ours(model, prompt, text_tokens, codes, dev, graphs, runs, variant=name) for name in VARIANTS}
        typer.echo(json.dumps(table, indent=2) if as_json else _variants_table(table))
        return
    if schedules:
        table = _schedules(model, prompt, text_tokens, codes, dev, runs)
        typer.echo(json.dumps(table, indent=2) if as_json else _variants_table(table))
        return
    ours = _ours(model, prompt, text_tokens, codes, dev, graphs, runs)
    ref = _reference(model, prompt, text_tokens, codes, dev) if compare_hf else None
    meta = {
        "preset": preset, "approximate": bool(PRESETS[preset] and PRESETS[preset]["approximate"]),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "dtype": str(dt), "torch": torch.__version__, "prompt_tokens": prompt_tokens,
        "text_tokens": text_tokens, "codes": codes, "graphs": graphs, "build_s": build_s,
        "date": time.strftime("%Y-%m-%d"),
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
    }
    if as_json:
        typer.echo(json.dumps({"meta": meta, "omni_cli": ours, "transformers": ref}, indent=2))
        return
    note = " (approximate: talker sizes assumed)" if meta["approximate"] else ""
    print(f"{preset}{note} on {meta['device']}, {dt}, {meta['parameters_b']:.2f} B parameters; "
          f"prompt {prompt_tokens}, text {text_tokens}, codes {codes}", file=sys.stderr)
    typer.echo(_table(ours, ref))


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
