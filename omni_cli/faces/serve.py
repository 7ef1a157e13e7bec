"""`omni-serve`: one model loaded once and kept, behind the OpenAI-compatible chat completions API
(api/server.py), on 127.0.0.1:8484 by default. omni-say and omni-chat use it when it answers there for
the same model (or with `--server URL`).

Flags: the model and device flags of the other commands, the reply defaults (sampling, limits; a
request's own fields win), `--host`, `--port`, `--api-key` (or $OMNI_API_KEY). Without a key the server
listens on a loopback address only: another host is a usage error (exit 2), since anyone who can reach
it could use the GPU; it then answers only requests made to a loopback name and from no other web site
(api/server.py's `Guard`). `--max-body-mb` caps a request's body; a client must send its request's head
within 10 s and may keep at most 64 connections open (api/connections.py; `Limits`). Ctrl-C or SIGTERM
stop it cleanly: the reply in progress is stopped and its stream ended (a last chunk, `[DONE]`), the
queued requests refused (503), the engine's worker joined, the port freed; exit 130 (Ctrl-C) or 143.
`--keep-alive DURATION` stops it after that long without a request (omni-say starts it so in the
background: api/keep_alive.py). On a GPU it serves at once with plain CUDA graphs and compiles its steps
in the background, taking them between two requests (`Assistant.compile_beside`, runtime/beside.py);
`--compile` compiles before serving, `--no-compile` never.

It is a face: flags in, the app served by uvicorn; no model logic.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated, Optional

import typer

from ..api.protocol import DEFAULT_PORT, is_loopback
from ..config import ReplyOptions
from ..errors import UsageError
from ..limits import DEFAULT as DEFAULT_LIMITS
from ..limits import MiB
from . import connect
from .console import make_console
from .options import (
    AttentionKernelOpt, CodesCapacityOpt, DebugOpt, DeviceOpt, DtypeOpt, GraphsOpt, GreedyOpt, MaxCodesOpt, KernelsOpt, QuantizeOpt, GroupSizeOpt, MaxContextOpt, MaxTextOpt, ModelOpt,
    OneLineErrors, SeedOpt, TemperatureOpt, TopKOpt, TopPOpt, VersionOpt, make_app, runtime_options,
)
from .program import end_on_signals, err_line, exit_at_once_if, exit_on, process_started_at, report_library_logs

serve_app = make_app(
    "omni-serve",
    "Keep a Qwen-Omni model loaded and serve it with the OpenAI-compatible chat completions API "
    "(text and streamed speech); omni-say and omni-chat use it when it runs.")


@serve_app.command(cls=OneLineErrors)
def serve(
    model: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", metavar="ADDRESS", help="Address to listen on (another than loopback needs --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, metavar="PORT", help="Port to listen on (0: any free one).")] = DEFAULT_PORT,
    api_key: Annotated[Optional[str], typer.Option("--api-key", metavar="KEY", show_default=False, envvar="OMNI_API_KEY", help="Every request must carry Authorization: Bearer KEY (default: $OMNI_API_KEY; none: loopback only).")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    graphs: GraphsOpt = True,
    kernels: KernelsOpt = True,
    quantize: QuantizeOpt = None,
    group_size: GroupSizeOpt = None,
    attention_kernel: AttentionKernelOpt = True,
    codes_capacity: CodesCapacityOpt = None,
    compile: Annotated[Optional[bool], typer.Option(
        "--compile/--no-compile", show_default=False,
        help="--compile: torch.compile the decode steps and the vocoder before serving (a minute or more the "
        "first time; cached). --no-compile: never. Default (GPU, with graphs): serve at once with plain CUDA "
        "graphs and compile in the background, switching to the compiled steps between two requests.")] = None,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    max_text_tokens: MaxTextOpt = None,
    max_codes: MaxCodesOpt = None,
    max_context: MaxContextOpt = 4096,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", min=0.001, metavar="MB", help="The largest request body taken, in MiB (media included, as base64); a larger one is refused (413) before it is read.")] = DEFAULT_LIMITS.body_bytes / MiB,
    keep_alive: Annotated[Optional[str], typer.Option("--keep-alive", metavar="DURATION", show_default=False, help="Stop after DURATION without a request (e.g. 300, 5m, 1h; default: run until stopped).")] = None,
    warm_up: Annotated[bool, typer.Option("--warm-up/--no-warm-up", help="Answer one short unheard request before serving, so that the first request is served as fast as the later ones.")] = True,
    debug: DebugOpt = False,
    version: VersionOpt = False,
) -> None:
    """Serve a model on http://HOST:PORT/v1 (OpenAI-compatible: /v1/chat/completions, /v1/models, /health)."""
    import time

    t_command = time.perf_counter()
    t_process = process_started_at()
    # SIGTERM (kill, the keep-alive replacing it) ends it as Ctrl-C does: uvicorn shuts down, then raises
    # the signal again, which then unwinds through `_serve`'s clean-up (the record forgotten) to exit 143.
    end_on_signals()
    report_library_logs()
    try:
        api_key = api_key or None
        if not is_loopback(host) and api_key is None:
            raise UsageError(f"refusing to listen on {host} without --api-key (or OMNI_API_KEY): anyone who can "
                             "reach it could use this machine; give a key, or keep the default 127.0.0.1")
        defaults = ReplyOptions(seed=seed, greedy=greedy, temperature=temperature, top_p=top_p, top_k=top_k,
                                max_text_tokens=max_text_tokens, max_codes=max_codes).check()
        from ..api.keep_alive import parse_duration, record_self

        idle = parse_duration(keep_alive) if keep_alive else None
        import socket

        runtime = runtime_options(device, dtype, graphs, bool(compile), max_context, kernels, attention_kernel,
                                  codes_capacity, quantize, group_size)
        listener = _listen(host, port, socket)  # a port in use is an error before a minute of loading
        # Started by omni-say's keep-alive: its record, now it listens (with how it packs the weights: a command
        # asking for other weights must not be handed this server).
        record_self(listener.getsockname()[1], model, quantize=runtime.quantize)
        connect.check_model(model)
        where = connect.Where(model=model, runtime=runtime)
        assistant = connect.load(where, make_console("stderr"), t_command, "before loading")
        if t_process is not None:
            assistant.startup = {"start Python, import omni-serve": t_command - t_process, **assistant.startup}
        if warm_up:
            t = time.perf_counter()
            assistant.warm_up()  # so that the first request is served like the later ones
            assistant.startup["the warm-up reply"] = time.perf_counter() - t
        from dataclasses import replace

        limits = replace(DEFAULT_LIMITS, body_bytes=int(max_body_mb * MiB))
        _serve(assistant, model, listener, api_key, defaults, idle, beside=compile is None, now=warm_up,
               limits=limits)
    except BaseException as exc:  # noqa: BLE001 - every way out is reported, none with a traceback
        if isinstance(exc, (SystemExit, typer.Exit)):
            raise
        exit_on(exc, debug)


def _listen(host: str, port: int, socket):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another omni-serve running? "
                         "pick another --port)") from None
    from ..api.connections import BACKLOG

    sock.listen(BACKLOG)
    return sock


def _serve(assistant, model, listener, api_key, defaults: ReplyOptions, idle: float | None = None,
           beside: bool = False, now: bool = True, limits=DEFAULT_LIMITS) -> None:
    """Serve until stopped. `beside`: compile the steps in the background (`_compile_beside`), from the
    start when `now` (the warm-up reply has run), else once the first request is answered (`--no-warm-up`:
    a request is likely waiting already, and the compiler would slow its reply)."""
    import threading

    from ..api import connections
    from ..api.client import model_key
    from ..api.server import create_app

    app = create_app(assistant, assistant.name, api_key=api_key, key=model_key(model), defaults=defaults,
                     limits=limits)
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    err_line(f"omni-serve: {assistant.name} at http://{shown}:{port}/v1 (OpenAI-compatible chat completions)"
         + ("" if api_key else " · loopback only, no API key") + " · Ctrl-C to stop")
    # The grace period only matters if a stopped reply does not end (`stop_replies` ends them first).
    config = connections.config(app, limits, log_level="warning", timeout_graceful_shutdown=5, lifespan="on",
                                access_log=bool(os.environ.get("OMNI_ACCESS_LOG")))
    server = connections.Server(config, before_shutdown=app.state.stop_replies)
    if beside:
        if now:
            _compile_beside(assistant)
        else:
            app.state.worker.after_first_job = lambda: _compile_beside(assistant)
    if idle:
        app.state.keep_alive = idle
        threading.Thread(target=_stop_when_idle, args=(server, app.state.worker, idle), name="omni-serve-idle",
                         daemon=True).start()
    try:
        server.run(sockets=[listener])
    finally:
        from ..api.keep_alive import forget

        forget(os.getpid())  # a background server's record goes with it
    logging.getLogger(__name__).debug("stopped")
    err_line("omni-serve: stopped")


def _compile_beside(assistant) -> None:
    """Start compiling the steps in the background (`Assistant.compile_beside`), saying so on stderr; a
    no-op where nothing would be compiled (a CPU, graphs off)."""
    def ready(seconds: float) -> None:
        err_line(f"omni-serve: compiled steps ready after {seconds:.0f} s; requests use them from now on")

    def failed(exc: BaseException) -> None:
        err_line(f"omni-serve: compiling in the background failed, plain CUDA graphs go on serving: {exc!r:.200}")

    try:
        thread = assistant.compile_beside(on_ready=ready, on_failure=failed)
    except RuntimeError as exc:
        err_line(f"omni-serve: not compiling in the background ({exc}); plain CUDA graphs serve (--compile: "
             "compiled before serving)")
        return
    if thread is not None:
        err_line("omni-serve: compiling the steps in the background (a minute or more the first time); plain CUDA "
             "graphs answer meanwhile (--no-compile: never; --compile: before serving)")


def _stop_when_idle(server, worker, idle: float) -> None:
    """`--keep-alive`: ask uvicorn to stop once no request of any kind (a reply, or a client that holds the
    server open pinging /health: an open omni-chat) has come, nor been queued or running, for `idle` s."""
    import time

    def seen():
        return worker.served, worker.asked

    last, before = time.monotonic(), seen()
    while not server.should_exit:
        time.sleep(min(0.5, idle))
        if worker.waiting or seen() != before:
            last, before = time.monotonic(), seen()
        elif time.monotonic() - last >= idle:
            err_line(f"omni-serve: no request for {idle:g} s, stopping")
            server.should_exit = True


def main() -> None:
    """The `omni-serve` program."""
    from ..bytecode import cache_bytecode

    cache_bytecode()  # before torch is imported
    try:
        serve_app(prog_name="omni-serve")
    except SystemExit as exc:
        sys.stdout.flush()
        # Stopped while it compiles in the background (that thread may be inside CUDA or the compiler), or
        # while an engine thread still ends a stopped reply (the worker was not joined in time): the
        # interpreter's tear-down under such a thread aborts the process ("terminate called without an
        # active exception"), so the process ends at once instead.
        exit_at_once_if(lambda t: t.name.startswith("omni-") and t.name != "omni-serve-idle", exc)
        raise exc


if __name__ == "__main__":
    main()
