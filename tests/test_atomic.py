"""`-o` never replaces what is not ours (omni_cli/atomic.py, through AudioFileSink): a regular file or a
new name is written to a temp file and renamed (whole or not at all, its mode kept); a symlink's target is
replaced and the link stays a link (a dangling link's target is created); a character device (a pty's
slave end here, never the real /dev) and a FIFO are written directly as the audio comes; a folder, a
socket and a block device are UsageErrors raised by the constructor. And the one atomic writer,
`atomic_write`, on each of them."""

from __future__ import annotations

import io
import os
import re
import socket
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from omni_cli import atomic
from omni_cli.audio import format as fmt
from omni_cli.audio.sinks import AudioFileSink, WavSink, writable_formats
from omni_cli.errors import OutputError, UsageError

SR = 24_000
posix_only = pytest.mark.skipif(os.name != "posix", reason="FIFOs, ptys and unix sockets are POSIX")


def tone(n: int = 12_000) -> np.ndarray:
    return (0.4 * np.sin(np.arange(n) / 7)).astype(np.float32)


def write_reply(sink, audio: np.ndarray, parts: int = 6) -> None:
    with sink:
        sink.start(SR)
        for part in np.array_split(audio, parts):
            sink.write(part)


def names(folder) -> list[str]:
    return sorted(os.listdir(folder))


class Reader(threading.Thread):
    """Reads a FIFO (or a pty's master) until its end or `expect` bytes: what a player on the far end gets."""

    def __init__(self, open_fd, expect: int | None = None) -> None:
        super().__init__(daemon=True)
        self.open_fd, self.expect, self.data, self.error = open_fd, expect, bytearray(), None

    def run(self) -> None:
        try:
            fd = self.open_fd()
            try:
                while self.expect is None or len(self.data) < self.expect:
                    try:
                        chunk = os.read(fd, 65536)
                    except OSError:  # a pty's master once the slave is closed (EIO)
                        break
                    if not chunk:
                        break
                    self.data.extend(chunk)
            finally:
                if self.expect is None:
                    os.close(fd)
        except BaseException as exc:  # handed to the test
            self.error = exc


# -- classification --------------------------------------------------------------------------------


def test_a_new_name_and_a_regular_file(tmp_path):
    new = atomic.output_target(tmp_path / "a.wav")
    assert (new.kind, new.path, new.atomic) == (atomic.NEW, tmp_path / "a.wav", True)
    (tmp_path / "a.wav").write_bytes(b"old")
    assert atomic.output_target(tmp_path / "a.wav").kind == atomic.REGULAR


def test_a_symlink_is_resolved_to_its_target(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.wav").write_bytes(b"old")
    (tmp_path / "link.wav").symlink_to("real/a.wav")
    (tmp_path / "dangling.wav").symlink_to(tmp_path / "real" / "b.wav")
    (tmp_path / "chain.wav").symlink_to("dangling.wav")
    linked = atomic.output_target(tmp_path / "link.wav")
    assert (linked.kind, linked.path, linked.given) == (atomic.REGULAR, tmp_path / "real" / "a.wav", tmp_path / "link.wav")
    for name in ("dangling.wav", "chain.wav"):
        target = atomic.output_target(tmp_path / name)
        assert (target.kind, target.path) == (atomic.NEW, tmp_path / "real" / "b.wav")
    (tmp_path / "to-nowhere.wav").symlink_to(tmp_path / "no" / "such" / "b.wav")
    with pytest.raises(OutputError, match="does not exist"):
        atomic.output_target(tmp_path / "to-nowhere.wav")


def test_a_folder_a_socket_and_an_empty_name_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="it is a folder"):
        atomic.output_target(tmp_path)
    with pytest.raises(UsageError):
        atomic.output_target("")


def test_a_block_device_is_a_usage_error(tmp_path, monkeypatch):
    """No block device is touched: os.stat says what one would."""
    real = os.stat
    fake = os.stat_result((stat.S_IFBLK | 0o660, 0, 0, 1, 0, 0, 0, 0, 0, 0))
    monkeypatch.setattr(atomic.os, "stat", lambda p, *a, **k: fake if str(p).endswith("disk") else real(p, *a, **k))
    with pytest.raises(UsageError, match="block device"):
        atomic.output_target(tmp_path / "disk")


def test_a_missing_folder_or_a_file_as_folder_is_an_output_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="is not a folder"):
        atomic.output_target(tmp_path / "file" / "a.wav")
    with pytest.raises(OutputError, match="does not exist"):
        atomic.output_target(tmp_path / "no" / "a.wav")


# -- AudioFileSink on each kind ----------------------------------------------------------------------


def test_the_sink_replaces_a_symlinks_target_and_keeps_the_link(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "a.wav"
    target.write_bytes(b"old contents")
    target.chmod(0o640)
    link = tmp_path / "a.wav"
    link.symlink_to("real/a.wav")
    audio = tone()
    sink = WavSink(link)
    sink.start(SR)
    sink.write(audio)
    assert target.read_bytes() == b"old contents"  # whole or not at all: nothing yet
    sink.close()
    assert link.is_symlink() and os.readlink(link) == "real/a.wav"  # the link stays a link
    assert target.read_bytes() == fmt.wav_bytes(audio, SR)  # its target replaced, whole
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # with its mode
    assert names(tmp_path) == ["a.wav", "real"] and names(tmp_path / "real") == ["a.wav"]


def test_an_aborted_reply_leaves_a_symlinks_target_untouched(tmp_path):
    target = tmp_path / "a.wav"
    target.write_bytes(b"old contents")
    (tmp_path / "link.wav").symlink_to(target)
    sink = WavSink(tmp_path / "link.wav")
    sink.start(SR)
    sink.write(tone())
    sink.abort()
    assert target.read_bytes() == b"old contents" and (tmp_path / "link.wav").is_symlink()
    assert names(tmp_path) == ["a.wav", "link.wav"]


def test_the_sink_creates_a_dangling_links_target(tmp_path):
    (tmp_path / "out").mkdir()
    link = tmp_path / "a.wav"
    link.symlink_to(tmp_path / "out" / "made.wav")
    write_reply(WavSink(link), tone())
    assert link.is_symlink() and (tmp_path / "out" / "made.wav").is_file()
    assert sf.info(link).frames == 12_000
    assert names(tmp_path / "out") == ["made.wav"]


def test_a_regular_file_keeps_its_mode_when_replaced(tmp_path):
    path = tmp_path / "a.wav"
    path.write_bytes(b"old")
    path.chmod(0o604)
    write_reply(WavSink(path), tone())
    assert stat.S_IMODE(path.stat().st_mode) == 0o604 and sf.info(path).frames == 12_000


def test_a_folder_is_a_usage_error_from_the_constructor(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir.wav").mkdir()
    with pytest.raises(UsageError, match="is a folder"):
        AudioFileSink(tmp_path / "dir.wav")
    with pytest.raises(UsageError, match="is a folder") as err:
        AudioFileSink(tmp_path / "dir")
    assert err.value.exit_code == 2
    (tmp_path / "dir-link").symlink_to("dir")
    with pytest.raises(UsageError, match="is a folder"):
        AudioFileSink(tmp_path / "dir-link")
    assert names(tmp_path / "dir") == [] and names(tmp_path / "dir.wav") == []


@posix_only
def test_a_socket_is_a_usage_error_from_the_constructor(tmp_path):
    here = os.getcwd()
    os.chdir(tmp_path)  # a short name: unix socket paths are limited to ~100 bytes
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind("sock")
            with pytest.raises(UsageError, match="is a socket") as err:
                AudioFileSink(tmp_path / "sock")
            assert err.value.exit_code == 2
            assert stat.S_ISSOCK(os.lstat(tmp_path / "sock").st_mode)  # still the socket
    finally:
        os.chdir(here)


@posix_only
def test_a_fifo_is_streamed_into_not_replaced(tmp_path):
    fifo = tmp_path / "player"
    os.mkfifo(fifo)
    sink = AudioFileSink(fifo)  # classifies only: opening a FIFO would wait for its reader
    assert names(tmp_path) == ["player"]
    reader = Reader(lambda: os.open(fifo, os.O_RDONLY))
    reader.start()
    audio = tone(24_001)
    sink.start(SR)  # opens it: the reader is there
    for part in np.array_split(audio, 5):
        sink.write(part)
    sink.close()
    reader.join(10)
    assert reader.error is None and not reader.is_alive()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and names(tmp_path) == ["player"]  # still the FIFO, nothing beside it
    data = bytes(reader.data)
    assert data[:44] == fmt.wav_header(SR)  # a stream: sizes unknown
    assert data[44:] == fmt.pcm16(audio)  # every sample, by the PCM16 rule
    back, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == SR and np.array_equal(back, fmt.to_int16(audio))


@posix_only
def test_a_character_device_is_streamed_into_not_replaced(tmp_path):
    """A pty's slave end is a character device this test owns (as root, `-o /dev/null` once replaced
    /dev/null with a regular file). Reached through a link in tmp_path, which stays a link."""
    import tty

    master, slave = os.openpty()
    try:
        tty.setraw(slave)  # bytes as they are: no newline translation on the way out
        device = os.ttyname(slave)
        link = tmp_path / "speaker"
        link.symlink_to(device)
        before = os.stat(device)
        target = atomic.output_target(link)
        assert (target.kind, target.what) == (atomic.STREAM, "character device")
        audio = tone(6000)
        reader = Reader(lambda: master, expect=44 + 2 * audio.size)
        reader.start()
        write_reply(AudioFileSink(link), audio)
        reader.join(10)
        assert reader.error is None and not reader.is_alive()
        assert bytes(reader.data) == fmt.wav_header(SR) + fmt.pcm16(audio)
        after = os.stat(device)
        assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino  # not replaced
        assert link.is_symlink() and names(tmp_path) == ["speaker"]
    finally:
        os.close(slave)
        os.close(master)


@posix_only
def test_a_stream_takes_wav_and_ogg_but_not_formats_that_seek_back(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for name in ("flac", "mp3"):
        if name in writable_formats():
            with pytest.raises(UsageError, match=f"cannot write {name.upper()} to .*pipe: .*is a FIFO"):
                AudioFileSink(fifo, format=name)
    with pytest.raises(UsageError, match="a streamed WAV is 16-bit"):
        WavSink(fifo, subtype="FLOAT")
    if "ogg" not in writable_formats():
        pytest.skip("no Ogg Vorbis here")
    reader = Reader(lambda: os.open(fifo, os.O_RDONLY))
    reader.start()
    write_reply(AudioFileSink(fifo, format="ogg"), tone(24_000))
    reader.join(10)
    assert reader.error is None
    back, rate = sf.read(io.BytesIO(bytes(reader.data)))
    assert rate == SR and len(back) == 24_000
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# -- the one atomic writer ------------------------------------------------------------------------------


def test_atomic_write_new_existing_and_through_a_link(tmp_path):
    path = tmp_path / "notes.json"
    atomic.atomic_write(path, "naïve\n")
    umask = os.umask(0)
    os.umask(umask)
    assert path.read_text(encoding="utf-8") == "naïve\n" and stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    path.chmod(0o600)
    (tmp_path / "link").symlink_to("notes.json")
    atomic.atomic_write(tmp_path / "link", b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (tmp_path / "link").is_symlink() and names(tmp_path) == ["link", "notes.json"]


def test_atomic_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text("old")

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "write", full)
    with pytest.raises(OutputError, match=rf"^cannot write .*a.txt: no space left on {re.escape(str(atomic.mount_point(tmp_path)))}$"):
        atomic.atomic_write(path, "new")
    assert path.read_text() == "old" and names(tmp_path) == ["a.txt"]


@posix_only
def test_atomic_write_to_a_fifo_writes_into_it(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    reader = Reader(lambda: os.open(fifo, os.O_RDONLY))
    reader.start()
    target = atomic.atomic_write(fifo, "hello\n")
    reader.join(10)
    assert target.kind == atomic.STREAM and bytes(reader.data) == b"hello\n" and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_replacement_commits_on_success_and_discards_on_failure(tmp_path):
    path = tmp_path / "a.bin"
    with atomic.Replacement(path) as rep:
        os.write(rep.fd, b"whole")
        assert names(tmp_path) == [rep.tmp.name] and rep.tmp.name.startswith(".a.bin.")
    assert path.read_bytes() == b"whole" and names(tmp_path) == ["a.bin"]
    with pytest.raises(RuntimeError):
        with atomic.Replacement(path) as rep:
            os.write(rep.fd, b"half")
            raise RuntimeError("interrupted")
    assert path.read_bytes() == b"whole" and names(tmp_path) == ["a.bin"]


def test_a_saved_conversation_is_written_whole(tmp_path, monkeypatch):
    """Conversation.save wrote in place: a failure midway lost the old transcript."""
    from omni_cli.prompt import Conversation

    path = tmp_path / "talk.json"
    path.write_text("old transcript")
    (tmp_path / "link.json").symlink_to("talk.json")
    conversation = Conversation(system="", turns=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    monkeypatch.setattr(atomic.os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OutputError, match=rf"link.json: no space left on {re.escape(str(atomic.mount_point(tmp_path)))}$"):
        conversation.save(tmp_path / "link.json")
    assert path.read_text() == "old transcript" and names(tmp_path) == ["link.json", "talk.json"]
    monkeypatch.undo()
    conversation.save(tmp_path / "link.json")
    assert (tmp_path / "link.json").is_symlink() and Conversation.load(path).turns[1]["content"] == "b"


@posix_only
def test_a_descriptors_name_writes_that_descriptor(tmp_path):
    """/dev/stdout, /dev/fd/N, /proc/self/fd/N: the descriptor itself (dup'd), at its offset and with its
    O_APPEND, never a rename onto the file a shell redirected it to (`>> all.wav` keeps what it had)."""
    path = tmp_path / "all.wav"
    path.write_bytes(b"earlier")
    with open(path, "ab") as appending:
        target = atomic.output_target(f"/dev/fd/{appending.fileno()}")
        assert (target.kind, target.fd, target.what) == (atomic.STREAM, appending.fileno(), "file descriptor")
        write_reply(AudioFileSink(f"/dev/fd/{appending.fileno()}"), tone(100))
    data = path.read_bytes()
    assert data[:7] == b"earlier" and data[7:] == fmt.wav_header(SR) + fmt.pcm16(tone(100))  # appended, sizes unknown
    with open(path, "wb") as fresh:  # `> one.wav`: a seekable file, so the sizes are patched in
        write_reply(AudioFileSink(f"/proc/self/fd/{fresh.fileno()}"), tone(100))
    assert path.read_bytes() == fmt.wav_bytes(tone(100), SR) and names(tmp_path) == ["all.wav"]
    assert atomic.output_target("/dev/stdout").fd == 1 == atomic.descriptor_of("/dev/stdout")
    assert atomic.descriptor_of(tmp_path / "all.wav") is None and atomic.descriptor_of(f"/proc/{os.getpid()}/fd/2") == 2
    with open(path, "rb") as reading:
        with pytest.raises(OutputError, match="open for reading only"):
            AudioFileSink(f"/dev/fd/{reading.fileno()}")


def test_messages_name_the_path_as_given(tmp_path, monkeypatch):
    """omni-chat's `/save no/such/folder/x` says the folder as typed (its test checks the line)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match=r"^cannot write no/such/x.json: folder no/such does not exist$"):
        atomic.atomic_write(Path("no") / "such" / "x.json", "{}")
    assert names(tmp_path) == []
