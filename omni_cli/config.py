"""Frozen option dataclasses: what a reply is asked to do, separate from how it is done.

The CLI maps flags onto these; the engine reads them. Nothing here imports torch, so `--help`
stays instant. Defaults that depend on the checkpoint (the thinker's sampling settings come from its
`generation_config.json`) are resolved by the loader, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SAMPLE_RATE = 24_000  # Qwen2.5-Omni's token2wav speaks at 24 kHz mono
CODES_PER_SECOND = 50  # one talker code is 20 ms of audio


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


# The reference's talker settings (transformers' Qwen2_5OmniForConditionalGeneration.generate).
TALKER_DEFAULTS = SamplingOptions(do_sample=True, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05)


@dataclass(frozen=True)
class ReplyOptions:
    """What one turn should produce."""

    # Speaker name from the checkpoint's spk_dict.pt.
    voice: str = "Chelsie"
    # Greedy decoding for both LLMs (reproducible; what the parity tests use).
    greedy: bool = False
    # Seed for sampling and for the vocoder's starting noise; None = fresh randomness.
    seed: int | None = None
    # Hard caps on the reply length; None = the model's defaults (see loader).
    max_text_tokens: int | None = None
    max_codes: int | None = None
    # Text only: skip the talker and the vocoder entirely.
    text_only: bool = False
    # Overrides of the thinker's / talker's sampling (None = checkpoint / reference defaults).
    thinker_sampling: SamplingOptions | None = None
    talker_sampling: SamplingOptions | None = None


@dataclass(frozen=True)
class RuntimeOptions:
    """How the engine runs on the device."""

    # "auto" = CUDA, then NPU, then MPS, then CPU.
    device: str = "auto"
    # "auto" = bfloat16 on accelerators, float32 on CPU. token2wav always runs in float32.
    dtype: str = "auto"
    # CUDA graphs / compile for the decode steps (a no-op on CPU).
    graphs: bool = True
    # Codes per vocoder hand-off after the first chunk (the first is as small as the DiT window allows).
    codes_per_chunk: int = 24
    # Longest prompt + reply the static KV caches are sized for.
    max_context: int = 4096
    # Extra fields for experiments, never required.
    extra: dict = field(default_factory=dict, hash=False, compare=False)
