"""omni-chat in a real terminal: tmux runs it in a pseudo-terminal, the test types (send-keys) and
reads the screen (capture-pane). A spoken turn, a slash command, Ctrl-C in the middle of a reply (the
next prompt appears, the next turn works), Ctrl-D to leave with exit code 0, and the history file.

Sound goes to an ALSA file device paced at real time (see audio_device.py), so a reply takes as long
to play as it would on a sound card. What a person hears is judged, not a count that depends on the
machine's load: the whole first reply played, and any silent gap in it was an underrun that the
timing block reported.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from audio_device import alsa_file_device, have_portaudio, have_tmux, heard, read_played
from conftest import REPO_ROOT, cli_env

pytestmark = [
    pytest.mark.skipif(not have_tmux(), reason="tmux is not installed (apt-get install tmux)"),
    pytest.mark.skipif(not have_portaudio(), reason="PortAudio is not installed (apt-get install libportaudio2)"),
]


class Tmux:
    """One detached tmux session on a private server, whose socket lives in the test's folder."""

    def __init__(self, tmp_path: Path, command: str, env: dict[str, str], width: int = 100, height: int = 40):
        self.socket = str(tmp_path / "tmux.sock")
        self.env = env
        self.tmux("new-session", "-d", "-s", "chat", "-x", str(width), "-y", str(height), command)

    def tmux(self, *args: str) -> str:
        result = subprocess.run(["tmux", "-S", self.socket, *args], env=self.env, capture_output=True, text=True,
                                timeout=30)
        assert result.returncode == 0, (args, result.stderr)
        return result.stdout

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "chat", *keys)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "chat", "-l", text)
        self.keys("Enter")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "chat", "-S", "-200")

    def wait(self, predicate, timeout: float = 120.0, what: str = "") -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if predicate(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the screen:\n{text}")
            time.sleep(0.05)

    def kill(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=30)

    exit_file: Path | None = None  # where `chat_in_tmux`'s command writes omni-chat's exit code

    def leave(self, timeout: float = 30.0) -> str:
        """Ctrl-D at the prompt; omni-chat's exit code once it has ended."""
        self.keys("C-d")
        deadline = time.monotonic() + timeout
        while not self.exit_file.exists() or not self.exit_file.read_text().strip():
            assert time.monotonic() < deadline, self.screen()
            time.sleep(0.05)
        return self.exit_file.read_text().strip()


def chat_in_tmux(tmp_path: Path, args: str, env: dict[str, str]) -> Tmux:
    """`omni-chat ARGS` in a tmux session; when it ends, its exit code goes to a file (`Tmux.leave`)."""
    exit_file = tmp_path / "exit-code"
    chat = f"{shlex.quote(sys.executable)} -m omni_cli.faces.chat.main {args}"
    command = f"cd {shlex.quote(str(REPO_ROOT))} && {chat}; echo $? > {shlex.quote(str(exit_file))}; sleep 60"
    # bash, not sh: dash exits after a child it waited for got a Ctrl-C, even when the child handled it.
    t = Tmux(tmp_path, f"bash -c {shlex.quote(command)}", env)
    t.exit_file = exit_file
    return t


def prompts(screen: str) -> int:
    return sum(1 for line in screen.splitlines() if line.startswith(">>>"))


def at_prompt(screen: str) -> bool:
    lines = [l for l in screen.splitlines() if l.strip()]
    return bool(lines) and lines[-1].rstrip() == ">>>"


def test_omni_chat_in_a_real_terminal(tmp_path):
    alsa, raw = alsa_file_device(tmp_path / "alsa")
    data = tmp_path / "data"
    env = cli_env(**alsa, XDG_DATA_HOME=str(data), TERM="xterm-256color")
    env.pop("OMNI_NOHISTORY", None)
    t = chat_in_tmux(tmp_path, "--seed 1 --max-codes 250 --max-text-tokens 60 --verbose", env)
    try:
        screen = t.wait(at_prompt, what="the first prompt")
        assert "built-in tiny demo model" in screen and "/? for help" in screen

        # A turn: its text streams, its speech plays (5 s at real time), then the next prompt.
        t.type("Hello there")
        screen = t.wait(lambda s: prompts(s) == 2 and at_prompt(s), what="the end of the first reply")
        assert "-- timing" in screen and "playback waited" in screen, screen
        # The prompt comes back once the device has played the reply out: the file holds all of it.
        sound = heard(read_played(raw))
        seconds = float(re.search(r"real-time factor\s+\S+ \((\d+\.\d) s of audio", screen)[1])
        assert seconds > 4 and abs(sound.samples.size / 24_000 - seconds) <= 0.05 + 1e-9, (sound.samples.size, screen)
        m = re.search(r"underruns\s+(\d+) \((\d+) ms of silence\)", screen)
        assert m and int(m[1]) == sound.gaps, (sound.gap_lengths, screen)
        assert abs(int(m[2]) - sound.gap_samples / 24) <= 0.5 + 1e-6, (sound.gap_lengths, screen)

        # A slash command.
        t.type("/voice Ethan")
        t.wait(lambda s: "voice: Ethan" in s and prompts(s) == 3 and at_prompt(s), what="/voice")

        # Ctrl-C in the middle of a reply: the sound stops, the next prompt comes back at once.
        t.type("Tell me a story")
        size = raw.stat().st_size
        t.wait(lambda s: raw.stat().st_size > size + 24_000 * 4, what="a second of the second reply's sound")
        t.keys("C-c")
        screen = t.wait(lambda s: "interrupted" in s and prompts(s) == 4 and at_prompt(s), timeout=10,
                        what="the prompt after Ctrl-C")
        m = re.search(r"interrupted: silent after (\d+) ms, back at the prompt after (\d+) ms", screen)
        assert m and int(m[1]) < 200 and int(m[2]) < 200, screen
        time.sleep(0.3)
        size = raw.stat().st_size
        time.sleep(0.5)
        assert raw.stat().st_size == size  # silence

        # The session goes on: the next turn works.
        t.type("/mute")
        t.wait(lambda s: "muted: text only" in s and prompts(s) == 5 and at_prompt(s), what="/mute")
        t.type("And now?")
        t.wait(lambda s: prompts(s) == 6 and at_prompt(s), what="the reply after the interrupt")

        # Ctrl-D on an empty line leaves with exit code 0.
        assert t.leave() == "0"
        screen = t.screen()
        (tmp_path / "screen.txt").write_text(screen)
        assert "Traceback" not in screen
    finally:
        t.kill()
    history = (data / "omni-cli" / "chat_history").read_text()
    for line in ("+Hello there", "+/voice Ethan", "+Tell me a story", "+And now?"):
        assert line in history


def test_omni_chat_keeps_its_model_in_a_background_server_warmed_while_you_type(tmp_path):
    """With the keep-alive on, omni-chat in a terminal loads the model in a background omni-serve and, while
    the person types, sends it the warm-up reply the server skipped (`--no-warm-up`); a turn, Ctrl-D, and
    the server lives on for the next command."""
    import json
    import os
    import signal

    from test_keep_alive import _free_port, _served

    port = _free_port()
    cache = tmp_path / "cache"
    env = cli_env(TERM="xterm-256color", XDG_CACHE_HOME=str(cache), OMNI_PORT=str(port), OMNI_KEEP_ALIVE="60")
    env.pop("OMNI_LOCAL", None)
    t = chat_in_tmux(tmp_path, "--mute --seed 1 --max-text-tokens 20", env)
    record = cache / "omni_cli" / "serve" / "omni-serve.json"
    try:
        screen = t.wait(at_prompt, what="the first prompt")
        assert "background omni-serve" in screen and f"127.0.0.1:{port}" in screen, screen
        deadline = time.monotonic() + 60
        while _served(port) < 1:  # the warm-up, while nobody types
            assert time.monotonic() < deadline
            time.sleep(0.1)
        t.type("Hello there")
        t.wait(lambda s: prompts(s) == 2 and at_prompt(s), what="the reply")
        assert _served(port) == 2
        assert t.leave() == "0" and "Traceback" not in t.screen()
        assert _served(port) == 2  # still there for the next command
    finally:
        t.kill()
        if record.exists():
            os.kill(json.loads(record.read_text())["pid"], signal.SIGTERM)
