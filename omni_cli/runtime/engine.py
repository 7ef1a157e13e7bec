"""The engine: one loaded model's steps, run one turn at a time.

`Engine(steps, tokenizer, eos_ids)` owns what outlives a turn: the family's steps (with their static
caches and graphs), the high-priority streams the thinker's and the talker's steps run on, and the lock
that keeps turns apart (and lets other steps of the same model take over between turns: `adopt`).
`stream(request)` runs a `Turn` (turn.py: threads and channels; schedule.py: the
decode order; detokenize.py; stats.py) and yields its events.

It knows no model family (the steps come from `omni_cli/models/<family>/`), no prompt and no terminal.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Generator, Protocol

import torch

from .events import AudioBlock, Done, Reply, TextDelta, TurnRequest  # noqa: F401 - re-exported
from .graphs import Policy
from .turn import Turn

log = logging.getLogger(__name__)

# The engines whose capture ahead may be running. A CUDA graph capture cut short by the interpreter's exit
# (the thread is a daemon: it must not hold a closing face open) aborted the process ("terminate called
# without an active exception", omni-bench --turns on an H200, the capture of a prompt's graph after the
# last turn): at exit no new capture starts, and the one under way is waited for (under a second).
_CAPTURING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _settle_at_exit() -> None:
    for engine in list(_CAPTURING):
        engine._closing = True
        engine.settle()

if TYPE_CHECKING:  # the interface the family's steps meet (models/base.py: Protocols, no family)
    from ..models.base import ModelSteps


class Engine:
    def __init__(self, steps: ModelSteps, tokenizer, *, eos_ids: list[int], max_lag: int = 4) -> None:
        self.steps = steps
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self.max_lag = max_lag
        self.device = steps.device
        # The engine thread issues its work on a high-priority stream: when the vocoder's windows and the
        # decode steps are both waiting for the GPU, the steps' blocks are scheduled first. (Measured on
        # an H200: the vocoder's stream first instead changed no benchmark figure beyond its noise.)
        self.step_stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        # The talker's steps go on a stream of their own (as high), so that talker step k runs on the GPU
        # beside thinker step k+1 instead of after it: each waits only for the thinker work issued before
        # it (schedule.py). `overlap = False` puts them back on the thinker's stream (omni-bench --streams).
        self.talker_stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.overlap = True
        self._lock = threading.Lock()  # one turn at a time: the caches are shared
        self.lingering: list[threading.Thread] = []
        self._turn: Turn | None = None  # the running turn, for `interrupt`
        self._next_steps: ModelSteps | None = None  # steps to take over at the next turn (`adopt`)
        self._adopting = threading.Lock()  # held by `adopt` while it holds the turns' lock
        self._ahead: threading.Thread | None = None  # the last capture ahead (`settle`)
        self._closing = False  # the process is exiting: no capture ahead starts

    @property
    def has_talker(self) -> bool:
        return self.steps.has_talker

    @property
    def max_codes(self) -> int:
        return self.steps.max_codes

    @property
    def max_context(self) -> int:
        return self.steps.max_context

    def warmup(self) -> dict | None:
        """Graphs and compiled kernels, made on this thread with nothing else running (a no-op on a CPU);
        the seconds each phase took, where the steps say."""
        return self.steps.warmup()

    def stream(self, req: TurnRequest) -> Generator[TextDelta | AudioBlock | Done, None, None]:
        """Run one turn; yield text deltas and audio blocks as they exist, then Done."""
        if not self._lock.acquire(blocking=False):
            with self._adopting:  # a moment's wait for an adoption; none for another turn
                pass
            if not self._lock.acquire(blocking=False):
                raise RuntimeError("a turn is already running on this model")
        finished = False
        try:
            self._join_lingering()
            self._take_next_steps()
            self._turn = Turn(self, req)
            for event in self._turn.run():
                finished = isinstance(event, Done)  # set before the yield: the consumer may stop at Done
                yield event
        finally:
            self._turn = None
            self._lock.release()
            if finished and self.device.type == "cuda":
                self._ahead = threading.Thread(target=self._capture_ahead, name="capture-ahead", daemon=True)
                _CAPTURING.add(self)
                self._ahead.start()

    def settle(self) -> None:
        """Wait for the work a finished turn left for the idle time (the capture ahead): what a person's
        pause between turns gives it (omni-bench --turns waits so, outside its timings)."""
        ahead = self._ahead
        if ahead is not None:
            ahead.join()

    def capture_ahead(self) -> None:
        """What a finished turn leaves for the pause before the next, done now on this thread (CUDA; a
        no-op elsewhere): omni-bench's runs, each a new conversation, after dropping the kept context."""
        self.settle()
        if self.device.type == "cuda":
            self._capture_ahead()

    def _capture_ahead(self) -> None:
        """After a finished turn, while the user reads, listens or speaks: the lazy step graphs' buckets
        the next turn of a growing conversation reaches (steps.capture_ahead), so that it replays them
        instead of capturing them in the middle of its reply. Under the turns' lock, held as `adopt`
        holds it: a turn asked for meanwhile waits for it (tens of ms a bucket); one already running
        makes it give up."""
        with self._adopting:
            if self._closing or not self._lock.acquire(blocking=False):
                return
            try:
                made = self.steps.capture_ahead()
                if made:
                    log.debug("captured %d step graphs ahead of the next turn", made)
            except Exception as exc:  # the buckets stay lazy: a reply captures them when it reaches them
                log.warning("capturing step graphs ahead of the next turn failed: %s", exc)
            finally:
                self._lock.release()

    def adopt(self, steps: ModelSteps) -> bool:
        """Run turns with `steps` from now on (the same model's steps built otherwise: compiled beside these,
        runtime/beside.py): at once if no turn is running, else from the next turn on. Returns whether they
        took over at once."""
        self._next_steps = steps
        with self._adopting:  # a turn asked for meanwhile waits for this, rather than failing as taken
            if not self._lock.acquire(blocking=False):
                return False  # the running turn keeps its steps; `stream` swaps before the next one
            try:
                self._join_lingering()  # it may still use the old steps
                self._take_next_steps()
                # Nothing runs now: the old steps' caches and graphs (held in reference cycles) go back to
                # the device, not only to the allocator's cache. Not done when the swap waits for a turn to
                # start, whose first audio it would delay.
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            finally:
                self._lock.release()
        return True

    def _join_lingering(self) -> None:
        """Wait for the vocoder threads still finishing interrupted turns (under the turns' lock)."""
        while self.lingering:
            self.lingering.pop().join()

    def _take_next_steps(self) -> None:
        steps, self._next_steps = self._next_steps, None
        if steps is not None:
            self.steps = steps

    def interrupt(self) -> None:
        """Stop the running turn (if any) from another thread: its event stream raises `TurnInterrupted`
        at once, wherever its consumer waits (a server's worker whose client went away)."""
        turn = self._turn
        if turn is not None:
            turn.interrupt()


def configure_cuda(float32_llm: bool = False) -> None:
    """Process-wide CUDA settings the engine relies on (call before a reference run to compare alike):
    TF32 matmuls for float32 vocoders (their GEMMs several times faster), unless the LLMs themselves
    run in float32 (as in the GPU parity tests), which keeps them at full precision."""
    if not float32_llm:
        torch.backends.cuda.matmul.allow_tf32 = True


class _FastDecoding(Protocol):
    """A family's thinker or talker stack, as `enable_fast_steps` sees it."""

    def enable_fast_decode(self, policy: Policy) -> None: ...


class StepsBeingBuilt(Protocol):
    """What `enable_fast_steps` reads and sets on a family's steps while their `__init__` runs (not yet the
    whole `ModelSteps`: its stacks, `thinker` and, where `has_talker`, `talker`, are the family's own)."""

    device: torch.device
    has_talker: bool
    fast_decode: bool
    policy: Policy
    compile: bool

    @property
    def thinker(self) -> _FastDecoding: ...

    @property
    def talker(self) -> _FastDecoding: ...


def enable_fast_steps(steps: StepsBeingBuilt, dtype, policy: Policy, fast_decode: bool | None) -> None:
    """What every family's steps do once their stacks exist: the CUDA settings (`configure_cuda`), then,
    unless `fast_decode` is False, the fused decode steps of the thinker and the talker, with the graphs and
    compile `policy` has (runtime/graphs.py). Sets `steps.fast_decode`, `steps.policy` (as built: without
    fused steps nothing is compiled) and `steps.compile`."""
    if steps.device.type == "cuda":
        configure_cuda(float32_llm=dtype == torch.float32)
    steps.fast_decode = True if fast_decode is None else fast_decode
    steps.policy = policy if steps.fast_decode else policy.without_compile()
    steps.compile = steps.policy.compile_on
    if steps.fast_decode:
        steps.thinker.enable_fast_decode(steps.policy)
        if steps.has_talker:
            steps.talker.enable_fast_decode(steps.policy)


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")
