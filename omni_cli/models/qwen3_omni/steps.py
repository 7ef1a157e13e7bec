"""Qwen3-Omni's steps as the runtime calls them (`ModelSteps`, models/base.py).

Builds the MoE thinker and the talker (with its code predictor) over static caches, and the streaming
code2wav for the audio. A talker step is one 80 ms frame: codebook 0 from the talker, codebooks 1-15
from the code predictor (talker.py); the runtime gets the frame's 16 ids at once. What the talker reads
for a reply token is `text_projection` of its thinker embedding (`reply_vector`).

It does not know the turn's threads, the boundary or the schedule (runtime/), nor prompts.

Speed: with fast decode (the default), the thinker's decode step, the talker's step and the frame (the
code predictor's 15 steps with all 16 picks) are fixed-shape functions over static buffers
(`runtime/fused.py`); on CUDA they are compiled and replayed as CUDA graphs captured in `warmup`. Prompts
(thinker and talker prefill) run through the library's layers.
"""

from __future__ import annotations

import torch

from ...config import RuntimeOptions
from ...runtime import audio_graphs
from ...runtime.context import context_figures
from ...runtime.engine import enable_fast_steps
from ...runtime.graphs import Policy
from ...runtime.kv_cache import StaticKVCache
from .talker import Talker
from .thinker import Thinker

CODEBOOK_SIZE = 2048  # codebook-0 ids below this are audio; the rest are the talker's control ids


class Qwen3Steps:
    frame_width = 16
    codes_per_second = 12.5
    sample_rate = 24_000
    audio_limit = CODEBOOK_SIZE
    vector_from_token = True  # R[k] is the projected thinker embedding of token k (`token_vector`)

    compile = False  # the decode layers and the picks compiled (set in __init__: `policy.compile_on`)
    MAX_CODES = 1024  # frames the talker's cache and code2wav hold, where the runtime options give none
    # Set in __init__ by `enable_fast_steps` (runtime/engine.py): the policy as built, and whether the fused
    # decode steps run.
    policy: Policy
    fast_decode: bool

    def __init__(self, model, voices: dict[str, int], runtime: RuntimeOptions | None = None, *,
                 fast_decode: bool | None = None) -> None:
        """`runtime`: cache sizes, graphs and compile (`RuntimeOptions`; None = the defaults), met with the
        model's device in one `graphs.Policy` (`self.policy`) that every graph and compiled function here
        is made through."""
        # `voices` (the loader's name -> codec id map) is not kept: the talker reads the same speaker map
        # from the model's config, and the name is checked before a turn starts.
        runtime = runtime or RuntimeOptions()
        self.model = model
        self.max_context = max_context = runtime.max_context
        self.max_codes = max_codes = runtime.max_codes or self.MAX_CODES
        self.device = next(model.thinker.parameters()).device
        dtype = next(model.thinker.parameters()).dtype
        text_config = model.config.thinker_config.text_config
        cache = StaticKVCache.for_config(text_config, max_context, device=self.device, dtype=dtype)
        self.has_talker = bool(getattr(model, "has_talker", False))
        accept = model.config.talker_config.accept_hidden_layer if self.has_talker else None
        self.thinker = Thinker(model.thinker, cache, accept_hidden_layer=accept)
        self.text_vocab = model.thinker.lm_head.out_features
        if self.has_talker:
            tcfg = model.config.talker_config
            # The talker's prompt keeps the user turns of the prompt and adds 9 opener positions.
            cache = StaticKVCache.for_config(tcfg.text_config, max_context + max_codes + 16, device=self.device,
                                             dtype=dtype)
            # The code predictor's: two prefill positions, then one per codebook after the first.
            predictor = StaticKVCache.for_config(tcfg.code_predictor_config, tcfg.num_code_groups + 1,
                                                 device=self.device, dtype=dtype)
            self.talker = Talker(model, cache, predictor)
            self.stop_codes = tuple(self.talker.stop_codes)
            self.text_eos_vec, self.text_pad_vec = self.talker.text_eos_vec, self.talker.text_pad_vec
        enable_fast_steps(self, dtype, Policy.of(runtime, self.device).over(model), fast_decode)

    # -- thinker -------------------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, media: dict | None = None):
        return self.thinker.prefill(input_ids, media)

    def decode_one(self, token: torch.Tensor):
        return self.thinker.decode_one(token)

    def kept_context(self) -> dict:
        """The thinker's kept context (runtime/context.py): `found`, the positions the last prefill found in
        the cache; `held`, the positions kept for the next; `bytes`, their keys and values in the cache and
        the prompt's embeddings and hidden states kept for the talker; `talker_found`, the rows of its last
        prompt the talker found in its cache."""
        return context_figures(self.thinker, self.talker if self.has_talker else None)

    def reply_vector(self, out) -> torch.Tensor:
        return self.talker.reply_vector(out)

    def token_vector(self, token: torch.Tensor) -> torch.Tensor:
        """R[k] from reply token k alone (its thinker embedding, projected): talker step k need not wait
        for thinker step k+1, which feeds the token (first audio one thinker step sooner)."""
        return self.talker.text_entry(self.thinker.embed(token.view(1, 1)))

    # -- talker and vocoder --------------------------------------------------------------------------
    def talker_turn(self, prompt_ids: list[int], voice: str, sampling, generator, force_audio: bool) -> "_TalkerTurn":
        _talker, predictor = self.talker.default_sampling()
        if not sampling.do_sample:  # the code predictor follows the talker's do_sample, as the reference's
            predictor = predictor.greedy()
        self.talker.begin(prompt_ids, voice.lower(), sampling, predictor, generator, force_audio=force_audio)
        return _TalkerTurn(self.talker)

    def vocoder(self, voice: str, seed: int, max_codes: int):
        from .code2wav import StreamingCode2Wav

        return StreamingCode2Wav(self.model.code2wav, max_frames=max_codes, graphs=self.policy.graphs_on)

    def capture_ahead(self) -> int:
        """Between turns (the engine's capture ahead, CUDA): the thinker's and the talker's lazy span
        buckets a growing conversation reaches next (runtime/graphs.py `capture_ahead`), and the prompts'
        graphs the next turn wants (`PrefillGraphs.capture_rests`: the rests over the thinker's and the
        talker's kept rows), and a few of the audio tower's graphs (runtime/audio_graphs.py)."""
        from ...runtime.graphs import capture_ahead, capture_prompts

        thinker = self.thinker.fused.graphs if self.thinker.fused is not None else None
        talker = (self.talker.step_graphs if self.has_talker and self.talker.fused is not None else None)
        made = capture_ahead((thinker, self.thinker.cache), (talker, self.talker.cache if talker else None))
        if self.policy.graphs_on:  # the audio tower per number of feature chunks, a few a pause
            made += audio_graphs.capture_ahead(self.thinker.module)
        return made + capture_prompts(self.thinker, self.talker if self.has_talker else None)

    def warmup(self) -> dict | None:
        """Capture the CUDA graphs (thinker and talker steps for every span bucket, the frame) and, with
        `compile`, compile, on this thread, with nothing else running: turns only replay them. Returns the seconds
        each phase took."""
        if self.device.type != "cuda":
            return None
        from ...runtime.stats import timed_warmup

        how = "compile and capture" if self.compile else "capture"
        phases = [(f"{how} the thinker's steps", self.thinker.capture_graphs)]
        if self.has_talker:
            phases += [(f"{how} the talker's steps and frame", self.talker.capture_graphs),
                       ("code2wav warm-up", self.warmup_vocoder)]
        return timed_warmup(self.device, phases)

    def warmup_vocoder(self, frames: int = 100) -> None:
        """One utterance through code2wav (chunks 4, 8, 16, 25, ...): the first call of each kernel and
        shape is slow (measured on an H200, true size: the first chunk of a process ~1 s), so a first
        reply must not pay it. Then, with graphs on, the chunks' graphs (`ChunkGraphs`)."""
        from .code2wav import ChunkGraphs, StreamingCode2Wav

        voc = StreamingCode2Wav(self.model.code2wav, max_frames=frames, graphs=self.policy.graphs_on)
        codes = torch.randint(0, voc.config.codebook_size, (frames, voc.config.num_quantizers),
                              generator=torch.Generator().manual_seed(0))
        voc.push(codes.tolist())
        voc.finish()
        if self.policy.graphs_on:
            ChunkGraphs.capture(self.model.code2wav, voc.first_chunk, voc.chunk, voc.left_context)


class _TalkerTurn:
    def __init__(self, talker: Talker) -> None:
        self.talker = talker

    def prefill(self, prompt, first_vec: torch.Tensor) -> torch.Tensor:
        return self.talker.prefill(prompt, first_vec)

    def step(self, frame: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        return self.talker.step(frame, vec)
