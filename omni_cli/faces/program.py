"""The program around every face: how a command ends, and what it shows of the library on the way.

- `run(app, name)`: runs a typer app as an installed program (bytecode kept, the process ended at once
  when a worker thread may still be inside torch, whose tear-down would abort it).
- `fail` / `exit_on`: any exception becomes one line on stderr and an exit code (2 usage, 1 runtime,
  130 Ctrl-C, 128+N for SIGTERM/SIGHUP, 141 for a reader of stdout that went away); a traceback only
  with `--debug`.
- `report_library_logs`: the library logs and never prints; while a command runs its records are
  `note: ...` (not with --quiet) and `warning: ...` lines on stderr.
- Signals: `end_on_signals` (SIGTERM and SIGHUP end a command as Ctrl-C does), `stop_on_interrupt`
  (a Ctrl-C during a reply silences the sinks at once, then raises KeyboardInterrupt so the caller
  closes the reply's event stream), and `end_quietly_on_signals` (once the command is over, a late
  signal ends the process at once with 130 / 128+N, never a traceback).

It knows nothing of models, of options or of what a face does; it imports typer, nothing heavier.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Iterator

import typer

from ..errors import OmniError, StdoutClosed, known_failure


def err_line(message: str) -> None:
    """`message` as one line on stderr, shown safely when stderr is a terminal (console.shown: a path,
    a server's message or a library's note may hold control characters)."""
    from .console import shown  # console imports this module

    print(shown(message, sys.stderr), file=sys.stderr, flush=True)


class _LineHandler(logging.Handler):
    """The library's log records as one line each on stderr: INFO as `note: ...`, WARNING and above as
    `warning: ...`. sys.stderr is looked up at each record (CliRunner and `-o -` swap streams)."""

    def emit(self, record: logging.LogRecord) -> None:
        kind = "note" if record.levelno < logging.WARNING else "warning"
        with contextlib.suppress(Exception):  # after SIGHUP the terminal may be gone: never fail for a note
            err_line(f"{kind}: {' '.join(record.getMessage().split())}")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning for the faces: one `warning: ...` line, no source line."""
    with contextlib.suppress(Exception):
        err_line(f"warning: {' '.join(str(message).split())}")


_saved_logging: list = []  # (logger level, warnings.showwarning) to restore; empty when not reporting


def report_library_logs(quiet: bool = False) -> None:
    """While a command runs, show what the library logs (it never prints): notes unless `quiet`,
    warnings always; Python warnings as one line too. Undone by `stop_reporting_library_logs`."""
    import warnings

    stop_reporting_library_logs()
    logger = logging.getLogger("omni_cli")
    _saved_logging.append((logger.level, warnings.showwarning))
    logger.addHandler(_LineHandler(logging.WARNING if quiet else logging.INFO))
    logger.setLevel(logging.INFO)
    warnings.showwarning = _show_warning


def stop_reporting_library_logs() -> None:
    import warnings

    logger = logging.getLogger("omni_cli")
    for old in [h for h in logger.handlers if isinstance(h, _LineHandler)]:
        logger.removeHandler(old)
    while _saved_logging:
        level, show = _saved_logging.pop()
        logger.setLevel(level)
        warnings.showwarning = show


def fail(exc: BaseException, debug: bool) -> int:
    """Report an exception on stderr; the exit code to end with."""
    if isinstance(exc, KeyboardInterrupt):
        code = getattr(exc, "exit_code", 130)  # ui.Terminated: 128 + SIGTERM/SIGHUP's number
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            err_line("interrupted" if code == 130 else f"terminated (signal {code - 128})")
        return code
    if _stdout_went_away(exc):
        silence_stdout()
        return StdoutClosed.exit_code  # quietly, as `yes | head` does: the reader has what it wanted
    exc = known_failure(exc)
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, OmniError):
        err_line(f"error: {' '.join(str(exc).split())}")
        return int(getattr(exc, "exit_code", 1))
    detail = " ".join(str(exc).split())
    hint = "" if debug else " (run with --debug for the traceback)"
    err_line(f"error: internal error: {type(exc).__name__}: {detail}{hint}")
    return 1


def _stdout_went_away(exc: BaseException) -> bool:
    """Did `exc` come from writing to a stdout whose reader is gone (EPIPE), directly or as the cause
    of a sink's OutputError (the WAV stream on `-o -`), however far down the chain?"""
    seen = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, (StdoutClosed, BrokenPipeError)):
            return True
        link = link.__cause__ or link.__context__
    return False


def abort_all(sinks) -> None:
    """Abort each sink (None skipped); one that fails to abort does not keep the others from it."""
    for sink in sinks:
        if sink is not None:
            with contextlib.suppress(Exception):
                sink.abort()


def exit_on(exc: BaseException, debug: bool, sinks=(), interrupt=None) -> None:
    abort_all(sinks)
    if isinstance(exc, KeyboardInterrupt) and interrupt is not None and interrupt.signal_at is not None:

        now = time.perf_counter()
        code = getattr(exc, "exit_code", 130)
        with contextlib.suppress(OSError):
            err_line(f"{'interrupted' if code == 130 else 'terminated'}: silent after "
                 f"{((interrupt.silenced_at or now) - interrupt.signal_at) * 1000:.0f} ms, "
                 f"generation stopped after {(now - interrupt.signal_at) * 1000:.0f} ms")
        raise typer.Exit(code) from None
    raise typer.Exit(fail(exc, debug)) from None


def silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass


def run(app, name: str) -> None:
    """Run a typer app as a program. After an interrupt the engine may leave its vocoder thread
    finishing a chunk inside torch; letting the interpreter tear down under it aborts the process
    ("terminate called without an active exception"), so then the process ends at once instead."""
    from ..bytecode import cache_bytecode, write_bytecode_later

    cache_bytecode()  # before torch is imported
    try:
        try:
            app(prog_name=name)
        finally:
            # The command is over (its file renamed, "wrote" said): from here to the process's end (click's
            # own exit, the bytecode, atexit, torch's finalizers) a signal ends it quietly, not with a traceback.
            end_quietly_on_signals()
    except KeyboardInterrupt as exc:  # a signal that came after the command's own handling, before the line above
        exit_quietly(getattr(exc, "exit_code", 130))
    except SystemExit as exc:
        write_bytecode_later()  # a command that loaded no model (through a server, --help, ...)
        exit_at_once_if(lambda t: t.name.startswith("omni-"), exc)
        raise


def exit_at_once_if(picked, exc: SystemExit) -> None:
    """End the process now, with `exc`'s code and the streams flushed, if a live thread is `picked`: one
    that may be inside torch, under which the interpreter's tear-down can abort the process."""

    if any(picked(t) and t.is_alive() for t in threading.enumerate()):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)



def exit_quietly(code: int) -> None:
    """End the process now with `code`, the streams flushed, nothing more said (no atexit, no finalizers:
    what the command wrote is already whole)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _exit_on_late_signal(signum, frame) -> None:
    exit_quietly(130 if signum == signal.SIGINT else 128 + int(signum))


def end_quietly_on_signals() -> None:
    """From now on SIGINT, SIGTERM and SIGHUP end the process at once with 130 / 128+N and no traceback
    (a signal 0-20 ms after "wrote" landed in click's exit or the interpreter's atexit handlers, and its
    KeyboardInterrupt or `Terminated` was printed as a traceback with exit 0). Signals that were ignored
    stay ignored. Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, *ENDING_SIGNALS):
        with contextlib.suppress(OSError, ValueError):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, _exit_on_late_signal)


def process_started_at() -> float | None:
    """When this process began, on the `time.perf_counter()` clock (Linux: from /proc, to 10 ms), so that
    `--verbose` can count the interpreter's start and the imports before our code ran; None elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start, in ticks after boot
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.perf_counter() - age if 0 <= age < 3600 else None


# SIGTERM (kill) and SIGHUP (the terminal closed) end a command as Ctrl-C does, with exit 128+N.
ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: stop like Ctrl-C (sound off, threads ended, no partial file), then
    leave the program with exit code 128 + the signal's number. A KeyboardInterrupt, so every clean-up
    path written for Ctrl-C runs; omni-chat does not stay at its prompt for it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def end_on_signals() -> None:
    """From now on SIGTERM and SIGHUP raise `Terminated` in the main thread (instead of killing the
    process outright, which would leave a WAV's temp file behind). Signals that were ignored when the
    program started (nohup, a background job) stay ignored. Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in ENDING_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _raise_terminated)


class InterruptTimes:
    """When a Ctrl-C came and when the sound stopped (perf_counter), for --verbose and the tests."""

    def __init__(self) -> None:
        self.signal_at: float | None = None
        self.silenced_at: float | None = None


@contextlib.contextmanager
def stop_on_interrupt(*sinks: Any, times: InterruptTimes | None = None) -> Iterator[InterruptTimes]:
    """While inside: SIGINT aborts `sinks` at once (sound off), then raises KeyboardInterrupt; SIGTERM
    and SIGHUP do the same and raise `Terminated` (when they are not ignored).

    Only in the main thread (signals are delivered there); elsewhere it does nothing.
    """
    times = times if times is not None else InterruptTimes()
    if threading.current_thread() is not threading.main_thread():
        yield times
        return
    # Started in the background with SIGINT ignored (or nohup for SIGHUP): keep such signals ignored.
    watched = [s for s in (signal.SIGINT, *ENDING_SIGNALS) if signal.getsignal(s) is not signal.SIG_IGN]

    def handler(signum, frame):
        again = times.signal_at is not None
        if not again:
            times.signal_at = time.perf_counter()
        abort_all(sinks)
        silent = [getattr(sink, "silent_time", None) for sink in sinks if sink is not None]
        if again and signum == signal.SIGINT:
            return  # the reply is already being stopped: a second Ctrl-C must not cut its clean-up short
        times.silenced_at = times.silenced_at or max((t for t in silent if t is not None), default=time.perf_counter())
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    previous = {s: signal.getsignal(s) for s in watched}
    for s in watched:
        signal.signal(s, handler)
    try:
        yield times
    finally:
        for s, old in previous.items():
            signal.signal(s, old)

