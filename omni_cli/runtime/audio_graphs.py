"""The thinker's audio tower replayed as a CUDA graph, one graph per number of feature chunks.

A spoken turn's clip goes through the audio tower before the prefill can be issued. The tower is small
work for a GPU (a 5 s clip: 32 layers over a few dozen to a few hundred rows) but hundreds of kernels
issued one by one from the library's Python layers: 15-22 ms of a turn on an H100, most of the time
between a turn's start and its prefill. A graph issues them at once. Measured on an H100 at true size
(`scripts/encoder_profile.py`), a 5 s clip's call with its host work: Qwen3-Omni 19.6 -> 4.2 ms,
Qwen2.5-Omni-7B 37.9 -> 5.4 ms; in bfloat16 both calls are as far from the float32 tower as each other
(1.7e-2 / 1.4e-2 of the largest value).

A graph has fixed shapes, and a clip's shapes follow its length. So the inputs are padded to a bucket: the
clips' feature chunks (the tower's own split: `n_window * 2` frames, the last of a clip shorter), B of
them, laid out as [B, mel, chunk frames] with zero chunks after the real ones; the token rows the layers
run on, B times the rows one chunk gives, the real ones first; the window boundaries (`cu_seqlens`) with
one more window for the padding rows. The layers' attention runs within windows, so padding rows never
reach a real one: here the windows are a mask made on the device from `cu_seqlens` (`windowed_attention`,
registered under a name with "flash" in it, which makes the library's layers hand it `cu_seqlens`
instead of splitting the windows by values read on the host). What the library's call computes and what
a replay computes are the same sums over the same rows; the rounding may differ where a kernel is chosen
for another shape (tests/test_audio_graphs.py bounds it on the CPU, tests/test_gpu.py on the GPU).

Graphs are made in the pauses between turns (the engine's capture ahead, which a turn asked for meanwhile
waits for), `PER_PAUSE` at a time: first the buckets turns since the last pause called the library for
(up to `MAX_CHUNKS`), then those of clips up to `WARM_CHUNKS` chunks, shortest first. Nothing at the
warm-up: a one-shot `omni-say` without a clip does not wait for them (75-93 ms a graph); omni-chat's and
omni-serve's warm-up reply (a clip of one chunk) is followed by such a pause.
All of a tower's graphs share one memory pool (a replay's output is copied out at once).

It knows the two families' towers only through the library's functions their modules define (the same
`compat.audio_plan` uses); a tower whose module lacks them keeps the library's call.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

ENABLED = True  # False: the library's call always (an A/B on a GPU: scripts/with_setting.py)
ATTENTION = "omni_flash_windows"  # "flash" in the name: the layers pass cu_seqlens, not host splits
WARM_CHUNKS = 12  # Qwen3-Omni: 12 s of audio, Qwen2.5-Omni: 24 s (chunks of 100 / 200 frames of 10 ms)
PER_PAUSE = 2  # graphs made in one pause (75-93 ms each at true size, H100): a turn asked for meanwhile waits
# The most chunks a graph is made for: a longer call takes the library's call (its windows one by one;
# the mask here is rows x rows, 10 MB at 32 of Qwen2.5-Omni's chunks).
MAX_CHUNKS = 32


def windowed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                       cu_seq_lens_q=None, **_kwargs):
    """Attention within the windows `cu_seq_lens_q` bounds ([1, H, T, D] each; an attention interface's
    signature): every row's window found on the device, so nothing is read back and the shapes are fixed."""
    rows = torch.arange(query.shape[2], device=query.device, dtype=cu_seq_lens_q.dtype)
    window = torch.searchsorted(cu_seq_lens_q[1:].contiguous(), rows, right=True)
    mask = window[:, None] == window[None, :]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, windowed_attention)


@contextlib.contextmanager
def _windowed(tower):
    """The tower's layers on `windowed_attention` for the duration (its config is theirs)."""
    _register()
    config = tower.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


class Layout:
    """A call's inputs as a graph's buffers take them (the features on the device, the indices on the
    host): the chunks `size` frames wide, the real rows' indices and windows, the rows of the output
    that are real."""

    def __init__(self, tower, features: torch.Tensor, lengths: torch.Tensor) -> None:
        """features: [mel, frames] of the clips end to end (on the device); lengths: their frame counts (host)."""
        lib = sys.modules[type(tower).__module__]
        self.qwen3 = hasattr(tower, "n_window_infer")
        size = 2 * tower.n_window  # frames a chunk
        padded, chunks = lib.chunk_and_pad_features(features, lengths, tower.n_window)
        self.chunks = len(chunks)
        self.padded = F.pad(padded, (0, size - padded.shape[-1]))  # every chunk `size` frames wide
        self.chunk_lengths = chunks
        full = torch.cat([chunks, torch.tensor([size])])  # a full chunk sets the grid's row stride
        if self.qwen3:
            valid = lib.get_valid_indices(full, tower.n_window)
            cu = lib.get_audio_cu_seqlens(chunks, lengths, tower.n_window_infer, tower.n_window)
        else:
            valid = lib.get_valid_indices(full)
            cu = lib.get_audio_cu_seqlens(chunks)
        self.rows = int(cu[-1])  # the real rows: the full chunk's come after them
        self.valid = valid[: self.rows]
        self.cu = cu
        self.pool = lib.get_pool_indices(lengths) if not self.qwen3 else None
        self.out_rows = len(self.pool) if self.pool is not None else self.rows


class TowerGraph:
    """One bucket's graph: static inputs, the captured tower call, its output buffer. `graphed=False`
    keeps the same buffers and runs the call each time (the CPU's tests of the layout)."""

    def __init__(self, tower, chunks: int, graphed: bool = True, pool=None, stream=None) -> None:
        from .graphs import capture_anywhere

        lib = sys.modules[type(tower).__module__]
        param = next(tower.parameters())
        dev, self.qwen3 = param.device, hasattr(tower, "n_window_infer")
        size = 2 * tower.n_window
        full = torch.tensor([size])
        per_chunk = len(lib.get_valid_indices(full, tower.n_window) if self.qwen3 else lib.get_valid_indices(full))
        self.tower, self.chunks, self.rows = tower, chunks, chunks * per_chunk
        self.padded = torch.zeros(chunks, tower.config.num_mel_bins, size, device=dev, dtype=param.dtype)
        self.chunk_lengths = torch.zeros(chunks, dtype=torch.long, device=dev)
        self.valid = torch.zeros(self.rows, dtype=torch.long, device=dev)
        self.cu = torch.full((chunks + 2,), self.rows, dtype=torch.int32, device=dev)  # one window: a valid call
        self.pool = None if self.qwen3 else torch.zeros(self.rows // 2, dtype=torch.long, device=dev)
        self.graph = None
        if not graphed:
            return
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            self._call()  # warm-up: kernels chosen and workspaces made outside the capture
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with capture_anywhere(self.graph, pool, stream):
            self.out = self._call()
        torch.cuda.current_stream(dev).wait_stream(stream)

    def _call(self) -> torch.Tensor:
        kwargs = dict(feature_lens=None, padded_feature=self.padded, chunk_lengths=self.chunk_lengths,
                      valid_indices=self.valid, cu_seqlens=self.cu, max_seqlen=self.rows)
        if self.pool is not None:
            kwargs["pool_indices"] = self.pool
        with _windowed(self.tower):
            return self.tower(self.padded, return_dict=True, **kwargs).last_hidden_state

    def __call__(self, layout: Layout) -> torch.Tensor:
        """Fill the buffers from `layout` (padding rows: copies of row 0, in a window of their own), run."""
        n, pin = layout.chunks, self.padded.device.type == "cuda"
        self.padded[:n].copy_(layout.padded)
        self.padded[n:].zero_()
        self.chunk_lengths.copy_(_host_pad(layout.chunk_lengths, self.chunks, 0, pin), non_blocking=pin)
        self.valid.copy_(_host_pad(layout.valid, self.rows, 0, pin), non_blocking=pin)
        cu = torch.cat([layout.cu.to(torch.int32), torch.tensor([self.rows], dtype=torch.int32)])
        self.cu.copy_(_host_pad(cu, self.chunks + 2, self.rows, pin), non_blocking=pin)
        if self.pool is not None:
            self.pool.copy_(_host_pad(layout.pool, self.rows // 2, 0, pin), non_blocking=pin)
        if self.graph is None:
            out = self._call()
        else:
            self.graph.replay()
            out = self.out
        return out[: layout.out_rows].clone()


def _host_pad(values: torch.Tensor, size: int, fill: int, pin: bool) -> torch.Tensor:
    """`values` (host) extended with `fill` to `size`; pinned for a CUDA copy that does not wait."""
    out = torch.full((size,), fill, dtype=values.dtype)
    out[: len(values)] = values
    return out.pin_memory() if pin else out


class TowerGraphs:
    """A tower's graphs by bucket (chunk count), kept on the tower module (`of`), made in the pauses
    between turns (`capture_ahead`)."""

    def __init__(self, tower) -> None:
        from .graphs import capture_stream

        self.tower = tower
        self.device = next(tower.parameters()).device
        self.by_chunks: dict[int, TowerGraph] = {}
        self.wanted: set[int] = set()  # buckets a call found without a graph
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = capture_stream(self.device)
        self.failed = False

    @staticmethod
    def of(tower) -> "TowerGraphs | None":
        """The tower's graphs, None where none were made or a capture failed."""
        graphs = getattr(tower, "_omni_audio_graphs", None)
        return None if graphs is None or graphs.failed else graphs

    @classmethod
    def made_for(cls, tower) -> "TowerGraphs | None":
        """The tower's graphs object, made now if it has none; None off CUDA, where its module lacks the
        library's functions the layout uses, or after a capture failed."""
        graphs = getattr(tower, "_omni_audio_graphs", None)
        if graphs is None:
            if next(tower.parameters()).device.type != "cuda":
                return None
            lib = sys.modules[type(tower).__module__]
            needs = ["chunk_and_pad_features", "get_valid_indices", "get_audio_cu_seqlens"]
            needs += [] if hasattr(tower, "n_window_infer") else ["get_pool_indices"]  # Qwen2.5-Omni's pooling
            if not all(hasattr(lib, n) for n in needs):
                return None
            graphs = tower._omni_audio_graphs = cls(tower)
        return None if graphs.failed else graphs

    def capture(self, chunks: int) -> bool:
        """The graph for `chunks` chunks (made once). On a failure warn and keep the library's call for good:
        audio later, never a failed reply."""
        from .decoder import no_cudnn_attention

        if self.failed or chunks in self.by_chunks:
            return not self.failed
        try:
            with torch.inference_mode(), no_cudnn_attention(True):
                self.by_chunks[chunks] = TowerGraph(self.tower, chunks, pool=self.pool, stream=self.stream)
        except Exception as exc:  # noqa: BLE001 - any capture failure: the library's call stays
            import warnings

            warnings.warn(f"the audio tower could not be captured as a CUDA graph, it runs eagerly: {exc!r:.300}")
            self.failed = True
        return not self.failed

    def capture_ahead(self, most: int = PER_PAUSE) -> int:
        """The buckets calls wanted, then the first of 1..`WARM_CHUNKS` not made yet, `most` in all.
        Returns the graphs made."""
        todo = sorted(self.wanted) + [n for n in range(1, WARM_CHUNKS + 1) if n not in self.wanted]
        self.wanted.clear()
        made = 0
        for chunks in todo:
            if made >= most or self.failed:
                break
            if chunks not in self.by_chunks:
                made += int(self.capture(chunks))
        return made


def capture_ahead(thinker) -> int:
    """Between turns (CUDA, graphs on): a few of `thinker`'s audio tower graphs (`TowerGraphs.capture_ahead`).
    Returns the graphs made."""
    from . import compat

    graphs = TowerGraphs.made_for(compat.audio_tower(thinker)) if ENABLED else None
    return graphs.capture_ahead() if graphs is not None else 0


def replay_call(tower, features: torch.Tensor, mask: torch.Tensor):
    """A call that gives the audio tower's output for the clips (`features` [clips, mel, frames] on the
    device, `mask` [clips, frames] on the host) from a graph, its host work done here; None where there are
    no graphs or none for this bucket yet (noted for the next pause; the caller takes the library's call,
    `compat.audio_encoder`)."""
    from .compat import clips_end_to_end

    graphs = TowerGraphs.made_for(tower) if ENABLED else None  # made on the first call: its bucket is noted
    if graphs is None:
        return None
    lengths = mask.sum(-1).to("cpu", torch.long)
    chunks = int((-(-lengths // (2 * tower.n_window))).sum())  # each clip's chunks, the last one partial
    graph = graphs.by_chunks.get(chunks)
    if graph is None:  # nothing laid out: the library's call does its own
        if chunks <= MAX_CHUNKS:
            graphs.wanted.add(chunks)
        return None
    layout = Layout(tower, clips_end_to_end(features, lengths), lengths)
    return lambda: graph(layout)
