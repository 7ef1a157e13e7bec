"""CUDA-graph replay for the decode steps, and the one policy that says where graphs and compile apply.

`Policy.of(runtime, device)` (frozen) is `RuntimeOptions` met with a device: graphs where they are asked
for and the device has them (CUDA), compile where asked for and graphs are on (compiled steps exist to
be captured), the hand-written kernels where asked for and available. The steps builders of every
family receive one and make their graphs and compiled functions through it (`policy.step_graphs`,
`policy.prefill_graphs`, `policy.compile`, `policy.graphs_on`): no family decides again, and no switch of
the environment is read here (`RuntimeOptions.from_env` did, once; only inductor's cache folder is).

`StepGraphs(fn, ...)` turns `fn(span)` — a step that reads and writes only preallocated ("static")
tensors — into graph replays, one graph per attention-span bucket (the span grows with the cache; the
host knows it without reading the device, so choosing a graph costs no sync). Graphs share one memory
pool. They are captured by `capture_all()` at warm-up, or, `lazy`, the first bucket there and each
later one when a step first reaches it (`capture_anywhere`: a plain step's capture takes tens of ms, so
a reply never waits for buckets it does not reach; compiled steps are never captured lazily, as a
bucket's first run may compile), or between turns, ahead of a growing conversation (`capture_upto`). On
CPU, with graphs switched off, or for a bucket without a graph, calling it runs `fn` eagerly with the
same bucketed span, so both paths do identical math.

Compiled code is kept in a persistent cache (`persistent_cache`). It knows nothing about models.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..config import RuntimeOptions

SPAN_BUCKET = 256  # attention-span granularity: a new graph every 256 positions
# Between turns, the lazy buckets up to this many positions past each cache's length are captured: a
# spoken turn and its reply (a 5 s clip is 150 audio positions; a reply of 64 text tokens, or of 250
# codes for the talker) are about that much.
CAPTURE_AHEAD = 512


def graphs_possible(device: torch.device) -> bool:
    """Whether `device` can capture and replay CUDA graphs (the one device test of the policy)."""
    return device.type == "cuda"


@dataclass(frozen=True)
class Policy:
    """Where graphs, compile and the hand-written kernels apply, for one device: made once from the
    runtime options (`Policy.of`) and handed to the steps builders, which wrap through it."""

    # The device the steps run on.
    device: torch.device
    # CUDA graphs of the decode steps, prompts and the vocoder: asked for and possible on the device.
    graphs_on: bool
    # torch.compile of the decode layers, picks and the vocoder's DiT: asked for, with graphs on.
    compile_on: bool
    # runtime/kernels.py's products for small projections: asked for (fused.py uses them where
    # `fused.kernels_wanted` finds them: CUDA with triton; looked up there, so that no step imports triton
    # where it has no small projections).
    kernels_on: bool
    # kernels.attend for one-token attention blocks: asked for (used where `fused.attend_wanted`).
    attention_kernel_on: bool
    # The decoder layers hold packed weights (RuntimeOptions.quantize): never compiled (the packed products
    # are Triton kernels and buffers torch.compile is not asked to trace; their steps are captured plain).
    packed: bool = False

    @classmethod
    def of(cls, runtime: RuntimeOptions | None, device) -> "Policy":
        """The policy for `runtime` (None: the defaults) on `device`."""
        runtime = runtime or RuntimeOptions()
        device = torch.device(device)
        graphs = bool(runtime.graphs) and graphs_possible(device)
        packed = runtime.quantize is not None
        if packed and runtime.compile and graphs:
            _compile_refused(str(runtime.quantize))
        return cls(device=device, graphs_on=graphs, compile_on=bool(runtime.compile) and graphs and not packed,
                   kernels_on=bool(runtime.kernels), attention_kernel_on=bool(runtime.attention_kernel),
                   packed=packed)

    def over(self, model) -> "Policy":
        """This policy for `model`: packed, so never compiled, where its layers hold packed weights (a
        quantized checkpoint loaded as it is, without --quantize, too)."""
        from ..quant.apply import has_packed

        if self.packed or not has_packed(model):
            return self
        if self.compile_on:
            _compile_refused("checkpoint")
        return replace(self, packed=True, compile_on=False)

    def compiling(self) -> "Policy":
        """This policy with compile on where graphs are (the steps `compile_beside` builds); never over
        packed weights."""
        return replace(self, compile_on=self.graphs_on and not self.packed)

    def without_compile(self) -> "Policy":
        return replace(self, compile_on=False)

    def compile(self, fn: Callable, **kwargs) -> Callable:
        """`fn` through `compile_fn` where compile is on, else `fn` itself."""
        return compile_fn(fn, **kwargs) if self.compile_on else fn

    def step_graphs(self, fn: Callable[[int], object], limit: int, lazy: bool = False,
                    allowed: bool = True) -> "StepGraphs":
        """`StepGraphs` over `fn` (graphs where the policy has them and the caller's `allowed`)."""
        return StepGraphs(fn, self.device, limit, self.graphs_on and allowed, lazy=lazy)

    def prefill_graphs(self, model, cache, width: int, dtype, *, keep: int | None = None,
                       allowed: bool = True) -> "PrefillGraphs":
        """`PrefillGraphs` for a stack's prompts (graphs where the policy has them and `allowed`: the
        family's say on whether its layers are graph-safe in this dtype)."""
        return PrefillGraphs(model, cache, width, dtype, self.device, self.graphs_on and allowed, keep=keep)

    def to_runtime(self, asked: RuntimeOptions, dtype: str) -> RuntimeOptions:
        """`asked` as built under this policy: the device and dtype it runs on, what is really on."""
        gpu = self.device.type == "cuda"  # the kernels' device (their other condition, triton, is fused.py's)
        return replace(asked, device=str(self.device), dtype=dtype, graphs=self.graphs_on, compile=self.compile_on,
                       kernels=self.kernels_on and gpu, attention_kernel=self.attention_kernel_on and gpu)


_REFUSED: set[str] = set()  # the --quantize kinds whose compile was refused (said once a process)


def _compile_refused(quantize: str) -> None:
    """Say once a process that compile is off over packed weights (the faces show the warning)."""
    if quantize not in _REFUSED:
        _REFUSED.add(quantize)
        logging.getLogger("omni_cli.runtime").warning(
            "torch.compile over packed (%s) weights is not supported: the steps run uncompiled "
            "(with CUDA graphs)", "a quantized checkpoint's" if quantize == "checkpoint" else f"--quantize {quantize}")


def compile_fn(fn: Callable, **kwargs) -> Callable:
    """`torch.compile(fn)` with room for many specialisations of one function: each model, dtype and
    span bucket that runs it is one, and a process may hold several engines (tests, `omni-bench
    --variants`); dynamo's default limit of 8 per function would make the ninth a hard error. What it
    compiles is kept in `persistent_cache()` for later processes."""
    import torch._dynamo

    persistent_cache()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, **kwargs)


def tracing() -> bool:
    """Whether dynamo is tracing this call (compiled code is being made from it), for functions that take
    another path when compiled. Not `torch.compiler.is_compiling()`: that is one flag for the whole process,
    held True while any thread compiles, so plain steps serving beside a compile (runtime/beside.py) took
    the compiled paths too (H200, the tiny Qwen3-Omni in float32: other code-predictor picks from frame 11)."""
    return torch.compiler.is_dynamo_compiling()


CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def persistent_cache() -> str:
    """The folder where torch.compile keeps what it made: `$TORCHINDUCTOR_CACHE_DIR` if set, else
    `~/.cache/omni_cli/torch-compile` (under `$XDG_CACHE_HOME` if set). Inductor's default is a folder in
    /tmp, which a reboot or a fresh container empties, so every start would compile again (a minute or
    more for a 7B). Its caches (FX graphs, AOT autograd, Triton kernels under `triton/`) are PyTorch's own;
    their keys hold the graph, the input shapes and dtypes, the torch version, the GPU and the compiler
    settings, so one folder serves every model and machine, and a stale entry is never used. Set before
    the first compile of the process (inductor reads the variable then)."""
    if not os.environ.get(CACHE_ENV):
        from ..config import cache_folder

        os.environ[CACHE_ENV] = cache_folder("torch-compile")
    return os.environ[CACHE_ENV]


def bucket(span: int, limit: int) -> int:
    return min(limit, -(-span // SPAN_BUCKET) * SPAN_BUCKET)


class StepGraphs:
    def __init__(self, fn: Callable[[int], object], device: torch.device, limit: int, enabled: bool,
                 lazy: bool = False) -> None:
        self.fn = fn
        self.device = device
        self.limit = limit
        self.enabled = enabled  # the policy's say (`Policy.step_graphs`): graphs on and possible
        self.lazy = lazy
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.capture_stream = capture_stream(device) if self.enabled else None

    def __call__(self, span: int):
        size = bucket(span, self.limit)
        entry = self.graphs.get(size) if self.enabled else None
        if entry is None:
            if not (self.enabled and self.lazy):
                return self.fn(size)  # no graph for this span (CPU, switched off, or not captured)
            entry = self.graphs[size] = self._capture(size)  # the first step in this bucket
        graph, outputs = entry
        graph.replay()
        return outputs

    def capture_all(self) -> None:
        """Capture every span bucket now (`lazy`: the first only). Called by the engine's warm-up. The
        static inputs must hold valid values (the step writes one cache row, which the next prefill
        overwrites)."""
        if not self.enabled:
            return
        sizes = range(SPAN_BUCKET, self.limit + SPAN_BUCKET, SPAN_BUCKET)
        for size in sizes[:1] if self.lazy else sizes:
            size = min(size, self.limit)
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)

    def capture_upto(self, span: int) -> int:
        """Capture the buckets up to `span`'s that are not captured yet; lazy graphs only (the others
        hold every bucket from the warm-up). Called between turns (`Engine`: capture ahead), so that a
        growing conversation's next reply replays its new buckets instead of capturing them mid-reply.
        Returns how many it captured."""
        if not (self.enabled and self.lazy):
            return 0
        top = bucket(span, self.limit)
        sizes = sorted({min(size, self.limit) for size in range(SPAN_BUCKET, top + SPAN_BUCKET, SPAN_BUCKET)})
        missing = [size for size in sizes if size <= top and size not in self.graphs]
        for size in missing:
            self.graphs[size] = self._capture(size)
        return len(missing)

    def _capture(self, size: int):
        # Warm up on a side stream (lazy library init, autotuning), then capture. The step rewrites the
        # same cache row with the same values each time (mid-reply too: the row of the step being taken),
        # so warm-up runs leave no trace.
        side = self.capture_stream
        assert side is not None  # made where `enabled`, and only then are graphs captured
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(size)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture_anywhere(graph, self.pool, side):
            outputs = self.fn(size)
        return graph, outputs


def capture_ahead(*stacks) -> int:
    """`capture_upto` for each (StepGraphs or None, its cache) of `stacks`, CAPTURE_AHEAD positions past
    the cache's length: what a family's `capture_ahead` does between turns. Returns the graphs made."""
    made = 0
    with torch.inference_mode():
        for graphs, cache in stacks:
            if graphs is not None:
                made += graphs.capture_upto(cache.length + CAPTURE_AHEAD)
    return made


def capture_prompts(thinker, talker) -> int:
    """Between turns: the prompt graphs (`PrefillGraphs.capture_rests`) the next turn wants, for the
    thinker (its rests over the kept context, or with none kept its long prompts from an empty cache) and
    the talker, if given: its rests after the rows it keeps (runtime/context.py `TalkerRows`: the cache cut
    back to them, the most the next prompt keeps; the rows of its own and the reply's are made again
    anyway), and its long prompts from an empty cache, around a copy of those rows. Each stack has
    `prefill_graphs` (or None) and `cache`; the thinker a `context`, the talker `rows`. Returns the graphs
    made."""
    made = 0
    with torch.inference_mode():
        if thinker.prefill_graphs is not None:
            context = thinker.context
            made += thinker.prefill_graphs.capture_rests(kept=context is not None and bool(context.ids))
        if talker is not None and talker.prefill_graphs is not None:
            rows = talker.rows.shared()
            if rows and rows <= talker.cache.length:
                talker.cache.keep_first(rows)
                made += talker.prefill_graphs.capture_rests(kept=True, long_over_kept=True)
            else:
                talker.rows.clear()
                made += talker.prefill_graphs.capture_rests(kept=False)
    return made


@contextlib.contextmanager
def capture_anywhere(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream):
    """Capture `graph` on `stream` while other threads may be using the GPU (a step graph in the middle of
    a reply, beside the vocoder's thread). `torch.cuda.graph` would synchronise the whole device first
    (waiting for whatever the vocoder has in flight) and empty the allocator's caches under the other
    threads; and in its default ("global") mode another thread's synchronising call (the vocoder copying
    audio to the host) would break the capture. Here only this thread's calls are checked
    ("thread_local"), the allocator serves the capture from `pool`, and nothing else is touched. The
    work on `stream` before the capture must already be ordered after what the captured kernels read."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            yield graph
        finally:
            graph.capture_end()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of its own for one family of graphs to be captured on.

    cuBLAS keeps one workspace per (handle, stream), and a GEMM captured in a graph keeps using the
    workspace of the stream it was captured on at every replay. `torch.cuda.graph` captures every graph
    on one shared stream unless told otherwise, so the decode steps' graphs and the vocoder's windows,
    which replay at the same time on two streams, raced on one workspace: the talker's logits were
    perturbed whenever a vocoder window ran (measured on an H200, float32: up to 1.4 in a logit, codes
    different from step 96 on). Graphs that may replay concurrently must be captured on different streams.

    Its priority is one that only these streams (and the warm-up beside replies, runtime/beside.py) ask
    for: torch hands out the streams of a priority round-robin from a pool of 32, and a turn takes two of
    the default priority (the boundary's copies, the vocoder's), so after some turns one of them was the
    stream a graph was being captured on; another thread's work on that stream breaks the capture and
    fails itself (H200: "dependency created on uncaptured work in another stream", when the compiled steps
    were first captured beside replies).
    """
    return torch.cuda.Stream(device, priority=CAPTURE_PRIORITY)


CAPTURE_PRIORITY = -2  # the pool of `capture_stream` (the engine's own streams are -1, a turn's 0)


PREFILL_BUCKETS = (32, 64, 128, 256, 512)  # prompt lengths with a graph from the warm-up on
# Longer prompts, and rests over a kept context, have graphs in these lengths too, captured between turns
# once wanted (`PrefillGraphs.capture_rests`): every 512 rows up to LONG_MAX (the context, if smaller).
LONG_STEP, LONG_MAX = 512, 8192
# The rests over a kept context wanted before any has run: a typed turn after a reply's tail, and a
# spoken one (a 5 s clip is 150 audio positions).
SUFFIX_FIRST = (64, 256)
SUFFIX_SPAN_MIN = 512  # the smallest key span of a rest's graph; then powers of two up to the context


def suffix_span(end: int, limit: int) -> int:
    """The key span of the graph for a rest that ends at `end`: the next power of two from SUFFIX_SPAN_MIN
    (a few graphs cover any context: 512, 1,024, 2,048, 4,096), at most `limit`."""
    span = SUFFIX_SPAN_MIN
    while span < end:
        span *= 2
    return min(span, limit)


def rest_graph(graphs: dict, sizes: list[int], n: int, start: int, limit: int):
    """(size, graph) of the smallest captured rest over `start` kept rows that holds `n` rows, or None.
    `graphs` is keyed by (size, key span); a rest of `size` rows ends by start + size <= `limit`."""
    for size in sizes:
        if size >= n and start + size <= limit:
            entry = graphs.get((size, suffix_span(start + size, limit)))
            if entry is not None:
                return size, entry
    return None


class PrefillGraphs:
    """A prompt's forward through the library's layers (`decoder.forward_layers_keeping`), replayed as one
    CUDA graph per length bucket: the prompt is padded to the bucket with zero rows after its end.

    Without a graph a prefill issues thousands of small kernels from Python (a 48-layer mixture of experts:
    ~80-120 ms for 60 tokens on an H200, most of it launch overhead). Padding changes nothing before the
    end: attention is causal, routing and every other op work row by row, and the cache rows the padding
    writes lie past the prompt, where the next step writes and masks anyway. Results can differ from the
    unpadded forward in the last bits (a matmul's kernel depends on its row count). Eager where graphs
    are off (CPU, switched off) or no graph of the length is captured yet.

    Prompts up to 512 rows from an empty cache have their graphs from the warm-up (`capture_all`).
    Longer ones, in buckets of 512 rows, and a prompt's rest over a kept context (runtime/context.py:
    `decoder.forward_suffix`, one graph per length bucket and key span, the rows before it a device
    value, so that one graph serves every conversation whose context fits the span) have many lengths,
    and the rests' spans grow with a conversation: they are captured between turns (`capture_rests`, the
    engine's capture ahead) for the lengths wanted: `SUFFIX_FIRST` from the start, any other once a
    prompt of its length has run (that once in a larger bucket's graph where one is captured, else
    eagerly), and the length a growing prompt reaches next. A long prompt's capture writes the cache from
    its first row: it is made where nothing is kept, or around a copy of the talker's kept rows
    (`capture_rests`). The rests read their keys
    through a mask (memory-efficient attention), which costs more than the causal kernel of a prompt
    from an empty cache: a long prompt is not run as a rest after nothing.
    """

    def __init__(self, model, cache, width: int, dtype, device: torch.device, enabled: bool, keep: int | None = None,
                 buckets: tuple[int, ...] = PREFILL_BUCKETS) -> None:
        from .decoder import forward_layers_keeping

        self.model, self.cache, self.keep = model, cache, keep
        self.forward = forward_layers_keeping
        self.enabled = enabled  # the policy's say (`Policy.prefill_graphs`)
        self.buckets = [b for b in buckets if b <= cache.max_len] if self.enabled else []
        top = min(LONG_MAX, cache.max_len)
        self.sizes = self.buckets + list(range(2 * LONG_STEP, top + 1, LONG_STEP)) if self.buckets else []
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.rest_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}  # (size, span) ->
        self.wanted_rests = {b for b in SUFFIX_FIRST if b in self.buckets}  # rests over a kept context
        self.wanted_long: set[int] = set()  # prompts over 512 rows from an empty cache (in `graphs`)
        self.last_long = 0  # the last such prompt's length (a growing one wants the next bucket)
        if self.buckets:
            self.inputs = torch.zeros(1, self.sizes[-1], width, device=device, dtype=dtype)
            self.start = torch.zeros((), dtype=torch.long, device=device)  # the rows before a rest
            self.pool = torch.cuda.graph_pool_handle()
            self.capture_stream = capture_stream(device)

    def __call__(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [1, n, W], the kept layer's output or None) for `embeds` [1, n, W], from an empty cache."""
        n = embeds.shape[1]
        self.cache.reset()
        size = next((b for b in self.sizes if b >= n), None)
        if size is not None and size > self.buckets[-1]:
            self.last_long = n
            self.wanted_long.add(size)
        if size is None or size not in self.graphs:
            return self.forward(self.model, embeds, self.cache, self.keep)
        return self._replay(self.graphs[size], embeds, size)

    def run(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`embeds` after the cache's rows: from an empty cache as `__call__` (a graph, else the eager
        forward), over kept rows as `over_kept` (a graph, else None: the caller runs it eagerly)."""
        return self(embeds) if self.cache.length == 0 else self.over_kept(embeds)

    def over_kept(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`embeds` [1, n, W] after the cache's kept positions, replayed as a graph: (hidden, kept layer's
        output), or None where no graph fits (the caller runs it eagerly). Its own bucket is wanted from
        now; until it is captured, a larger bucket's graph over the same kept rows serves, padded (an
        H100, Qwen3-Omni: a spoken turn's 79-row rest took 80 ms eagerly, 41 ms in the 256-row graph, its
        clip's encoder included)."""
        n, start = embeds.shape[1], self.cache.length
        size = next((b for b in self.sizes if b >= n), None)
        if size is None:
            return None
        self.wanted_rests.add(size)
        found = rest_graph(self.rest_graphs, self.sizes, n, start, self.cache.max_len)
        if found is None:
            return None
        self.start.fill_(start)
        return self._replay(found[1], embeds, found[0])

    def _replay(self, entry, embeds: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`embeds` padded with zero rows to `size` into the static input, the graph replayed, the cache
        advanced by the real rows: their (hidden, kept layer's output)."""
        n = embeds.shape[1]
        self.inputs[:, :n].copy_(embeds)
        self.inputs[:, n:size].zero_()
        graph, (hidden, kept) = entry
        graph.replay()
        self.cache.advance(n)
        return hidden[:, :n], (None if kept is None else kept[:, :n])

    def capture_rests(self, kept: bool, long_over_kept: bool = False) -> int:
        """Between turns: the graphs the next turn wants. `kept`: the cache holds a context to keep (its
        length now being what the next turn keeps at most): the wanted rests over it, for the span the next
        turn needs, each capture writing only past that length (rows the next prefill writes anyway). Then
        the wanted long prompts from an empty cache and the length a growing one reaches next
        (`_capture_long`): where nothing is kept, or (`long_over_kept`: the talker, whose kept rows are a
        few tens of MB) around a copy of the kept rows. A thinker's kept context is a conversation's whole
        cache (an H100's 2,500-token Qwen3-Omni prompt: 245 MB), and its long prompts are compute-bound
        (eager 57 ms against 53 ms of kernels): it is not copied for them. Returns the graphs made."""
        length, made = self.cache.length, 0
        if kept:
            for size in sorted(self.wanted_rests):
                key = (size, suffix_span(length + size, self.cache.max_len))
                if key not in self.rest_graphs and length + size <= key[1]:
                    self.start.fill_(length)
                    self.rest_graphs[key] = self._capture(size, span=key[1])  # leaves the length as it was
                    made += 1
        if kept and not long_over_kept:
            return made
        return made + self._capture_long(length if kept else 0)

    def _capture_long(self, keep: int) -> int:
        """The wanted prompts over `buckets` from an empty cache. Their captures' warm-up forwards write the
        cache from the first row, so the `keep` rows a context holds are copied aside and put back (the
        talker's cache keeps its rows between turns, and a 2,500-row talker prompt ran eagerly on every
        fresh prompt: an H100, 21 ms against 13 ms of kernels). With nothing kept the cache is left empty."""
        long = set(self.wanted_long)
        if self.last_long:
            long.add(next((b for b in self.sizes if b >= self.last_long + LONG_STEP // 2), self.sizes[-1]))
        todo = sorted(long - set(self.graphs))
        saved = self.cache.copy_first(keep) if keep and todo else None
        try:
            for size in todo:
                self.graphs[size] = self._capture(size)
        finally:
            if saved is not None:
                self.cache.restore_first(saved)
            elif not keep:
                self.cache.reset()
        return len(todo)

    def capture_all(self) -> None:
        """Capture every bucket (the engine's warm-up, nothing else on the GPU; the cache is left empty)."""
        for size in self.buckets:
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)
        self.cache.reset()

    def _capture(self, size: int, span: int | None = None):
        """A graph of the prefill of `size` rows: from an empty cache, or (`span`) after `self.start` kept
        rows, which it leaves as they are."""
        from . import prompt_ops
        from .decoder import forward_suffix

        x = self.inputs[:, :size]
        length = self.cache.length
        # A long prompt from an empty cache takes cuDNN's attention (prompt_ops.py): its plan is built by the
        # warm-up forwards below, and the replays never ask for it again.
        cudnn = span is None and size > self.buckets[-1]

        def forward():
            if span is not None:
                return forward_suffix(self.model, x, self.cache, self.keep, self.start, span)
            self.cache.reset()
            return self.forward(self.model, x, self.cache, self.keep)

        side = self.capture_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode(), prompt_ops.cudnn_attention(cudnn):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Not `torch.cuda.graph`: it synchronises the whole device and empties the allocator's caches, which
        # must not happen under the replies of steps that serve while these are made (runtime/beside.py).
        with torch.inference_mode(), prompt_ops.cudnn_attention(cudnn), capture_anywhere(graph, self.pool, side):
            outputs = forward()
        self.cache.length = length if span is not None else 0
        return graph, outputs
