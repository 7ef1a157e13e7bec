"""Streaming code2wav for Qwen3-Omni: codec frames in, final 24 kHz PCM blocks out, chunk by chunk.

`StreamingCode2Wav` turns talker frames (16 codebook ids per 80 ms frame) into audio while the talker
is still generating. transformers' `Qwen3OmniMoeCode2Wav` is causal, in two parts:

- a pre-transformer whose layers all use sliding-window attention (window 72): 8 layers reach
  8 * 71 = 568 frames (45 s) back, far more than any left context on codes can cover. So it runs once
  per frame with a sliding-window KV cache kept across chunks: every frame's hidden state is the
  whole decode's, at the same RoPE positions, for the cost of the new frames alone;
- convolutions upsampling x1920. Their transposed convolutions (kernel 2r, stride r) look one step
  ahead and drop it at the end, so F frames give 1920 * F - 555 samples, each depending on earlier
  frames only. Counted from the first sample a chunk emits, they reach `conv_reach(config)` = 10
  frames back (kernel-7 convolutions, dilations 1, 3, 9). So each chunk runs them on
  [`left_context` hidden frames | its frames] and keeps what was not emitted yet: the 555 samples
  held back at the last seam, then its own.

So the stream has the whole decode's length for every utterance and push pattern, and with
`left_context >= 10` equals the whole decode (`code2wav(codes)`) up to the rounding of that decode
itself. Measured, max abs difference over the utterance (in brackets the decode against itself: its
first half decoded alone vs the same samples of the whole, mathematically equal):
- tiny checkpoint, float32, CPU, up to 200 frames: <= 3.1e-7 (peak 0.6); the tests hold it to 1e-6;
- full size (hidden 1024, 8 layers, decoder_dim 1536; transformers' random init, rms 0.39), 60
  frames: float32 CPU 8.6e-6 (7.3e-6), float64 (30 frames) 0; 200 frames on an H200: float32 3.0e-3
  (2.7e-3: cuDNN's default TF32 convolutions), 1.6e-5 (1.7e-5) without TF32, bfloat16 0.079 (0.082).
transformers' `chunked_decode` in 25-frame chunks with 25 frames of code context is 1.26 off there.

Chunks grow: `first_chunk` frames (`FIRST_CHUNK`, 4: 0.3 s of audio), then doubling up to `chunk` (4, 8,
16, 25, 25, ...). A chunk's frames must be generated (and decoded) while the audio before it plays: with
the talker v times faster than real time that holds from the first block on for v >= 2.2, set by the
second chunk (8 frames made within the first block's 0.3 s; the talker's v is about 12 on an H100). Why
the first chunk is not smaller: with 2 frames the first block comes sooner (H200, 2,500-token prompt:
87 ms against 104), but it holds 0.14 s of audio, under the 0.2 s a speaker queues before it starts
(`audio/speaker.py`), so the speaker starts at the second block, later than with 4 (130 ms against 104;
omni-bench's `speaker_start_ms`). Later, large chunks spend less on context and per-call overhead.

On a GPU every chunk but an utterance's last replays a CUDA graph (`ChunkGraphs`, captured at the
engine's warm-up): each chunk of the schedule has the same shapes in every utterance until the
pre-transformer's cache is full, and from then on every steady chunk has, so one graph serves those with
the positions an input. Eager, a chunk's few hundred kernels are issued from Python (the first took 55 ms
inside a turn on an H200, 5 ms as a replay), holding the interpreter while the talker's thread issues
its steps beside it: with a two-frame first chunk, the second block came 22 ms after the first had played
out (eager, H100); replayed, 94 ms before (H200).

It does not know where frames come from (talker, file, test), where audio goes, or control ids (the
runtime strips them; an id outside the codebook is a ValueError).
"""

from __future__ import annotations

import copy
import time
from typing import Sequence

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from ...runtime import compat
from ...runtime.decoder import no_cudnn_attention

# Frames in an utterance's first chunk: the first sound waits for them (each a talker frame). 2 was
# measured (H200, 2,500-token prompt): the first block 104 -> 87 ms, but a speaker starts later (104 -> 130
# ms: it waits for 0.2 s of audio); see the docstring.
FIRST_CHUNK = 4


def decoded_lag(config) -> int:
    """Samples the whole decode falls short of 1920 * F: one input step per transposed conv with look-ahead."""
    length = int(np.prod(config.upsampling_ratios))  # one frame after the look-ahead-free upsampling
    for rate in config.upsample_rates:
        length = (length - 1) * rate
    return int(np.prod(config.upsampling_ratios + config.upsample_rates)) - length


def conv_reach(config) -> int:
    """Frames of hidden states before a chunk that the convolutions read for the first sample it emits
    (held back at the last seam: 555 samples before the chunk's first frame), walking its inputs back."""
    total = int(np.prod(config.upsampling_ratios + config.upsample_rates))
    start = 1000  # a chunk far from the utterance's start, where no zero padding is reached
    p = start * total - decoded_lag(config) - 6  # the last conv, kernel 7
    for rate in reversed(config.upsample_rates):
        p = (p - 6 * (1 + 3 + 9)) // rate  # residual units (kernel 7, dilations 1, 3, 9), then the transposed conv
    p -= 6  # the decoder's first conv
    for factor in reversed(config.upsampling_ratios):
        p = (p - 6) // factor  # ConvNeXt's depthwise conv (kernel 7), then the transposed conv (kernel = stride)
    return start - p


class StreamingCode2Wav:
    """Chunked code2wav over one utterance; `push` frames, get back PCM blocks that are final."""

    def __init__(
        self, code2wav, *, max_frames: int, first_chunk: int | None = None, chunk: int = 25,
        left_context: int = 25, graphs: bool = True,
    ) -> None:
        """
        code2wav: a `Qwen3OmniMoeCode2Wav` (put in eval mode here), on any device and dtype.
        max_frames: the longest utterance, in frames; more is a ValueError.
        first_chunk, chunk: frames decoded by the first call (default `FIRST_CHUNK`), and the most by any
            later one (sizes double).
        left_context: frames of hidden states before a chunk that its convolutions see: `conv_reach`
            (10) makes the stream equal the whole decode, more only costs; 25 is the serving framework's
            figure. At least 1: the samples held back at the last seam lie in the last chunk's last frame.
        graphs: replay the chunks' CUDA graphs where the warm-up captured them (the steps' policy says:
            `policy.graphs_on`); False: every chunk eager.
        """
        first_chunk = FIRST_CHUNK if first_chunk is None else first_chunk
        if min(first_chunk, chunk, left_context, max_frames) < 1:
            raise ValueError("max_frames, first_chunk, chunk and left_context must be positive")
        self.model = code2wav.eval()
        self.config = config = code2wav.config
        param = next(code2wav.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_frames, self.chunk, self.left_context = max_frames, chunk, left_context
        self.first_chunk = self.codes_for_first_audio = first_chunk  # no look-ahead: the first chunk alone
        self.log_units_per_code = 1  # chunk_log counts frames, one per talker step
        # The first sound waits for the first chunk alone: the engine holds its steps until it is out.
        # Eager (hundreds of kernels issued from Python) beside the talker's graphs it took 90 ms instead
        # of 13 (H200, true size); on a GPU it is a graph now (`ChunkGraphs`).
        self.quiet_first_chunk = True
        self.graphs = graphs
        self.samples_per_frame = int(np.prod(config.upsampling_ratios + config.upsample_rates))  # 1920
        self.reset()

    def reset(self) -> None:
        """Start a new utterance: nothing pushed, decoded or emitted."""
        self.codes = np.zeros((self.max_frames, self.config.num_quantizers), dtype=np.int64)
        self.n_frames = 0
        self.done = 0  # frames decoded
        self.emitted = 0  # samples handed out
        self.next_chunk = self.first_chunk
        self.cache = DynamicCache(config=self.config)  # the pre-transformer's keys / values, last 71 frames
        self.context = torch.zeros(1, 0, self.config.hidden_size, device=self.device, dtype=self.dtype)
        self.finished = False
        self.chunk_log: list[tuple[int, float]] = []  # per decode call: (frames made final, seconds)

    def push(self, frames: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Take new frames (16 ids each, codebook 0 first); return the PCM blocks (float32) now final."""
        if self.finished:
            raise RuntimeError("push() after finish(); call reset() for a new utterance")
        new = self._check(frames)
        if self.n_frames + len(new) > self.max_frames:
            raise ValueError(f"utterance longer than max_frames={self.max_frames}")
        self.codes[self.n_frames : self.n_frames + len(new)] = new
        self.n_frames += len(new)
        blocks = []
        # No look-ahead is needed (the held-back tail waits for the next chunk), so a chunk is due as soon
        # as its frames exist; a big push can make several due.
        while self.done + self.next_chunk <= self.n_frames:
            blocks.append(self._decode(self.done + self.next_chunk))
            self.next_chunk = min(2 * self.next_chunk, self.chunk)
        return blocks

    def finish(self) -> list[np.ndarray]:
        """End of the utterance: decode the frames left; the stream then has the whole decode's length."""
        if self.finished:
            return []
        self.finished = True
        return [self._decode(self.n_frames)] if self.done < self.n_frames else []

    def _check(self, frames) -> np.ndarray:
        q = self.config.num_quantizers
        new = np.asarray(frames, dtype=np.int64)
        new = new.reshape(0, q) if new.size == 0 else new
        if new.ndim != 2 or new.shape[1] != q:
            raise ValueError(f"frames must be lists of {q} codec ids each, got an array of shape {new.shape}")
        bad = new[(new < 0) | (new >= self.config.codebook_size)]
        if bad.size:
            raise ValueError(f"not a codec id (must be 0..{self.config.codebook_size - 1}): {bad[:4].tolist()}")
        return new

    @torch.inference_mode()
    def _decode(self, end: int) -> np.ndarray:
        """Frames [done, end): the pre-transformer on them alone (the cache holds the past), the
        convolutions on them and the hidden context; return the samples not emitted yet."""
        t, start = time.perf_counter(), self.done
        codes = torch.from_numpy(np.ascontiguousarray(self.codes[start:end].T[None]))
        graphs = ChunkGraphs.of(self.model) if self.graphs else None
        graph = graphs.get(start, end - start) if graphs is not None else None
        if graph is not None and graph.fits(self.context, self.cache):
            window, wav, self.cache = graph(start, codes, self.context, self.cache)
        else:
            window, wav = self._run(codes.to(self.device, non_blocking=True), self.context, self.cache)
        # The window's sample 0 is the first sample of its first frame; skip what was emitted before.
        skip = self.emitted - (end - window.shape[1]) * self.samples_per_frame
        block = wav[skip:].float().cpu().numpy().copy()  # the one host sync: the PCM itself
        self.context = window[:, -self.left_context :]
        self.done, self.emitted = end, self.emitted + len(block)
        self.chunk_log.append((end - start, time.perf_counter() - t))
        return block

    def _run(self, codes: torch.Tensor, context: torch.Tensor, cache,
             positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's device work: codes [1, 16, n] (on the device) -> (the convolutions' window [context |
        the frames' hidden states], its samples); the pre-transformer reads and extends `cache`.
        `positions` [1, n]: the frames' positions on the device (a graph's input); None: the library
        counts them from the cache's length on the host."""
        m = self.model
        hidden = m.code_embedding(codes + m.code_offset).mean(1)
        # Positions continue from the cache's length, so RoPE sees the whole decode's positions. Every
        # chunk attends over a new (chunk, cache) shape: without cuDNN's attention, which builds a plan
        # per shape (measured on an H200, true size: 134 ms for the second chunk, 0.8-1.2 s for 25-frame
        # chunks, against ~20 ms for the first).
        with no_cudnn_attention(self.device.type == "cuda"):
            hidden = m.pre_transformer(inputs_embeds=hidden, position_ids=positions, use_cache=True,
                                       **compat.cache_kwargs(cache, m.pre_transformer)).last_hidden_state
        window = torch.cat([context, hidden], dim=1)
        return window, self._convs(window)

    def _convs(self, hidden: torch.Tensor) -> torch.Tensor:
        """`Qwen3OmniMoeCode2Wav.forward` after its pre-transformer: hidden [1, T, H] -> samples [T * 1920 - 555]."""
        x = hidden.permute(0, 2, 1)
        for blocks in self.model.upsample:
            for block in blocks:
                x = block(x)
        for block in self.model.decoder:
            x = block(x)
        return x.clamp(min=-1, max=1).reshape(-1)

    @torch.inference_mode()
    def decode_whole(self, frames: Sequence[Sequence[int]]) -> np.ndarray:
        """The whole utterance in one `code2wav(codes)` call (the reference); leaves the stream alone."""
        new = self._check(frames)
        if len(new) == 0:
            return np.zeros(0, dtype=np.float32)
        codes = torch.from_numpy(new.T[None].copy()).to(self.device)
        return self.model(codes).reshape(-1).float().cpu().numpy()


class ChunkGraph:
    """A chunk of every utterance as a CUDA graph. The chunk that starts at frame `start` of the doubling
    schedule has the same shapes in every utterance (`frames` codes, `min(start, left_context)` frames of
    context, `min(start, window - 1)` positions in the pre-transformer's sliding-window cache), and so
    do transformers' host-side values (mask sizes and offsets), so one capture serves them all. Once the
    cache is full (`start >= window - 1`), every chunk of a size has those shapes, and its mask too (it
    depends on the query's and key's distance only): one graph serves them all, the positions an input.

    The stream's context and cache are copied into the graph's input buffers before a replay (a few small
    copies; none for the first chunk, whose cache is empty); a replay returns copies of the window and of
    the cache, which the stream goes on with; the samples are read at once. `graphed=False` runs the same
    buffers eagerly instead (the CPU tests' stand-in for a replay).
    """

    def __init__(self, voc: "StreamingCode2Wav", frames: int, pool=None, graphed: bool = True) -> None:
        """`voc`: an eager stream at the frame this chunk starts at, whose state is copied (not changed)."""
        from ...runtime.graphs import capture_anywhere, capture_stream

        self.start, self.frames, self.device, self._voc = voc.done, frames, voc.device, voc
        self.codes = torch.zeros(1, voc.config.num_quantizers, frames, dtype=torch.long, device=self.device)
        self.positions = torch.arange(self.start, self.start + frames, device=self.device)[None]
        self.positions_start = self.start  # the start the positions hold now
        self.context = voc.context.clone()
        self.inputs = copy.deepcopy(voc.cache)  # its layers' tensors are the input buffers
        _on_device(self.inputs, self.device)  # a cache's lazy set-up would copy from the host inside a capture
        self.graph = None
        if not graphed:
            return
        side = capture_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # kernels chosen outside the capture
            voc._run(self.codes, self.context, _layers_copied(self.inputs), self.positions)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.cache = _layers_copied(self.inputs)
        self.graph = torch.cuda.CUDAGraph()
        with capture_anywhere(self.graph, pool, side):
            self.window, self.wav = voc._run(self.codes, self.context, self.cache, self.positions)
        torch.cuda.current_stream(self.device).wait_stream(side)

    def fits(self, context: torch.Tensor, cache) -> bool:
        """Whether a stream's state has the shapes this graph was made for: the context's frames (which the
        left context caps) and the cached positions each layer holds."""
        return context.shape == self.context.shape and _held(cache) == _held(self.inputs)

    def __call__(self, start: int, codes: torch.Tensor, context: torch.Tensor, cache):
        """The chunk at frame `start`: codes [1, 16, frames] on the host, the stream's context and cache ->
        (window, samples, cache)."""
        self.codes.copy_(codes, non_blocking=True)
        if start != self.positions_start:
            torch.arange(start, start + self.frames, device=self.device, out=self.positions[0])
            self.positions_start = start
        if self.start:
            self.context.copy_(context)
            for mine, theirs in zip(self.inputs.layers, cache.layers):
                mine.keys.copy_(theirs.keys)
                mine.values.copy_(theirs.values)
        if self.graph is None:
            out = _layers_copied(self.inputs)
            window, wav = self._voc._run(self.codes, self.context, out, self.positions)
        else:
            self.graph.replay()
            window, wav, out = self.window.clone(), self.wav, copy.deepcopy(self.cache)
        for layer in out.layers:  # the capture's count on the host; a later start has a later one
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = start + self.frames
        return window, wav, out


class ChunkGraphs:
    """The graphs of every chunk of a schedule but an utterance's last: one per chunk until the cache is
    full, then one for the steady chunks. Captured by the engine's warm-up (`capture`), kept on the
    code2wav module (`of`), replayed by every `StreamingCode2Wav` over that module where a chunk starts,
    ends and has its state as one of them. All share one memory pool: a replay's outputs are copied or
    read before the next."""

    def __init__(self, graphs: dict[int, ChunkGraph], full: int) -> None:
        self.graphs, self.full = graphs, full

    @classmethod
    def capture(cls, code2wav, first_chunk: int, chunk: int, left_context: int,
                graphed: bool = True) -> "ChunkGraphs | None":
        """Capture the chunks of the schedule `first_chunk`, doubling up to `chunk`, through the first that
        starts with the cache full; on failure warn and keep the eager path (the audio is only later
        without them, so a capture problem must not stop a reply)."""
        full = code2wav.config.sliding_window - 1  # the positions a full sliding-window cache holds
        graphs: dict[int, ChunkGraph] = {}
        try:
            with torch.inference_mode():
                # The last chunk pushed starts before `full` and holds at most `chunk` frames.
                voc = StreamingCode2Wav(code2wav, max_frames=full + chunk, first_chunk=first_chunk, chunk=chunk,
                                        left_context=left_context, graphs=False)
                pool = torch.cuda.graph_pool_handle() if graphed else None
                size = first_chunk
                while True:
                    graphs[min(voc.done, full)] = ChunkGraph(voc, size, pool, graphed)
                    if voc.done >= full:
                        break
                    voc.push([[0] * voc.config.num_quantizers] * size)
                    size = voc.next_chunk
            made: ChunkGraphs | None = cls(graphs, full)
        except Exception as exc:  # noqa: BLE001 - any capture failure
            import warnings

            warnings.warn(f"code2wav's chunks could not be captured as CUDA graphs, they run eagerly: {exc!r:.300}")
            made = None
        code2wav._omni_chunk_graphs = made
        return made

    @staticmethod
    def of(code2wav) -> "ChunkGraphs | None":
        return getattr(code2wav, "_omni_chunk_graphs", None)

    def get(self, start: int, frames: int) -> ChunkGraph | None:
        """The graph of a chunk of `frames` frames that starts at frame `start`, if one was made (whether a
        stream's state fits it is `ChunkGraph.fits`)."""
        graph = self.graphs.get(min(start, self.full))
        return graph if graph is not None and graph.frames == frames else None


def _held(cache) -> list:
    """The shape of each layer's cached keys (None before its first chunk)."""
    return [None if getattr(layer, "keys", None) is None else tuple(layer.keys.shape) for layer in cache.layers]


def _layers_copied(cache):
    """A copy of `cache` whose layers are new objects over the same tensors: an update inside `_run`
    re-points the copy's layers at new tensors and leaves `cache`'s (the input buffers) where they are."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


def _on_device(cache, device: torch.device) -> None:
    """Move the host tensors a new cache's layers hold (a sliding layer's window size) to `device` now."""
    for layer in getattr(cache, "layers", ()):
        for name, value in list(vars(layer).items()):
            if isinstance(value, torch.Tensor) and value.device != device:
                setattr(layer, name, value.to(device))
