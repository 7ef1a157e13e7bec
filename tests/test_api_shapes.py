"""The chat completions API's wire shapes, checked without a model, a server process or the network.

What this file checks:

- `RemoteAssistant` (omni_cli/api/client.py) reading recorded reply streams (tests/data/api/*.sse) served
  through the client's `transport` stand-in for the network: vLLM-Omni's shape (a top-level "modality"; the speech as base64 in
  `choices[0].delta.content`, described by `choices[0].audio_metadata`), once with a WAV file per chunk and
  once with raw PCM16; OpenAI's shape as omni-serve sends it (`delta.audio.transcript`, `delta.audio.data`);
  an error event in the middle of a reply. For each: the text, the samples (exactly: every stream here
  carries 16-bit samples), the sample rate, what the sink was told and in which order, and the request the
  client sent.
- `parse_chat_request` (omni_cli/api/protocol.py): valid bodies onto `ReplyOptions`, bad bodies refused
  with a 400 that names the field.
- `pcm16` / `from_pcm16`, `sse()`, `completion()`.
- that the client side (api/client.py, cli.py) imports no torch.

What it does not check: a running vLLM-Omni or omni-serve. The fixtures are not captures; the generator
in this file writes them, in the shapes read from vLLM-Omni's source (the files and commits are named on
each generator) and from omni-serve's `_stream` (omni_cli/api/server.py). Nor the HTTP server itself,
playback, or any model.

`python tests/test_api_shapes.py` rewrites the fixtures; test_fixture_is_what_the_generator_writes keeps
the files and the generator in step.

Among the refusals: null fields mean their defaults (as in OpenAI's API), non-finite numbers are a 400,
a 5xx body says server_error (bugs these tests found and pinned before protocol.py was fixed).
"""

from __future__ import annotations

import base64
import io
import json
import math
import subprocess
import sys
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from omni_cli.api import protocol as p
from omni_cli.api.client import RemoteAssistant, ServerError
from omni_cli.config import ReplyOptions
from omni_cli.prompt import Conversation
from omni_cli.runtime.events import AudioBlock, Done, TextDelta

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "api"
URL = "http://fake:8000"
CREATED = 1767225600  # fixed, so that the generator writes the same bytes every time
PROMPT_TOKENS = 31
FIXTURE_LIMIT = 60_000  # bytes


# -- the recordings -----------------------------------------------------------------------------------


def tone(hz: float, seconds: float, rate: int) -> np.ndarray:
    """A sine at half scale as int16 samples (what a 16-bit stream carries)."""
    n = np.arange(round(seconds * rate))
    return np.rint(0.5 * np.sin(2 * np.pi * hz * n / rate) * 32768).astype("<i2")


def split(samples: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    assert sum(sizes) == len(samples)
    return np.split(samples, np.cumsum(sizes)[:-1])


def wav_file(samples: np.ndarray, rate: int) -> bytes:
    """A mono 16-bit WAV file (stdlib, so the bytes never change; the same bytes soundfile writes for
    int16 samples, see test_wav_chunks_are_what_soundfile_writes)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def event(data: dict | str) -> str:
    """One server-sent event, JSON as pydantic's model_dump_json and omni-serve write it (compact, UTF-8)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


@dataclass
class Recording:
    """A reply as a server streams it, and what a client must make of it."""

    name: str
    model: dict  # the server's entry in GET /v1/models
    text_parts: list[str]
    blocks: list[np.ndarray]  # int16 samples, one array per audio chunk
    rate: int
    source_hz: float  # the tone the samples were made from
    body: str = ""  # the SSE text
    stats: dict = field(default_factory=dict)  # the reply's `omni.stats` (omni-serve only)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def audio(self) -> np.ndarray:
        """The float32 samples a reader must produce: int16 / 32768, exactly."""
        return np.concatenate(self.blocks).astype(np.float32) / 32768.0


VLLM_MODEL = {"id": "Qwen/Qwen3-Omni-30B-A3B-Instruct", "object": "model", "created": CREATED, "owned_by": "vllm",
              "root": "Qwen/Qwen3-Omni-30B-A3B-Instruct", "parent": None, "max_model_len": 65536}
OMNI_MODEL = {"id": "Qwen2.5-Omni-3B", "object": "model", "created": 0, "owned_by": "omni-cli",
              "omni": {"voices": ["Chelsie", "Ethan"], "default_voice": "Chelsie", "default_system": "You are Qwen.",
                       "sample_rate": 24000, "has_audio": True, "speech_steps": ["codes", 50.0]}}


def vllm_omni_stream(rec: Recording, fmt: str, empty_audio_chunk: bool = False) -> str:
    """A Qwen3-Omni reply (text and audio) as vLLM-Omni streams it; `fmt`: "wav" (the default: every chunk
    a whole WAV file) or "pcm" (what a request for "pcm16" gets: raw little-endian PCM16).

    Shape taken from github.com/vllm-project/vllm-omni (main, mid-2026), read for facts only:
    - vllm_omni/entrypoints/openai/serving_chat.py @ 00a3619b9b6647378a285e9d135475e2fa085744:
      chat_completion_stream_generator (the first text chunk carries role "assistant" and content "";
      chunks serialized with model_dump_json(exclude_unset=True); finish_reason held back until every
      modality has finished, so the last audio chunk carries "stop"; `data: [DONE]` last) and
      _create_audio_choice(stream=True) (delta {role, content: base64 audio}; an audio chunk also
      carries usage with completion_tokens 0; a chunk with no waveform is an empty content).
    - vllm_omni/entrypoints/openai/protocol/chat_completion.py: OmniChatCompletionStreamResponse adds
      `modality` ("text" / "audio") and `metrics` to vLLM's chunk.
    - vllm_omni/entrypoints/openai/audio_utils_mixin.py @ 1a48fce524602d75904fabb79a4fa18bf3f08842
      (create_audio: soundfile WAV, or RAW PCM_16 for "pcm") and protocol/audio.py
      @ 0131cb5560450800b800e889fb849ea2c851bd3f (AudioChunkMetadata: format, sample_rate_hz,
      frame_count, channels; DEFAULT_AUDIO_FORMAT "wav").
    - tests/entrypoints/openai_api/test_audio_format.py @ 02952af3fdeeb34ca423689b15c97dd688895894:
      `audio_metadata` sits on each streamed choice; a request's "pcm16" becomes format "pcm".
    Qwen3-Omni's talker reports no rate, so vLLM-Omni says 24000.
    """
    ids = {"id": "chatcmpl-5f0c2a7e91d34b68", "object": "chat.completion.chunk", "created": CREATED,
           "model": VLLM_MODEL["id"]}
    usage = {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS, "completion_tokens": 0}

    def text(content: str, last: bool = False) -> str:
        choice = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
        if last:  # the thinker's last step: its finish_reason held back (the audio is not done)
            choice["stop_reason"] = None
        choice["token_ids"] = None
        return event({**ids, "choices": [choice], "modality": "text", "metrics": None})

    def audio(block: np.ndarray | None, finish: str | None = None) -> str:
        if block is None:  # a talker segment with no waveform
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": finish, "stop_reason": None, "token_ids": None}
        else:
            raw = wav_file(block, rec.rate) if fmt == "wav" else block.astype("<i2").tobytes()
            choice = {"index": 0, "delta": {"role": "assistant", "content": b64(raw)}, "logprobs": None,
                      "finish_reason": finish, "stop_reason": None, "token_ids": None,
                      "audio_metadata": {"format": fmt, "sample_rate_hz": rec.rate, "frame_count": len(block),
                                         "channels": 1}}
        return event({**ids, "choices": [choice], "usage": usage, "modality": "audio", "metrics": None})

    first = event({**ids, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}],
                   "prompt_token_ids": None, "prompt_text": None, "modality": "text"})
    half = len(rec.text_parts) // 2
    out = [first, *map(text, rec.text_parts[:half]), audio(rec.blocks[0]), *map(text, rec.text_parts[half:]),
           text("", last=True)]
    for block in rec.blocks[1:-1]:
        out.append(audio(block))
    if empty_audio_chunk:
        out.append(audio(None))
    out += [audio(rec.blocks[-1], finish="stop"), event("[DONE]")]
    return "".join(out)


def omni_serve_stream(rec: Recording, error: dict | None = None, parts: int | None = None) -> str:
    """A spoken reply in OpenAI's streamed shape, as omni-serve sends it: `_stream` in
    omni_cli/api/server.py and `chunk` in omni_cli/api/protocol.py at commit e13a998 (the transcript
    as delta.audio.transcript, the speech as delta.audio.data: base64 PCM16, 24 kHz mono; a last chunk
    with an empty delta, the finish_reason and the reply's `omni` stats; `data: [DONE]`). With `error`,
    the reply fails after `parts` text parts: the error event omni-serve sends, then [DONE]."""
    ids = {"id": "chatcmpl-3b9d6f0e2a5c4718b0e9d2c4a6f81357", "object": "chat.completion.chunk",
           "created": CREATED, "model": OMNI_MODEL["id"]}
    audio_id = "audio_8e2f4c6a0b1d4e3f9a7c5b2d1e0f3a6c"

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return event({**ids, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                      **extra})

    out = [chunk({"role": "assistant", "content": None})]
    blocks = iter(rec.blocks)
    for i, part in enumerate(rec.text_parts[:parts]):
        out.append(chunk({"audio": {"id": audio_id, "transcript": part}}))
        if i % 2 == 1 and (block := next(blocks, None)) is not None:  # speech follows the text it says
            out.append(chunk({"audio": {"id": audio_id, "data": b64(block.astype("<i2").tobytes()),
                                        "expires_at": CREATED + 3600}}))
    if error is not None:
        return "".join(out) + event(error) + event("[DONE]")
    for block in blocks:
        out.append(chunk({"audio": {"id": audio_id, "data": b64(block.astype("<i2").tobytes()),
                                    "expires_at": CREATED + 3600}}))
    seconds = sum(len(b) for b in rec.blocks) / rec.rate
    out.append(chunk({}, "stop", omni={"stats": rec.stats, "audio_seconds": seconds}))
    return "".join(out) + event("[DONE]")


OMNI_SERVE_ERROR = {"error": {"message": "the reply failed: RuntimeError: CUDA error: out of memory",
                              "type": "invalid_request_error", "param": None, "code": "server_error"}}


def recordings() -> dict[str, Recording]:
    """Every fixture file, by name (tests/data/api/<name>.sse)."""
    recs = {}
    wav = Recording("vllm_omni_wav", VLLM_MODEL, ["Hello", "!", " Grüße", " from", " a test tone", "."],
                    split(tone(440, 0.3, 24000), [2400, 3600, 1200]), 24000, 440)
    wav.body = vllm_omni_stream(wav, "wav")
    pcm = Recording("vllm_omni_pcm16", VLLM_MODEL, ["Sure", ",", " here is", " a tone", "."],
                    split(tone(660, 0.3, 24000), [1920, 3840, 1440]), 24000, 660)
    pcm.body = vllm_omni_stream(pcm, "pcm", empty_audio_chunk=True)
    openai = Recording("omni_serve_openai", OMNI_MODEL, ["One", ",", " two", ",", " three", "."],
                       split(tone(330, 0.3, 24000), [2400, 2400, 2400]), 24000, 330,
                       stats={"prompt_tokens": PROMPT_TOKENS, "time_to_first_text": 0.045,
                              "time_to_first_audio": 0.121, "total_time": 0.512, "codes": 15})
    openai.body = omni_serve_stream(openai)
    error = Recording("omni_serve_error_midstream", OMNI_MODEL, ["Hello", " there", " and"],
                      [tone(330, 0.1, 24000)], 24000, 330)
    error.body = omni_serve_stream(error, OMNI_SERVE_ERROR, parts=3)
    for rec in (wav, pcm, openai, error):
        recs[rec.name] = rec
    return recs


RECORDINGS = recordings()
REPLIES = ["vllm_omni_wav", "vllm_omni_pcm16", "omni_serve_openai"]


def write_fixtures() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    for rec in RECORDINGS.values():
        (DATA / f"{rec.name}.sse").write_text(rec.body, encoding="utf-8")


# -- a fake server and a recording sink ---------------------------------------------------------------


class Pieces:
    """A response body in pieces that cut lines in two (as a network does); knows whether it was closed."""

    def __init__(self, body: bytes, size: int = 997) -> None:
        self.body, self.size, self.closed = body, size, False

    def __iter__(self):
        for i in range(0, len(self.body), self.size):
            yield self.body[i: i + self.size]

    def close(self) -> None:
        self.closed = True


class FakeServer:
    """GET /v1/models answers `model`; POST /v1/chat/completions answers `sse` (and keeps the request).
    `transport` is what the client calls instead of the network (api/client.py `_Connection`)."""

    def __init__(self, sse: str, model: dict) -> None:
        self.sse, self.model = sse, model
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.bodies: list[Pieces] = []

    def transport(self, method: str, path: str, headers: dict, body: bytes | None):
        self.headers.append(headers)
        if method == "GET" and path == "/v1/models":
            return 200, {}, [json.dumps({"object": "list", "data": [self.model]}).encode()]
        if method == "POST" and path == "/v1/chat/completions":
            self.requests.append(json.loads(body))
            self.bodies.append(Pieces(self.sse.encode("utf-8")))
            return 200, {"content-type": "text/event-stream"}, self.bodies[-1]
        return 404, {}, [json.dumps({"error": {"message": f"no route {method} {path}"}}).encode()]

    def connect(self) -> RemoteAssistant:
        return RemoteAssistant.connect(URL, transport=self.transport)


class RecordingSink:
    """An audio sink (start/write/close/abort) that notes every call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start(self, rate: int) -> None:
        self.calls.append(("start", rate))

    def write(self, block) -> None:
        self.calls.append(("write", np.array(block, copy=True)))

    def close(self) -> None:
        self.calls.append(("close",))

    def abort(self) -> None:
        self.calls.append(("abort",))

    @property
    def names(self) -> list[str]:
        return [call[0] for call in self.calls]

    @property
    def written(self) -> list[np.ndarray]:
        return [call[1] for call in self.calls if call[0] == "write"]


def fixture_text(name: str) -> str:
    return (DATA / f"{name}.sse").read_text(encoding="utf-8")


def run(remote: RemoteAssistant, prompt: str = "Say something.", **kwargs) -> tuple[list, BaseException | None]:
    """The events `stream` yielded, and the exception that ended it (None if it ended well)."""
    events: list = []
    try:
        for ev in remote.stream(prompt, **kwargs):
            events.append(ev)
    except Exception as exc:  # noqa: BLE001 - the tests look at it
        return events, exc
    return events, None


def user(text) -> dict:
    return {"role": "user", "content": text}


def assistant(text) -> dict:
    return {"role": "assistant", "content": text}


# -- 1. recorded streams through RemoteAssistant ------------------------------------------------------


@pytest.mark.parametrize("name", [*REPLIES, "omni_serve_error_midstream"])
def test_fixture_is_what_the_generator_writes(name):
    path = DATA / f"{name}.sse"
    assert path.read_text(encoding="utf-8") == RECORDINGS[name].body, \
        "the fixture and the generator differ: run `python tests/test_api_shapes.py`"
    assert path.stat().st_size < FIXTURE_LIMIT


def test_wav_chunks_are_what_soundfile_writes():
    """vLLM-Omni writes each chunk with soundfile; the generator's stdlib WAV is byte for byte the same."""
    import soundfile

    samples = RECORDINGS["vllm_omni_wav"].blocks[0]
    out = io.BytesIO()
    soundfile.write(out, samples, 24000, format="WAV")
    assert wav_file(samples, 24000) == out.getvalue()


@pytest.mark.parametrize("name", REPLIES)
def test_recorded_reply_gives_its_text_samples_and_rate(name):
    rec = RECORDINGS[name]
    server = FakeServer(fixture_text(name), rec.model)
    remote = server.connect()
    sink = RecordingSink()
    try:
        events, error = run(remote, options=ReplyOptions(voice="Ethan"), sink=sink)
    finally:
        remote.close()
    assert error is None
    *body, done = events
    assert isinstance(done, Done) and not any(isinstance(ev, Done) for ev in body)

    texts = [ev.text for ev in body if isinstance(ev, TextDelta)]
    assert texts == rec.text_parts  # vLLM-Omni's base64 audio in delta.content is not text
    assert "".join(texts) == rec.text

    blocks = [ev for ev in body if isinstance(ev, AudioBlock)]
    assert [len(b.pcm) for b in blocks] == [len(b) for b in rec.blocks]  # one block per audio chunk
    assert all(b.sample_rate == rec.rate and b.pcm.dtype == np.float32 for b in blocks)
    audio = np.concatenate([b.pcm for b in blocks])
    np.testing.assert_array_equal(audio, rec.audio)  # 16-bit samples: exact
    source = 0.5 * np.sin(2 * np.pi * rec.source_hz * np.arange(len(audio)) / rec.rate)
    assert np.max(np.abs(audio - source)) <= 1 / 32768  # and it is the tone they were made from

    reply = done.reply
    assert reply.text == rec.text
    assert reply.sample_rate == rec.rate
    np.testing.assert_array_equal(reply.audio, rec.audio)

    assert sink.names == ["start"] + ["write"] * len(rec.blocks) + ["close"]
    assert sink.calls[0] == ("start", rec.rate)
    for written, block in zip(sink.written, blocks, strict=True):
        np.testing.assert_array_equal(written, block.pcm)

    [sent] = server.requests
    assert sent["stream"] is True and sent["model"] == rec.model["id"]
    assert sent["modalities"] == ["text", "audio"]
    assert sent["audio"] == {"voice": "Ethan", "format": "pcm16"}
    assert sent["messages"] == [user("Say something.")]
    assert server.bodies[0].closed


def test_omni_serve_stats_come_back_as_server_stats():
    rec = RECORDINGS["omni_serve_openai"]
    remote = FakeServer(fixture_text(rec.name), rec.model).connect()
    try:
        reply = remote.say("Count.")
    finally:
        remote.close()
    assert reply.stats["server_time_to_first_audio"] == 0.121
    assert reply.stats["server_time_to_first_text"] == 0.045
    assert reply.stats["server_total_time"] == 0.512
    assert reply.stats["prompt_tokens"] == PROMPT_TOKENS
    assert 0 <= reply.stats["time_to_first_text"] <= reply.stats["time_to_first_audio"] <= reply.stats["total_time"]


def test_vllm_omni_sample_rate_comes_from_audio_metadata():
    """A talker at another rate (vLLM-Omni reports e.g. Ming-flash-omni's 44.1 kHz): the client plays
    what audio_metadata says, not its 24 kHz default."""
    rec = Recording("ming", VLLM_MODEL, ["Hi", "."], split(tone(500, 0.05, 44100), [1000, 1205]), 44100, 500)
    remote = FakeServer(vllm_omni_stream(rec, "pcm"), rec.model).connect()
    sink = RecordingSink()
    try:
        reply = remote.say("Hi", sink=sink)
    finally:
        remote.close()
    assert reply.sample_rate == 44100
    assert sink.calls[0] == ("start", 44100)
    np.testing.assert_array_equal(reply.audio, rec.audio)


def test_say_sends_the_conversation_and_adds_the_turn():
    rec = RECORDINGS["omni_serve_openai"]
    server = FakeServer(fixture_text(rec.name), rec.model)
    remote = server.connect()
    history = [user("Hi"), assistant("Hello! How can I help?")]
    conv = Conversation(system="Be brief.", turns=[dict(t) for t in history])
    try:
        reply = remote.say("Count to three.", ReplyOptions(temperature=0.7, seed=3, max_text_tokens=64),
                           sink=RecordingSink(), conversation=conv)
    finally:
        remote.close()
    [sent] = server.requests
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, *history, user("Count to three.")]
    assert sent["stream"] is True and sent["modalities"] == ["text", "audio"]
    assert sent["audio"] == {"voice": "Chelsie", "format": "pcm16"}  # the server's default voice
    assert (sent["temperature"], sent["seed"], sent["max_completion_tokens"]) == (0.7, 3, 64)
    assert reply.text == rec.text
    assert conv.turns == [*history, user("Count to three."), assistant(rec.text)]


def test_text_only_asks_for_text_and_no_audio():
    text_reply = "".join(event(d) for d in (
        {"id": "c", "object": "chat.completion.chunk", "created": CREATED, "model": OMNI_MODEL["id"],
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"id": "c", "object": "chat.completion.chunk", "created": CREATED, "model": OMNI_MODEL["id"],
         "choices": [{"index": 0, "delta": {"content": "Just text."}, "finish_reason": None}]},
        {"id": "c", "object": "chat.completion.chunk", "created": CREATED, "model": OMNI_MODEL["id"],
         "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        "[DONE]"))
    server = FakeServer(text_reply, OMNI_MODEL)
    remote = server.connect()
    sink = RecordingSink()
    try:
        reply = remote.say("Hi", ReplyOptions(text_only=True, voice="Ethan"), sink=sink)
    finally:
        remote.close()
    [sent] = server.requests
    assert sent["modalities"] == ["text"]
    assert "audio" not in sent
    assert reply.text == "Just text." and len(reply.audio) == 0
    assert sink.calls == []  # no audio: the sink is never started


def vllm_omni_error_midstream() -> str:
    """vLLM-Omni's stream cut after its first audio chunk by the error event vLLM's
    create_streaming_error_response writes ({"error": {message, type, param, code}}), then [DONE]."""
    events = RECORDINGS["vllm_omni_pcm16"].body.split("\n\n")
    cut = next(i for i, ev in enumerate(events) if '"modality":"audio"' in ev) + 1
    error = {"error": {"message": "CUDA error: out of memory", "type": "InternalServerError", "param": None,
                       "code": 500}}
    return "\n\n".join(events[:cut]) + "\n\n" + event(error) + event("[DONE]")


@pytest.mark.parametrize("shape", ["omni_serve", "vllm_omni"])
def test_error_mid_stream_raises_and_aborts_the_sink(shape):
    if shape == "omni_serve":
        sse, model, texts = fixture_text("omni_serve_error_midstream"), OMNI_MODEL, ["Hello", " there", " and"]
    else:
        sse, model, texts = vllm_omni_error_midstream(), VLLM_MODEL, ["Sure", ","]
    server = FakeServer(sse, model)
    remote = server.connect()
    sink = RecordingSink()
    history = [user("Hi"), assistant("Hello!")]
    conv = Conversation(system="", turns=[dict(t) for t in history])
    try:
        events, error = run(remote, sink=sink, conversation=conv)
    finally:
        remote.close()
    assert isinstance(error, ServerError)
    assert "out of memory" in str(error)
    assert [ev.text for ev in events if isinstance(ev, TextDelta)] == texts  # what came before the error
    assert [type(ev) for ev in events].count(AudioBlock) == 1 and not any(isinstance(ev, Done) for ev in events)
    assert sink.names == ["start", "write", "abort"]  # aborted, never closed
    assert conv.turns == history  # a failed reply is not added
    assert server.bodies[0].closed


def test_stopping_early_aborts_the_sink_and_closes_the_connection():
    rec = RECORDINGS["vllm_omni_wav"]
    server = FakeServer(fixture_text(rec.name), rec.model)
    remote = server.connect()
    sink = RecordingSink()
    try:
        events = remote.stream("Go on.", sink=sink)
        for ev in events:
            if isinstance(ev, AudioBlock):
                break
        events.close()  # what an interrupt does
    finally:
        remote.close()
    assert sink.names == ["start", "write", "abort"]
    assert server.bodies[0].closed  # the server sees the client go and stops the reply


# -- 2. parse_chat_request ----------------------------------------------------------------------------


def test_valid_body_maps_onto_reply_options():
    req = p.parse_chat_request({
        "model": "Qwen2.5-Omni-3B",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "Answer in "},
                                           {"type": "text", "text": "English."}]},
            user("Hi"),
            {"role": "assistant", "content": None, "audio": {"id": "audio_1", "transcript": "Hello!"}},
            {"role": "user", "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}]},
        ],
        "modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "pcm16"}, "stream": True,
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 7, "max_tokens": 64,
        "omni": {"max_codes": 500, "greedy": True}, "stream_options": {"include_usage": True},
    })
    assert req.prompt == "How are you?"
    assert req.system == "Be brief.\nAnswer in English."  # developer is system; system messages joined
    assert req.turns == [user("Hi"), assistant("Hello!")]  # a spoken turn given back by its transcript
    assert req.options == ReplyOptions(voice="Ethan", greedy=True, seed=7, max_text_tokens=64, max_codes=500,
                                       text_only=False, temperature=0.7, top_p=0.9, top_k=20)
    assert (req.stream, req.spoken, req.audio_format, req.model, req.include_usage) == \
        (True, True, "pcm16", "Qwen2.5-Omni-3B", True)
    assert req.audio == []  # no audio said


@pytest.mark.parametrize("extra, text_only", [({}, True), ({"modalities": ["text"]}, True),
                                              ({"modalities": ["text", "audio"]}, False)])
def test_text_only_unless_audio_is_asked_for(extra, text_only):
    req = p.parse_chat_request({"messages": [user("Hi")], **extra})
    assert req.options.text_only is text_only and req.spoken is not text_only
    assert req.system is None and req.turns == [] and req.prompt == "Hi"


def test_number_fields_take_their_type():
    req = p.parse_chat_request({"messages": [user("Hi")], "temperature": 1, "top_k": 5.0,
                                "max_tokens": 10, "max_completion_tokens": 20})
    assert req.options.temperature == 1.0 and isinstance(req.options.temperature, float)
    assert req.options.top_k == 5 and isinstance(req.options.top_k, int)
    assert req.options.max_text_tokens == 20  # max_completion_tokens wins over the older max_tokens


def test_whole_reply_audio_format_defaults_to_wav():
    req = p.parse_chat_request({"messages": [user("Hi")], "modalities": ["text", "audio"]})
    assert req.audio_format == "wav"
    req = p.parse_chat_request({"messages": [user("Hi")], "modalities": ["text", "audio"], "audio": {"format": "FLAC"}})
    assert req.audio_format == "flac"


SYSTEM = {"role": "system", "content": "Be brief."}
IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}  # the server fetches nothing
BAD_BODIES = [
    # (id, body, param, what the message says)
    ("messages not a list", {"messages": "Hi"}, "messages", "messages must be"),
    ("messages empty", {"messages": []}, "messages", "messages must be"),
    ("last message not the user's", {"messages": [user("Hi"), assistant("Hello")]}, "messages", "last message"),
    ("two user messages in a row", {"messages": [user("Hi"), user("Hi")]}, "messages[1]", "messages[1]"),
    ("assistant first", {"messages": [assistant("Hello"), user("Hi")]}, "messages[0]", "messages[0]"),
    ("system after the conversation", {"messages": [user("Hi"), assistant("Hello"), SYSTEM, user("Hi")]},
     "messages[2]", "system message"),
    ("tool role", {"messages": [{"role": "tool", "content": "42"}, user("Hi")]}, "messages[0].role", "messages[0]"),
    ("an image_url part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                                     IMAGE_PART]}]},
     "messages[0].content", "image_url"),
    ("content a number", {"messages": [user(3)]}, "messages[0].content", "messages[0].content"),
    ("modalities video", {"modalities": ["video"]}, "modalities", "modalities"),
    ("modalities empty", {"modalities": []}, "modalities", "modalities"),
    ("modalities audio alone", {"modalities": ["audio"]}, "modalities", "modalities"),
    ("modalities of nulls", {"modalities": [None, None]}, "modalities", "modalities"),  # found by the fuzz: a 500
    ("modalities mixed", {"modalities": ["text", 1]}, "modalities", "modalities"),
    ("stream with audio.format wav", {"stream": True, "modalities": ["text", "audio"], "audio": {"format": "wav"}},
     "audio.format", "audio.format"),
    ("unknown audio.format", {"modalities": ["text", "audio"], "audio": {"format": "aac"}}, "audio.format",
     "audio.format"),
    ("audio not an object", {"audio": "alloy"}, "audio", "audio must be"),
    ("n=2", {"n": 2}, "n", "n must be 1"),
    ("temperature a word", {"temperature": "hot"}, "temperature", "temperature"),
    ("max_completion_tokens 1.5", {"max_completion_tokens": 1.5}, "max_completion_tokens", "max_completion_tokens"),
    ("max_tokens 1.5", {"max_tokens": 1.5}, "max_tokens", "max_tokens"),
    ("stream a word", {"stream": "yes"}, "stream", "stream"),
    ("seed a bool", {"seed": True}, "seed", "seed"),
    ("top_k 2.5", {"top_k": 2.5}, "top_k", "top_k"),
    ("omni.greedy a word", {"omni": {"greedy": "yes"}}, "omni.greedy", "omni.greedy"),
    ("omni not an object", {"omni": ["greedy"]}, "omni", "omni"),
]


@pytest.mark.parametrize("case, body, param, says", BAD_BODIES, ids=[
    c[0] for c in BAD_BODIES])
def test_bad_body_is_a_400_naming_the_field(case, body, param, says):
    if "messages" not in body:
        body = {"messages": [user("Hi")], **body}
    with pytest.raises(p.RequestError) as info:
        p.parse_chat_request(body)
    err = info.value
    assert (err.status, err.param) == (400, param)
    assert says in str(err)
    assert err.body()["error"] == {"message": str(err), "type": "invalid_request_error", "param": param,
                                   "code": None}


def test_input_audio_goes_with_its_user_message():
    wav = b"RIFF....WAVEfmt "  # any bytes: reading them as audio is the server's next step
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    req = p.parse_chat_request({"messages": [{"role": "user", "content": [part, {"type": "text", "text": "Hm?"}]}]})
    assert req.audio == [wav] and req.prompt == "Hm?"
    # An earlier turn keeps its files (the model hears them again); the last message has none here.
    earlier = {"messages": [{"role": "user", "content": [part]}, assistant("Yes."), user("And?")]}
    req = p.parse_chat_request(earlier)
    assert req.turns[0] == {"role": "user", "content": "", "media": {"audio": [wav], "images": []}}
    assert req.turns[1] == {"role": "assistant", "content": "Yes."} and req.audio == [] and req.prompt == "And?"
    bad = {"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}
    with pytest.raises(p.RequestError) as info:
        p.parse_chat_request({"messages": [{"role": "user", "content": [bad]}]})
    assert "not base64" in str(info.value)


def test_image_url_data_goes_with_the_last_user_message():
    png = b"\x89PNG\r\n\x1a\n...."  # any bytes: opening them as an image is the server's next step
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
    req = p.parse_chat_request({"messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}]})
    assert req.images == [png] and req.audio == [] and req.prompt == "?"


def test_body_not_an_object_is_a_400():
    with pytest.raises(p.RequestError) as info:
        p.parse_chat_request([user("Hi")])
    assert info.value.status == 400 and "JSON object" in str(info.value)


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_non_finite_token_cap_is_a_400(value):
    with pytest.raises(p.RequestError) as info:
        p.parse_chat_request({"messages": [user("Hi")], "max_tokens": value})
    assert info.value.param == "max_tokens"


@pytest.mark.parametrize("fields, check", [
    ({"n": None}, lambda req: True),
    ({"modalities": None}, lambda req: req.options.text_only),
    ({"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": None}},
     lambda req: req.audio_format == "wav"),
    ({"max_tokens": 64, "max_completion_tokens": None}, lambda req: req.options.max_text_tokens == 64),
], ids=["n", "modalities", "audio.format", "max_completion_tokens"])
def test_null_means_the_default(fields, check):
    assert check(p.parse_chat_request({"messages": [user("Hi")], **fields}))


def test_server_error_body_says_server_error():
    assert p.RequestError("the reply failed", 500, code="server_error").body()["error"]["type"] == "server_error"


# -- 3. PCM16, SSE framing, whole completions ---------------------------------------------------------


def test_pcm16_round_trip_is_exact_on_every_int16_value():
    every = np.arange(-32768, 32768, dtype="<i2").tobytes()
    samples = p.from_pcm16(every)
    assert samples.dtype == np.float32 and samples[0] == -1.0 and samples[-1] == 32767 / 32768
    assert p.pcm16(samples) == every


def test_pcm16_clips_beyond_full_scale():
    out = np.frombuffer(p.pcm16(np.array([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], dtype=np.float32)), dtype="<i2")
    assert out.tolist() == [-32768, -32768, -16384, 0, 16384, 32767, 32767]


def test_sse_frames_one_event():
    assert p.sse({"text": "Grüße", "n": 1}) == 'data: {"text":"Grüße","n":1}\n\n'.encode("utf-8")
    assert p.sse("[DONE]") == b"data: [DONE]\n\n"


def test_chunk_without_delta_has_no_choices():
    ids = ("chatcmpl-x", "audio_x", CREATED)
    assert p.chunk(ids, "m", None, usage={"total_tokens": 3}) == {
        "id": "chatcmpl-x", "object": "chat.completion.chunk", "created": CREATED, "model": "m", "choices": [],
        "usage": {"total_tokens": 3}}


def test_completion_puts_spoken_text_in_the_transcript():
    ids = ("chatcmpl-x", "audio_x", CREATED)
    wav = wav_file(tone(440, 0.01, 24000), 24000)
    spoken = p.completion(ids, "m", "Hello.", "stop", p.usage(5, 3), wav, {"stats": {}})
    message = spoken["choices"][0]["message"]
    assert message["content"] is None
    assert message["audio"] == {"id": "audio_x", "data": b64(wav), "expires_at": CREATED + 3600,
                                "transcript": "Hello."}
    assert spoken["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    assert spoken["object"] == "chat.completion" and spoken["choices"][0]["finish_reason"] == "stop"

    text = p.completion(ids, "m", "Hello.", "length", p.usage(5, 3), None, {"stats": {}})
    assert text["choices"][0]["message"]["content"] == "Hello." and "audio" not in text["choices"][0]["message"]


# -- 4. no torch on the client side -------------------------------------------------------------------


def test_client_side_imports_no_torch():
    code = ("import sys, omni_cli.api.client, omni_cli.faces.say; "
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


if __name__ == "__main__":
    write_fixtures()
    for rec in RECORDINGS.values():
        print(f"{DATA / rec.name}.sse: {len(rec.body.encode('utf-8'))} bytes")
