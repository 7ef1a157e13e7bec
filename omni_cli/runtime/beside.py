"""Compiled steps made beside the plain ones: a server answers at once with plain CUDA graphs, and serves
with compiled steps once they exist, so that nobody waits on the compiler.

`compile_beside(engine, build, on_ready)` starts a thread ("omni-compile") that builds a second set of the
family's steps with `compile` on (`build()`: the same weights, caches and graphs of their own) and runs
their warm-up (compile, capture) on a CUDA stream of its own, while the engine goes on running turns with
the steps it has. `Engine.adopt` then hands the engine the new steps between two turns; the old ones are
freed when nothing holds them.

Why the two can run side by side:
- the weights are shared and only read; the fused q/k/v and gate/up matrices of the first set are reused
  (`fused.fuse_rows` copies nothing the second time);
- every capture is `graphs.capture_anywhere` (only this thread's calls checked, a pool and a stream of
  its own), the vocoder's compiled windows are a graph set of their own (`_WindowGraphs.for_model`),
  and a warm-up waits only for its own stream;
- the new caches are their own: nothing the warm-up writes is read by a turn in progress.

What it costs: a second set of caches and graphs in GPU memory until the switch, and, while it compiles,
the interpreter: dynamo's tracing holds the GIL, so the turns' threads get it back later than they would
(the switch interval is shortened meanwhile, `SWITCH_INTERVAL`). A failure only leaves the plain steps
serving (logged as a warning).

It knows no model family and no server.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Callable

import torch

from .graphs import capture_stream

log = logging.getLogger(__name__)

# Seconds a thread holding the GIL keeps it while another waits (Python's default: 5 ms), while the
# compiler runs: a decode step's thread waits for the GIL a few times per step.
SWITCH_INTERVAL = 0.0005


def compile_beside(engine, build: Callable, on_ready: Callable[[float], None] | None = None,
                   on_failure: Callable[[BaseException], None] | None = None) -> threading.Thread:
    """Start the thread that builds and warms up `build()`'s steps and gives them to `engine`; `on_ready`
    gets the seconds it took, `on_failure` the exception (then the engine keeps its steps)."""

    def run() -> None:
        t = time.perf_counter()
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
        try:
            cuda = engine.device.type == "cuda"
            stream = capture_stream(engine.device) if cuda else None  # not one a turn may be given
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                steps = build()
                steps.warmup()
            if stream is not None:  # made where `cuda`
                stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - the plain steps go on serving
            log.warning("compiling the steps beside the plain ones failed; these go on serving: %s", exc)
            if on_failure is not None:
                on_failure(exc)
            return
        finally:
            sys.setswitchinterval(interval)
        engine.adopt(steps)
        if on_ready is not None:
            on_ready(time.perf_counter() - t)

    thread = threading.Thread(target=run, name="omni-compile", daemon=True)
    thread.start()
    return thread
