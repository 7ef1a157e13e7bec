"""Files and the session around them (issue 29): a file replaced keeps its mode (omni-say -o, /save,
Conversation.save); /save renames its files together, the transcript last, so that a failed transcript
write leaves the old WAV; a temporary of ours that a SIGKILL left is removed by the next write into its
folder once it is a day old, and nothing else is; a full disk is "no space left on MOUNT" (also through
libsndfile, whose own words were "System error."); an OSError naming a file is one line; a signal that
comes after the command is over ends the process quietly with 130 / 143; Ctrl-C during a slash command
returns to the prompt with the session as it was; a history file that cannot be written is one warning.

In-process (ChatRepl through prompt_toolkit's pipe input, CliRunner, a fake assistant), except the
SIGKILL and the late signal, which need a process of their own (a few lines of Python, no model).
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import cli_env, invoke, invoke_chat
from fakes import FakeAssistant
from interrupting import interrupt_when
from test_chat import Session

from omni_cli import atomic
from omni_cli.errors import OmniError, OutputError

DAY = 24 * 3600


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# Our temporaries' names (atomic.temp_path), spelled out here so that the tests also run on the old code.
TEMP = re.compile(r"\..+\.[0-9a-f]{16}\.(?:part|probe)")


def _only_theirs(folder) -> list[str]:
    """The folder's names, with none of our temporaries among them."""
    names = sorted(os.listdir(folder))
    assert not [n for n in names if TEMP.fullmatch(n)], names
    return names


def _mount(path) -> str:
    """Where the file system holding `path` is mounted (what "no space left on ..." names)."""
    here = os.path.abspath(path)
    while not os.path.ismount(here):
        here = os.path.dirname(here)
    return here


# -- a file replaced keeps its mode ------------------------------------------------------------------


def test_save_keeps_the_mode_of_the_files_it_replaces(tmp_path):
    base = tmp_path / "talk"
    for suffix in (".json", ".wav"):
        path = base.with_name("talk" + suffix)
        path.write_text("old")
        os.chmod(path, 0o600)
    s = Session()
    s.run(f"Hello\r/save {base}\r\x04")
    assert "saved" in s.err, s.err
    assert json.loads((tmp_path / "talk.json").read_text())["turns"][0]["content"] == "Hello"
    assert _mode(tmp_path / "talk.json") == 0o600 and _mode(tmp_path / "talk.wav") == 0o600
    assert _only_theirs(tmp_path) == ["talk.json", "talk.wav"]


def test_say_output_and_conversation_save_keep_the_mode(tmp_path, fake):
    from omni_cli.prompt import Conversation

    wav = tmp_path / "a.wav"
    wav.write_bytes(b"old")
    os.chmod(wav, 0o640)
    result = invoke("Hello", "-o", wav)
    assert result.exit_code == 0, result.output
    assert wav.read_bytes()[:4] == b"RIFF" and _mode(wav) == 0o640
    saved = tmp_path / "c.json"
    saved.write_text("{}")
    os.chmod(saved, 0o600)
    Conversation(system="", turns=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]).save(saved)
    assert _mode(saved) == 0o600 and json.loads(saved.read_text())["turns"]


# -- /save: the transcript last, the old files kept when it fails ---------------------------------------


def _fail_writes_to(monkeypatch, name: str, code: int = errno.ENOSPC) -> None:
    """os.write fails with `code` into any temporary whose target is `name` (the disk filled up there)."""
    real = os.write

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if f"/.{name}." in target:
            raise OSError(code, os.strerror(code))
        return real(fd, data)

    monkeypatch.setattr(atomic.os, "write", write)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name a descriptor's file")
def test_a_failed_transcript_write_leaves_the_old_wav_and_transcript(tmp_path, monkeypatch):
    s = Session()
    s.run(f"Old\r/save {tmp_path / 'talk'}\r\x04")
    old_json, old_wav = (tmp_path / "talk.json").read_bytes(), (tmp_path / "talk.wav").read_bytes()
    s = Session()
    _fail_writes_to(monkeypatch, "talk.json")
    s.run(f"New and longer\rAnd a second one\r/save {tmp_path / 'talk'}\r\x04")
    # Before: the new WAV (two replies) had been renamed in beside the old transcript (one reply).
    assert (tmp_path / "talk.wav").read_bytes() == old_wav
    assert (tmp_path / "talk.json").read_bytes() == old_json
    assert _only_theirs(tmp_path) == ["talk.json", "talk.wav"]
    mount = re.escape(_mount(tmp_path))
    assert re.search(rf"error: cannot write .*talk\.json: no space left on {mount}\n", s.err), s.err


def test_a_folder_where_the_transcript_goes_writes_no_wav(tmp_path):
    (tmp_path / "talk.json").mkdir()
    s = Session()
    s.run(f"Hello\r/save {tmp_path / 'talk'}\r\x04")
    assert "error: cannot write" in s.err and "it is a folder" in s.err
    assert _only_theirs(tmp_path) == ["talk.json"]  # before: talk.wav was written, then the error


# -- temporaries a SIGKILL left behind ---------------------------------------------------------------


def _killed_mid_write(folder) -> str:
    """A process that dies by SIGKILL while writing folder/a.wav through atomic.Replacement; the name of
    the temporary it left."""
    code = ("import os, signal, sys; from omni_cli import atomic\n"
            "r = atomic.Replacement(sys.argv[1]); fd = r.create(); os.write(fd, b'half a file')\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", code, str(folder / "a.wav")], env=cli_env(), timeout=60, check=False)
    assert done.returncode == -signal.SIGKILL
    left = [n for n in os.listdir(folder) if TEMP.fullmatch(n)]
    assert len(left) == 1, os.listdir(folder)
    return left[0]


def test_a_temporary_left_by_sigkill_is_removed_by_the_next_write_once_a_day_old(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_swept", set(), raising=False)
    left = _killed_mid_write(tmp_path)
    atomic.atomic_write(tmp_path / "b.txt", "fresh temporaries are a live writer's: kept")
    assert left in os.listdir(tmp_path)
    old = time.time() - DAY - 60
    os.utime(tmp_path / left, (old, old))
    # Look-alikes that are not ours, each as old: never touched.
    theirs = [".a.wav.part", ".a.wav.0123456789ABCDEF.part", ".a.wav.0123456789abcdef.partial", "a.wav.0123456789abcdef.part",
              ".a.wav.0123456789abcde.part", ".notes.0123456789abcdef.part.txt"]
    for name in theirs:
        (tmp_path / name).write_text("someone else's")
    (tmp_path / "keep.txt").write_text("the link's target")
    (tmp_path / ".link.0123456789abcdef.part").symlink_to("keep.txt")  # a link named like ours: not a file of ours
    (tmp_path / ".dir.0123456789abcdef.part").mkdir()
    for name in [*theirs, ".link.0123456789abcdef.part", ".dir.0123456789abcdef.part"]:
        os.utime(tmp_path / name, (old, old), follow_symlinks=False)
    monkeypatch.setattr(atomic, "_swept", set(), raising=False)  # a new process
    atomic.atomic_write(tmp_path / "c.txt", "the next write into the folder")
    names = os.listdir(tmp_path)
    assert left not in names
    assert set(theirs) | {".link.0123456789abcdef.part", ".dir.0123456789abcdef.part", "keep.txt"} <= set(names)


def test_stale_temporaries_are_ours_only(tmp_path):
    old = time.time() - 2 * DAY
    mine = tmp_path / ".x.wav.00112233445566ff.part"
    mine.write_bytes(b"")
    os.utime(mine, (old, old))
    probe = tmp_path / ".x.wav.00112233445566ff.probe"
    probe.write_bytes(b"")
    os.utime(probe, (old, old))
    if os.getuid() == 0:  # root can give a file away: another user's temporary stays
        other = tmp_path / ".y.wav.00112233445566ff.part"
        other.write_bytes(b"")
        os.chown(other, 12345, 12345)
        os.utime(other, (old, old))
    removed = atomic.remove_stale_temporaries(tmp_path, now=time.time())
    assert sorted(p.name for p in removed) == sorted([mine.name, probe.name])
    assert sorted(os.listdir(tmp_path)) == ([".y.wav.00112233445566ff.part"] if os.getuid() == 0 else [])


# -- a full disk, and OSErrors in words --------------------------------------------------------------


def test_a_full_disk_names_the_file_system(tmp_path, monkeypatch):
    _fail_writes_to(monkeypatch, "a.txt")
    mount = _mount(tmp_path)
    with pytest.raises(OutputError, match=rf"^cannot write .*a\.txt: no space left on {re.escape(mount)}$"):
        atomic.atomic_write(tmp_path / "a.txt", "x")
    _fail_writes_to(monkeypatch, "b.txt", errno.EDQUOT)
    with pytest.raises(OutputError, match=rf"b\.txt: disk quota exceeded on {re.escape(mount)}$"):
        atomic.atomic_write(tmp_path / "b.txt", "x")
    assert _only_theirs(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("fmt", ["ogg", "wav"])
def test_a_full_device_through_libsndfile_is_no_space_left_not_system_error(fake, fmt):
    # /dev/full answers every write with ENOSPC; Ogg goes through libsndfile (whose message was
    # "System error."), a WAV stream through our own writer. Seconds of sound, so that libsndfile writes
    # Ogg pages while it encodes (a write that fails in its sf_close is not reported by libsndfile).
    fake.assistant = FakeAssistant(seconds=10.0, blocks=10)
    result = invoke("Hello", "-o", "/dev/full", "--format", fmt)
    assert result.exit_code == 1
    if fmt == "ogg":
        assert result.stderr.strip() == f"error: cannot write /dev/full: no space left on {_mount('/dev/full')}"
    else:
        assert result.stderr.strip() == "error: cannot write the WAV to /dev/full: No space left on device"
    assert "System error" not in result.stderr and "Traceback" not in result.stderr


def test_an_oserror_naming_a_file_is_one_line(tmp_path):
    from omni_cli.errors import known_failure

    failure = known_failure(PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "x")))
    assert isinstance(failure, OmniError) and str(failure) == f"{tmp_path / 'x'}: Permission denied"
    s = Session(piped=True)

    def refuse(arg):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "y"))

    s.repl.cmd_stats = refuse
    s.run_lines("/stats")
    assert s.err.strip() == f"error: {tmp_path / 'y'}: no space left on {_mount(tmp_path)}"


# -- a signal after the command is over ---------------------------------------------------------------

LATE = """
import atexit, sys, time
import typer
from omni_cli.faces.program import end_on_signals, run

app = typer.Typer(add_completion=False)

@app.command()
def main() -> None:
    end_on_signals()
    atexit.register(time.sleep, 5)  # the interpreter's end (torch's finalizers, in omni-say's case)
    print("wrote x.wav", file=sys.stderr, flush=True)

run(app, "omni-late")
"""


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_after_wrote_ends_quietly(signum, code):
    process = subprocess.Popen([sys.executable, "-c", LATE], env=cli_env(), stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    assert process.stderr.readline().startswith("wrote")
    time.sleep(0.2)  # in the atexit handler now
    process.send_signal(signum)
    rest = process.stderr.read()
    assert process.wait(timeout=30) == code, rest
    assert rest == ""  # before: a traceback of Terminated / KeyboardInterrupt, and exit 0


# -- Ctrl-C during a slash command ------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_ctrl_c_during_a_blocking_command_returns_to_the_prompt(tmp_path):
    # /save onto a FIFO (talk.json) waits for a reader that never comes, as a slow disk or share would.
    os.mkfifo(tmp_path / "talk.json")
    s = Session(muted=True)
    main = threading.main_thread().ident
    interrupter = interrupt_when(lambda: sys._current_frames()[main].f_code.co_name == "open_stream")
    try:
        code = s.run(f"Hello\r/save {tmp_path / 'talk'}\rAgain\r/save {tmp_path / 'after'}\r\x04")
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C ended the session")  # before: so it did (omni-chat: exit 130, the conversation lost)
    finally:
        interrupter.cancel()
    assert interrupter.reached, "/save never waited on the FIFO"
    assert code == 0
    assert "interrupted: /save stopped; the conversation is as it was" in s.err, s.err
    assert s.out.count("Hi there.") == 2  # before: the KeyboardInterrupt ended the session (omni-chat: exit 130)
    turns = json.loads((tmp_path / "after.json").read_text())["turns"]
    assert [t["content"] for t in turns] == ["Hello", "Hi there.", "Again", "Hi there."]


def test_an_interrupted_load_leaves_the_session_as_it_was(tmp_path, monkeypatch):
    from omni_cli.faces.chat.transcript import Transcripts

    saved = Session()
    saved.run(f"Saved one\rSaved two\r/save {tmp_path / 'old'}\r\x04")
    s = Session()

    def interrupted(self, start):  # Ctrl-C after the history was replaced, before the load was done
        raise KeyboardInterrupt

    monkeypatch.setattr(Transcripts, "_restore_media", interrupted)
    try:
        s.run(f"Mine\r/system Be brief.\r/load {tmp_path / 'old'}\r\x04")
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C ended the session")
    assert "interrupted: /load stopped" in s.err
    assert [t["content"] for t in s.repl.transcript] == ["Mine", "Hi there."]
    assert [t["content"] for t in s.repl.chat.history.turns] == ["Mine", "Hi there."]
    assert s.repl.chat.history.system == "Be brief." and s.repl.loaded_from is None
    assert len(s.repl.speech) == 1


def test_omni_chat_goes_on_after_ctrl_c_in_a_command(fake, tmp_path, monkeypatch):
    from omni_cli.faces.chat.commands import Commands

    def stuck(self, arg):
        raise KeyboardInterrupt

    monkeypatch.setattr(Commands, "cmd_stats", stuck)
    result = invoke_chat("--mute", "--no-history",
                                                input=f"Hello\n/stats\n/save {tmp_path / 'x'}\n")
    assert result.exit_code == 0, result.output  # before: 130, and nothing saved
    assert [t["content"] for t in json.loads((tmp_path / "x.json").read_text())["turns"]] == ["Hello", "Hi there."]


# -- a history file that cannot be written ------------------------------------------------------------


def _run_with_timeout(session: Session, keys: str, history, seconds: float = 20.0):
    done: list = []

    def go():
        try:
            done.append(session.run(keys, history=history))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            done.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, "the session wedged"
    return done[0]


def test_a_history_file_on_a_full_disk_is_one_warning_and_the_session_goes_on(tmp_path, monkeypatch):
    import prompt_toolkit.history

    from omni_cli.faces.chat.history import make_history

    real_open = open

    def full(file, mode="r", *args, **kwargs):
        if "a" in mode and "b" in mode:  # FileHistory's append at each line
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(prompt_toolkit.history, "open", full, raising=False)
    warnings: list[str] = []
    history = make_history(tmp_path / "history", warnings.append)
    s = Session()
    assert _run_with_timeout(s, "first\rsecond\r\x04", history) == 0  # before: wedged at "first"
    assert s.out.count("Hi there.") == 2
    assert list(history.load_history_strings()) == [] and history.get_strings() == ["first", "second"]  # in memory
    assert warnings == [(f"warning: cannot keep the input history in {tmp_path / 'history'} (no space left on "
                         f"{_mount(tmp_path)}); it lasts this session only")]


def test_a_history_file_that_is_a_device_is_not_read(tmp_path):
    from omni_cli.faces.chat.history import make_history

    warnings: list[str] = []
    history = make_history(Path("/dev/zero"), warnings.append)  # before: read forever
    assert not hasattr(history, "filename") and "it is not a regular file" in warnings[0]


def test_only_the_end_of_a_long_history_file_is_read(tmp_path, monkeypatch):
    from omni_cli.faces.chat import history as module

    monkeypatch.setattr(module, "HISTORY_BYTES", 1000)
    path = tmp_path / "history"
    path.write_text("".join(f"\n# time\n+line {i}\n" for i in range(1000)))
    loaded = list(module.make_history(path, print).load_history_strings())
    assert loaded[0] == "line 999" and 50 < len(loaded) < 100 and all(s.startswith("line ") for s in loaded)


def test_fake_is_the_assistant_here():
    # The chat tests above run on the fake assistant: its reply is "Hi there." (a guard for the counts).
    assert FakeAssistant().say("x").text == "Hi there."
