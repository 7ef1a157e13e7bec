"""Qwen2.5-Omni's steps as the runtime calls them (`ModelSteps`, models/base.py).

Builds the thinker and talker over their static caches (with the fused decode step and, on CUDA, its
graphs), says what the talker is fed for a reply token (the thinker's last hidden state plus the
token's embedding: `reply_vector`; text-EOS and text-pad embeddings after the text), samples the
talker's codes with the reference's rules (repetition penalty over the talker prompt's ids and the
codes so far, codec BOS suppressed), and makes the streaming vocoder for a voice.

It does not know the turn's threads, the boundary or the schedule (runtime/), nor prompts.
"""

from __future__ import annotations

import torch

from ...config import RuntimeOptions
from ...runtime import audio_graphs
from ...runtime.context import context_figures
from ...runtime.engine import enable_fast_steps
from ...runtime.graphs import Policy
from ...runtime.kv_cache import StaticKVCache
from ...runtime.sampling import mark_seen, select
from .talker import Talker
from .thinker import Thinker

AUDIO_CODE_LIMIT = 8192  # only codes below this are audio (token2wav's embedding has 8193 rows)


class Qwen25Steps:
    frame_width = 1
    codes_per_second = 50.0  # one code is 20 ms of audio
    sample_rate = 24_000
    audio_limit = AUDIO_CODE_LIMIT
    vector_from_token = False  # R[k] needs the hidden state of the thinker step that feeds token k

    compile = False  # the decode layers and the vocoder's DiT compiled (set in __init__: `policy.compile_on`)
    MAX_CODES = 4096  # the talker's cache and the vocoder, where the runtime options give no max_codes
    # Set in __init__ by `enable_fast_steps` (runtime/engine.py): the policy as built, and whether the fused
    # decode steps run.
    policy: Policy
    fast_decode: bool

    def __init__(self, model, speakers: dict, runtime: RuntimeOptions | None = None, *,
                 fast_decode: bool | None = None, vocoder_chunk_codes: int = 192) -> None:
        """`runtime`: cache sizes, graphs and compile (`RuntimeOptions`; None = the defaults), met with the
        model's device in one `graphs.Policy` (`self.policy`) that every graph and compiled function here
        is made through."""
        runtime = runtime or RuntimeOptions()
        self.model = model
        self.speakers = speakers
        self.max_context = max_context = runtime.max_context
        self.max_codes = max_codes = runtime.max_codes or self.MAX_CODES
        self.device = next(model.thinker.parameters()).device
        dtype = next(model.thinker.parameters()).dtype
        tcfg = model.config.thinker_config.text_config
        self.thinker = Thinker(model.thinker, StaticKVCache.for_config(tcfg, max_context, device=self.device, dtype=dtype))
        self.text_vocab = model.thinker.lm_head.out_features
        self.has_talker = getattr(model, "has_talker", False)
        if self.has_talker:
            kcfg = model.config.talker_config
            cache = StaticKVCache.for_config(kcfg, max_context + max_codes + 2, device=self.device, dtype=dtype)
            self.talker = Talker(model.talker, cache)
            self.stop_codes = (self.talker.codec_pad, self.talker.codec_eos)  # the reference stops on both
            with torch.no_grad():
                ids = torch.tensor([kcfg.tts_text_end_token_id, kcfg.tts_text_pad_token_id], device=self.device)
                vecs = self.thinker.embed(ids)
            self.text_eos_vec, self.text_pad_vec = vecs[0].view(1, 1, -1), vecs[1].view(1, 1, -1)
        # The fused fixed-shape decode step: on accelerators fewer, larger kernels and CUDA graphs; on a
        # CPU fewer, larger matmuls and less Python per step (one core, built-in model: talker
        # 3.3 -> 2.9 ms a step, thinker 1.4 -> 1.0 ms a token, real-time factor 0.23-0.27 -> 0.20-0.22).
        # Its picks equal the library layers' and transformers' (tests/test_parity.py checks both).
        enable_fast_steps(self, dtype, Policy.of(runtime, self.device).over(model), fast_decode)
        # The vocoder's steady chunk (chunks grow 12, 24, 48, ... up to it; see vocoder.py). A DiT window
        # has a large fixed cost (36 evaluations of small kernels), so larger chunks cost less per second
        # of audio. Measured side by side on an H200 beside the 7B talker (omni-bench --schedules):
        # steady 48 codes: 111 ms a chunk, 0.130 s per second of audio, real-time factor 0.239;
        # 96: 158 ms, 0.101 s, 0.212; 192: 222 ms, 0.080 s, 0.193; first audio the same (~300-317 ms).
        # The first chunks stay small (12, 24, ...), so short replies are unaffected.
        self.vocoder_chunk_codes = vocoder_chunk_codes

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
        """What the talker reads for the fed token: the thinker's hidden state plus the token's embedding."""
        return out.hidden + out.embeds

    # -- talker and vocoder --------------------------------------------------------------------------
    def talker_turn(self, prompt_ids: list[int], voice: str, sampling, generator, force_audio: bool) -> "_TalkerTurn":
        return _TalkerTurn(self, len(prompt_ids), voice, sampling, generator, force_audio)

    def vocoder(self, voice: str, seed: int, max_codes: int):
        from .vocoder import StreamingVocoder

        spk = self.speakers[voice]
        # The seed makes a CPU generator: the noise is drawn on the CPU, as transformers' is.
        return StreamingVocoder(self.model.token2wav, spk["cond"], spk["ref_mel"], max_codes=max_codes,
                                generator=seed, codes_per_chunk=self.vocoder_chunk_codes,
                                compiled=self.compile, policy=self.policy)

    # -- warm-up -------------------------------------------------------------------------------------
    def capture_ahead(self) -> int:
        """Between turns (the engine's capture ahead, CUDA): the thinker's and the talker's lazy span
        buckets a growing conversation reaches next (runtime/graphs.py `capture_ahead`), and the prompts'
        graphs the next turn wants (`capture_prompts`; none while `PROMPT_GRAPHS` is off), and a few of
        the audio tower's graphs (runtime/audio_graphs.py)."""
        from ...runtime.graphs import capture_ahead, capture_prompts

        thinker = self.thinker.fused.graphs if self.thinker.fused is not None else None
        talker = (self.talker.graphs if self.has_talker and self.talker.fused is not None else None)
        made = capture_ahead((thinker, self.thinker.cache), (talker, self.talker.cache if talker else None))
        if self.policy.graphs_on:  # the audio tower per number of feature chunks, a few a pause
            made += audio_graphs.capture_ahead(self.thinker.module)
        return made + capture_prompts(self.thinker, self.talker if self.has_talker else None)

    def warmup(self) -> dict | None:
        """Capture the CUDA graphs and, with `compile`, compile, on this thread, with nothing else running.
        Compiled: the decode steps for every span bucket and every vocoder window, so turns only replay
        them. Uncompiled: the first span bucket and the first windows; a turn captures the others when it
        first reaches them (tens of ms each). Returns the seconds each phase took."""
        if self.device.type != "cuda":
            return None
        from ...runtime.stats import timed_warmup

        how = "compile and capture" if self.compile else "capture"
        phases = [(f"{how} the thinker's steps", self.thinker.capture_graphs)]
        if self.has_talker:
            phases += [(f"{how} the talker's steps", self.talker.capture_graphs),
                       (f"{how} the vocoder's windows", self.warmup_vocoder)]
        return timed_warmup(self.device, phases)

    def warmup_vocoder(self) -> None:
        """Capture the vocoder's windows for the current chunk size, for every voice (after a change
        of `vocoder_chunk_codes`, call again: the windows have other lengths)."""
        if not (self.policy.graphs_on and self.has_talker):
            return  # without graphs the vocoder's windows run eagerly too (a window without a graph does)
        from .vocoder import capture_windows

        # Compiled, a window's graph has its voice inside: one set per voice. Uncompiled, the step graphs
        # take the voice as an input: one set serves all.
        voices = list(self.speakers.values()) if self.compile else list(self.speakers.values())[:1]
        for spk in voices:
            capture_windows(self.model.token2wav, spk["cond"], spk["ref_mel"], self.vocoder_chunk_codes, self.compile,
                            self.policy)
        torch.cuda.current_stream(self.device).synchronize()  # this thread's work only (runtime/beside.py)


class _TalkerTurn:
    """One turn's talker sampling state: the repetition-penalty mask and the suppressed codes."""

    def __init__(self, steps: Qwen25Steps, prompt_len: int, voice: str, sampling, generator, force_audio: bool) -> None:
        talker, dev = steps.talker, steps.device
        self.talker, self.sampling, self.gen = talker, sampling, generator
        self.seen = torch.zeros(1, talker.codec_head.out_features, dtype=torch.bool, device=dev)
        self.seen[0, talker.prompt_ids(prompt_len)] = True
        self.suppress = torch.zeros_like(self.seen)
        self.suppress[0, talker.codec_bos] = True
        if force_audio:  # benchmarks: only audio codes, so the reply has exactly the asked length
            self.suppress[0, AUDIO_CODE_LIMIT:] = True
        self.voice_bos_id = int(steps.speakers[voice]["bos_token"])
        self.voice_bos = steps.thinker.embed(torch.tensor([[self.voice_bos_id]], device=dev))

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        code = select(logits, self.sampling, self.seen, self.suppress, self.gen)
        mark_seen(self.seen, code)
        return code

    def prefill(self, prompt, first_vec: torch.Tensor) -> torch.Tensor:
        embeds = prompt.embeds if prompt.talker_embeds is None else prompt.talker_embeds  # media zeroed
        positions, shift = None, 0
        if prompt.media and prompt.media.get("pixel_values") is not None:
            # The reference's talker takes its positions from the prompt, the voice's text-bos and the
            # first reply token (a text token: its value does not move any position).
            from ...runtime.decoder import mrope_positions

            ids = list(prompt.prompt_ids) + [self.voice_bos_id, 0]
            positions, shift = mrope_positions(self.talker.module, ids, prompt.media, embeds.device)
        return self._pick(self.talker.prefill(embeds, prompt.hidden, self.voice_bos, first_vec, positions, shift,
                                              prompt=prompt.prompt, found=prompt.found))

    def step(self, code: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        return self._pick(self.talker.decode_one(code, vec))
