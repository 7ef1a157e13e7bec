"""The terminal side: rich consoles, the loading spinner, the timing block, Ctrl-C during a reply,
and the prompt_toolkit session of omni-chat (history file, key bindings).

Two consoles: `out` for the answer (stdout) and `err` for everything else (stderr). A console made
with `file=None` looks up `sys.stdout` / `sys.stderr` each time it writes, so it follows
prompt_toolkit's `patch_stdout` while a prompt is on screen.

`stop_on_interrupt(sink)` is how a Ctrl-C stops a reply within milliseconds: while a reply runs, a
SIGINT handler aborts the speaker sink right away (the sound stops), then raises KeyboardInterrupt
so the caller closes the reply's event stream (which stops the engine's threads).

It knows nothing of models or of the engine (`speech_steps` reads what an assistant says of its talker's
steps, for the wording); rich and prompt_toolkit are imported when used.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .config import env_flag

# Turns the chat's history file off when set to anything but "" or "0" (like OLLAMA_NOHISTORY).
NO_HISTORY_ENV = "OMNI_NOHISTORY"


def make_console(stream: str = "stdout", file: Any = None, force_terminal: bool | None = None):
    """A rich Console on `file`, or on sys.stdout / sys.stderr looked up at each write."""
    from rich.console import Console

    return Console(
        file=file,
        stderr=(stream == "stderr"),
        highlight=False,
        soft_wrap=True,
        force_terminal=force_terminal,
        emoji=False,
    )


def safe_text_streams() -> None:
    """Random-weight models decode to odd characters: never let printing them fail."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="replace")
        except (AttributeError, ValueError):
            pass


@contextlib.contextmanager
def loading(err, what: str, enabled: bool = True) -> Iterator[None]:
    """A spinner on stderr naming what is being loaded (only on a terminal; silent otherwise)."""
    if not enabled or not err.is_terminal:
        yield
        return
    start = time.perf_counter()
    with err.status(f"Loading {what}...", spinner="dots"):
        yield
    err.print(f"[dim]Loaded {what} in {time.perf_counter() - start:.1f} s[/dim]")


def model_label(model: str | None) -> str:
    """What the spinner names before the model is resolved."""
    if model:
        return f"model {model}"
    env = os.environ.get("OMNI_MODEL", "").strip()
    if env:
        return f"model {env} (from OMNI_MODEL)"
    return "the built-in tiny demo model"


def _fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def speech_steps(assistant: Any) -> tuple[str, float | None]:
    """(name, steps per second of audio) of the talker's steps of `assistant`'s model, for what people
    read: ("codes", 50.0) for Qwen2.5-Omni, ("frames", 12.5) for Qwen3-Omni (`Assistant.speech_steps`);
    ("codes", None) for an assistant that does not say."""
    return getattr(assistant, "speech_steps", ("codes", None))


def timing_lines(stats: dict, playback: dict | None = None, played: bool = False,
                 unit: str = "codes") -> list[tuple[str, str]]:
    """(label, value) rows of the --verbose timing block for one reply's stats (+ the speaker's); `unit`
    names the talker's steps (`speech_steps`: "codes" or "frames")."""
    rows = [
        ("time to first text", _fmt_seconds(stats.get("time_to_first_text"))),
        ("time to first audio", _fmt_seconds(stats.get("time_to_first_audio"))),
    ]
    if playback and playback.get("start_delay") is not None:
        rows.append(("time to first sound", _fmt_seconds(playback["start_delay"])))
    if playback and playback.get("start_reason"):
        # The speaker's adaptive start: how long it held the first audio back, and why.
        queued = playback.get("start_buffered")
        detail = playback["start_reason"] + (f", {queued:.2f} s queued" if queued is not None else "")
        rate = playback.get("production_rate")
        if rate is not None and rate < 100:  # above that, the first block came at once: no estimate yet
            detail += f", audio made at {rate:.2f}x real time"
        rows.append(("playback waited", f"{_fmt_seconds(playback.get('start_wait'))} ({detail})"))
    audio = stats.get("audio_seconds") or 0.0
    # "audio_done": when the last audio block was handed over (set by the CLI); the engine's total_time
    # also counts the wait for the speaker to play out, which is not generation time.
    made_in = stats.get("audio_done", stats.get("total_time"))
    if audio and made_in is not None:
        rows.append(("real-time factor", f"{made_in / audio:.2f} ({audio:.1f} s of audio made in {made_in:.2f} s)"))
    else:
        rows.append(("real-time factor", "- (no audio)"))
    shown = stats.get("images_in")
    if shown:
        enc = stats.get("image_encoder_ms")
        rows.append(("images in", f"{shown}" + (f" (encoder {enc:.0f} ms, in the prefill)" if enc is not None else "")))
    heard = stats.get("audio_in_seconds")
    if heard:
        enc = stats.get("audio_encoder_ms")
        rows.append(("audio in", f"{heard:.1f} s" + (f" (encoder {enc:.0f} ms, in the prefill)" if enc is not None else "")))
    th = stats.get("thinker_ms_per_token")
    tk = stats.get("talker_ms_per_step")
    rows.append(("text tokens", f"{stats.get('text_tokens', 0)}" + (f" ({th:.1f} ms/token)" if th else "")))
    rows.append((f"speech {unit}", f"{stats.get('codes', 0)}" + (f" ({tk:.1f} ms/step)" if tk else "")))
    if playback is not None:
        rows.append(("underruns", f"{playback['underruns']} ({playback['underrun_seconds'] * 1000:.0f} ms of silence)"))
        if playback.get("device_underflows"):
            rows.append(("device underflows", str(playback["device_underflows"])))
    else:
        rows.append(("underruns", "- (not playing)"))
    return rows


class AudioClock:
    """Notes when the last audio block of a reply arrived, to tell generation time from playback time."""

    def __init__(self) -> None:
        self.last: float | None = None

    def tick(self) -> None:
        self.last = time.perf_counter()

    def stats(self, stats: dict) -> dict:
        out = dict(stats)
        if self.last is not None and stats.get("started_at") is not None:
            out["audio_done"] = self.last - stats["started_at"]
        return out


def print_timing(err, stats: dict, playback: dict | None = None, title: str = "timing", unit: str = "codes") -> None:
    rows = timing_lines(stats, playback, unit=unit)
    width = max(len(label) for label, _ in rows)
    err.print(f"[dim]-- {title}[/dim]")
    for label, value in rows:
        err.print(f"[dim]{label.ljust(width)}  {value}[/dim]")


BYTECODE_ENV = "OMNI_NO_PYCACHE"  # 1: leave Python's "write no bytecode" as it is (see cache_bytecode)
_bytecode_later: str | None = None  # the folder write_bytecode_later fills, when this start wrote none

# The background writer: it reads the whole list first (so that the program's write returns at once),
# then compiles each source into the folder -X pycache_prefix names, at the lowest CPU priority.
_WRITER = """
import os, sys, py_compile
files = sys.stdin.read().split("\\n")
if hasattr(os, "nice"):
    os.nice(19)
for file in files:
    try:
        py_compile.compile(file, doraise=True)
    except Exception:
        pass
"""


def cache_bytecode() -> str | None:
    """When Python was told to write no bytecode (PYTHONDONTWRITEBYTECODE, usual in container images)
    and the installed torch ships none, every start compiles torch's and transformers' Python sources
    again: on the H200 machines this project measures on, importing them took 12-17 s each time, and
    6.4 s once their bytecode was kept. So the programs keep it, in `~/.cache/omni_cli/pycache` (under
    `$XDG_CACHE_HOME` if set; `$PYTHONPYCACHEPREFIX` if the user set one), never beside the sources the
    setting kept clean: ~100 MB. Nothing changes where bytecode is written anyway, or with
    OMNI_NO_PYCACHE=1. Call it before torch is imported.

    The first start (no such folder yet) writes none: writing ~3,700 files while the weights come from a
    cold disk made a fresh start of the 7B model 0.4-6.7 s longer (three pairs on H200 machines, page cache
    dropped). `write_bytecode_later` then writes them on a background process, once the model is
    loaded. Returns the folder, or None when it did nothing."""
    global _bytecode_later
    if not sys.dont_write_bytecode or env_flag(BYTECODE_ENV):
        return None
    if sys.pycache_prefix is None:
        from .config import cache_folder

        sys.pycache_prefix = cache_folder("pycache")
    if os.path.isdir(sys.pycache_prefix):
        sys.dont_write_bytecode = False
    else:
        _bytecode_later = sys.pycache_prefix
    return sys.pycache_prefix


def write_bytecode_later() -> None:
    """If this start wrote no bytecode (see `cache_bytecode`): write that of every module imported so far,
    on a detached process at the lowest CPU priority, so that the next start finds it. Once per process;
    it outlives the program and never reports (a file it cannot write is compiled again next time)."""
    global _bytecode_later
    prefix, _bytecode_later = _bytecode_later, None
    if prefix is None:
        return
    import subprocess

    files = sorted({f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)
                    and f.endswith(".py")})
    try:
        writer = subprocess.Popen([sys.executable, "-X", f"pycache_prefix={prefix}", "-c", _WRITER],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True, text=True)
        writer.stdin.write("\n".join(files))
        writer.stdin.close()
    except (OSError, ValueError):
        pass  # no bytecode kept: the next start compiles again, as without this


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


def print_startup(err, startup: dict, after: dict, since_command: float | None = None) -> None:
    """`--verbose`: where start-up went (the assistant's `startup` phases, in order; a name indented by
    spaces is a part of the phase above it, not counted twice), what came after it (`after`: name ->
    seconds), and how long after the command the first audio existed."""
    rows = [(name, f"{seconds:.2f} s") for name, seconds in startup.items()]
    if startup:
        rows.append(("start-up in all", f"{sum(v for k, v in startup.items() if not k.startswith(' ')):.2f} s"))
    rows += [(name, f"{seconds:.2f} s") for name, seconds in after.items()]
    if since_command is not None:
        rows.append(("first audio after the command", f"{since_command:.2f} s"))
    width = max(len(label) for label, _ in rows)
    err.print("[dim]-- start-up[/dim]")
    for label, value in rows:
        err.print(f"[dim]{label.ljust(width)}  {value}[/dim]")


# -- Ctrl-C during a reply, and the signals that end the program ------------------------------

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
        silent = []
        for sink in sinks:
            if sink is not None:
                try:
                    sink.abort()
                except Exception:
                    pass
                silent.append(getattr(sink, "silent_time", None))
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


# -- omni-chat's prompt ------------------------------------------------------------------------


def data_dir() -> Path:
    """The user's data folder for omni-cli (XDG on Linux, Application Support on macOS, APPDATA on Windows)."""
    if sys.platform == "win32":
        base = Path(os.environ.get("APPDATA") or Path.home() / "AppData" / "Roaming")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "omni-cli"


def history_disabled_by_env() -> bool:
    return env_flag(NO_HISTORY_ENV)


def default_history_file() -> Path:
    return data_dir() / "chat_history"


def make_history(path: Path | None, warn: Callable[[str], None]):
    """A prompt_toolkit FileHistory at `path` (its folder made), or in-memory history if None or unusable."""
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    if path is None:
        return InMemoryHistory()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        warn(f"warning: cannot keep the input history in {path} ({exc.strerror or exc}); it lasts this session only")
        return InMemoryHistory()
    return FileHistory(str(path))


def make_session(history, input=None, output=None):
    """The prompt_toolkit session of omni-chat: `>>> ` prompts, history, Ctrl-C / Ctrl-D as usual, and
    Ctrl-T on an empty line for /listen (speak instead of typing)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("c-t")
    def _listen(event) -> None:
        buffer = event.app.current_buffer
        if not buffer.text.strip():
            buffer.text = "/listen"
            buffer.validate_and_handle()

    return PromptSession(history=history, input=input, output=output, enable_history_search=False,
                         mouse_support=False, complete_while_typing=False, key_bindings=keys)


# -- word wrap of streamed text ----------------------------------------------------------------


def terminal_width(stream: Any) -> int | None:
    """The width to wrap text written to `stream` at: its terminal's columns, or None when it is not a
    terminal (a pipe or a file gets the text as the model wrote it)."""
    try:
        if not stream.isatty():
            return None
        return os.get_terminal_size(stream.fileno()).columns or None
    except (AttributeError, ValueError, OSError):
        return None


class StreamWrapper:
    """Word wrap for text that arrives in pieces (a reply's tokens), at `width` terminal cells.

    `feed(piece)` returns what can be printed now; `end()` returns the rest. A word is held back until
    it is complete (a space, a newline or the end comes), because only then is it known whether it
    still fits on the current line; so the text lags by at most one word. The terminal itself would
    wrap in the middle of a word; here a word moves to the next line whole when it fits on one, and a
    word longer than a line is broken hard (as soon as it is that long, so it is not held back either).

    - Spaces where a line is broken are dropped; spaces inside a line, and indentation after a newline
      in the text, are kept. Trailing spaces before a newline are dropped (they cannot be seen).
    - "\\n" (and "\\r") in the text end the line and reset the column.
    - Width is counted in cells (a CJK character or an emoji takes two), and a wide character may be
      broken before or after like a word of its own (Chinese and Japanese have no spaces).
    - A tab counts as spaces to the next multiple of 8, as terminals show it.
    """

    TAB = 8

    def __init__(self, width: int) -> None:
        from rich.cells import get_character_cell_size

        if width < 1:
            raise ValueError(f"width must be at least 1 (got {width})")
        self.width = int(width)
        self._cells = get_character_cell_size
        self.column = 0  # cells already printed on the current line
        self._spaces = ""  # a run of blanks not printed yet (it may become the line break)
        self._word = ""  # the word being built, not printed yet
        self._word_cells = 0

    def feed(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            if ch in "\n\r":
                self._flush(out)
                self._spaces = ""  # trailing blanks are invisible: not worth a wrapped empty line
                out.append(ch)
                self.column = 0
            elif ch == " " or ch == "\t":
                self._flush(out)
                if ch == "\t":
                    at = self.column + len(self._spaces)
                    self._spaces += " " * (self.TAB - at % self.TAB)
                else:
                    self._spaces += ch
            elif self._cells(ch) > 1:  # a wide character is a word of its own
                self._flush(out)
                self._word, self._word_cells = ch, self._cells(ch)
                self._flush(out)
            else:
                self._word += ch
                self._word_cells += self._cells(ch)
                if self._word_cells > self.width:
                    self._break_long_word(out)
        return "".join(out)

    def end(self) -> str:
        """The held-back word; the column is then that of the text printed so far."""
        out: list[str] = []
        self._flush(out)
        self._spaces = ""
        return "".join(out)

    # -- inside ------------------------------------------------------------------------------------
    def _flush(self, out: list[str]) -> None:
        """Print the pending blanks and word: on this line if they fit, else the word on the next."""
        if not self._word:
            return
        if self.column > 0 and self.column + len(self._spaces) + self._word_cells > self.width:
            out.append("\n")  # the blanks become the line break
            self.column = 0
            self._spaces = ""
        elif self.column == 0 and len(self._spaces) + self._word_cells > self.width:
            self._spaces = ""  # indentation that leaves no room for the word: the word wins
        self._put(self._spaces + self._word, out)
        self._spaces, self._word, self._word_cells = "", "", 0

    def _break_long_word(self, out: list[str]) -> None:
        """The pending word is wider than a line: it breaks wherever it starts, so it starts here."""
        if self.column > 0:
            if self.column + len(self._spaces) >= self.width:
                out.append("\n")
                self.column = 0
                self._spaces = ""
        chunk, self._spaces = self._spaces + self._word, ""
        # Print whole lines of it; the last part stays pending (the word may go on in the next piece).
        cells = self.column
        lines: list[str] = []
        start = 0
        for i, ch in enumerate(chunk):
            w = self._cells(ch)
            if cells + w > self.width:
                lines.append(chunk[start:i])
                start, cells = i, 0
            cells += w
        for line in lines:
            out.append(line + "\n")
            self.column = 0
        self._word = chunk[start:]
        self._word_cells = sum(self._cells(c) for c in self._word)

    def _put(self, chunk: str, out: list[str]) -> None:
        """Print `chunk` from the current column, breaking hard at the width (indentation that does not
        fit, a wide character at the last column)."""
        start = 0
        for i, ch in enumerate(chunk):
            w = self._cells(ch)
            if self.column + w > self.width and self.column > 0:
                out.append(chunk[start:i] + "\n")
                start, self.column = i, 0
            self.column += w
        out.append(chunk[start:])
