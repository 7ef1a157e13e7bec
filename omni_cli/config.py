"""Frozen option dataclasses: what a reply is asked to do, separate from how it is done.

The CLI maps flags onto these; the engine reads them. Nothing here imports torch, so `--help`
stays instant. Defaults that depend on the checkpoint (the thinker's sampling settings come from its
`generation_config.json`) are resolved by the loader, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
class RuntimeOptions:
    """How the engine runs on the device."""

    # "auto" = CUDA, then NPU, then MPS, then CPU.
    device: str = "auto"
    # "auto" = bfloat16 on accelerators, float32 on CPU. token2wav always runs in float32.
    dtype: str = "auto"
    # CUDA graphs and compiled decode layers (a no-op on CPU); OMNI_NO_GRAPHS=1 also turns them off.
    graphs: bool = True
    # Longest prompt + reply text the thinker's static KV cache is sized for (tokens).
    max_context: int = 4096
    # Longest reply audio the talker's cache and the vocoder's noise are sized for (50 codes = 1 s).
    max_codes: int = 4096
