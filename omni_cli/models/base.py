"""The one small interface between a model family and the family-free runtime.

A family folder (`qwen2_5_omni/`, `qwen3_omni/`) knows its checkpoint, its prompt and its steps; the
runtime (`omni_cli/runtime/`) knows the turn: threads, the async output boundary, the decode schedule,
sampling and stats. They meet here:

- `Family`: what the loader and the API ask of a family before and while loading (its `model_type`,
  the checks of a folder, the voices, how to load it, the defaults a reply gets).
- `ModelSteps`: what the runtime's schedule calls during a turn, all on device tensors and without a
  host sync: thinker `prefill` / `decode_one`, the talker's text entry for each reply token
  (`reply_vector`, `text_eos_vec`, `text_pad_vec`), a per-turn `TalkerTurn` whose `prefill` / `step`
  return the sampled ids of one talker step (1 id for Qwen2.5-Omni, a 16-id frame for Qwen3-Omni),
  and a streaming vocoder for the audio.

The schedule is the same for every family: thinker step j feeds reply token j-1 (giving its text entry
R[j-1], or R[j] at once from the sampled token where `token_vector` gives it) and samples token j;
talker step k is fed R[k], or the text-EOS entry at the index of the text's end (EOS, or the last token
when the text stops by length), or text-pad after it.

It holds the Protocols the runtime is typed with (`ModelSteps`, `Vocoder`, `TalkerTurn`, `ThinkerOutput`)
and the `Family` base class, whose defaults say what a family that lacks a capability gives. It knows no
family, and imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np
    import torch

    from ..config import SamplingOptions
    from ..runtime.graphs import Policy


class ThinkerOutput(Protocol):
    embeds: "torch.Tensor"  # [1, n, W] input embeddings of the fed tokens
    hidden: "torch.Tensor"  # [1, n, W] last hidden state
    logits: "torch.Tensor"  # [1, vocab] float32 logits of the next token


class Vocoder(Protocol):
    """Streams one utterance's audio: codes (ints, or 16-id frames) in, final float32 PCM blocks out."""

    device: "torch.device"
    codes_for_first_audio: int  # talker steps the first block needs
    chunk_log: list  # per decode call: (units made final, seconds); units per code: `log_units_per_code`
    log_units_per_code: int
    # True asks the engine thread to wait (once, bounded) for the first block after the steps it needs, on
    # accelerators too (always on a CPU).
    quiet_first_chunk: bool

    def push(self, codes: Sequence[Any]) -> "list[np.ndarray]": ...

    def finish(self) -> "list[np.ndarray]": ...


class TalkerTurn(Protocol):
    """One turn's talker: sampling state (repetition-penalty masks, suppressed ids) made in `begin`."""

    def prefill(self, prompt: ThinkerOutput, first_vec: "torch.Tensor") -> "torch.Tensor": ...

    def step(self, ids: "torch.Tensor", vec: "torch.Tensor") -> "torch.Tensor": ...


class ModelSteps(Protocol):
    device: "torch.device"
    policy: "Policy"  # where graphs and compile apply, as built (runtime/graphs.py)
    compile: bool  # the decode steps compiled (`policy.compile_on`)
    fast_decode: bool  # the fused fixed-shape decode steps (False: the library's layers)
    max_context: int  # prompt + reply tokens the thinker's cache holds
    max_codes: int  # talker steps the talker's cache and the vocoder are sized for
    has_talker: bool
    text_vocab: int  # rows of the thinker's lm_head
    frame_width: int  # ids a talker step samples: 1 or 16 (codebook 0 first)
    codes_per_second: float  # talker steps per second of audio
    sample_rate: int
    stop_codes: tuple[int, ...]  # codebook-0 ids that end the speech (the step's ids are dropped)
    audio_limit: int  # codebook-0 ids below this are audio; others are kept in the reply but not voiced
    text_eos_vec: "torch.Tensor"  # [1, 1, D]
    text_pad_vec: "torch.Tensor"  # [1, 1, D]

    # `media`: the prompt's encoder inputs as the family's processor makes them (audio features), or None.
    def prefill(self, input_ids: "torch.Tensor", media: "dict | None" = None) -> ThinkerOutput: ...

    def decode_one(self, token: "torch.Tensor") -> ThinkerOutput: ...

    # A prompt that extends the last prefills only the rest (runtime/context.py): {"found": positions the
    # last prefill found kept, "held": positions kept for the next, "bytes": what they hold on the device}.
    def kept_context(self) -> dict: ...

    def reply_vector(self, out: ThinkerOutput) -> "torch.Tensor": ...

    # True where a token's text entry depends on the token alone (Qwen3-Omni: its projected embedding):
    # `token_vector` gives it as soon as the token is sampled, so talker step k need not wait for the
    # thinker step that feeds token k. False where that step's hidden state is needed (Qwen2.5-Omni).
    vector_from_token: bool

    def token_vector(self, token: "torch.Tensor") -> "torch.Tensor": ...  # only where vector_from_token

    def talker_turn(self, prompt_ids: list[int], voice: str, sampling: "SamplingOptions", generator,
                    force_audio: bool) -> TalkerTurn: ...

    def vocoder(self, voice: str, seed: int, max_codes: int) -> Vocoder: ...

    def warmup(self) -> "dict[str, float] | None": ...  # seconds per phase (None: nothing to do)

    # Between turns, on CUDA (the engine's capture ahead): the lazy step graphs' buckets up to AHEAD
    # positions past where the last turn left each cache; the number captured.
    def capture_ahead(self) -> int: ...


class Family:
    """What the loader, the API and the faces ask of a model family, every optional capability stated with
    its default (so nobody probes with getattr). Each family's package makes one from its module-level names
    (`family_of`) and exposes it as `FAMILY` (omni_cli/models/<family>/__init__.py; no torch at import): `models.family(type)`
    and `loaded.family` are that instance."""

    MODEL_TYPE: str = ""  # config.json's model_type
    TITLE: str = ""  # what people call it ("Qwen2.5-Omni")
    EXAMPLE_HUB_ID: str = ""  # for messages: "Qwen/Qwen2.5-Omni-7B"
    # The system prompt a conversation gets when none is given ("" = none).
    DEFAULT_SYSTEM: str = ""
    # The talker speaks reliably only under DEFAULT_SYSTEM (a face warns when another is set).
    NEEDS_DEFAULT_SYSTEM: bool = False
    DEFAULT_VOICE: str = ""  # the voice a reply gets when none is asked for (where the model has it)
    CODES_PER_SECOND: float = 0.0  # talker steps per second of audio
    # The loader may read the folder's weights onto a GPU while transformers is imported (early_weights.py).
    READS_WEIGHTS_EARLY: bool = False
    HEARS_AUDIO: bool = False  # prompts may hold audio clips (`audio_inputs`, `audio_token_id`)
    SEES_IMAGES: bool = False  # prompts may hold images (`image_processor`, `image_inputs`, `image_token_id`)
    # The reference's talker sampling, before a checkpoint's generation_config.json (`talker_sampling`).
    TALKER_SAMPLING: "SamplingOptions | None" = None

    def missing_parts(self, folder: Path) -> list[str]:
        """What a complete folder of this family holds beyond weights and tokenizer, where it is missing."""
        return []

    def voices(self, folder: Path, name: str) -> list[str]:  # no weights read, no torch
        raise NotImplementedError

    def load(self, path: Path, device, dtype, name: str, early=None) -> tuple[Any, dict]:  # (model, voices)
        """`early`: the weights read during the import (only where READS_WEIGHTS_EARLY)."""
        raise NotImplementedError

    def build_steps(self, model, voices: dict, runtime=None) -> ModelSteps:
        """The runtime's steps under `runtime` (config.RuntimeOptions: sizes, graphs, compile; None = the
        defaults). Their graphs and compiled functions all come from one `runtime.graphs.Policy`."""
        raise NotImplementedError

    def talker_sampling(self, generation_config=None) -> "SamplingOptions":
        """The talker's sampling: TALKER_SAMPLING with what the checkpoint's generation_config.json says for
        the talker (`talker_temperature`, ...) taking precedence."""
        from ..config import SamplingOptions, talker_overrides

        return talker_overrides(self.TALKER_SAMPLING or SamplingOptions(), generation_config)

    # -- audio and images in prompts (HEARS_AUDIO, SEES_IMAGES) --------------------------------------------
    def audio_inputs(self, feature_extractor, clips) -> tuple[dict, list[int]]:
        """(encoder inputs for 16 kHz clips, audio tokens each becomes in the prompt)."""
        raise NotImplementedError(f"{self.TITLE} does not hear audio")

    def audio_token_id(self, config) -> int:
        raise NotImplementedError(f"{self.TITLE} does not hear audio")

    def image_processor(self, path: Path):
        raise NotImplementedError(f"{self.TITLE} does not see images")

    def image_inputs(self, image_processor, images) -> tuple[dict, list[int]]:
        raise NotImplementedError(f"{self.TITLE} does not see images")

    def image_token_id(self, config) -> int:
        raise NotImplementedError(f"{self.TITLE} does not see images")

    def __repr__(self) -> str:
        return f"<family {self.TITLE} ({self.MODEL_TYPE})>"


# What a family's package may define at module level to fill in its `Family` (see `family_of`).
_CONSTANTS = ("MODEL_TYPE", "TITLE", "EXAMPLE_HUB_ID", "DEFAULT_SYSTEM", "NEEDS_DEFAULT_SYSTEM", "DEFAULT_VOICE",
              "CODES_PER_SECOND", "READS_WEIGHTS_EARLY", "HEARS_AUDIO", "SEES_IMAGES", "TALKER_SAMPLING")
_FUNCTIONS = ("missing_parts", "voices", "load", "build_steps", "talker_sampling", "audio_inputs",
              "audio_token_id", "image_processor", "image_inputs", "image_token_id")


def family_of(namespace: dict[str, Any], **overrides: Any) -> Family:
    """The `Family` a package's module-level names make: each constant and function of the base that the
    package defines (`namespace`: its globals()) takes the base's place; `overrides` set the rest. A
    capability the package does not define keeps the base's default (no audio, a NotImplementedError)."""
    unknown = set(overrides) - set(_CONSTANTS + _FUNCTIONS)
    if unknown:
        raise TypeError(f"not a Family capability: {sorted(unknown)}")
    family = Family()
    for name in _CONSTANTS + _FUNCTIONS:
        if name in overrides:
            setattr(family, name, overrides[name])
        elif name in namespace:
            setattr(family, name, namespace[name])  # a plain function on the instance: called unbound
    return family
