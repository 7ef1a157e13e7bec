"""Qwen3-Omni talker steps: from the thinker's text to 16-codebook codec frames, one frame a step.

Each step is what transformers 5.17's `Qwen3OmniMoeForConditionalGeneration.generate` does for one talker
token, rebuilt from the library's inner modules (`talker.model` layers, `codec_head`, `text_projection`,
`code_predictor.model` layers and `lm_head[k]`, the embeddings), never its `forward`s or the nested
per-frame `generate`. A step samples codebook 0 from `codec_head` (repetition penalty over the turn's
earlier codebook-0 ids only, the top 1024 ids suppressed except codec EOS), then the code predictor
samples codebooks 1..15 one after another over a fresh small cache whose two prefill positions are the
talker's final-normed hidden state and the codec embedding of codebook 0. The next step's input is the
sum of the frame's 16 codebook embeddings plus one text entry.

The talker prompt (made in `prefill`, as the reference): the user turns of the conversation only
(system and earlier assistant turns dropped), each token `text_projection`-ed; then nine positions:
`<|im_start|>`, `assistant`, `\\n` (text-projected), then tts_pad + codec nothink / think_bos / think_eos /
the voice's codec id, tts_bos + codec pad, and the first reply token + codec bos. In a conversation the
next prompt's user rows begin with the last one's: those the thinker kept stay in the cache and only the
rest is prefilled (runtime/context.py `TalkerRows`).

Steps take and return device tensors only (no host sync); every id and mask tensor is made in
`__init__` or `begin`. It does not know where the text entries come from (the runtime picks R[k],
`text_eos_vec` or `text_pad_vec`), when the speech ends (a host-side check of codebook 0 against
`stop_codes`), or the vocoder. A user turn's audio positions are read through `hidden_projection` of the
thinker's `accepted` state, as the reference reads them; positions are a 1-D offset, exact for text and
audio (image and video would need the talker's M-RoPE positions from `get_rope_index`).

Two paths do the same steps. The library's layers (`forward_layers`) run the prompt and, without fast
decode, every step. With fast decode (`enable_fast_decode`, on accelerators) a step is two fixed-shape
functions over static buffers, each replayed as one CUDA graph: the talker's step (`runtime/fused.py`,
one graph per attention-span bucket) and the frame (codebook 0's pick, then the code predictor's 15
steps and picks: one graph for all 16 picks). Sampling settings are device tensors and the randomness is
drawn into a buffer before each frame (`runtime/sampling.pick`), so one capture serves every setting
and both paths draw the same picks from the same seed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...config import SamplingOptions
from . import TALKER_SAMPLING
from ...runtime.context import TalkerRows
from ...runtime.decoder import forward_layers
from ...runtime.kv_cache import StaticKVCache
from ...runtime.sampling import SamplingParams, mark_seen, pick

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ...runtime.fused import FusedDecoder
    from ...runtime.graphs import PrefillGraphs

# The reference projects the whole assistant segment (opener + every fed reply token) through
# `text_projection` in ONE matmul after the thinker has finished; a stream must project each reply token
# on its own. A BLAS picks its kernel (and so its summation order) by the row count: on the CPU (MKL, one
# thread) a 1- or 2-row matmul rounds differently from a many-row one, which flips near-tied greedy picks.
# Projected inside a block of this many rows, a row takes the many-row kernel, whose per-row result does
# not depend on the row count: bit-identical to the reference's whenever its segment has enough rows too
# (measured: >= 3 for input widths up to 64, >= 5-6 for 96-128, >= 11 for 256; the segment has 3 + the
# fed reply tokens). Short replies on wide models may still differ in the last bit. On an accelerator in
# bf16 exact parity is not a goal; the padding is free there (reading the weights dominates).
PROJECTION_ROWS = 16

# Talker sampling defaults of `generate` (its signature; generation_config.json is not read for them).
TALKER_DEFAULTS = TALKER_SAMPLING
# The code predictor's: `prepare_inputs_for_generation` passes top_k 50 and top_p 0.8 when sampling; its own
# generation config has no temperature (1.0) and no penalty; its do_sample mirrors the talker's.
PREDICTOR_DEFAULTS = SamplingOptions(do_sample=True, temperature=1.0, top_k=50, top_p=0.8, repetition_penalty=1.0)


class Talker:
    frame_width = 16  # codebooks a step samples (the config's num_code_groups; set per model below)
    audio_limit: int = 2048  # codebook-0 ids below it are audio (the codebook size; set per model below)

    def __init__(self, model, cache: StaticKVCache, predictor_cache: StaticKVCache) -> None:
        """`model`: the `Qwen3OmniMoeForConditionalGeneration` (the talker needs the thinker's embeddings).

        `cache`: the talker's, at least (user-turn positions + 9 + frames) long; `predictor_cache`: the code
        predictor's, at least num_code_groups (16) long, reset for every frame.
        """
        talker = model.talker
        cfg = model.config
        tcfg = cfg.talker_config
        self.module = talker
        self.rope_delta = 0  # what an image prompt's M-RoPE positions leave for the steps after it
        self._tts_pad = cfg.tts_pad_token_id
        self.model = talker.model  # Qwen3OmniMoeTalkerModel
        self.codec_embed = talker.get_input_embeddings()  # codebook 0 and the codec control ids
        self.codec_head = talker.codec_head
        self.text_projection = talker.text_projection
        self.hidden_projection = talker.hidden_projection  # what multimodal user positions get
        self.thinker_embed = model.thinker.get_input_embeddings()
        self.predictor = talker.code_predictor.model
        self.predictor_heads = talker.code_predictor.lm_head  # [k] gives codebook k+1
        self.predictor_embeds = talker.code_predictor.get_input_embeddings()  # [k] embeds codebook k+1
        self.cache = cache
        self.rows = TalkerRows()  # which of the cache's rows the next prompt may keep (runtime/context.py)
        self.predictor_cache = predictor_cache
        self.accept_hidden_layer = tcfg.accept_hidden_layer

        self.frame_width = tcfg.num_code_groups
        self.audio_limit = tcfg.code_predictor_config.vocab_size
        vocab = tcfg.text_config.vocab_size
        self.codec_eos = tcfg.codec_eos_token_id
        # `generate` stops the talker on codec EOS only (its eos_token_id); every other control id is
        # suppressed, so it cannot be sampled.
        self.stop_codes = (self.codec_eos,)
        self.voices = dict(tcfg.speaker_id)
        self._tcfg = tcfg
        self._im_start, self._assistant, self._user = cfg.im_start_token_id, cfg.assistant_token_id, cfg.user_token_id
        thinker_cfg = cfg.thinker_config
        self._media_ids = {thinker_cfg.audio_token_id, thinker_cfg.image_token_id, thinker_cfg.video_token_id}

        dev = self.codec_head.weight.device
        dtype = self.codec_head.weight.dtype
        width = self.thinker_embed.weight.shape[1]
        self._pad_rows = torch.zeros(1, PROJECTION_ROWS, width, device=dev, dtype=self.thinker_embed.weight.dtype)
        self._no_codec = torch.zeros(1, 3, self.codec_head.in_features, device=dev, dtype=dtype)  # opener rows
        # `generate` suppresses the top 1024 ids of the talker vocabulary except codec EOS (a fixed rule
        # of its code, not the config's codebook size).
        self._suppress = torch.zeros(1, vocab, dtype=torch.bool, device=dev)
        self._suppress[0, vocab - 1024 :] = True
        self._suppress[0, self.codec_eos] = False
        self._seen = torch.zeros(1, vocab, dtype=torch.bool, device=dev)
        self._codec_ids = None  # set by `begin`
        self.talker_params = SamplingParams(vocab, dev)
        self.predictor_params = SamplingParams(self.audio_limit, dev)
        # Exp(1) draws for one frame's picks (row k: codebook k), drawn before each frame outside any graph.
        self._race = torch.ones(self.frame_width, vocab, device=dev)
        # The code predictor's positions: its two prefill rows, then one per codebook after the first.
        self._predictor_pos = [torch.tensor([0, 1], device=dev)]
        self._predictor_pos += [torch.tensor([k + 1], device=dev) for k in range(1, self.frame_width - 1)]
        # What the talker's step leaves for the frame: its last hidden state and codebook-0 logits (static,
        # so that the frame's graph reads them in place).
        self._hidden = torch.zeros(1, 1, self.codec_head.in_features, device=dev, dtype=dtype)
        self._logits = torch.zeros(1, vocab, device=dev)
        with torch.no_grad():
            # As the reference: the three tts entries projected together (one 3-row matmul).
            special = torch.tensor([[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]], device=dev)
            self.text_bos_vec, self.text_eos_vec, self.text_pad_vec = self.text_projection(
                self.thinker_embed(special)
            ).chunk(3, dim=1)

    @staticmethod
    def default_sampling() -> tuple[SamplingOptions, SamplingOptions]:
        """(talker, code predictor) sampling as the reference's `generate` defaults."""
        return TALKER_DEFAULTS, PREDICTOR_DEFAULTS

    def _project(self, embeds: torch.Tensor) -> torch.Tensor:
        """`text_projection` of thinker embeddings [1, n, W] (n < PROJECTION_ROWS) inside a padded row block."""
        n = embeds.shape[1]
        block = torch.cat([embeds, self._pad_rows[:, : PROJECTION_ROWS - n]], dim=1)
        return self.text_projection(block)[:, :n]

    def reply_vector(self, out) -> torch.Tensor:
        """[1, 1, D]: the text entry of the token `out` fed (its thinker input embedding, projected)."""
        return self.text_entry(out.embeds[:, -1:])

    def text_entry(self, embeds: torch.Tensor) -> torch.Tensor:
        """[1, 1, D]: the text entry of a token from its thinker embedding ([1, 1, W])."""
        return self._project(embeds)

    def begin(
        self,
        prompt_ids: list[int],
        voice: str,
        talker: SamplingOptions,
        predictor: SamplingOptions,
        generator: torch.Generator | None = None,
        force_audio: bool = False,
    ) -> None:
        """Per-turn state: the prompt's user positions, the voice's codec ids, the sampling settings.

        `prompt_ids` must end with the assistant opener (`<|im_start|>assistant\\n`), as a generation prompt
        does: the reference reads the token after it as the first reply token. The reference makes the code
        predictor follow the talker's `do_sample`; `predictor` is used as given. `force_audio`
        (benchmarks): codec EOS is suppressed too, so the speech lasts exactly the asked frames.
        """
        speaker = self.voices.get(voice.lower())  # `generate` lower-cases the name too
        if speaker is None:
            raise ValueError(f"unknown voice {voice!r}; this model has {sorted(self.voices)}")
        ids = list(prompt_ids)
        starts = [t for t in range(len(ids) - 1) if ids[t] == self._im_start and ids[t + 1] == self._assistant]
        if not starts or starts[-1] + 3 != len(ids):
            raise ValueError("the prompt must end with the assistant opener <|im_start|>assistant\\n")
        self._opener = starts[-1]
        # The reference's rule: a position belongs to the turn of the last <|im_start|> at or before it (the
        # first one's turn before any), and is kept when that turn's role token is `user`.
        users, last_start = [], 0
        for t, tok in enumerate(ids):
            if tok == self._im_start:
                last_start = t
            if ids[min(last_start + 1, len(ids) - 1)] == self._user:
                users.append(t)
        if not users:
            raise ValueError("the prompt has no user turn (the talker prompt is made of user turns)")
        dev = self._seen.device
        self._users = users  # host-side, for an image prompt's positions (no device read in the loop)
        self._user_idx = torch.tensor(users, device=dev)
        media = [t for t, tok in enumerate(ids) if tok in self._media_ids]
        # Multimodal positions (audio, image, video placeholders) and the rest, each projected as one block
        # as the reference projects them; None: a text prompt (one projection over every position).
        self._media_idx = torch.tensor(media, device=dev) if media else None
        placed = set(media)  # once: rebuilt for every position, it cost 9 ms at a 920-token prompt on a CPU
        self._text_idx = torch.tensor([t for t in range(len(ids)) if t not in placed], device=dev) if media else None
        c = self._tcfg
        self._codec_ids = torch.tensor(
            [c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id, speaker, c.codec_pad_id, c.codec_bos_id],
            device=dev,
        )
        self._seen.zero_()
        self._suppress[0, self.codec_eos] = force_audio
        self.talker_params.set(talker)
        self.predictor_params.set(predictor)
        self._generator = generator

    # The fused steps and the prompt's graphs (`enable_fast_decode`), made together.
    fused: FusedDecoder | None = None
    predictor_fused: FusedDecoder | None = None
    prefill_graphs: PrefillGraphs | None = None
    _pick = staticmethod(pick)

    def enable_fast_decode(self, policy) -> None:
        """Steps through the fused fixed-shape functions (`runtime/fused.py`), replayed as CUDA graphs
        where `policy` (runtime/graphs.py) has them: the talker's step (one graph per span bucket) and the
        frame (one graph); compiled where it says."""
        from ...runtime.fused import FusedDecoder

        dev = self._seen.device
        self.fused = FusedDecoder(self.model, self.cache, policy=policy, as_sum=True)
        # The code predictor (5 layers) compiled as one function, fused across its layers: measured on an
        # H200, true size, the frame's graph 4.0 ms against 4.4-4.8 ms compiled layer by layer.
        self.predictor_fused = FusedDecoder(self.predictor, self.predictor_cache, policy=policy, mrope=False,
                                            whole=True, as_sum=True)
        self._in_frame = torch.zeros(self.frame_width, dtype=torch.long, device=dev)
        self._in_vec = torch.zeros_like(self.text_pad_vec)
        self._in_pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.step_graphs = policy.step_graphs(self._fused_step, self.cache.max_len, lazy=not policy.compile_on)
        self.prefill_graphs = policy.prefill_graphs(self.model, self.cache, self._hidden.shape[-1], self._hidden.dtype,
                                                    allowed=self._hidden.dtype == torch.bfloat16)  # as the thinker's
        # The 16 picks of a frame, compiled: a sampled pick is ~20 small kernels eagerly (a sort and
        # softmaxes of the vocabulary among them); compiled, the kept tokens are counted without a sort
        # (runtime/sampling.py: the frame 4.79 -> 4.38 ms on an H200).
        self._pick = policy.compile(pick, fullgraph=True)
        # The frame does not depend on the talker's span: one "bucket", the predictor cache's length.
        self.frame_graphs = policy.step_graphs(self._fused_frame, self.predictor_cache.max_len)

    def capture_graphs(self) -> None:
        """Capture the frame's graph and the step's for every span bucket (the engine's warm-up). The
        capture's warm-up runs write the sampling state: `begin` resets it for every turn."""
        self.rows.clear()  # the captures write the cache
        if self.fused is None:
            return
        assert self.prefill_graphs is not None  # made with the fused steps (`enable_fast_decode`)
        self.talker_params.set(self.default_sampling()[0])
        self.predictor_params.set(self.default_sampling()[1])
        with torch.inference_mode():
            self.step_graphs.capture_all()
            self.frame_graphs.capture_all()
        self.prefill_graphs.capture_all()

    def _fused_step(self, span: int) -> None:
        assert self.fused is not None  # only `enable_fast_decode`'s graphs run this step
        x = self._embed_frame(self._in_frame) + self._in_vec
        hidden = self.fused.step(x, self._in_pos, span)
        self._hidden.copy_(hidden)
        self._logits.copy_(self.codec_head(hidden)[:, -1].float())

    def _fused_frame(self, span: int) -> torch.Tensor:
        return self._frame(self._hidden, self._logits)

    def prefill(self, prompt, first_vec: torch.Tensor) -> torch.Tensor:
        """The talker prompt from the thinker's prefill output and R[0]; returns frame 0 ([16] long).

        When the reply is a single token (nothing fed after it), the reference crashes (its prompt loses the
        first-text position); the runtime passes `text_eos_vec` there, a choice of ours.
        """
        if self._codec_ids is None:
            raise RuntimeError("Talker.begin must come before prefill")
        embeds = prompt.embeds
        # User turns: projected over the whole prompt in one matmul, then gathered, as the reference; its
        # audio / image / video positions from the thinker's `accepted` state through hidden_projection.
        user = self._user_rows(prompt).index_select(0, self._user_idx).unsqueeze(0)
        a = self._opener
        opener = self._project(embeds[:, a : a + 3])
        text = torch.cat([opener, self.text_pad_vec.expand(1, 4, -1), self.text_bos_vec, first_vec], dim=1)
        # Added as the reference adds them: the opener rows get zeros, the other six their codec ids.
        codec = torch.cat([self._no_codec, self.codec_embed(self._codec_ids).unsqueeze(0)], dim=1)
        x = torch.cat([user, text + codec], dim=1)
        # The user rows of the positions the thinker kept are in the cache from the turn before.
        sources = self._users + [-1] * (x.shape[1] - len(self._users))
        start = self.rows.reuse(sources, prompt.prompt, prompt.found)
        self.cache.keep_first(start)  # 0: nothing kept
        positions, self.rope_delta = self._positions(prompt, x.device)
        if self.fused is not None:
            self.fused.rope_shift.fill_(self.rope_delta)
        rest = x[:, start:]
        graphed = self.prefill_graphs.run(rest) if self.prefill_graphs is not None and positions is None else None
        hidden = graphed[0] if graphed is not None else forward_layers(
            self.model, rest, self.cache, positions=None if positions is None else positions[..., start:])
        self.rows.keep(sources, prompt.prompt)
        # `codec_head` over every row prefilled, last row kept: the reference's matmul shape (all of the
        # prompt's rows) where nothing was kept.
        logits = self.codec_head(hidden)[:, -1].float()
        self._draw()
        if self.fused is None:
            return self._frame(hidden[:, -1:], logits)
        self._hidden.copy_(hidden[:, -1:])
        self._logits.copy_(logits)
        return self.frame_graphs(self.predictor_cache.max_len).clone()  # out of the graph's buffer

    def _positions(self, prompt, device):
        """(the talker prompt's M-RoPE positions, their delta) for an image prompt, else (None, 0): the
        reference's talker takes them from its own ids, the user turns' and one tts-pad id per opener row."""
        media = getattr(prompt, "media", None)
        if not media or media.get("pixel_values") is None:
            return None, 0
        from ...runtime.decoder import mrope_positions

        users = [prompt.prompt_ids[i] for i in self._users]
        return mrope_positions(self.module, users + [self._tts_pad] * 9, media, device)

    def _user_rows(self, prompt) -> torch.Tensor:
        """[L, D]: every prompt position as the talker's user rows read it."""
        embeds = prompt.embeds[0]
        if self._media_idx is None:
            return self.text_projection(embeds)
        if prompt.accepted is None:
            raise RuntimeError("a multimodal prompt needs the thinker's accepted hidden state")
        rows = torch.empty(embeds.shape[0], self.codec_head.in_features, device=embeds.device,
                           dtype=self.codec_head.weight.dtype)
        rows[self._text_idx] = self.text_projection(embeds.index_select(0, self._text_idx))
        rows[self._media_idx] = self.hidden_projection(prompt.accepted[0].index_select(0, self._media_idx))
        return rows

    def step(self, frame: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        """Feed the previous frame ([16] long) with one text entry ([1, 1, D]); returns the next frame."""
        self._draw()
        if self.fused is None:
            x = self._embed_frame(frame) + vec
            hidden = forward_layers(self.model, x, self.cache, shift=self.rope_delta)
            return self._frame(hidden, self.codec_head(hidden)[:, -1].float())
        self._in_frame.copy_(frame)
        self._in_vec.copy_(vec)
        self._in_pos.fill_(self.cache.length)
        self.step_graphs(self.cache.length + 1)
        self.cache.advance(1)
        return self.frame_graphs(self.predictor_cache.max_len).clone()  # out of the graph's buffer

    def _embed_frame(self, frame: torch.Tensor) -> torch.Tensor:
        """[1, 1, D]: the frame's 16 codebook embeddings, summed as the reference sums them (one reduction
        over the stacked entries; the text entry is added after)."""
        parts = [self.codec_embed(frame[0:1]).view(1, 1, -1)]
        parts += [emb(frame[k + 1 : k + 2]).view(1, 1, -1) for k, emb in enumerate(self.predictor_embeds)]
        return torch.cat(parts, dim=1).sum(1, keepdim=True)

    def _draw(self) -> None:
        """The frame's randomness, from the turn's generator (greedy picks ignore it)."""
        self._race.exponential_(1, generator=self._generator)

    def _frame(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Codebook 0 from `logits`, then codebooks 1..15 from the code predictor; [16] long."""
        c0 = self._pick(logits, self.talker_params, self._seen, self._suppress, self._race[0:1])
        mark_seen(self._seen, c0)
        codes = [c0]
        x = torch.cat([hidden[:, -1:], self.codec_embed(c0).view(1, 1, -1)], dim=1)
        for k, head in enumerate(self.predictor_heads):
            if k:
                x = self.predictor_embeds[k - 1](codes[-1]).view(1, 1, -1)
            logits = head(self._predict(x, k))[:, -1].float()  # over both prefill rows, as the reference
            race = self._race[k + 1 : k + 2, : logits.shape[-1]]
            codes.append(self._pick(logits, self.predictor_params, None, None, race))
        return torch.cat(codes)

    def _predict(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """The code predictor's layers on the rows for codebook k+1 (k = 0: its two prefill rows)."""
        if self.predictor_fused is None:
            if k == 0:
                self.predictor_cache.reset()
            return forward_layers(self.predictor, x, self.predictor_cache, mrope=False)
        return self.predictor_fused.step(x, self._predictor_pos[k], self.predictor_cache.max_len)
