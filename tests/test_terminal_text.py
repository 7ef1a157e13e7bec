"""The terminal shows text, not control sequences (issue 29): what a model, a server or a file says
(a reply, a model's name, a transcript's names and paths, an error's message) reaches a TERMINAL with
every character that would control it escaped (ESC as `\\x1b`, C1, DEL, the bidi overrides) or dropped
(CR), and is never read as rich markup; into a pipe or a file it stays exactly as the model made it.

A terminal is a pseudo-terminal here (os.openpty, in raw mode so that its bytes are read back as they
were written); the faces run in-process (CliRunner, ChatRepl) on a fake assistant that says hostile text.
"""

from __future__ import annotations

import io
import os
import select
import sys
import tty

import pytest
from conftest import invoke
from fakes import FakeAssistant
from test_chat import Session

# A window title, a clear-screen, a hyperlink, a one-byte CSI (C1), a bell, a backspace, a right-to-left
# override, DEL and a carriage return that would overwrite the line: each would act, not show.
HOSTILE = "A\x1b]0;pwned\x07B\x1b[2JC\x1b]8;;http://evil/\x1b\\link\x1b]8;;\x1b\\D\x9b31mE\x08F\u202eG\x7fH\rI"
SEQUENCES = ("\x1b]0;", "\x1b[2J", "\x1b]8;;", "\x9b", "\x07", "\x08", "\u202e", "\x7f", "\r")
SHOWN = "A\\x1b]0;pwned\\x07B\\x1b[2JC\\x1b]8;;http://evil/\\x1b\\link\\x1b]8;;\\x1b\\D\\x9b31mE\\x08F\\u202eG\\x7fHI"
MARKUP = "[bold red]not markup[/bold red] [link=http://evil/]x[/link]"


class Pty:
    """A pseudo-terminal: `file` is a text stream on its terminal side (isatty() is True), `read()` gives
    what reached it."""

    def __init__(self) -> None:
        self.master, slave = os.openpty()
        tty.setraw(slave)  # no "\n" -> "\r\n": the bytes come back as they were written
        self.file = open(slave, "w", encoding="utf-8", errors="replace")

    def read(self) -> str:
        self.file.flush()
        data = b""
        while select.select([self.master], [], [], 0.05)[0]:
            data += os.read(self.master, 1 << 16)
        return data.decode("utf-8", errors="replace")

    def close(self) -> None:
        self.file.close()
        os.close(self.master)


@pytest.fixture
def pty():
    if not hasattr(os, "openpty"):
        pytest.skip("needs a pseudo-terminal")
    terminal = Pty()
    yield terminal
    terminal.close()


def _unsafe(text: str) -> list[str]:
    return [s for s in SEQUENCES if s in text]


class Hostile(FakeAssistant):
    """The fake assistant, whose reply's text (and name) are hostile."""

    name = "evil\x1b]0;pwned\x07[red]model[/red]"

    def stream(self, prompt, options=None, **kwargs):
        from omni_cli.assistant import TextDelta

        for event in super().stream(prompt, options, **kwargs):
            if isinstance(event, TextDelta):
                event = TextDelta(HOSTILE if event.text.startswith("Hi") else " " + MARKUP)
            yield event


@pytest.mark.unit
def test_terminal_text_escapes_every_control_and_keeps_the_text():
    from omni_cli.faces.console import terminal_text

    assert terminal_text(HOSTILE) == SHOWN
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]:
        ch = chr(code)
        if ch in "\n\t":
            assert terminal_text(ch) == ch
        elif ch == "\r":
            assert terminal_text(ch) == ""
        else:
            assert terminal_text(ch) == (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    text = "plain ASCII, é, ß, 中文, emoji 🙂 and a ZWJ family 👨‍👩‍👧, tabs\tand\nnewlines, [brackets]"
    assert terminal_text(text) == text


@pytest.mark.unit
def test_text_out_escapes_on_a_terminal_and_keeps_a_pipe_exact(pty):
    from omni_cli.faces.console import TextOut

    out = TextOut(pty.file)
    out.write(HOSTILE)
    out.end()
    shown = pty.read()
    assert not _unsafe(shown) and SHOWN in shown
    pipe = io.StringIO()
    out = TextOut(pipe)
    out.write(HOSTILE)
    out.end()
    assert pipe.getvalue() == HOSTILE + "\n"


def test_omni_say_reply_into_a_pipe_is_exact_and_on_a_terminal_escaped(fake, monkeypatch):
    fake.assistant = Hostile()
    result = invoke("Hello", "--text-only")
    assert result.exit_code == 0 and result.stdout == HOSTILE + " " + MARKUP + "\n"
    from omni_cli.faces import console

    monkeypatch.setattr(console, "isatty", lambda stream: True)  # stdout a terminal (CliRunner's is not)
    result = invoke("Hello", "--text-only")
    assert result.exit_code == 0 and result.stdout == SHOWN + " " + MARKUP + "\n", result.stdout


def test_chat_reply_and_notes_on_a_terminal(pty, tmp_path):
    from omni_cli.faces.console import make_console

    s = Session(assistant=Hostile(), muted=True)
    s.repl.out = make_console("stdout", file=pty.file)
    s.repl.err = make_console("stderr", file=pty.file)
    # A transcript (a file anyone can send) whose model names and attachments are hostile.
    saved = tmp_path / "t\x1b[2J.json"
    saved.write_text('{"format": 1, "model": "other\\u001b]0;pwned\\u0007", "turns": ['
                     '{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}')
    s.run_lines("Hello", f"/load {saved}", "/show", "/nosuch\x1b[2J")  # as typed (a pipe input would eat the ESC)
    shown = pty.read()
    assert not _unsafe(shown), [s for s in SEQUENCES if s in shown]
    assert SHOWN in shown and MARKUP in shown  # the reply, escaped, and its brackets as text
    assert "saved with the model other\\x1b]0;pwned\\x07" in shown
    assert "t\\x1b[2J.json" in shown  # /load's note and /show's "loaded from"
    assert "unknown command '/nosuch\\x1b[2j'" in shown  # the name is lowered


def test_chat_reply_into_a_pipe_is_exact():
    s = Session(assistant=Hostile(), muted=True)
    s.run("Hello\r\x04")
    assert s.out == HOSTILE + " " + MARKUP + "\n"


def test_the_chat_banner_shows_a_server_s_name_as_text(pty, monkeypatch):
    from omni_cli.faces.chat import history, main
    from omni_cli.faces.console import make_console

    class NoPrompt:
        def prompt(self, text):
            raise EOFError

    monkeypatch.setattr(history, "make_session", lambda *args, **kwargs: NoPrompt())
    s = Session(assistant=Hostile(), muted=True)
    err = make_console("stderr", file=pty.file)
    assert main._chat_in_terminal(s.repl, err, s.assistant, None, True) == 0
    banner = pty.read()
    assert not _unsafe(banner) and "evil\\x1b]0;pwned\\x07[red]model[/red]" in banner, banner


def test_the_loading_line_and_errors_are_text(pty, monkeypatch):
    from omni_cli.faces.console import loading, make_console
    from omni_cli.faces.program import err_line

    err = make_console("stderr", file=pty.file)
    with loading(err, "model [red]x[/red]\x1b[2J"):
        pass
    shown = pty.read()
    # (rich's own spinner moves the cursor with CR and ESC: the model's name does not)
    assert "Loaded model [red]x[/red]\\x1b[2J in" in shown and "\x1b[2J" not in shown, shown
    monkeypatch.setattr(sys, "stderr", pty.file)
    err_line(f"error: {HOSTILE}")
    assert pty.read() == f"error: {SHOWN}\n"
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    err_line(f"error: {HOSTILE}")
    assert pipe.getvalue() == f"error: {HOSTILE}\n"  # a log file gets the message as it was
