"""Thinker steps (the text LLM): `prefill` a prompt and `decode_one` token over a static KV cache.

Each step returns what the rest of the turn needs: the next-token logits (float32, for sampling), and the
input embedding plus last hidden state of the fed tokens, whose sum is the "reply vector" the talker
reads. Steps take and return device tensors only; nothing here looks at a value on the host.

A prompt may hold audio clips: `prefill(ids, media)` runs the thinker's audio encoder on their features
(the processor's `input_features` and `feature_attention_mask`) and puts its outputs at the prompt's
audio placeholder positions, as the reference's forward does; positions stay 1-D (for audio the three
M-RoPE rows are equal). `ThinkerOut.talker_embeds` is then what the talker's prompt reads: the same
embeddings with the audio positions zeroed (the reference's generate zeroes them). Images and video (the
vision encoder, 3-D positions) are not handled.

It does not know about sampling, the talker, or threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...runtime import compat
from ...runtime.context import KeptContext, Reuse
from ...runtime.decoder import forward_layers, mrope_positions
from ...runtime.kv_cache import StaticKVCache
from ...runtime import encoders

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ...runtime.fused import TokenDecoder
    from ...runtime.graphs import PrefillGraphs


@dataclass
class ThinkerOut:
    embeds: torch.Tensor  # [1, n, width] input embeddings of the fed tokens
    hidden: torch.Tensor  # [1, n, width] last hidden state (after the final norm)
    logits: torch.Tensor  # [1, vocab] float32 logits for the token after the last fed one
    # [1, n, width] the embeddings the talker's prompt reads (audio/image positions zeroed); None: `embeds`
    talker_embeds: torch.Tensor | None = None
    # The prompt's media (encoder inputs) and ids, for the talker's positions; None for a decode step.
    media: dict | None = None
    prompt_ids: list | None = None
    # Of a prompt: the positions its prefill found kept in the cache, and which prefill it was (the
    # thinker's count): the talker keeps its rows of those positions (runtime/context.py `TalkerRows`).
    found: int = 0
    prompt: int = 0


class Thinker:
    def __init__(self, thinker_module, cache: StaticKVCache) -> None:
        self.module = thinker_module
        self.audio_token = thinker_module.config.audio_token_index
        self.image_token = thinker_module.config.image_token_index
        self.rope_delta = 0  # what the last prompt's M-RoPE positions leave for the steps after it
        self.model = compat.thinker_text_model(thinker_module)  # Qwen2_5OmniThinkerTextModel
        self.embed_tokens = thinker_module.get_input_embeddings()
        self.lm_head = thinker_module.lm_head
        self.cache = cache
        # The last prompt's positions kept for the next (runtime/context.py); None: every prefill is whole.
        self.context: KeptContext | None = KeptContext(self.audio_token, self.image_token)
        self.kept_positions = 0  # positions the last prefill found in the cache
        self.prompts = 0  # prefills so far (a prompt's number, for the talker's kept rows)

    def enable_fast_decode(self, policy) -> None:
        """Decode through the fused fixed-shape step (`runtime/fused.py`), replayed as CUDA graphs where
        `policy` (runtime/graphs.py) has them."""
        from ...runtime.fused import TokenDecoder

        from . import PROMPT_GRAPHS

        self.fused = TokenDecoder(self.model, self.cache, self.embed, self.lm_head, policy=policy)
        weight = self.embed_tokens.weight
        self.prefill_graphs = policy.prefill_graphs(self.model, self.cache, weight.shape[1], weight.dtype,
                                                    allowed=PROMPT_GRAPHS and weight.dtype == torch.bfloat16)

    def capture_graphs(self) -> None:
        if self.context is not None:
            self.context.clear()  # the captures write the cache
        if self.fused is not None:
            self.fused.capture()
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture_all()

    fused: TokenDecoder | None = None  # the fused step (`enable_fast_decode`)
    prefill_graphs: PrefillGraphs | None = None  # made with `fused`

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def prefill(self, input_ids: torch.Tensor, media: dict | None = None) -> ThinkerOut:
        """Run the prompt ([1, L] ids; `media`: its audio features and images): over the kept context
        where the prompt extends the last one (runtime/context.py: only the rest is prefilled, only its
        clips and images encoded), else from an empty cache. The outputs cover the whole prompt."""
        ids = input_ids[0].tolist()
        self.prompts += 1
        reuse = self.context.reuse(ids, media) if self.context is not None else Reuse(0, media)
        start, part = reuse.start, reuse.media or {}
        self.cache.keep_first(start)  # 0: nothing kept
        self.kept_positions = start
        rest = input_ids[:, start:]
        embeds = self.embed(rest)
        talker_embeds, positions, self.rope_delta = None, None, 0
        if part.get("input_features") is not None:
            embeds, talker_embeds = self._with_audio(rest, embeds, part, ids[start:].count(self.audio_token))
        if part.get("pixel_values") is not None:
            embeds, talker_embeds = self._with_images(rest, embeds, talker_embeds, part,
                                                      ids[start:].count(self.image_token))
        encoders.timed_into(media, part)
        if media and media.get("pixel_values") is not None:  # the whole prompt's 3-D positions, this part's
            positions, self.rope_delta = mrope_positions(self.module, ids, media, embeds.device)
            positions = positions[..., start:]
        if self.fused is not None:
            self.fused.fused.rope_shift.fill_(self.rope_delta)
        # A graph per length bucket, from an empty cache or over the kept context, where one is captured
        # (runtime/graphs.py PrefillGraphs); eagerly otherwise, and with an image's 3-D positions.
        graphed = self.prefill_graphs.run(embeds) if self.prefill_graphs is not None and positions is None else None
        hidden = graphed[0] if graphed is not None else forward_layers(self.model, embeds, self.cache,
                                                                        positions=positions)
        # The reference projects every position and keeps the last row: do the same matmul so the
        # picked token is bit-identical (a one-row matmul may round differently).
        logits = self.lm_head(hidden)[:, -1].float()
        talker_embeds = embeds if talker_embeds is None else talker_embeds
        if start:
            assert self.context is not None  # a reuse comes from it
            embeds, hidden, talker_embeds = (self.context.joined(name, start, t) for name, t in
                                             (("embeds", embeds), ("hidden", hidden), ("talker", talker_embeds)))
        if self.context is not None:
            self.context.keep(ids, media, {"embeds": embeds, "hidden": hidden, "talker": talker_embeds},
                              self.rope_delta)
        return ThinkerOut(embeds, hidden, logits, talker_embeds, media or None, ids, start, self.prompts)

    def _with_images(self, input_ids, embeds, talker_embeds, media, places: int):
        """The vision encoder's outputs at the image positions (and zeros there for the talker)."""
        embeds, positions, _ = encoders.with_images(self.module, input_ids, embeds, media, self.image_token, places)
        base = talker_embeds if talker_embeds is not None else embeds
        return embeds, base.masked_fill(positions, 0.0)

    def _with_audio(self, input_ids, embeds, media, places: int):
        """(embeds with the audio encoder's outputs at the audio positions, the same with them zeroed)."""
        embeds, positions = encoders.with_audio(self.module, input_ids, embeds, media, self.audio_token, places)
        return embeds, embeds.masked_fill(positions, 0.0)

    def decode_one(self, token: torch.Tensor) -> ThinkerOut:
        """Feed one token ([1] long, on device) and return its vectors and the next logits."""
        if self.fused is not None:  # outputs in static (graph) buffers until the next step: use them at once
            return ThinkerOut(*self.fused(token))
        embeds = self.embed(token.view(1, 1))
        hidden = forward_layers(self.model, embeds, self.cache, shift=self.rope_delta)
        return ThinkerOut(embeds, hidden, self.lm_head(hidden)[:, -1].float())

