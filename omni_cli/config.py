"""Frozen option dataclasses: what a reply is asked to do (`ReplyOptions`, `SamplingOptions`), separate
from how it is done (`RuntimeOptions`: device, dtype, graphs, compile, kernels, cache sizes; the only reader
of the runtime switches in the environment, OMNI_NO_GRAPHS=1 and the like).

The CLI maps flags onto these; the engine reads them. It knows no model family and no device. Nothing here imports torch, so `--help`
stays instant. Defaults that depend on the checkpoint (the thinker's sampling settings come from its
`generation_config.json`) are resolved by the loader, not here. Also where the programs keep their
caches (`cache_folder`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

SAMPLE_RATE = 24_000  # both families' vocoders speak at 24 kHz mono


def env_flag(name: str) -> bool:
    """Whether the switch `name` is set in the environment: any value but empty or "0" (OMNI_NO_PYCACHE=1,
    ...). Runtime switches (OMNI_NO_GRAPHS, ...) are read by `RuntimeOptions.from_env` only."""
    return _switch_on(os.environ, name)


def cache_folder(name: str) -> str:
    """Where omni_cli keeps the cache called `name` (compiled kernels, bytecode): paths.cache_dir."""
    from .paths import cache_dir

    return str(cache_dir(name))


@dataclass(frozen=True)
class SamplingOptions:
    """One LLM's sampling settings (the thinker's and the talker's are kept apart)."""

    # False = greedy argmax (after repetition penalty and suppression, as transformers does).
    do_sample: bool = True
    # Softmax temperature; ignored when do_sample is False.
    temperature: float = 1.0
    # Keep the k most likely tokens (0 = off).
    top_k: int = 0
    # Keep the smallest set whose probability mass reaches top_p (1.0 = off).
    top_p: float = 1.0
    # > 1 discourages tokens already in the sequence (prompt included), like transformers.
    repetition_penalty: float = 1.0

    def greedy(self) -> "SamplingOptions":
        return replace(self, do_sample=False)


def talker_overrides(base: SamplingOptions, generation_config) -> SamplingOptions:
    """`base` with the `talker_*` sampling fields a checkpoint's generation config sets (if any)."""
    changes: dict[str, Any] = {}  # field -> value, each cast to its field's type
    for name, cast in (("temperature", float), ("top_k", int), ("top_p", float), ("repetition_penalty", float)):
        value = getattr(generation_config, f"talker_{name}", None) if generation_config is not None else None
        if value is not None:
            changes[name] = cast(value)
    return replace(base, **changes)


# RuntimeOptions fields an environment switch turns off (`RuntimeOptions.from_env`), for runs where a flag
# cannot be passed (tests, profilers, a server started by another program).
RUNTIME_SWITCHES = {
    "graphs": "OMNI_NO_GRAPHS",
    "compile": "OMNI_NO_COMPILE",
    "kernels": "OMNI_NO_KERNELS",
    "attention_kernel": "OMNI_NO_ATTEND",
}
DEFAULT_MAX_CONTEXT = 4096


@dataclass(frozen=True)
class RuntimeOptions:
    """How the engine runs on the device: the one runtime-settings object.

    A face builds it once from its flags and the environment (`from_env`); the library reads nothing
    from the environment after that. Asked for, its fields may say "auto" or wishes the device cannot
    grant (graphs on a CPU); the assistant's `runtime` is the same type as built (`resolved`): the
    device and dtype it runs on ("cuda:0", "bfloat16"), graphs and compile as they really are.
    omni-serve tells its clients the built one (`to_json`); a background omni-serve is started with
    `to_argv()`, which reproduces the asked one.
    """

    # "auto" = CUDA, then NPU, then MPS, then CPU. Resolved: the device the model runs on ("cuda:0").
    device: str = "auto"
    # "auto" = bfloat16 on accelerators, float32 on CPU (token2wav runs in float32 unless packed). Resolved: the
    # thinker's dtype ("bfloat16").
    dtype: str = "auto"
    # CUDA graphs of the decode steps and the vocoder (a no-op on CPU); `--no-graphs`, or OMNI_NO_GRAPHS=1
    # through `from_env`, turns them off.
    graphs: bool = True
    # torch.compile of the decode layers and the vocoder's DiT, before the first reply (with graphs, on a
    # GPU). Off, the default, so that a first reply never waits on a compiler: the graphs replay the plain
    # steps, captured in seconds (H200: Qwen2.5-Omni-7B RTF 0.28, Qwen3-Omni-30B-A3B 0.25). On: faster
    # steady decoding (0.19, 0.095) after a compile of a minute or more the first time, kept in a persistent
    # cache (runtime/graphs.py) for the next start. omni-bench compiles unless told not to. OMNI_NO_COMPILE=1
    # (`from_env`) turns it off.
    compile: bool = False
    # runtime/kernels.py's one-launch matrix-vector products for the small projections (CUDA with triton,
    # uncompiled steps), and a prompt's routed experts, fused norms and rotary embedding (runtime/prompt_ops.py);
    # OMNI_NO_KERNELS=1 (`from_env`) turns them off.
    kernels: bool = True
    # kernels.attend, the one-launch attention block of a one-token step (where the kernels may run);
    # OMNI_NO_ATTEND=1 (`from_env`) turns it off, to measure against the library's attention.
    attention_kernel: bool = True
    # Longest prompt + reply text the thinker's static KV cache is sized for (tokens).
    max_context: int = DEFAULT_MAX_CONTEXT
    # Longest reply audio the talker's cache and the vocoder are sized for, in talker steps (Qwen2.5-Omni:
    # 50 codes = 1 s; Qwen3-Omni: 12.5 frames = 1 s); None = the family's default (about 82 s).
    max_codes: int | None = None
    # Pack the thinker's and the talker's decoder layers at load (quant/apply.py): "int4" (round-to-nearest,
    # symmetric, group scales) or "fp8" (e4m3, 128x128 block scales); None = the checkpoint's own weights.
    # The float weights are read on the CPU and each layer is packed on the device, so only the packed model
    # has to fit there (Qwen3-Omni-30B-A3B: 66 GiB in bfloat16, about 22 GiB int4). A checkpoint quantized
    # already refuses it (its weights load as stored). Packed steps are not compiled.
    quantize: str | None = None
    # int4: the inputs each scale covers (a divisor of every packed layer's input width); None = 128.
    group_size: int | None = None

    @classmethod
    def from_env(cls, environ=None, **fields) -> "RuntimeOptions":
        """The options the flags in `fields` ask for (None = not given), with the environment's switches
        (`RUNTIME_SWITCHES`: OMNI_NO_GRAPHS=1, ...) turning off what no flag set. The one place the
        environment is read for runtime settings. `environ`: a mapping instead of `os.environ` (tests)."""
        env = os.environ if environ is None else environ
        given = {name: value for name, value in fields.items() if value is not None}
        for name, switch in RUNTIME_SWITCHES.items():
            if name not in given and _switch_on(env, switch):
                given[name] = False
        return cls(**given)

    def to_argv(self) -> list[str]:
        """omni-serve's flags that load the model with these options (a background server's command line)."""
        argv = ["--device", self.device, "--dtype", self.dtype]
        if not self.graphs:
            argv.append("--no-graphs")
        argv.append("--compile" if self.compile else "--no-compile")
        if not self.kernels:
            argv.append("--no-kernels")
        if not self.attention_kernel:
            argv.append("--no-attention-kernel")
        argv += ["--max-context", str(self.max_context)]
        if self.max_codes is not None:
            argv += ["--codes-capacity", str(self.max_codes)]
        if self.quantize is not None:
            argv += ["--quantize", self.quantize]
        if self.group_size is not None:
            argv += ["--group-size", str(self.group_size)]
        return argv

    def to_json(self) -> dict:
        """The fields as a JSON object (omni-serve's model info: how it runs the model)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "RuntimeOptions":
        """Back from `to_json` (a server's model info); unknown keys (a newer server's) are left out, a
        missing one keeps its default. A ValueError for what is not an object."""
        if not isinstance(data, dict):
            raise ValueError(f"runtime options must be a JSON object, not {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _switch_on(env, name: str) -> bool:
    return str(env.get(name, "")).strip() not in ("", "0")


@dataclass(frozen=True)
class ReplyOptions:
    """What one reply is asked for: the one object the CLI and the REPL build from their flags and hand
    to `Assistant.stream(prompt, options)` (keyword arguments there override single fields)."""

    # A voice of the model (Qwen2.5-Omni: its spk_dict.pt; Qwen3-Omni: its config's speaker map);
    # None = the model's default voice.
    voice: str | None = None
    # Greedy decoding for thinker and talker (overrides the sampling fields below).
    greedy: bool = False
    # Seed for sampling and the vocoder's noise; None = a fresh random seed per reply.
    seed: int | None = None
    # Caps on the reply's text tokens and talker steps (codes; frames for Qwen3-Omni); None = the
    # model's defaults.
    max_text_tokens: int | None = None
    max_codes: int | None = None
    # Text only: no talker, no vocoder.
    text_only: bool = False
    # The thinker's (text) sampling; None = the checkpoint's generation_config.json. Giving any of them
    # turns sampling on; temperature 0 means greedy text. The talker keeps the reference's settings.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def thinker_sampling(self, base: SamplingOptions) -> SamplingOptions:
        """`base` (the checkpoint's settings) with this reply's overrides applied."""
        if self.greedy or self.temperature == 0:
            return base.greedy()
        changes: dict = {}
        if self.temperature is not None:
            changes["temperature"] = float(self.temperature)
        if self.top_p is not None:
            changes["top_p"] = float(self.top_p)
        if self.top_k is not None:
            changes["top_k"] = int(self.top_k)
        if changes:
            changes["do_sample"] = True
        return replace(base, **changes)

    def check(self) -> "ReplyOptions":
        """Raise a UsageError for values no model accepts (the CLI checks its flags with this too): a
        `LimitError` whose `param` is the field's name (the API names its own field by it)."""
        from .limits import LimitError

        def bad(name: str, message: str) -> LimitError:
            return LimitError(f"{name} {message}", param=name)

        if self.temperature is not None and not (0 <= self.temperature <= 100):
            raise bad("temperature", f"must be between 0 and 100 (got {self.temperature:g})")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise bad("top_p", f"must be above 0 and at most 1 (got {self.top_p:g})")
        if self.top_k is not None and self.top_k < 0:
            raise bad("top_k", f"must be 0 (off) or more (got {_short(self.top_k)})")
        for name in ("max_text_tokens", "max_codes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise bad(name, f"must be at least 1 (got {_short(value)})")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise bad("seed", f"must be between 0 and 2**63-1 (got {_short(self.seed)})")
        return self


# The largest seed: torch.Generator.manual_seed takes 64 bits, and the talker's seed is the reply's plus an
# offset modulo 2**63.
MAX_SEED = 2**63 - 1


def _short(value: int) -> str:
    """An integer as a message shows it: a huge one (a hostile request's 10**30) by its size."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:8]}... ({len(text)} digits)"


@dataclass(frozen=True)
class QuantizeOptions:
    """What `omni-quantize` writes (quant/writing.py's `quantize_folder` reads it)."""

    kind: str = "int4"  # "int4" (compressed-tensors pack-quantized) or "fp8" (float-quantized, block scales)
    group_size: int = 128  # int4: inputs sharing a scale (a divisor of every quantized layer's K)
    symmetric: bool = True  # int4: no zero points (what the community W4A16 checkpoints use)
    block: int = 128  # fp8: the side of a square block sharing a scale (the block-FP8 checkpoints' 128)
    device: str = "auto"  # where each layer is packed: auto, cpu, cuda, ... (the float model stays on the CPU)
    dtype: str = "auto"  # the model's dtype while packing and on disk: auto = config.json's, else bfloat16
    force: bool = False  # replace a DST folder that is not empty
