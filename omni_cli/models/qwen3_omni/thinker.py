"""Qwen3-Omni thinker steps (the MoE text LLM): `prefill` a prompt and `decode_one` token over a static KV cache.

The layers, norms, rotary embedding, embeddings and `lm_head` are transformers' own modules of
`Qwen3OmniMoeThinkerForConditionalGeneration`, called directly, so the float ops are the reference's and
greedy picks match `generate` token for token. Each step returns the input embeddings of the fed tokens
(what the talker's `text_projection` reads), the last hidden state, the next-token logits (float32), and
the hidden state the talker's `hidden_projection` reads at audio/image/video positions
(`accept_hidden_layer`). Steps take and return device tensors only: nothing here reads a device value.

Positions are a host-side 1-D offset expanded to the three interleaved M-RoPE rows. That is exact for
text (the reference's `get_rope_index` gives the same position on every row); audio, image and video
prompts (the encoders, `get_rope_index` and its delta, deepstack) are not handled yet. It knows nothing
of sampling, the talker or threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...runtime import compat
from ...runtime.decoder import forward_layers_keeping
from ...runtime.kv_cache import StaticKVCache


@dataclass
class ThinkerOut:
    embeds: torch.Tensor  # [1, n, W] input embeddings of the fed tokens
    hidden: torch.Tensor  # [1, n, W] last hidden state (after the final norm)
    logits: torch.Tensor  # [1, vocab] float32 logits for the token after the last fed one
    # [1, n, W] the reference's `hidden_states[accept_hidden_layer]` of the fed tokens: the output of layer
    # accept_hidden_layer-1, or the final-normed state when that is the last layer (transformers replaces
    # the last recorded hidden state by the normed one). The talker reads it only at multimodal positions.
    accepted: torch.Tensor | None = None


class Thinker:
    def __init__(self, thinker_module, cache: StaticKVCache, accept_hidden_layer: int | None = None) -> None:
        """`accept_hidden_layer`: the talker config's value (the thinker's own config does not hold it);
        None leaves `ThinkerOut.accepted` empty (text-only turns never read it)."""
        self.model = compat.thinker_text_model(thinker_module)  # Qwen3OmniMoeThinkerTextModel
        self.embed_tokens = thinker_module.get_input_embeddings()
        self.lm_head = thinker_module.lm_head
        self.cache = cache
        self.accept_layer = accept_hidden_layer

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def _forward(self, embeds: torch.Tensor) -> ThinkerOut:
        hidden, accepted = forward_layers_keeping(self.model, embeds, self.cache, self.accept_layer)
        # The reference projects every fed position and keeps the last row: the same matmul keeps the
        # picked token bit-identical (a one-row matmul may round differently from an L-row one).
        logits = self.lm_head(hidden)[:, -1].float()
        return ThinkerOut(embeds, hidden, logits, accepted)

    def prefill(self, input_ids: torch.Tensor) -> ThinkerOut:
        """Run the whole prompt ([1, L] ids) from an empty cache."""
        self.cache.reset()
        return self._forward(self.embed(input_ids))

    def decode_one(self, token: torch.Tensor) -> ThinkerOut:
        """Feed one token ([1] long, on device) and return its vectors and the next logits."""
        return self._forward(self.embed(token.view(1, 1)))
