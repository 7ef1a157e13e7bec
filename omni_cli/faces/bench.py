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
import re
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

import typer

from ..models import presets_modules
from .options import GroupSizeOpt, OneLineErrors, QuantizeOpt, VersionOpt, check_quantize  # neither torch nor numpy
from .program import err_line

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ..config import SamplingOptions

# Each family's presets module (models/<family>/presets.py) says all the bench needs of it: PRESETS
# (name -> spec: true sizes or the built-in tiny checkpoint), build_model, prompt, steps, reference, and
# its words for the table. They import torch only when a function runs.
FAMILIES = tuple(presets_modules())
# name -> spec, the true sizes first, then the tiny ones
PRESETS = dict(sorted(((name, spec) for fam in FAMILIES for name, spec in fam.PRESETS.items()),
                      key=lambda item: "asset" in item[1]))
_FAMILY_OF = {name: fam for fam in FAMILIES for name in fam.PRESETS}
TINY_PRESETS = tuple(name for name, p in PRESETS.items() if "asset" in p)  # those that run on a CPU

DEFAULT_AUDIO_S = 15  # the default reply: 15 s of audio


def family_of(preset: str):
    """The presets module of the family `preset` (a key of PRESETS) belongs to."""
    return _FAMILY_OF[preset]


def build_model(preset: str, device, dtype):
    """The preset's model: random weights allocated and initialised on the device (the tiny presets: their
    checkpoints, in float32)."""
    return family_of(preset).build_model(preset, device, dtype, progress)[0]


class BenchTokenizer:
    """Text for the producer thread without a vocabulary file: one character per token."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


@dataclass
class _Subject:
    """What a run needs beside the weights: the family (its presets module), its voices and default voice,
    text EOS ids and talker sampling."""

    model: Any  # the library's model (torch)
    family: ModuleType  # models/<family>/presets.py
    voices: dict
    voice: str
    eos_ids: list
    talker_sampling: SamplingOptions
    quantize: str | None = None  # --quantize: how the decoder layers were packed (None: not)


def _subject(model, family, voices: dict, quantize: str | None = None) -> _Subject:
    return _Subject(model, family, voices, family.DEFAULT_VOICE, family.text_eos_ids(model), family.TALKER_SAMPLING,
                    quantize)


def _engine(subject: _Subject, prompt_ids, text_tokens, codes, context: int | None = None, **steps_options):
    """The family's steps for these lengths (`steps_options`: graphs, compile, variant) in an engine, warmed
    up: (engine, the warm-up's phases). `context`: the thinker's cache length where the prompt and the
    reply do not say it (a conversation)."""
    from ..runtime.engine import Engine

    from ..config import RuntimeOptions

    # The one runtime object, from the flags and the environment's OMNI_NO_* switches (read once, here).
    graphs, compile = steps_options.pop("graphs", True), steps_options.pop("compile", True)
    runtime = RuntimeOptions.from_env(graphs=None if graphs else False, compile=True if compile else None,
                                      quantize=subject.quantize)
    steps = subject.family.steps(subject.model, subject.voices, max_context=context or max(1024, len(prompt_ids) + text_tokens + 8),
                                 max_codes=codes, runtime=runtime, **steps_options)
    engine = Engine(steps, BenchTokenizer(), eos_ids=subject.eos_ids)
    return engine, engine.warmup()


def _ours(subject: _Subject, prompt_ids, text_tokens, codes, device, graphs: bool, runs: int,
          variant: str | None = None, compile: bool = True) -> dict:
    t0 = time.perf_counter()
    engine, phases = _engine(subject, prompt_ids, text_tokens, codes, graphs=graphs, variant=variant, compile=compile)
    steps = engine.steps
    setup = time.perf_counter() - t0
    how = "compiled" if steps.compile else "not compiled"
    progress(f"engine ready in {setup:.1f} s ({subject.family.READY_NOTE}; {how})")
    out = _measure(engine, subject, prompt_ids, text_tokens, codes, device, runs)
    out["setup_s"] = setup
    out["setup_phases_s"] = phases
    out["compiled"] = bool(steps.compile)
    return out


def _schedules(subject: _Subject, prompt_ids, text_tokens, codes, device, runs: int) -> dict:
    """Each of the family's vocoder schedules on one engine, one after the other in this process (side by side)."""
    family = subject.family
    engine, _ = _engine(subject, prompt_ids, text_tokens, codes, graphs=True)
    steps = engine.steps
    table = {}
    for name in family.SCHEDULES:
        family.use_schedule(steps, name)
        progress(f"schedule {name}")
        table[name] = _measure(engine, subject, prompt_ids, text_tokens, codes, device, runs)
    return table


def _streams(subject: _Subject, prompt_ids, text_tokens, codes, device, runs: int, compile: bool) -> dict:
    """One engine, its talker's steps on the thinker's stream and on their own (the default), side by side:
    each run takes one reply of each, in turn, after a warm-up reply of each."""
    engine, _ = _engine(subject, prompt_ids, text_tokens, codes, graphs=True, compile=compile)
    modes = {"one stream": False, "two streams": True}
    results: dict[str, list] = {name: [] for name in modes}
    for i in range(runs + 1):  # the first run warms up
        for name, overlap in modes.items():
            engine.overlap = overlap
            results[name].append(_reply(engine, subject, prompt_ids, text_tokens, codes, device, i, f"{name}, "))
    return {name: _summary(r) for name, r in results.items()}


def _measure(engine, subject: _Subject, prompt_ids, text_tokens, codes, device, runs: int) -> dict:
    """`runs` timed replies (after one warm-up reply) on a ready engine; medians of the stats."""
    # the first run warms up (graph capture, kernel selection)
    results = [_reply(engine, subject, prompt_ids, text_tokens, codes, device, i) for i in range(runs + 1)]
    # The last run's capture ahead done before anything else uses the device: a capture holds the default
    # CUDA generator, which transformers' reference (--compare-hf) then draws its noise from.
    engine.settle()
    return _summary(results)


def _summary(results: list[dict]) -> dict:
    """The medians of the runs after the first (the warm-up)."""
    best = results[1:] or results
    out = {k: _median([r[k] for r in best]) for k in best[0]}
    out["warmup_total_s"] = results[0]["total_s"]
    return out


def _reply(engine, subject: _Subject, prompt_ids, text_tokens, codes, device, i: int, label: str = "",
           media: dict | None = None, text_ids: list | None = None, fresh: bool = True) -> dict:
    """Run `i` (0: the warm-up) of a benchmark: one timed reply at forced lengths, seeded with `i`; `media`:
    the prompt's encoder inputs; the reply's text ids are appended to `text_ids` where given. `fresh`: the
    prompt is prefilled whole, as a new conversation's (each run repeats the last run's prompt, which the
    thinker's kept context would otherwise find all but one position of); False for a conversation's turns.
    What the last turn left for the idle time (the capture ahead) is done first, untimed."""
    import torch

    engine.settle()
    context = getattr(engine.steps.thinker, "context", None)
    if fresh and context is not None and context.ids:
        context.clear()
        engine.capture_ahead()  # the pause before a new conversation, with nothing kept (a long prompt's graph)

    from ..config import SamplingOptions
    from ..runtime.events import TurnRequest

    thinker = SamplingOptions(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
    sink = _TimedSink()
    req = TurnRequest(prompt_ids, subject.voice, thinker, subject.talker_sampling, text_tokens, codes, seed=i,
                      sink=sink, force_lengths=True, step_events=True, media=media)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for event in engine.stream(req):
        pass
    wall = time.perf_counter() - t
    reply = event.reply
    s = reply.stats
    if text_ids is not None:
        text_ids.extend(reply.text_ids)
    progress(f"{label}{'warm-up run' if i == 0 else f'run {i}'}: {wall:.2f} s, first audio "
             f"{1000 * (s['time_to_first_audio'] or 0):.0f} ms, {s['audio_seconds']:.1f} s of audio")
    return {
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
        "audio_min_lead_ms": sink.min_lead_ms(),  # < 0: a speaker started at the first block runs dry
        # When the speaker's own start rule (omni-say, omni-chat) would begin to play, from the turn's start.
        "speaker_start_ms": _plus(1000 * s["time_to_first_audio"], sink.speaker_wait_ms()),
        "real_time_factor": wall / s["audio_seconds"],
        "total_s": wall,
        "audio_s": s["audio_seconds"],
        "text_tokens": len(reply.text_ids),
        "codes": len(reply.codes),
        "prompt_tokens": s["prompt_tokens"],
        "prefill_tokens": s["prefill_tokens"],  # the rest was kept from the turn before
        "talker_kept_rows": s.get("talker_kept_rows"),  # the talker prompt's rows kept from the turn before
        "audio_encoder_ms": s.get("audio_encoder_ms"),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


class _TimedSink:
    """A null sink that notes when each block arrives (the vocoder's chunk cadence) and how far ahead of
    its play-out it came, for a speaker that starts at the first block."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.starts: list[int] = []  # the sample each block starts at
        self.rate, self.samples = 24000, 0
        self.began = time.perf_counter()

    def start(self, sample_rate):
        self.times.clear()
        self.starts.clear()
        self.rate, self.samples = sample_rate, 0
        self.began = time.perf_counter()  # as a speaker's start(): the producer's rate is counted from here

    def write(self, block):
        self.times.append(time.perf_counter())
        self.starts.append(self.samples)
        self.samples += len(block)

    def min_lead_ms(self):
        """The least time a block came before a speaker started at the first block would need it
        (negative: it would have run dry that long); None for one block."""
        if len(self.times) < 2:
            return None
        t0 = self.times[0]
        return 1000 * min(t0 + s / self.rate - t for t, s in zip(self.times[1:], self.starts[1:]))

    def speaker_wait_ms(self):
        """How long after the first block a speaker (`SpeakerSink`'s start rule, its default settings)
        would start to play: when the block that fills what it asks for came (the last block, where only
        the reply's end would start it); None for no block."""
        from ..audio.speaker import start_after

        if not self.times:
            return None
        sizes = [b - a for a, b in zip(self.starts, self.starts[1:] + [self.samples])]
        at = start_after(self.began, list(zip(self.times, sizes)), self.rate)
        return 1000 * (self.times[-1 if at is None else at] - self.times[0])

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


def _plus(a, b):
    """a + b, or None where either is None."""
    return None if a is None or b is None else a + b


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


ROWS = [
    ("time to first text (ms)", "time_to_first_text_ms", "{:.1f}"),
    ("time to first audio (ms)", "time_to_first_audio_ms", "{:.1f}"),
    ("a speaker starts playing (ms)", "speaker_start_ms", "{:.1f}"),
    ("thinker ms/token", "thinker_ms_per_token", "{:.2f}"),
    ("talker ms/step", "talker_ms_per_step", "{:.3f}"),
    ("code predictor ms/frame", "code_predictor_ms_per_frame", "{:.3f}"),
    ("idle between talker steps (µs)", "talker_gap_us", "{:.1f}"),
    ("vocoder ms/chunk (steady chunk)", "vocoder_ms_per_chunk", "{:.1f}"),
    ("vocoder s per s of audio", "vocoder_s_per_audio_s", "{:.3f}"),
    ("real-time factor", "real_time_factor", "{:.3f}"),
    ("least lead of a block on play-out (ms)", "audio_min_lead_ms", "{:.0f}"),
    ("total (s)", "total_s", "{:.2f}"),
    ("audio (s)", "audio_s", "{:.2f}"),
    ("peak GPU memory (GiB)", "peak_gib", "{:.1f}"),
]


def _table(ours: dict, ref: dict | None, labels: dict) -> str:
    """The rows of ROWS, in the family's words (`labels`: key -> its label, None for a row it has not)."""
    def fmt(value, spec):
        return "-" if value is None else spec.format(value)

    head = f"{'metric':34} {'omni_cli':>12}" + (f" {'transformers':>14} {'ratio':>8}" if ref else "")
    lines = [head, "-" * len(head)]
    for label, key, spec in ROWS:
        label = labels.get(key, label)
        if label is None:
            continue
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


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(gib|gb|mib|mb|g|m)\s*", re.IGNORECASE)
_UNITS = {"gib": 2**30, "g": 2**30, "gb": 10**9, "mib": 2**20, "m": 2**20, "mb": 10**6}


def parse_size(text: str) -> int:
    """'24GiB', '24 GB', '512MiB', '1.5g' -> bytes (GiB, MiB, G and M are powers of two; GB, MB of ten); a
    UsageError for anything else."""
    from ..errors import UsageError

    found = _SIZE.fullmatch(str(text))
    if found is None or float(found.group(1)) <= 0:
        raise UsageError(f"--memory-limit {text!r} is not a size: e.g. 24GiB, 24GB or 512MiB")
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()])


def cap_memory(text: str, device) -> int:
    """--memory-limit: cap this process's allocations on the CUDA `device` at `text` (a size,
    `parse_size`) with torch.cuda.set_per_process_memory_fraction; the cap in bytes. A one-line
    UsageError off CUDA or above the device's memory."""
    import torch

    from ..errors import UsageError

    limit = parse_size(text)
    if device.type != "cuda":
        raise UsageError(f"--memory-limit caps a CUDA GPU's memory, and this run is on {device.type}: leave it out")
    total = torch.cuda.get_device_properties(device).total_memory
    if limit > total:
        raise UsageError(f"--memory-limit {text} is more than the GPU's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    return limit


def _pick_preset(preset: str | None, device) -> str:
    """The preset to build on `device` from the one asked for (None or a key of PRESETS), or a UsageError:
    the full sizes are refused on a CPU (in float32 they need more memory than a CPU machine has, and
    building them runs out of it after a minute)."""
    from ..errors import UsageError

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


@app.command(cls=OneLineErrors)
def bench(
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
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="CUDA graphs for the decode steps and the "
                                                                   "vocoder"),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="torch.compile the decode steps and the "
                                 "vocoder first (with graphs); --no-compile measures what omni-say and omni-chat "
                                 "run by default"),
    compare_hf: bool = typer.Option(False, "--compare-hf", help="also run transformers' generate"),
    variants: bool = typer.Option(False, "--variants", help="time each decode-step variant (eager, fused, graphs, "
                                                            "graphs+compile; Qwen2.5)"),
    schedules: bool = typer.Option(False, "--schedules", help="time the vocoder's steady chunk sizes side by side "
                                                              "(Qwen2.5)"),
    streams: bool = typer.Option(False, "--streams", help="time the talker's steps on the thinker's stream and on "
                                                          "their own (the default), side by side"),
    turns: Optional[int] = typer.Option(None, "--turns", min=1, show_default=False,
                                        help="a spoken conversation of this many turns, each with a clip "
                                             "(--audio-seconds), timed turn by turn with the context kept "
                                             "between turns and with every prompt prefilled whole, side by "
                                             "side (--prompt-tokens does not apply)"),
    audio_seconds: float = typer.Option(5.0, "--audio-seconds", min=0.1, help="the clip of each --turns turn"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    quantize: QuantizeOpt = None,
    group_size: GroupSizeOpt = None,
    memory_limit: Optional[str] = typer.Option(
        None, "--memory-limit", metavar="SIZE", show_default=False,
        help="cap this process's GPU memory (e.g. 24GiB, 24GB, 512MiB; torch's per-process fraction): whether "
             "the preset fits a smaller GPU; the JSON records the cap, the weights' bytes and the peak"),
    version: VersionOpt = False,
) -> None:
    """Benchmark one reply at forced lengths on random weights."""
    import torch

    from ..errors import UsageError
    from ..loader import pick_device, pick_dtype

    if preset is not None and preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    dev = pick_device(device)  # a device that is not here: the same one-line UsageError as omni-say's
    preset = _pick_preset(preset, dev)
    family = family_of(preset)
    asked = "variants" if variants else "schedules" if schedules else None
    if asked and not _offers(family, asked):
        offered = " and ".join(f.TITLE for f in FAMILIES if _offers(f, asked))
        raise UsageError(f"--{asked} is for the {offered} presets (the {family.TITLE} steps have one variant, "
                         f"{', '.join(family.VARIANTS)})")
    if prompt_tokens <= family.PROMPT_FRAME:
        raise UsageError(f"--prompt-tokens must be more than {family.PROMPT_FRAME} for {preset} (a user turn and "
                         "the assistant opener)")
    if codes is None:
        codes = int(DEFAULT_AUDIO_S * family.CODES_PER_SECOND + 0.5)
    quantize = check_quantize(quantize, group_size)
    limit = cap_memory(memory_limit, dev) if memory_limit is not None else None
    if quantize is not None and compile and graphs and dev.type == "cuda":
        progress(f"note: torch.compile over packed (--quantize {quantize}) weights is not supported: the steps run "
                 "uncompiled")
        compile = False
    dt = pick_dtype(dtype, dev)
    t = time.perf_counter()
    model, voices = family.build_model(preset, dev, dt, progress, **(
        {"quantize": quantize, "group_size": group_size} if quantize else {}))
    build_s = time.perf_counter() - t
    build_peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    progress(f"built {preset} on {dev} in {build_s:.1f} s")
    subject = _subject(model, family, voices, quantize)
    prompt = family.prompt(model, prompt_tokens)
    if variants:
        table = {name: _ours(subject, prompt, text_tokens, codes, dev, graphs, runs, variant=name)
                 for name in family.VARIANTS}
        typer.echo(json.dumps(table, indent=2) if as_json else _variants_table(table))
        return
    if turns is not None:
        typer.echo(_conversation(subject, turns, audio_seconds, text_tokens, codes, dev, graphs, compile, as_json))
        return
    if schedules or streams:
        table = (_schedules(subject, prompt, text_tokens, codes, dev, runs) if schedules
                 else _streams(subject, prompt, text_tokens, codes, dev, runs, compile))
        typer.echo(json.dumps(table, indent=2) if as_json else _variants_table(table))
        return
    ours = _ours(subject, prompt, text_tokens, codes, dev, graphs, runs, compile=compile)
    ref = family.reference(model, prompt, text_tokens, codes, dev, progress) if compare_hf else None
    meta = {
        "preset": preset, "family": family.FAMILY, "approximate": PRESETS[preset]["approximate"],
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "dtype": str(next(model.thinker.parameters()).dtype), "torch": torch.__version__,
        "transformers": _transformers_version(), "prompt_tokens": prompt_tokens,
        # talker steps asked for, in the family's unit (codes, or 16-id frames), and per second
        "text_tokens": text_tokens, "codes": codes, "unit": family.UNIT,
        "steps_per_second": float(family.CODES_PER_SECOND),
        "graphs": graphs and family.GRAPHS, "build_s": build_s,
        "date": time.strftime("%Y-%m-%d"),
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "quantize": quantize, "group_size": group_size,
        # bytes: the weights (packed by --quantize, and the float parameters), the cap --memory-limit set,
        # the device's peak while building and, over the whole run, after it
        "weights_bytes": _weights_bytes(model), "memory_limit_bytes": limit, "build_peak_bytes": build_peak,
        "peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
    }
    if as_json:
        typer.echo(json.dumps({"meta": meta, "omni_cli": ours, "transformers": ref}, indent=2))
        return
    note = " (approximate: talker sizes assumed)" if meta["approximate"] else ""
    print(f"{preset}{note} on {meta['device']}, {meta['dtype']}, {meta['parameters_b']:.3g} B parameters; "
          f"prompt {prompt_tokens}, text {text_tokens}, {family.UNIT} {codes}", file=sys.stderr)
    w = meta["weights_bytes"]
    print(f"weights {w['total'] / 2**30:.2f} GiB" + (f" ({w['packed'] / 2**30:.2f} GiB packed {quantize})" if quantize else "")
          + (f", {w['host'] / 2**30:.2f} GiB of it in host memory until an image" if w["host"] else "")
          + (f", cap {limit / 2**30:.1f} GiB" if limit else "")
          + (f", peak {meta['peak_bytes'] / 2**30:.2f} GiB" if meta["peak_bytes"] is not None else ""), file=sys.stderr)
    typer.echo(_table(ours, ref, family.LABELS))


def _conversation(subject: _Subject, turns: int, audio_seconds: float, text_tokens: int, codes: int, device,
                  graphs: bool, compile: bool, as_json: bool) -> str:
    """`--turns`: the conversation kept and whole on one engine (faces/bench_turns.py), as JSON or a table."""
    import torch

    from . import bench_turns

    # Room for every turn: its clip (Qwen2.5-Omni: 25 placeholders a second, Qwen3-Omni: 13), its words,
    # its reply and the template around them.
    context = max(1024, turns * (int(30 * audio_seconds) + text_tokens + 32))
    engine, _ = _engine(subject, [], text_tokens, codes, context=context, graphs=graphs, compile=compile)

    def reply(prompt, media, i, label, text_ids):
        return _reply(engine, subject, prompt, text_tokens, codes, device, i, label, media, text_ids, fresh=False)

    result = bench_turns.conversation(engine, subject, turns, audio_seconds, reply)
    if as_json:
        meta = {"preset_family": subject.family.FAMILY, "turns": turns, "audio_seconds": audio_seconds,
                "text_tokens": text_tokens, "codes": codes, "unit": subject.family.UNIT, "graphs": graphs,
                "compiled": bool(engine.steps.compile), "max_context": context, "date": time.strftime("%Y-%m-%d"),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
                "torch": torch.__version__, "transformers": _transformers_version()}
        return json.dumps({"meta": meta, "turns": result}, indent=2)
    return bench_turns.table(result)


def _weights_bytes(model) -> dict:
    """{"packed", "float", "total", "host"}: the model's packed weights' bytes (quant/apply.packed_bytes) and
    its parameters'; `host`: of those, what waits in host memory (the vision tower: runtime/vision_place.py)."""
    from ..quant.apply import packed_bytes
    from ..runtime.vision_place import host_bytes

    packed = packed_bytes(model)
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"packed": packed, "float": floats, "total": packed + floats, "host": host_bytes(model)}


def _offers(family, flag: str) -> bool:
    """Whether `family` has something for --variants (more than one) or --schedules to compare."""
    return len(family.VARIANTS) > 1 if flag == "variants" else bool(family.SCHEDULES)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def bench_app(argv: list[str] | None = None) -> None:
    """The `omni-bench` program (`argv`: the arguments, default sys.argv[1:]). Every usage error, typer's
    own included (an unknown flag, a value that is not a number), is one `error: ...` line on stderr and
    exit code 2; a failure with a known cause is one line and exit code 1; anything else is a bug and
    keeps its traceback."""
    from ..bytecode import cache_bytecode
    from ..errors import OmniError, known_failure

    cache_bytecode()  # before torch is imported

    try:
        # Not standalone: the command (options.OneLineErrors, as omni-say's) prints click's usage errors
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
    err_line(f"error: {' '.join(message.split())}")
    raise SystemExit(code)


main = bench_app  # the program, as the other faces name it

if __name__ == "__main__":
    bench_app()
