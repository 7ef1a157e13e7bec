"""Issue 29's hostile inputs to the prompt, media and file readers, each refused before the expensive step:
a time bound on each, and a memory bound (the peak RSS, reset before the call) on the big ones. The
files are made small and fast: sparse files (truncate), image headers written by hand, FIFOs (mkfifo).

Also: `fit` gives the ids of the old algorithm (drop the oldest pair, render again) on many conversations,
while tokenizing each turn about once and the oldest turns that cannot fit not at all."""

from __future__ import annotations

import io
import os
import random
import socket
import struct
import sys
import threading
import time
import wave
import zlib
from pathlib import Path

import pytest

from omni_cli.errors import UsageError
from omni_cli.limits import DEFAULT, LimitError, Limits, read_bounded, read_regular_file
from omni_cli.prompt import Conversation, build_ids, fit

MB = 1 << 20


# -- measuring -----------------------------------------------------------------------------------------


def _hwm_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return None


def costs(fn, *args, **kwargs):
    """(what fn raised or returned, seconds, peak RSS added in MB). The peak is the kernel's (VmHWM, reset
    through /proc/self/clear_refs), so that C allocations (libsndfile, Pillow) count; where that is not
    there (not Linux), tracemalloc's peak of Python's and numpy's allocations."""
    import tracemalloc

    reset = True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _hwm_mb()
    except OSError:
        reset, before = False, None
    if not reset or before is None:
        tracemalloc.start()
    t = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the refusal is what is measured
        result = exc
    seconds = time.perf_counter() - t
    if reset and before is not None:
        added = (_hwm_mb() or before) - before
    else:
        added = tracemalloc.get_traced_memory()[1] / MB
        tracemalloc.stop()
    return result, seconds, added


def within(seconds: float, fn, *args):
    """fn(*args) on a daemon thread, or a failure if it has not returned in `seconds` (a FIFO's open
    blocks forever when it regresses: the test fails instead of hanging the suite)."""
    box: list = []

    def run():
        try:
            box.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"{getattr(fn, '__name__', fn)} did not return within {seconds} s (it blocks)"
    return box[0]


# -- hostile files ---------------------------------------------------------------------------------------


def wav_header(path: Path, seconds: float, rate: int = 16_000, size: int | None = None) -> Path:
    """A WAV whose header says `seconds` of 16-bit mono, made a sparse file of that size (or `size`)."""
    data = int(seconds * rate) * 2
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", min(36 + data, 2**32 - 1)) + b"WAVE")
        f.write(b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16))
        f.write(b"data" + struct.pack("<I", min(data, 2**32 - 1)))
        f.truncate(44 + data if size is None else size)
    return path


def png_header(path: Path, width: int, height: int) -> Path:
    """A PNG that says it is width x height (1-bit grey) with a token payload: what a header check must
    refuse before Pillow allocates and decodes it."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


@pytest.fixture
def fifo(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


# -- the one bounded reader -------------------------------------------------------------------------------


def test_a_regular_file_is_read_whole_within_its_cap(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello")
    assert read_regular_file(tmp_path / "a.txt", 5, "the file") == b"hello"
    link = tmp_path / "link.txt"
    link.symlink_to(tmp_path / "a.txt")  # a link to a regular file is that file
    assert read_regular_file(link, 5, "the file") == b"hello"


def test_a_file_over_its_cap_is_refused_before_a_byte_is_read(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(100 * MB)  # sparse: nothing to read but its size
    result, seconds, added = costs(read_regular_file, big, 16 * MB, "the prompt file")
    assert isinstance(result, LimitError) and "100.0 MB, more than the 16.0 MB" in str(result)
    assert seconds < 0.1 and added < 10


def test_a_file_that_grows_past_its_cap_while_read_is_refused(tmp_path, monkeypatch):
    from omni_cli import limits

    grown = tmp_path / "grown.txt"
    grown.write_bytes(b"x" * 200)
    real = os.fstat
    # fstat saw it small (it grew after): at most the cap and one byte are read, then it is refused
    monkeypatch.setattr(limits.os, "fstat", lambda fd: os.stat_result((*real(fd)[:6], 10, *real(fd)[7:])))
    with pytest.raises(LimitError, match="grew past the 100 bytes"):
        read_regular_file(grown, 100, "the file")


@pytest.mark.parametrize("kind", ["fifo", "device", "link to a device", "link to a fifo", "socket", "folder"])
def test_only_regular_files_are_read_and_others_are_refused_at_once(kind, tmp_path, fifo):
    link = tmp_path / "link"
    if kind == "fifo":
        path, says = fifo, "a FIFO (named pipe)"
    elif kind == "device":
        path, says = Path("/dev/zero"), "a character device"
    elif kind == "link to a device":
        link.symlink_to("/dev/zero")
        path, says = link, "a character device"
    elif kind == "link to a fifo":
        link.symlink_to(fifo)
        path, says = link, "a FIFO"
    elif kind == "socket":
        path, says = tmp_path / "sock", "a socket"
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    else:
        path, says = tmp_path, "a folder"
    t = time.perf_counter()
    result = within(2.0, read_regular_file, path, 16 * MB, "the transcript")
    assert isinstance(result, UsageError), result
    assert says in str(result) and str(result).startswith(f"the transcript {path} is ")
    assert time.perf_counter() - t < 0.5


def test_a_stream_is_read_up_to_its_cap_and_one_byte():
    class Endless(io.RawIOBase):  # /dev/zero on stdin
        reads = 0

        def readable(self):
            return True

        def readinto(self, b):
            Endless.reads += len(b)
            b[:] = bytes(len(b))
            return len(b)

    stream = io.BufferedReader(Endless())
    with pytest.raises(LimitError, match="stdin holds more than the 1.0 MB"):
        read_bounded(stream, MB, "stdin")
    assert Endless.reads < 2 * MB
    assert read_bounded(io.BytesIO(b"abc"), 3, "stdin") == b"abc"


# -- the faces' inputs: -f, stdin, --image, --audio -------------------------------------------------------


def test_prompt_file_from_a_device_or_fifo_is_refused_and_dash_is_still_stdin(fifo, monkeypatch):
    from omni_cli.faces.inputs import read_prompt_file

    for name, says in (("/dev/zero", "a character device"), (str(fifo), "a FIFO")):
        result = within(2.0, read_prompt_file, name)
        assert isinstance(result, UsageError) and says in str(result), result
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"from stdin\n")))
    assert read_prompt_file("-") == "from stdin\n"


def test_piped_stdin_is_bounded(monkeypatch):
    from omni_cli.faces.inputs import read_stdin

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x" * 101)))
    with pytest.raises(LimitError, match="stdin holds more than"):
        read_stdin(limits=Limits(prompt_file_bytes=100))


def test_say_f_dev_zero_and_a_huge_image_exit_2_at_once(tmp_path):
    from conftest import invoke

    for args in (["-f", "/dev/zero"], ["--image", png_header(tmp_path / "huge.png", 20_000, 20_000), "What is it?"]):
        t = time.perf_counter()
        result = invoke(*args, "--text-only")
        assert result.exit_code == 2, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
        assert time.perf_counter() - t < 2.0


# -- audio: the header's length before decoding -----------------------------------------------------------


def test_a_wav_header_longer_than_the_cap_is_refused_before_decoding(tmp_path):
    from omni_cli.media import read_audio

    long = wav_header(tmp_path / "long.wav", seconds=3000, rate=8000)  # 48 MB sparse, 50 minutes
    result, seconds, added = costs(read_audio, long)
    assert isinstance(result, LimitError) and "3000 s of audio, more than the 600 s" in str(result), result
    assert seconds < 0.5 and added < 30
    # the same bytes through the API (a request's input_audio): the header is read from memory
    data = long.read_bytes()
    result, seconds, _ = costs(read_audio, data, "input_audio 1")
    assert isinstance(result, LimitError) and str(result).startswith("input_audio 1 is 3000 s")


def test_a_sparse_2_gb_wav_is_refused_by_its_size(tmp_path):
    from omni_cli.media import read_audio

    huge = wav_header(tmp_path / "huge.wav", seconds=65_000)  # 2.1 GB sparse
    result, seconds, added = costs(read_audio, huge)
    assert isinstance(result, LimitError) and "more than the 256.0 MB" in str(result), result
    assert seconds < 0.2 and added < 10
    # under a larger file cap, the header's length refuses it (the old code allocated 4 GB here)
    result, seconds, added = costs(read_audio, huge, None, Limits(attachment_bytes=4 << 30))
    assert isinstance(result, LimitError) and "65000 s of audio" in str(result), result
    assert seconds < 0.5 and added < 30


def test_a_header_with_many_channels_is_bounded_by_its_samples(tmp_path):
    from omni_cli.media import read_audio

    path = tmp_path / "wide.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(64)
        w.setsampwidth(2)
        w.setframerate(48_000)
        w.writeframes(bytes(2 * 64 * 48_000))  # 1 s of 64 channels: 3 M samples
    with pytest.raises(LimitError, match="64 channels"):
        read_audio(path, limits=Limits(audio_seconds=20))  # 20 s at 96 kHz: 1.9 M samples
    assert read_audio(path).seconds == 1.0


def test_audio_from_a_fifo_is_refused_at_once(fifo):
    from omni_cli.media import read_audio

    result = within(2.0, read_audio, fifo)
    assert isinstance(result, UsageError) and "a FIFO" in str(result), result


def test_an_ordinary_clip_still_reads(tmp_path):
    import numpy as np
    import soundfile

    from omni_cli.media import read_audio

    soundfile.write(tmp_path / "a.wav", np.zeros(8000, dtype=np.float32), 16_000)
    clip = read_audio(tmp_path / "a.wav")
    assert (clip.seconds, clip.sample_rate) == (0.5, 16_000)


# -- images: the header's pixels before decoding ----------------------------------------------------------


@pytest.mark.parametrize("side", [12_000, 30_000])  # over our cap; over Pillow's bomb limit
def test_a_huge_image_is_refused_from_its_header(side, tmp_path):
    from omni_cli.media import read_image

    path = png_header(tmp_path / "huge.png", side, side)
    for source in (path, path.read_bytes()):  # a file (--image) and a request's image_url bytes
        result, seconds, added = costs(read_image, source, "image_url 1" if isinstance(source, bytes) else None)
        assert isinstance(result, LimitError), result
        assert (f"{side}x{side} pixels" if side == 12_000 else "is 900 MP, more than the 40 MP") in str(result), result
        assert seconds < 0.5 and added < 30


def test_an_image_from_a_fifo_is_refused_at_once_and_a_small_one_reads(fifo, tmp_path):
    from PIL import Image

    from omni_cli.media import read_image

    result = within(2.0, read_image, fifo)
    assert isinstance(result, UsageError) and "a FIFO" in str(result), result
    Image.new("RGB", (40, 30), "red").save(tmp_path / "small.png")
    assert read_image(tmp_path / "small.png").size == (40, 30)
    with pytest.raises(LimitError, match="40x30 pixels"):
        read_image(tmp_path / "small.png", limits=Limits(image_pixels=1000))


# -- transcripts --------------------------------------------------------------------------------------------


def test_a_100_mb_transcript_is_refused_before_it_is_read(tmp_path, fifo):
    big = tmp_path / "talk.json"
    with open(big, "wb") as f:
        f.truncate(100 * MB)
    result, seconds, added = costs(Conversation.load, big)
    assert isinstance(result, LimitError) and "100.0 MB" in str(result), result
    assert seconds < 0.1 and added < 10
    result = within(2.0, Conversation.load, fifo)
    assert isinstance(result, UsageError) and "a FIFO" in str(result)


def test_chat_load_of_a_link_to_dev_zero_or_a_fifo_or_a_big_file_is_one_line(tmp_path, fifo):
    from test_chat import Session

    link = tmp_path / "zero"
    link.symlink_to("/dev/zero")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(100 * MB)
    for path, says in ((link, "a character device"), (fifo, "a FIFO"), (big, "100.0 MB")):
        s = Session()
        t = time.perf_counter()
        assert within(5.0, s.run, f"/load {path}\r\x04") == 0
        assert says in s.err and s.err.count("\n") == 1, s.err
        assert time.perf_counter() - t < 2.0
        assert s.repl.loaded_from is None


# -- prompts: characters before tokens -------------------------------------------------------------------


class CountingTokenizer:
    """A stand-in for a checkpoint's tokenizer: chatml rendered as text, a token per word or punctuation
    mark (at most 4 characters a token), the characters it was given counted."""

    def __init__(self) -> None:
        self.chars = 0
        self.texts: list[str] = []

    def _ids(self, text: str) -> list[int]:
        import re

        self.chars += len(text)
        self.texts.append(text)
        return [hash(piece) % 50_000 for word in re.findall(r"<\|[a-z_]+\|>|\w+|\s+|[^\w\s]", text)
                for piece in ([word] if word.startswith("<|") else [word[i:i + 4] for i in range(0, len(word), 4)])]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self._ids(text)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<|im_start|>{m['role']}\n{_text(m['content'])}<|im_end|>\n" for m in messages)
        return self._ids(text + ("<|im_start|>assistant\n" if add_generation_prompt else ""))


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if p["type"] == "text" else f"<|{p['type']}|>" for p in content)


def old_fit(tokenizer, conv: Conversation, user, budget: int, expand=None):
    """`fit` as it was: render the whole conversation, drop the oldest pair, again, until it fits."""
    dropped = 0
    while True:
        ids = build_ids(tokenizer, conv.messages(user))
        if expand is not None:
            ids = expand(ids)
        if len(ids) <= budget:
            return ids, dropped
        if not conv.turns:
            raise UsageError(f"prompt is {len(ids)} tokens but the context holds {budget}: shorten it")
        del conv.turns[:2]
        dropped += 1


def conversations(seed: int, n: int):
    """(system, turns, user, budget) of random conversations: sizes that fit, that drop some pairs,
    and that cannot fit at all."""
    rng = random.Random(seed)
    words = ["the", "a", "cat", "über", "日本語", "，", "\n", "  ", "tab\t", "=====", "chrysanthemum"]
    for _ in range(n):
        turns = [{"role": ("user", "assistant")[i % 2], "content": " ".join(rng.choices(words, k=rng.randint(0, 90)))}
                 for i in range(2 * rng.randint(0, 14))]
        system = rng.choice(["", "You are terse.", "s" * rng.randint(0, 200)])
        yield system, turns, " ".join(rng.choices(words, k=rng.randint(1, 50))), rng.randint(8, 1200)


def compare(tokenizer, system, turns, user, budget, expand=None):
    def run(f):
        conv = Conversation(system, [dict(t) for t in turns])
        try:
            return f(tokenizer, conv, user, budget, expand), conv.turns
        except UsageError as exc:
            return type(exc), None

    new, old = run(fit), run(old_fit)
    if new[0] is LimitError:  # refused by the char bound: the old algorithm could not fit it either
        assert old[0] is UsageError
    else:
        assert new == old


def test_fit_gives_the_old_algorithms_ids_and_history():
    tokenizer = CountingTokenizer()
    for case in conversations(0, 200):
        compare(tokenizer, *case)


def test_fit_keeps_media_placeholders_and_their_expansion_as_before():
    from omni_cli.prompt import expand_placeholders, user_parts

    tokenizer = CountingTokenizer()
    audio = tokenizer("<|audio|>")["input_ids"][0]
    for system, turns, user, budget in conversations(1, 100):
        counts = [random.Random(budget).randint(1, 40) for _ in range(len(turns) // 2 + 1)]
        for i in range(0, len(turns), 4):  # every other exchange said with a clip
            turns[i] = {**turns[i], "media": {"audio": ["a clip"], "images": []}}  # as Conversation.add keeps it

        def expand(ids, counts=counts):
            return expand_placeholders(ids, audio, counts[-ids.count(audio):] if ids.count(audio) else [])

        compare(tokenizer, system, turns, user_parts(user, clips=1), budget, expand)


def test_fit_is_linear_and_never_tokenizes_what_cannot_fit():
    tokenizer = CountingTokenizer()
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"old{i} " + "word " * 2000} for i in range(200)]
    result, seconds, _ = costs(fit, tokenizer, Conversation("", turns), "And then?", 4072)
    ids, dropped = result
    assert len(ids) <= 4072 and dropped >= 99
    assert seconds < 1.0
    # 200 turns of 10 KB: 2 MB of text; only what the char bound lets through is tokenized, a few times
    assert tokenizer.chars < 10 * DEFAULT.prompt_chars(4072)
    assert not any("old0 " in text for text in tokenizer.texts)
    # a conversation that fits is rendered once, as before
    tokenizer = CountingTokenizer()
    small = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(20)]
    assert fit(tokenizer, Conversation("", small), "And?", 4072)[1] == 0 and len(tokenizer.texts) == 1


def test_a_50_mb_prompt_is_refused_before_tokenizing():
    prompt = "word " * (10 * MB)  # 50 MB
    tokenizer = CountingTokenizer()
    result, seconds, added = costs(fit, tokenizer, Conversation(), prompt, 4072)
    assert isinstance(result, LimitError) and result.param == "messages", result
    assert "the prompt is 52428800 characters, more than the 65152" in str(result)
    assert tokenizer.chars == 0 and seconds < 0.5 and added < 100


def test_a_50_mb_prompt_to_an_assistant_is_refused_before_its_media_and_tokenizer():
    from omni_cli.assistant import Assistant
    from omni_cli.config import ReplyOptions

    bare = object.__new__(Assistant)  # no model: nothing of it may be needed to refuse the prompt
    bare.limits, bare.max_context = {"text": 24, "codes": 100}, 4096
    prompt = "word " * (10 * MB)
    conversation = Conversation("Be brief.")
    result, seconds, added = costs(bare._request, prompt, ReplyOptions(), None, conversation, ["not read.wav"])
    assert isinstance(result, LimitError) and result.param == "messages", result
    assert seconds < 0.5 and added < 100
    # a reply cap the context cannot hold is said in words (it was "the context holds -999999995904")
    with pytest.raises(LimitError, match=r"^the reply's token cap \(1000000000000\) leaves no room for the prompt: the context holds 4096 "):
        bare._request("Hi", ReplyOptions(max_text_tokens=10**12), None, conversation)


@pytest.mark.model  # transformers and two tokenizers: seconds, not milliseconds
def test_fit_with_the_tiny_models_tokenizers_gives_the_old_ids():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    root = Path(__file__).resolve().parent.parent / "assets"
    for name in ("tiny-qwen2.5-omni", "tiny-qwen3-omni"):
        tokenizer = AutoTokenizer.from_pretrained(str(root / name))
        for case in conversations(2, 60):
            compare(tokenizer, *case)
        turns = [{"role": ("user", "assistant")[i % 2], "content": "word " * 2000} for i in range(200)]
        t = time.perf_counter()
        ids, dropped = fit(tokenizer, Conversation("", turns), "And then?", 4072)
        assert len(ids) <= 4072 and dropped == 100
        assert time.perf_counter() - t < 2.0  # it was 133 s (quadratic)


# -- the API's numbers ---------------------------------------------------------------------------------


def user(text):
    return {"role": "user", "content": text}


@pytest.mark.parametrize("fields, param, says", [
    ({"seed": 10**30}, "seed", "seed must be between 0 and 2**63-1 (got 10000000... (31 digits))"),
    ({"seed": -1}, "seed", "seed must be between 0 and 2**63-1"),
    ({"max_completion_tokens": 10**12}, "max_completion_tokens", "max_completion_tokens must be at most 2147483647"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
    ({"max_completion_tokens": 1e300}, "max_completion_tokens", "must be at most"),
    ({"temperature": 1e300}, "temperature", "temperature must be between 0 and 100"),
    ({"temperature": -1}, "temperature", "temperature must be between 0 and 100"),
    ({"top_p": 0}, "top_p", "top_p must be above 0"),
    ({"top_k": -5}, "top_k", "top_k must be 0 (off) or more"),
    ({"omni": {"max_codes": 0}}, "omni.max_codes", "omni.max_codes must be at least 1"),
    ({"omni": {"max_codes": 10**20}}, "omni.max_codes", "omni.max_codes must be at most"),
    ({"seed": 1.5}, "seed", "seed must be an integer"),
])
def test_every_number_of_a_request_is_range_checked_with_a_400_naming_it(fields, param, says):
    from omni_cli.api import protocol as p

    with pytest.raises(p.RequestError) as info:
        p.parse_chat_request({"messages": [user("Hi")], **fields})
    assert (info.value.status, info.value.param) == (400, param)
    assert says in str(info.value)
    assert p.parse_chat_request({"messages": [user("Hi")], "seed": 2**63 - 1}).options.seed == 2**63 - 1


def test_a_limit_error_from_the_assistant_is_a_400_naming_its_field():
    from omni_cli.api import protocol as p

    err = p.api_error(LimitError("the prompt is too long", param="messages"))
    assert (err.status, err.param, str(err)) == (400, "messages", "the prompt is too long")
    err = p.api_error(LimitError("max_text_tokens must be at least 1", param="max_text_tokens"))
    assert (err.param, str(err)) == ("max_completion_tokens", "max_completion_tokens must be at least 1")
    assert p.api_error(UsageError("empty prompt")).param is None
