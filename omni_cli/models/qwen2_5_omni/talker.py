"""Talker steps (the speech-codec LLM): `prefill` from the thinker's prompt vectors and `decode_one` code.

Inputs are built exactly as transformers' `Qwen2_5OmniForConditionalGeneration.generate` builds them:
prefill = [prompt hidden + prompt embeddings, voice's text-bos embedding (+ codec pad), first reply
vector (+ codec bos)]; decode step k = embedding of code k-1 + reply vector k. Every input goes through
`thinker_to_talker_proj`, a plain `torch.nn.Linear` that we call directly on the critical path. In a
conversation the rows of the prompt positions the thinker kept stay in the cache from the turn before.

It does not know where reply vectors come from (the engine picks reply vector, text-EOS or text-pad),
nor about sampling or stopping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...runtime.context import TalkerRows
from ...runtime.decoder import forward_layers
from ...runtime.kv_cache import StaticKVCache

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ...runtime.fused import FusedDecoder
    from ...runtime.graphs import PrefillGraphs


class Talker:
    def __init__(self, talker_module, cache: StaticKVCache) -> None:
        self.module = talker_module
        self.rope_delta = 0  # what an image prompt's M-RoPE positions leave for the steps after it
        self.model = talker_module.model  # Qwen2_5OmniTalkerModel
        self.proj = talker_module.thinker_to_talker_proj
        self.codec_embed = talker_module.get_input_embeddings()
        self.codec_head = talker_module.codec_head
        self.cache = cache
        self.rows = TalkerRows()  # which of the cache's rows the next prompt may keep (runtime/context.py)
        cfg = talker_module.config
        self.codec_bos = cfg.tts_codec_start_token_id
        self.codec_pad = cfg.tts_codec_pad_token_id
        self.codec_eos = cfg.tts_codec_end_token_id
        self.codec_mask = cfg.tts_codec_mask_token_id
        # Made once: building a tensor from host values inside the loop would be a host→device copy.
        self.pad_bos_ids = torch.tensor([self.codec_pad, self.codec_bos], device=self.proj.weight.device)

    fused: FusedDecoder | None = None  # the fused step (`enable_fast_decode`)
    prefill_graphs: PrefillGraphs | None = None  # the prompt's graphs, made with `fused`

    def enable_fast_decode(self, policy) -> None:
        """Decode through the fused fixed-shape step (`fused.py`), replayed as CUDA graphs where `policy`
        (runtime/graphs.py) has them, compiled where it says."""
        from ...runtime.fused import FusedDecoder

        dev = self.cache.keys[0].device
        width = self.proj.in_features
        self.fused = FusedDecoder(self.model, self.cache, policy=policy)
        self.static_code = torch.zeros(1, dtype=torch.long, device=dev)
        self.static_reply = torch.zeros(1, 1, width, dtype=self.proj.weight.dtype, device=dev)
        self.static_pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs = policy.step_graphs(self._fused_step, self.cache.max_len, lazy=not policy.compile_on)
        from . import PROMPT_GRAPHS

        dtype = self.proj.weight.dtype
        self.prefill_graphs = policy.prefill_graphs(self.model, self.cache, self.proj.out_features, dtype,
                                                    allowed=PROMPT_GRAPHS and dtype == torch.bfloat16)

    def capture_graphs(self) -> None:
        self.rows.clear()  # the captures write the cache
        if self.fused is not None:
            with torch.inference_mode():
                self.graphs.capture_all()
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture_all()

    def _fused_step(self, span: int) -> torch.Tensor:
        assert self.fused is not None  # only `enable_fast_decode`'s graphs run this step
        x = self.codec_embed(self.static_code.view(1, 1)) + self.static_reply
        hidden = self.fused.step(self.proj(x), self.static_pos, span)
        return self.codec_head(hidden).float()[:, -1]

    def prefill(
        self,
        prompt_embeds: torch.Tensor,  # [1, L, W] thinker input embeddings of the prompt
        prompt_hidden: torch.Tensor,  # [1, L, W] thinker last hidden states of the prompt
        voice_bos_embed: torch.Tensor,  # [1, 1, W] thinker embedding of the voice's text-bos id
        first_reply: torch.Tensor,  # [1, 1, W] reply vector of the first reply token
        positions: torch.Tensor | None = None,  # [3, 1, L + 2] M-RoPE positions of an image prompt
        shift: int = 0,  # their delta for the steps after the prompt
        *,
        prompt: int,  # the thinker's prompt number (`ThinkerOut.prompt`)
        found: int,  # the positions of it the thinker kept (`ThinkerOut.found`)
    ) -> torch.Tensor:
        """Returns float32 logits [1, vocab] for code 0. The rows of the positions the thinker kept are
        in the cache from the turn before (`TalkerRows`): only the rest is prefilled."""
        length = prompt_embeds.shape[1]
        sources = list(range(length)) + [-1, -1]
        start = self.rows.reuse(sources, prompt, found)
        self.cache.keep_first(start)  # 0: nothing kept
        self.rope_delta = shift
        if self.fused is not None:
            self.fused.rope_shift.fill_(shift)
        x = torch.cat([prompt_hidden + prompt_embeds, voice_bos_embed, first_reply], dim=1)
        pad_bos = self.codec_embed(self.pad_bos_ids)
        x[:, -1, :] += pad_bos[1]
        x[:, -2, :] += pad_bos[0]
        # Projected over every row, as the reference (a matmul's rounding depends on its row count).
        rest = self.proj(x)[:, start:]
        # A graph of the rest's length where one is captured (runtime/graphs.py PrefillGraphs), as the thinker's.
        graphed = self.prefill_graphs.run(rest) if self.prefill_graphs is not None and positions is None else None
        hidden = graphed[0] if graphed is not None else forward_layers(
            self.model, rest, self.cache, positions=None if positions is None else positions[..., start:])
        self.rows.keep(sources, prompt)
        # As the reference: the head over every row prefilled (all of them where nothing was kept), the
        # last kept.
        return self.codec_head(hidden).float()[:, -1]

    def decode_one(self, code: torch.Tensor, reply: torch.Tensor) -> torch.Tensor:
        """Feed code k-1 ([1] long) with reply vector k ([1, 1, W]); returns float32 logits [1, vocab]."""
        if self.fused is not None:
            self.static_code.copy_(code)
            self.static_reply.copy_(reply)
            self.static_pos.fill_(self.cache.length)
            logits = self.graphs(self.cache.length + 1)
            self.cache.advance(1)
            return logits
        x = self.codec_embed(code.view(1, 1)) + reply
        hidden = forward_layers(self.model, self.proj(x), self.cache, shift=self.rope_delta)
        return self.codec_head(hidden).float()[:, -1]

    def prompt_ids(self, prompt_len: int) -> list[int]:
        """The codec-side ids the reference's talker prompt holds (they count for the repetition penalty)."""
        return [self.codec_mask] * prompt_len + [self.codec_pad, self.codec_bos]
