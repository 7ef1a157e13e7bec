"""What a face shows on the terminal: the two rich consoles, the loading spinner, streamed text with word
wrap, and the sound devices' list.

Two consoles: `out` for the answer (stdout) and `err` for everything else (stderr). A console made
with `file=None` looks up `sys.stdout` / `sys.stderr` each time it writes, so it follows
prompt_toolkit's `patch_stdout` while a prompt is on screen. `TextOut` is where omni-say's reply text
streams (stdout, or stderr when stdout carries WAV); `StreamWrapper` wraps words as they stream.

The terminal shows text, not control sequences: whatever a model, a server or a file says (a reply, a
model's name, a transcript's paths, an error's message) goes through `shown` (or `print_text`, on a
rich console: never read as markup either), which escapes what would control a terminal
(`terminal_text`) when the stream is one, and leaves the text exactly as it is into a pipe or a file.

It knows nothing of models or of the engine; rich is imported when used.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Iterator

from ..errors import OmniError, StdoutClosed
from .program import err_line, silence_stdout


# What would control a terminal rather than show on it: C0 but newline and tab (ESC begins colours, cursor
# moves, clear-screen, window titles, hyperlinks; BEL, BS and CR move or sound), DEL, C1 (0x9b is a
# one-byte CSI to many terminals), and the bidi embeddings, overrides and isolates that reorder what
# follows them (Trojan Source). CR is dropped (a "\r\n" shows as the newline it is; a lone "\r" would
# let text overwrite its own line); the others are shown escaped, as Python writes them (\x1b, \u202e).
_CONTROLS = ({c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)) if chr(c) not in "\n\t"}
             | {c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}
             | {0x0D: None})


def terminal_text(text: str) -> str:
    """`text` made safe to show on a terminal: characters that would control it (see _CONTROLS) escaped
    (ESC as `\x1b`) or dropped (CR); every other character, newline and tab included, as it is. Only
    for text going to a terminal: a pipe or a file gets the text as the model made it (`shown`)."""
    return text.translate(_CONTROLS)


def shown(text: str, stream: Any) -> str:
    """`text` as it should be written to `stream`: `terminal_text(text)` on a terminal, else unchanged.
    The one check that every place writing untrusted text (a reply, a server's or a transcript's names,
    a path, an error's message) goes through."""
    return terminal_text(text) if isatty(stream) else text


def print_text(console: Any, text: str, style: str | None = None, end: str = "\n") -> None:
    """Print untrusted `text` (a name, a path, a message) on a rich `console` as text: never read as rich
    markup, and shown safely on a terminal (`shown`)."""
    console.print(shown(text, console.file), style=style, end=end, markup=False, highlight=False)


def isatty(stream) -> bool:
    """Whether `stream` is a terminal (False for None, a closed stream, or a test's StringIO)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


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
        reconfigure = getattr(stream, "reconfigure", None)  # not on a test's StringIO
        if reconfigure is not None:
            with contextlib.suppress(ValueError):
                reconfigure(errors="replace")


@contextlib.contextmanager
def loading(err, what: str, enabled: bool = True) -> Iterator[Any]:
    """A spinner on stderr naming what is being loaded (only on a terminal; silent otherwise). It yields
    the `progress(done, total)` callback of long work inside the load (--quantize packing layers): the
    spinner then gives way to a bar (rich's), gone once the load ends."""
    if not enabled or not err.is_terminal:
        yield None
        return
    from rich.text import Text

    start = time.perf_counter()
    bar: dict[str, Any] = {}  # the rich Progress and its task, once the load reports progress

    # `what` names a path or a server's model: text, not markup, and no control characters
    with err.status(Text(f"Loading {terminal_text(what)}..."), spinner="dots") as status:
        def progress(done: int, total: int) -> None:
            if "progress" not in bar:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                status.stop()  # one live display at a time
                bar["progress"] = Progress(TextColumn("packing layers"), BarColumn(), MofNCompleteColumn(),
                                           TimeElapsedColumn(), console=err, transient=True)
                bar["progress"].start()
                bar["task"] = bar["progress"].add_task("pack", total=total)
            bar["progress"].update(bar["task"], completed=done, total=total)

        try:
            yield progress
        finally:
            if "progress" in bar:
                bar["progress"].stop()
    print_text(err, f"Loaded {what} in {time.perf_counter() - start:.1f} s", style="dim")


def model_label(model: str | None) -> str:
    """What the spinner names before the model is resolved."""
    if model:
        return f"model {model}"
    env = os.environ.get("OMNI_MODEL", "").strip()
    if env:
        return f"model {env} (from OMNI_MODEL)"
    return "the built-in tiny demo model"



def consoles():

    return make_console("stdout"), make_console("stderr")


class TextOut:
    """Where the reply's text streams: stdout, or stderr when stdout carries the WAV, or nowhere."""

    def __init__(self, stream) -> None:

        self.stream = stream
        self.terminal = isatty(stream)  # the reply's text is shown safely there (terminal_text), else as it is
        self.written = False
        self.stopped = False  # abort(): an interrupted reply prints nothing more
        # On a terminal, words wrap at its width as they stream; a pipe or a file gets the text as is.
        width = terminal_width(stream) if stream is not None else None
        self.wrapper = StreamWrapper(width) if width else None

    def write(self, text: str) -> None:
        if self.terminal:
            text = terminal_text(text)  # before the wrapper, which counts the cells as they will show
        if self.wrapper is not None:
            text = self.wrapper.feed(text)
        self._write(text)

    def abort(self) -> None:
        """Print nothing more (a Ctrl-C came: the text stops where it was, as the sound does)."""
        self.stopped = True

    def _write(self, text: str) -> None:
        if self.stream is None or not text or self.stopped:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except BrokenPipeError as exc:  # `omni-say ... | head -c 5`: the reader has what it wanted
            silence_stdout()
            raise StdoutClosed("stdout was closed before the reply was written") from exc
        self.written = True

    def end(self) -> None:
        if self.stopped:  # only the line's end, so that what is said next starts a line of its own
            self.stopped = False
            if self.stream is not None and self.written:
                self._write("\n")
            return
        if self.wrapper is not None:
            self._write(self.wrapper.end())
        if self.stream is not None and self.written:
            self._write("\n")


def print_audio_devices() -> None:
    """The sound output devices (what plays), then the input devices (what /listen records from) under
    an `inputs:` line when there are any."""
    from ..audio.microphone import input_devices
    from ..audio.speaker import output_devices

    outputs = output_devices()
    if not outputs:
        err_line("no audio output devices")
    for dev in outputs:
        _device_line(dev)
    try:
        inputs = input_devices()
    except OmniError:
        inputs = []
    if inputs:
        print("inputs:", flush=True)
    for dev in inputs:
        _device_line(dev)


def _device_line(dev: dict) -> None:
    mark = "  (default)" if dev["default"] else ""
    api = f"{dev['hostapi']}, " if dev["hostapi"] else ""
    line = f"{dev['index']:>3}  {dev['name']}  [{api}{dev['channels']} ch, {dev['samplerate']:.0f} Hz]{mark}"
    print(shown(line, sys.stdout), flush=True)  # the names are the sound system's



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

