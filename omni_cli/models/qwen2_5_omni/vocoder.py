"""Streaming token2wav for Qwen2.5-Omni: codec codes in, final 24 kHz PCM blocks out, chunk by chunk.

`StreamingVocoder` turns talker codes into audio while the talker is still generating. The DiT
(flow matching, 10-point RK4, classifier-free guidance) attends block-wise: 24 mel frames a block
(12 codes), and each layer sees at most one block back or one block ahead (the layers listed in
`look_backward_layers` / `look_ahead_layers`). So one chunk of mel is decoded from a window of
[past context | chunk | future context] and only the chunk is kept, the way Qwen's own streaming
decoder does it (72-frame chunks, 48 frames of past, 24 of future). BigVGAN then turns final mel into
audio; at each seam it gets `bigvgan_context` mel frames on both sides and the overlap is trimmed.
History is never decoded again: each chunk costs its own frames plus a constant context. Chunks grow
(12, 24, 48, ... codes, doubling up to `codes_per_chunk`: 48 by default, 192 in the engine) so the first
audio is early and later ones spend less on context and on each window's fixed cost; the last
window of an utterance is padded to a full window's length with rows no real row attends to, so every
window has one of a few fixed lengths and can be replayed as CUDA graphs (`_WindowGraphs`): with
`compiled`, each window's whole ODE is one graph of the DiT compiled by inductor (fastest, but the
compile takes a minute); without, each RK4 step of a window is one graph of the plain DiT (captured in
a fraction of a second per window length, so a first reply never waits for a compiler).

The starting noise of the whole utterance is drawn once, so a chunk's window uses the same noise
rows as the whole-utterance decode (`decode_whole`), which makes the two comparable; with the same
seed, `decode_whole` is transformers' `token2wav(code, conditioning, reference_mel)`. The streamed
audio is not bit-equal to the whole decode: the ODE carries information across the window edges over
its 36 evaluations, which a fixed window cuts off. The tests state the measured difference.

It deliberately does not know where codes come from (talker, file, test), where audio goes (speaker,
WAV, null), how a checkpoint is laid out, or Qwen3-Omni's code2wav. It uses transformers' modules
for the model and runs its own loop around them.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch

from .dit import DitPlan, attention_masks, dit_forward, dit_forward_compiled, rk4_final, rk4_step

AUDIO_CODES = 8192  # talker ids below this are audio; the rest (pad, bos, eos, ...) are control


class StreamingVocoder:
    """Chunked token2wav over one utterance; `push` codes, get back PCM blocks that are final."""

    quiet_first_chunk = False  # the engine need not hold its steps for the first block on an accelerator

    def __init__(
        self,
        token2wav,
        cond: torch.Tensor,
        ref_mel: torch.Tensor,
        max_codes: int,
        generator: torch.Generator | int | None = None,
        *,
        codes_per_chunk: int = 48,
        first_chunk_codes: int | None = None,
        past_frames: int | None = None,
        future_frames: int | None = None,
        bigvgan_context: int = 20,
        num_steps: int = 10,
        guidance_scale: float = 0.5,
        sway_coefficient: float | None = -1.0,
        compiled: bool = True,
        pad_windows: bool | None = None,
        policy=None,
    ) -> None:
        """
        token2wav: a float32 `Qwen2_5OmniToken2WavModel` (put in eval mode here: the DiT has dropout).
        cond, ref_mel: the voice, 1x192 and 1xTx80, as in `spk_dict.pt`.
        max_codes: the longest utterance; the starting noise is drawn for all of it at once.
        generator: a `torch.Generator`, a seed, or None for torch's global RNG (what transformers uses).
        codes_per_chunk / first_chunk_codes: chunk sizes in codes, multiples of a DiT block (12 codes).
            The first chunk defaults to one block so the first audio comes as early as the window allows;
            each next chunk is twice the last, up to `codes_per_chunk` (12, 24, 48, 48, ...): larger
            chunks spend less of each window on context, small early ones keep the first audio early.
        past_frames / future_frames: DiT context in mel frames; default one block per look-back /
            look-ahead layer, which is how far one DiT evaluation reaches (48 / 24 on the real model).
        bigvgan_context: mel frames BigVGAN sees beyond each seam (Qwen's streaming decoder uses 20).
        num_steps, guidance_scale, sway_coefficient: the ODE settings; defaults are transformers'.
        pad_windows: run an utterance's last window at a full window's length (see `_decode_mel`), so
            it can replay a CUDA graph; default: when the windows are replayed as graphs.
        compiled: where graphs are on, a window's whole ODE is one graph of the compiled DiT; False: one
            graph per RK4 step of the plain DiT (`_ode_by_steps`). Same float operations either way.
        policy: the steps' `runtime.graphs.Policy`, which says whether the windows are CUDA graphs
            (`graphs_on`); None: the default runtime options on the vocoder's device.
        """
        self.model = token2wav.eval()
        self.dit = token2wav.code2wav_dit_model
        self.bigvgan = token2wav.code2wav_bigvgan_model
        config = self.dit.config
        self.device = next(self.dit.parameters()).device
        self.dtype = next(self.dit.parameters()).dtype
        self.repeats = config.repeats
        self.block = config.block_size
        self.mel_dim = config.mel_dim
        self.num_steps = num_steps
        self.guidance_scale = guidance_scale
        self.sway_coefficient = sway_coefficient
        self.max_codes = max_codes
        self.code_limit = min(AUDIO_CODES, self.dit.text_embed.codec_embed.num_embeddings)

        block_codes = self.block // self.repeats
        first_chunk_codes = block_codes if first_chunk_codes is None else first_chunk_codes
        for name, n in (("codes_per_chunk", codes_per_chunk), ("first_chunk_codes", first_chunk_codes)):
            # Chunks must start on block boundaries, or a window's block partition would differ
            # from the whole decode's and every frame would attend to a different set.
            if n <= 0 or n % block_codes:
                raise ValueError(f"{name} must be a positive multiple of {block_codes} codes, got {n}")
        self.chunk_frames = codes_per_chunk * self.repeats
        self.first_chunk_frames = first_chunk_codes * self.repeats
        self.past_frames = self.block * len(config.look_backward_layers) if past_frames is None else past_frames
        self.future_frames = self.block * len(config.look_ahead_layers) if future_frames is None else future_frames
        if self.past_frames % self.block or self.past_frames < 0 or self.future_frames < 0:
            raise ValueError("past_frames must be a non-negative multiple of the DiT block size")
        self.bigvgan_context = bigvgan_context
        self.compiled = compiled
        # Room past the longest utterance so a window padded to its full length (see _decode_mel) can
        # always be sliced from the noise and code buffers.
        self.pad_room = self.past_frames + max(self.chunk_frames, self.first_chunk_frames) + self.future_frames

        # CUDA graphs of the fixed-shape windows, kept on the model so later utterances reuse them;
        # the voice's conditioning is baked into them, so it is cached there too, per voice.
        if policy is None:
            from ...runtime.graphs import Policy

            policy = Policy.of(None, self.device)
        self._graphs = _WindowGraphs.for_model(token2wav, policy, compiled)
        # The ODE's grid is fixed by the settings, so each evaluation's time conditioning is computed once
        # per model and grid (`DitPlan.grid`), not in every evaluation of every window.
        self._plan = DitPlan.for_dit(self.dit)
        self._times, self._grid = self._plan.grid(num_steps, sway_coefficient, self.device, self.dtype)
        self.pad_windows = self._graphs.enabled if pad_windows is None else pad_windows
        self._voice_key = id(cond)
        voice = self._graphs.voices.get(self._voice_key)
        if voice is None:
            voice = self._graphs.voices[self._voice_key] = self._voice_conditioning(cond, ref_mel)
        self._voice = voice
        if isinstance(generator, int):
            generator = torch.Generator().manual_seed(generator)
        self.generator: torch.Generator | None = generator
        self.reset()

    @property
    def log_units_per_code(self) -> int:
        """`chunk_log` counts mel frames: this many a code."""
        return self.repeats

    @property
    def codes_for_first_audio(self) -> int:
        """How many codes the first chunk waits for: the chunk itself and the DiT's look-ahead."""
        return (self.first_chunk_frames + self.future_frames) // self.repeats

    # -- per voice and per utterance state -------------------------------------------------------
    @torch.inference_mode()
    def _voice_conditioning(self, cond: torch.Tensor, ref_mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The speaker parts of the DiT input for the CFG batch (conditioned, unconditioned).

        transformers' DiTInputEmbedding runs the ECAPA speaker encoder over [ref_mel, zeros] on
        every one of the 36 evaluations of every call; its result depends only on the voice, so it
        is computed here once, on the same batch of two, which keeps the numbers identical.
        """
        cond = cond.to(self.device, self.dtype).reshape(1, -1)
        ref_mel = ref_mel.to(self.device, self.dtype)
        encoded = self.dit.input_embed.spk_encoder(torch.cat([ref_mel, torch.zeros_like(ref_mel)], dim=0))
        speaker = torch.cat([cond, torch.zeros_like(cond)], dim=0)
        return encoded, speaker

    def reset(self, seed: int | None = None) -> None:
        """Start a new utterance (same voice): fresh starting noise, nothing decoded yet.

        The noise continues the generator's stream (like successive transformers calls), unless
        `seed` reseeds it first (a generator of its own is made if the vocoder used the global RNG).
        """
        if seed is not None:
            self.generator = (self.generator or torch.Generator()).manual_seed(seed)
        # One draw for the longest utterance: on CPU, torch's normal sampler fills in groups of 16
        # values and 80 mel bins are 5 groups, so the first T rows equal `torch.randn([1, T, 80])`
        # under the same seed, which is what transformers' `sample()` draws.
        self.noise = torch.randn(
            [1, self.max_codes * self.repeats + self.pad_room, self.mel_dim], generator=self.generator, dtype=self.dtype
        ).to(self.device)
        self.codes = torch.zeros(1, self.max_codes + self.pad_room // self.repeats, dtype=torch.long)
        self.mel = torch.zeros(1, self.mel_dim, self.max_codes * self.repeats, dtype=self.dtype, device=self.device)
        self.n_codes = 0
        self.mel_done = 0  # mel frames that are final
        self.audio_done = 0  # mel frames whose audio has been handed out
        self.finished = False
        self.dit_frames = 0  # mel frames run through the DiT windows, padding included (cost accounting)
        self.dit_calls = 0
        self.bigvgan_frames = 0
        self.chunk_log: list[tuple[int, float]] = []  # (mel frames made final, seconds the chunk took)

    # -- streaming -------------------------------------------------------------------------------
    def push(self, codes: Sequence[int]) -> list[np.ndarray]:
        """Take new audio codes; return the PCM blocks (float32, 24 kHz) that became final."""
        if self.finished:
            raise RuntimeError("push() after finish(); call reset() for a new utterance")
        new = self._check_codes(codes)
        if self.n_codes + len(new) > self.max_codes:
            raise ValueError(f"utterance longer than max_codes={self.max_codes}")
        self.codes[0, self.n_codes : self.n_codes + len(new)] = torch.from_numpy(new)
        self.n_codes += len(new)
        blocks = []
        # A chunk is final once its look-ahead context exists; several may be due after a big push.
        while self._next_chunk_end() + self.future_frames <= self.n_codes * self.repeats:
            t, start, end = time.perf_counter(), self.mel_done, self._next_chunk_end()
            self._decode_mel(start, end, end + self.future_frames)
            blocks += self._vocode(last=False)  # copies the audio to the host: the chunk is done
            self.chunk_log.append((end - start, time.perf_counter() - t))
        return blocks

    def finish(self) -> list[np.ndarray]:
        """End of utterance: decode the tail (no look-ahead exists or is needed) and flush the audio."""
        if self.finished:
            return []
        self.finished = True
        t, start, total = time.perf_counter(), self.mel_done, self.n_codes * self.repeats
        if self.mel_done < total:
            self._decode_mel(self.mel_done, total, total)
        blocks = self._vocode(last=True)
        if total > start:
            self.chunk_log.append((total - start, time.perf_counter() - t))
        return blocks

    def _next_chunk_end(self) -> int:
        return self.mel_done + self._chunk_frames(self.mel_done)

    def _chunk_frames(self, start: int) -> int:
        """Length of the chunk that starts at mel frame `start`: the first, then doubling up to the steady size."""
        size, pos = self.first_chunk_frames, 0
        while pos < start:
            pos += size
            size = min(2 * size, self.chunk_frames)
        return size

    def _check_codes(self, codes: Sequence[int]) -> np.ndarray:
        new = np.asarray(codes, dtype=np.int64).reshape(-1)
        if new.size and (new.min() < 0 or new.max() >= self.code_limit):
            # Control ids (eos 8294, pad 8292, ...) must be stripped upstream; silently dropping or
            # clamping them here would hide a bug in the engine.
            bad = new[(new < 0) | (new >= self.code_limit)][:4].tolist()
            raise ValueError(f"not an audio code (must be 0..{self.code_limit - 1}): {bad}")
        return new

    @torch.inference_mode()
    def _decode_mel(self, start: int, end: int, window_end: int) -> None:
        """Run the DiT on [start - past, window_end) and keep frames [start, end) as final mel.

        With `pad_windows` the window is always run at the full length a chunk starting at `start` gets
        (context, chunk, look-ahead). At the end of an utterance it is shorter: the rows past
        `window_end` are padding that sits in a block of its own, so no real row attends to it (see
        `_block_index`). That way the last chunk replays the same CUDA graph as a full one instead of
        running eagerly at an odd length; without graphs the padding would only cost time.
        """
        window_start = max(0, start - self.past_frames)
        full = window_end - window_start
        if self.pad_windows:
            full = (start - window_start) + self._chunk_frames(start) + self.future_frames
        r = self.repeats
        code = self.codes[:, window_start // r : (window_start + full) // r].to(self.device)
        blocks = self._block_index(full, window_end - window_start).to(self.device)
        noise = self.noise[:, window_start : window_start + full]
        if self.compiled:
            mel = self._graphs.run(("dit", self._voice_key, full), self._sample, code, noise, blocks)
        else:
            mel = self._sample(code, noise, blocks, by_step=True)
        self.mel[:, :, start:end] = mel[:, :, start - window_start : end - window_start]
        self.mel_done = end
        self.dit_frames += full
        self.dit_calls += 1

    def _block_index(self, length: int, valid: int) -> torch.Tensor:
        """DiT block of each window row; padding rows (from `valid` on) go to one far-away block.

        A layer lets row i attend to row j when their blocks differ by at most its look-back / look-ahead
        (one block), so real rows and padding never see each other, and padding rows still see each
        other (a row with nothing to attend to would give NaN, which the value matmul would spread).
        """
        blocks = torch.arange(length) // self.block
        blocks[valid:] = 1 << 20
        return blocks

    @torch.inference_mode()
    def _vocode(self, last: bool) -> list[np.ndarray]:
        """BigVGAN over the final mel not yet voiced, with context on both sides, trimmed at seams."""
        # Audio for a frame is final once `bigvgan_context` frames of final mel follow it
        # (or the utterance ended); the frames before it only serve as left context.
        stop = self.mel_done if last else self.mel_done - self.bigvgan_context
        if stop <= self.audio_done:
            return []
        left = max(0, self.audio_done - self.bigvgan_context)
        right = self.mel_done
        audio = self._graphs.run(("bigvgan", right - left), self._bigvgan, self.mel[:, :, left:right],
                                 lazy=not self.compiled).reshape(-1)
        # BigVGAN gives exactly `hop` samples a frame (its transposed convs are padded that way),
        # so frame indices map onto sample indices without drift.
        hop = audio.shape[-1] // (right - left)
        block = audio[(self.audio_done - left) * hop : (stop - left) * hop]
        self.bigvgan_frames += right - left
        self.audio_done = stop
        return [block.float().cpu().numpy().copy()]

    # -- whole utterance (the reference) ----------------------------------------------------------
    @torch.inference_mode()
    def decode_whole(self, codes: Sequence[int]) -> np.ndarray:
        """The whole utterance in one DiT + BigVGAN call, with the same noise as the stream.

        Leaves the streaming state alone. With torch's global RNG seeded as this vocoder's
        generator was, this equals transformers' `token2wav(code, conditioning, reference_mel)`.
        """
        new = self._check_codes(codes)
        if len(new) > self.max_codes:
            raise ValueError(f"utterance longer than max_codes={self.max_codes}")
        if len(new) == 0:
            return np.zeros(0, dtype=np.float32)
        code = torch.from_numpy(new).reshape(1, -1).to(self.device)
        frames = len(new) * self.repeats
        mel = self._sample(code, self.noise[:, :frames], self._block_index(frames, frames).to(self.device))
        return self._bigvgan(mel).reshape(-1).float().cpu().numpy()

    # -- the DiT, called piece by piece --------------------------------------------------------
    def _sample(self, code: torch.Tensor, noise: torch.Tensor, blocks: torch.Tensor,
                by_step: bool = False) -> torch.Tensor:
        """Flow-matching ODE from `noise` [1, T, 80] given `code` [1, T/2] and each row's DiT block
        `blocks` [T]; returns mel [1, 80, T]. `by_step`: through `_ode_by_steps`."""
        static = self._static_inputs(code)
        length = noise.shape[1]
        positions = torch.arange(length, device=self.device)[None, :].repeat(2, 1)
        # Positions restart at 0 in every window: the DiT's RoPE is relative, so only the block
        # partition matters, and windows start on block boundaries.
        rope = self.dit.rotary_embed(static, positions)
        # As the DiT's `_create_block_diff` (block of key minus block of query), from given blocks.
        block_diff = blocks[None, :] - blocks[:, None]
        # Each layer's mask depends only on the window, not on the ODE's state: made once here instead
        # of in every layer of each of the 36 evaluations (on a small model, most of the DiT's time).
        masks = attention_masks(self.dit, block_diff, noise.dtype)
        times, grid = self._times, self._grid
        if by_step:
            return self._ode_by_steps(noise, times, grid, static, rope, masks).permute(0, 2, 1)
        plan, guidance = self._plan, self.guidance_scale
        forward = self._graphs.compiled_dit() if self._graphs.capturing else dit_forward

        # Always the CFG batch of two: transformers switches to a batch of one below guidance 1e-5,
        # which gives the same velocity up to rounding.
        def velocity(i: int, j: int, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            out = forward(plan, x, grid[i][j], static, rope, masks)
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * guidance

        return rk4_final(velocity, noise, times).permute(0, 2, 1)

    def _ode_by_steps(self, x, times, grid, static, rope, masks) -> torch.Tensor:
        """The ODE one RK4 step at a time, each step a CUDA graph per window length (`_WindowGraphs.stepper`):
        uncompiled, the whole ODE's graph would take ~1.5 s to capture per window length (an estimate: two
        runs of ~35 000 kernel launches from Python), one step's a ninth of that. The window's own tensors
        (conditioning, RoPE, masks) are copied into the graph once per window; `x`, the step's times and its
        four evaluations' time conditioning once per step.
        The result lives in the graph's buffer until the next window: use it at once."""
        shared: list[torch.Tensor] = []  # the masks the layers share (by reach)
        layer_mask: list[int] = []  # each layer's
        for mask in masks:
            i = next((j for j, m in enumerate(shared) if m is mask), None)
            if i is None:
                i = len(shared)
                shared.append(mask)
            layer_mask.append(i)
        plan, guidance = self._plan, self.guidance_scale

        def step(x, t0, t1, c0, c1, c2, c3, static, cos, sin, *shared):
            by_layer, conds = [shared[i] for i in layer_mask], (c0, c1, c2, c3)

            def velocity(j, t, y):
                guided, null = torch.chunk(dit_forward(plan, y, conds[j], static, (cos, sin), by_layer), 2, dim=0)
                return guided + (guided - null) * guidance

            return rk4_step(velocity, x, t0, t1)

        run = self._graphs.stepper(("dit-step", x.shape[1]), step, (x, times[0], times[1], *grid[0]),
                                   (static, *rope, *shared), lazy=True)
        for i in range(times.shape[0] - 1):
            x = run(x, times[i], times[i + 1], *grid[i])
        return x

    def _static_inputs(self, code: torch.Tensor) -> torch.Tensor:
        """The DiT input that stays fixed over the ODE: [ECAPA(ref_mel) | code embedding | cond], CFG batch."""
        length = code.shape[1] * self.repeats
        encoded, speaker = self._voice
        code_embed = torch.cat([self.dit.text_embed(code), self.dit.text_embed(code, drop_code=True)], dim=0)
        return torch.cat(
            (
                encoded.unsqueeze(1).repeat(1, length, 1),
                code_embed,
                speaker.unsqueeze(1).repeat(1, length, 1),
            ),
            dim=-1,
        )

    def _bigvgan(self, mel: torch.Tensor) -> torch.Tensor:
        """BigVGAN's forward, same float operations, minus its two graph breakers: the mel floor is
        built from a host scalar on every call, and the waveform is copied to the CPU at the end."""
        v = self.bigvgan
        # The floor lives with the per-model graphs, not on this (per-utterance) object: a graph keeps
        # reading the memory it was captured with, so that tensor must outlive every utterance.
        floor = self._graphs.constants.get("mel_floor")
        if floor is None:
            floor = torch.exp(torch.tensor(-115 / 20.0 * np.log(10), device=mel.device, dtype=mel.dtype))
            self._graphs.constants["mel_floor"] = floor
        decibels = 20 * torch.log10(torch.clamp(torch.exp(mel), min=floor)) - 20
        hidden = torch.clamp(2 * ((decibels - -115) / 115) - 1, -1, 1)  # normalize_spectrogram(db, 1, -115)
        hidden = v.conv_pre(hidden)
        for i in range(v.num_upsample_layers):
            hidden = v.ups[i][0](hidden)
            blocks = v.resblocks[i * v.num_residual_blocks : (i + 1) * v.num_residual_blocks]
            hidden = sum(block(hidden) for block in blocks) / v.num_residual_blocks
        hidden = v.conv_post(v.activation_post(hidden))
        return torch.clamp(hidden, min=-1.0, max=1.0).squeeze()


class _WindowGraphs:
    """Replays the vocoder's fixed-shape work (a DiT window's whole ODE or one of its RK4 steps, a BigVGAN
    span) as CUDA graphs.

    One graph per key (kind, voice, length; a step's graph serves every voice: the voice is in the window's
    tensors), replayed after: thousands of small kernel launches per chunk become one or nine. The whole
    ODE's graphs (compiled) are captured only while `capturing` is set, by the engine's warm-up; the
    plain steps' and BigVGAN's beside them (`lazy`) also when a window length first comes up in a reply,
    on the vocoder's thread (`graphs.capture_anywhere`: a capture beside the engine's thread; tens of ms
    for a step, where running the window eagerly would take ~0.7 s). A key without a graph runs eagerly,
    as everything does where the policy has no graphs (CPU, `--no-graphs`).
    """

    def __init__(self, policy) -> None:
        from ...runtime.graphs import capture_stream

        self.policy = policy
        self.enabled = policy.graphs_on  # the one switch: never decided again here
        self.device = device = policy.device
        self.graphs: dict = {}
        # id(cond tensor) -> the voice's DiT conditioning
        self.voices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.constants: dict = {}  # device tensors the graphs read (they must live as long as the graphs)
        self.capturing = False
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.capture_stream = capture_stream(device) if self.enabled else None  # see graphs.capture_stream
        self._compiled: Callable | None = None

    def compiled_dit(self) -> Callable:
        """`dit_forward_compiled` through inductor, for the windows being captured: the element-wise work is
        fused (a 120-frame window's graph: 130 → 83 ms on an H200, measured with static shapes). One compile
        serves every window length (dynamic shapes); outside captures, and where the policy has no graphs, the
        plain function runs. (Only the compiled kind of windows asks for it: those of steps built compiled.)"""
        from ...runtime.graphs import compile_fn

        if self._compiled is None:
            self._compiled = dit_forward
            if self.enabled:
                self._compiled = _or_plain(compile_fn(dit_forward_compiled, dynamic=True), dit_forward)
        return self._compiled

    @classmethod
    def for_model(cls, token2wav, policy, compiled: bool = False) -> "_WindowGraphs":
        """The model's graphs of one kind: the plain steps' or the compiled windows'. Each kind has its own
        pool, stream and `capturing` flag, so the compiled windows can be captured on another thread
        (runtime/beside.py) while the plain ones serve replies. Steps without graphs (`policy.graphs_on`
        False) get a set of their own, which never captures."""
        name = "_omni_window_graphs" + ("_compiled" if compiled else "") + ("" if policy.graphs_on else "_eager")
        graphs = getattr(token2wav, name, None)
        if graphs is None:
            graphs = cls(policy)
            setattr(token2wav, name, graphs)
        return graphs

    def run(self, key, fn: Callable, *inputs: torch.Tensor, lazy: bool = False) -> torch.Tensor:
        """`fn(*inputs)`, replayed as the CUDA graph of `key` (see `stepper`, with no window tensors)."""
        return self.stepper(key, fn, inputs, (), lazy=lazy)(*inputs)

    def stepper(self, key, fn: Callable, inputs: tuple, window: tuple, lazy: bool = False) -> Callable:
        """`fn(*inputs, *window)` as a function of `inputs` alone, replayed as the CUDA graph of `key` (the
        window's tensors copied in now, once); eager where there is no graph and none is being captured."""
        entry = self.graphs.get(key) if self.enabled else None
        if entry is None and self.enabled and (self.capturing or lazy):
            entry = self.graphs[key] = self._capture(fn, inputs + window)
        if entry is None:
            return lambda *args: fn(*args, *window)
        graph, static_in, static_out = entry
        for buf, value in zip(static_in[len(inputs):], window):
            buf.copy_(value)

        def replay(*args):
            for buf, value in zip(static_in, args):
                buf.copy_(value)
            graph.replay()
            return static_out

        return replay

    def _capture(self, fn, inputs):
        from ...runtime.graphs import capture_anywhere

        static_in = [x.clone() for x in inputs]
        stream = torch.cuda.current_stream(self.device)
        side = self.capture_stream
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            fn(*static_in)  # warm-up: cuDNN/cuBLAS choose their kernels outside the capture
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture_anywhere(graph, self.pool, side):
            static_out = fn(*static_in)
        return graph, static_in, static_out


def _or_plain(compiled: Callable, plain: Callable) -> Callable:
    """`compiled`, unless compiling fails (first call): then a warning, and `plain` from then on.
    The vocoder is only slower without it, so a compiler problem must not stop the assistant."""
    state = {"fn": compiled}

    def call(*args):
        try:
            return state["fn"](*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure
            if state["fn"] is plain:
                raise
            import warnings

            warnings.warn(f"torch.compile of the vocoder's DiT failed, running it uncompiled: {exc!r:.300}")
            state["fn"] = plain
            return plain(*args)

    return call


def capture_windows(token2wav, cond: torch.Tensor, ref_mel: torch.Tensor, codes_per_chunk: int, compiled: bool,
                    policy=None) -> None:
    """Capture the CUDA graphs of a vocoder's windows for one voice, as the engine's warm-up does: compiled,
    every window length (a capture may compile); uncompiled, the first chunks' (12, 24 and 48 codes), the
    rest being captured when a reply first reaches them (on the vocoder's thread, while the audio made so
    far plays)."""
    codes = warmup_codes(codes_per_chunk if compiled else min(24, codes_per_chunk))
    voc = StreamingVocoder(token2wav, cond, ref_mel, max_codes=len(codes), generator=0,
                           codes_per_chunk=codes_per_chunk, compiled=compiled, policy=policy)
    voc._graphs.capturing = True
    try:
        with torch.inference_mode():
            voc.push(codes)
            voc.finish()
    finally:
        voc._graphs.capturing = False


def warmup_codes(codes_per_chunk: int, block_codes: int = 12) -> list[int]:
    """Audio codes enough for a vocoder with padded windows to run every DiT window length it has and
    the BigVGAN span of a steady chunk: the growing chunks (12, 24, ...), one steady chunk with its
    look-ahead block, and a tail that `finish` pads to a steady window."""
    n, size = 0, block_codes
    while size < codes_per_chunk:
        n, size = n + size, 2 * size
    return [100 + i % 4000 for i in range(n + codes_per_chunk + 2 * block_codes)]
