"""Thinker steps (the text LLM): `prefill` a prompt and `decode_one` token over a static KV cache.

Each step returns what the rest of the turn needs: the next-token logits (float32, for sampling), and the
input embedding plus last hidden state of the fed tokens, whose sum is the "reply vector" the talker
reads. Steps take and return device tensors only; nothing here looks at a value on the host.

It does not know about sampling, the talker, or threads. Audio, image and video prompt inputs (the
thinker's encoders) are not handled: prompts are token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...runtime import compat
from ...runtime.decoder import forward_layers
from ...runtime.kv_cache import StaticKVCache


@dataclass
class ThinkerOut:
    embeds: torch.Tensor  # [1, n, width] input embeddings of the fed tokens
    hidden: torch.Tensor  # [1, n, width] last hidden state (after the final norm)
    logits: torch.Tensor  # [1, vocab] float32 logits for the token after the last fed one


class Thinker:
    def __init__(self, thinker_module, cache: StaticKVCache) -> None:
        self.model = compat.thinker_text_model(thinker_module)  # Qwen2_5OmniThinkerTextModel
        self.embed_tokens = thinker_module.get_input_embeddings()
        self.lm_head = thinker_module.lm_head
        self.cache = cache

    def enable_fast_decode(self, graphs: bool, compile: bool = False) -> None:
        """Decode through the fused fixed-shape step (`runtime/fused.py`), replayed as CUDA graphs when possible."""
        from ...runtime.fused import TokenDecoder

        self.fused = TokenDecoder(self.model, self.cache, self.embed, self.lm_head, graphs=graphs, compile=compile)

    def capture_graphs(self) -> None:
        if self.fused is not None:
            self.fused.capture()

    fused = None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def prefill(self, input_ids: torch.Tensor) -> ThinkerOut:
        """Run the whole prompt ([1, L] ids) from an empty cache."""
        self.cache.reset()
        embeds = self.embed(input_ids)
        hidden = forward_layers(self.model, embeds, self.cache)
        # The reference projects every position and keeps the last row: do the same matmul so the
        # picked token is bit-identical (a one-row matmul may round differently).
        logits = self.lm_head(hidden)[:, -1].float()
        return ThinkerOut(embeds, hidden, logits)

    def decode_one(self, token: torch.Tensor) -> ThinkerOut:
        """Feed one token ([1] long, on device) and return its vectors and the next logits."""
        if self.fused is not None:  # outputs in static (graph) buffers until the next step: use them at once
            return ThinkerOut(*self.fused(token))
        embeds = self.embed(token.view(1, 1))
        hidden = forward_layers(self.model, embeds, self.cache)
        return ThinkerOut(embeds, hidden, self.lm_head(hidden)[:, -1].float())
