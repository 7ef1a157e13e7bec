"""Qwen3-Omni thinker steps (the MoE text LLM): `prefill` a prompt and `decode_one` token over a static KV cache.

The layers, norms, rotary embedding, embeddings and `lm_head` are transformers' own modules of
`Qwen3OmniMoeThinkerForConditionalGeneration`, called directly, so the float ops are the reference's and
greedy picks match `generate` token for token. Each step returns the input embeddings of the fed tokens
(what the talker's `text_projection` reads), the last hidden state, the next-token logits (float32), and
the hidden state the talker's `hidden_projection` reads at audio/image/video positions
(`accept_hidden_layer`). Steps take and return device tensors only: nothing here reads a device value.

Positions are a host-side 1-D offset expanded to the three interleaved M-RoPE rows. That is exact for
text and audio (the reference's `get_rope_index` gives the same, consecutive position on every row);
a prompt's audio clips go through the audio encoder in `prefill`. Image and video prompts (the vision
encoder, 3-D positions and their delta, deepstack) are not handled yet. It knows nothing of sampling,
the talker or threads.

With fast decode (`enable_fast_decode`), `decode_one` runs the fused fixed-shape step (`runtime/fused.py`:
the experts routed on the device), on CUDA replayed as one CUDA graph per span bucket; the prompt goes
through the library's layers, on CUDA replayed as one graph per prompt-length bucket (`PrefillGraphs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...runtime import compat
from ...runtime.context import KeptContext, Reuse
from ...runtime.decoder import forward_layers_keeping, mrope_positions
from ...runtime.kv_cache import StaticKVCache
from ...runtime import encoders

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ...runtime.fused import TokenDecoder
    from ...runtime.graphs import PrefillGraphs


@dataclass
class ThinkerOut:
    embeds: torch.Tensor  # [1, n, W] input embeddings of the fed tokens
    hidden: torch.Tensor  # [1, n, W] last hidden state (after the final norm)
    logits: torch.Tensor  # [1, vocab] float32 logits for the token after the last fed one
    # [1, n, W] the reference's `hidden_states[accept_hidden_layer]` of the fed tokens: the output of layer
    # accept_hidden_layer-1, or the final-normed state when that is the last layer (transformers replaces
    # the last recorded hidden state by the normed one). The talker reads it only at multimodal positions.
    accepted: torch.Tensor | None = None
    # The prompt's media (encoder inputs) and ids, for the talker's positions; None for a decode step.
    media: dict | None = None
    prompt_ids: list | None = None
    # Of a prompt: the positions its prefill found kept in the cache, and which prefill it was (the
    # thinker's count): the talker keeps its rows of those positions (runtime/context.py `TalkerRows`).
    found: int = 0
    prompt: int = 0


class Thinker:
    def __init__(self, thinker_module, cache: StaticKVCache, accept_hidden_layer: int | None = None) -> None:
        """`accept_hidden_layer`: the talker config's value (the thinker's own config does not hold it);
        None leaves `ThinkerOut.accepted` empty (text-only turns never read it)."""
        self.module = thinker_module
        self.audio_token = thinker_module.config.audio_token_id
        self.image_token = thinker_module.config.image_token_id
        self.rope_delta = 0  # what the last prompt's M-RoPE positions leave for the steps after it
        self.model = compat.thinker_text_model(thinker_module)  # Qwen3OmniMoeThinkerTextModel
        self.embed_tokens = thinker_module.get_input_embeddings()
        self.lm_head = thinker_module.lm_head
        self.cache = cache
        self.accept_layer = accept_hidden_layer
        # The last prompt's positions kept for the next (runtime/context.py); None: every prefill is whole.
        self.context: KeptContext | None = KeptContext(self.audio_token, self.image_token)
        self.kept_positions = 0  # positions the last prefill found in the cache
        self.prompts = 0  # prefills so far (a prompt's number, for the talker's kept rows)

    def enable_fast_decode(self, policy) -> None:
        """Decode through the fused fixed-shape step (`runtime/fused.py`), replayed as CUDA graphs where
        `policy` (runtime/graphs.py) has them."""
        from ...runtime.fused import TokenDecoder

        self.fused = TokenDecoder(self.model, self.cache, self.embed, self.lm_head, policy=policy, as_sum=True)
        weight = self.embed_tokens.weight
        # The library's experts are graph-safe in bfloat16 only (in float32 its grouped matmul copies from
        # the host): float32 prompts run eagerly.
        self.prefill_graphs = policy.prefill_graphs(self.model, self.cache, weight.shape[1], weight.dtype,
                                                    keep=self.accept_layer, allowed=weight.dtype == torch.bfloat16)

    def capture_graphs(self) -> None:
        if self.context is not None:
            self.context.clear()  # the captures write the cache
        if self.fused is not None:
            self.fused.capture()
            assert self.prefill_graphs is not None  # made with the fused step (`enable_fast_decode`)
            self.prefill_graphs.capture_all()

    prefill_graphs: PrefillGraphs | None = None  # made with `fused`

    fused: TokenDecoder | None = None  # the fused step (`enable_fast_decode`)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def _forward(self, embeds: torch.Tensor, prefill: bool = False, positions=None, after_layer=None) -> ThinkerOut:
        # A prefill replays a graph per length bucket: from an empty cache, or over a kept context (a graph
        # per key span too, captured between turns). One with 3-D positions (an image in the conversation),
        # and one no graph fits, run eagerly.
        graphed = None
        if prefill and self.prefill_graphs is not None and positions is None:
            graphed = self.prefill_graphs.run(embeds)
        if graphed is not None:
            hidden, accepted = graphed
        else:
            hidden, accepted = forward_layers_keeping(self.model, embeds, self.cache, self.accept_layer,
                                                      positions=positions, shift=0 if prefill else self.rope_delta,
                                                      after_layer=after_layer)
        # The reference projects every fed position and keeps the last row: the same matmul keeps the
        # picked token bit-identical (a one-row matmul may round differently from an L-row one).
        logits = self.lm_head(hidden)[:, -1].float()
        return ThinkerOut(embeds, hidden, logits, accepted)

    def prefill(self, input_ids: torch.Tensor, media: dict | None = None) -> ThinkerOut:
        """Run the prompt ([1, L] ids; `media`: its audio features and images): over the kept context where
        the prompt extends the last one (runtime/context.py: only the rest is prefilled, only its clips and
        images encoded), else from an empty cache. Audio positions stay 1-D (for audio the reference's
        M-RoPE rows are equal and consecutive). The outputs cover the whole prompt."""
        ids = input_ids[0].tolist()
        self.prompts += 1
        reuse = self.context.reuse(ids, media) if self.context is not None else Reuse(0, media)
        start, part = reuse.start, reuse.media or {}
        self.cache.keep_first(start)  # 0: nothing kept
        self.kept_positions = start
        rest = input_ids[:, start:]
        embeds = self.embed(rest)
        if part.get("input_features") is not None:
            embeds, _ = encoders.with_audio(self.module, rest, embeds, part, self.audio_token,
                                            ids[start:].count(self.audio_token))
        positions, deepstack, self.rope_delta = None, None, 0
        if part.get("pixel_values") is not None:
            embeds, deepstack = self._with_images(rest, embeds, part, ids[start:].count(self.image_token))
        encoders.timed_into(media, part)
        if media and media.get("pixel_values") is not None:  # the whole prompt's 3-D positions, this part's
            positions, self.rope_delta = mrope_positions(self.module, ids, media, embeds.device)
            positions = positions[..., start:]
        if self.fused is not None:
            self.fused.fused.rope_shift.fill_(self.rope_delta)
        out = self._forward(embeds, prefill=True, positions=positions, after_layer=deepstack)
        if start:
            assert self.context is not None  # a reuse comes from it
            out.embeds, out.hidden, out.accepted = (self.context.joined(name, start, t) for name, t in
                                                    (("embeds", out.embeds), ("hidden", out.hidden),
                                                     ("accepted", out.accepted)))
        if self.context is not None:
            self.context.keep(ids, media, {"embeds": out.embeds, "hidden": out.hidden, "accepted": out.accepted},
                              self.rope_delta)
        out.media, out.prompt_ids, out.found, out.prompt = media or None, ids, start, self.prompts
        return out

    def _with_images(self, input_ids, embeds, media, places: int):
        """(embeds with the vision encoder's outputs at the image positions, the deepstack step: its
        multiscale features added at those positions after the first layers, as the reference adds them)."""
        embeds, positions, out = encoders.with_images(self.module, input_ids, embeds, media, self.image_token, places)
        mask = positions[0, :, 0]
        levels = [f.to(embeds.dtype) for f in deepstack_levels(out.deepstack_features)]

        def deepstack(i: int, hidden: torch.Tensor) -> torch.Tensor:
            if i >= len(levels):
                return hidden
            hidden = hidden.clone()
            hidden[0, mask] = hidden[0, mask] + levels[i]
            return hidden

        return embeds, deepstack

    def decode_one(self, token: torch.Tensor) -> ThinkerOut:
        """Feed one token ([1] long, on device) and return its vectors and the next logits (with fast
        decode they live in the graph's buffers until the next step: callers use them at once)."""
        if self.fused is None:
            return self._forward(self.embed(token.view(1, 1)))
        return ThinkerOut(*self.fused(token))


def deepstack_levels(features) -> list:
    """Qwen3-Omni's deepstack image features, one tensor per level over all images: 5.17 returns them so;
    5.24 splits each level per image (a tuple), which the model then joins back (transformers 5.17 ... 5.24)."""
    return [f if isinstance(f, torch.Tensor) else torch.cat(list(f), dim=0) for f in features]
