"""The OpenAI-compatible chat completions API, as plain data: a request body checked and turned into what
the assistant takes (a prompt, the conversation before it, `ReplyOptions`), and the response shapes built
(a completion, streamed chunks as server-sent events, PCM16 audio in base64).

The shapes are OpenAI's (`POST /v1/chat/completions` with `modalities: ["text", "audio"]` and `audio:
{voice, format}`): streamed, the text of a spoken reply comes as `delta.audio.transcript` and the speech
as `delta.audio.data` (base64 PCM16, mono, 24 kHz); a text-only reply as `delta.content`; not streamed,
`message.audio.data` is a whole file (WAV by default). What omni-cli adds is optional and namespaced: a
request's `top_k` and `omni: {max_codes, greedy}`, a response's `omni` field (the reply's stats) and
`GET /v1/models`' `omni` field (voices, default system prompt, sample rate).

It knows neither the HTTP server (api/server.py) nor the client (api/client.py), and no torch: the client
imports it too.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..audio.format import from_pcm16, pcm16, to_int16, wav_bytes  # noqa: F401 (from_pcm16: the client reads it here)
from ..config import ReplyOptions
from ..errors import UsageError
from ..limits import LimitError

if TYPE_CHECKING:  # numpy is imported where samples are made or read: a client sends its request first
    import numpy as np

SAMPLE_RATE = 24_000  # OpenAI's PCM16 is 24 kHz mono, as both model families speak
PORT_ENV = "OMNI_PORT"


def default_port() -> int:
    """omni-serve's port on 127.0.0.1, where the commands look for it: $OMNI_PORT, else 8484 (a value that
    is not a port is ignored: the commands' probe must not fail on it)."""
    value = os.environ.get(PORT_ENV, "").strip()
    return int(value) if value.isdigit() and 0 < int(value) < 65536 else 8484


DEFAULT_PORT = default_port()
QUEUE_HEADER = "X-Omni-Queue-Position"  # requests ahead of this one when it was queued (0: none)
WHOLE_FORMATS = ("wav", "flac", "mp3", "opus", "pcm16")  # `audio.format` of a reply that is not streamed


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RequestError(Exception):
    """A request the API refuses: an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A checked chat completions request, in the assistant's terms."""

    prompt: str  # the last user message's text
    # the user/assistant messages before it; a user message with audio or images has "media": {"audio":
    # [file bytes], "images": [file bytes]}, read by the server into the conversation's clips and images
    turns: list[dict] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)  # audio files said with the last user message
    images: list[bytes] = field(default_factory=list)  # image files shown with it (data: URLs' bytes)
    system: str | None = None  # None: the model's default system prompt
    options: ReplyOptions = field(default_factory=ReplyOptions)
    stream: bool = False
    spoken: bool = False  # "audio" in modalities: the reply is spoken
    audio_format: str = "pcm16"
    model: str | None = None
    include_usage: bool = False


def parse_chat_request(body: object) -> ChatRequest:
    """Check a decoded JSON body; raise RequestError (400) saying which field is wrong and how."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    system: str | None = None
    turns: list[dict] = []  # as ChatRequest.turns
    messages = _messages(body)
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "system":
            if turns:
                raise RequestError("a system message must come before the conversation", param=f"messages[{i}]")
            system = content if system is None else f"{system}\n{content}"
            continue
        want = "user" if len(turns) % 2 == 0 else "assistant"
        if role != want:
            raise RequestError(f"messages[{i}] is a {role} message where a {want} message was expected: the "
                               "conversation alternates user and assistant, starting and ending with user",
                               param=f"messages[{i}]")
        turns.append({"role": role, "content": content})
        if (message["audio"] or message["images"]) and i != len(messages) - 1:
            # An earlier turn's clips and images (the files' bytes: the server reads them) stay with it.
            turns[-1]["media"] = {"audio": message["audio"], "images": message["images"]}
    if not turns or turns[-1]["role"] != "user":
        raise RequestError("the last message must be the user's", param="messages")
    # A field given as null means its default, as in OpenAI's API.
    modalities = body.get("modalities")
    modalities = ["text"] if modalities is None else modalities
    if (not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities)
            or sorted(modalities) not in (["text"], ["audio", "text"])):
        raise RequestError('modalities must be ["text"] or ["text", "audio"]', param="modalities")
    stream = bool(_typed(body, "stream", bool, False))
    audio = "audio" in modalities
    spec = body.get("audio") or {}
    if not isinstance(spec, dict):
        raise RequestError("audio must be an object: {\"voice\": ..., \"format\": ...}", param="audio")
    voice = _typed(spec, "voice", str, None, "audio.voice")
    fmt = (_typed(spec, "format", str, None, "audio.format") or ("pcm16" if stream else "wav")).lower()
    if stream and fmt != "pcm16":
        raise RequestError("a streamed reply's audio is PCM16: give audio.format \"pcm16\"", param="audio.format")
    if fmt not in WHOLE_FORMATS:
        raise RequestError(f"audio.format must be one of {', '.join(WHOLE_FORMATS)}", param="audio.format")
    if _typed(body, "n", int, None) not in (None, 1):
        raise RequestError("n must be 1", param="n")
    extra = body.get("omni") or {}
    if not isinstance(extra, dict):
        raise RequestError("omni must be an object", param="omni")
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    options = ReplyOptions(
        voice=voice, greedy=bool(_typed(extra, "greedy", bool, False, "omni.greedy")),
        seed=_typed(body, "seed", int, None), max_text_tokens=_number(body.get(limit), limit, int),
        max_codes=_typed(extra, "max_codes", int, None, "omni.max_codes"), text_only=not audio,
        temperature=_number(body.get("temperature"), "temperature", float),
        top_p=_number(body.get("top_p"), "top_p", float), top_k=_number(body.get("top_k"), "top_k", int))
    _check_ranges(options, {"max_text_tokens": limit, "max_codes": "omni.max_codes"})
    stream_options = body.get("stream_options") or {}
    return ChatRequest(
        prompt=turns[-1]["content"], turns=turns[:-1], audio=messages[-1]["audio"], images=messages[-1]["images"],
        system=system, options=options,
        stream=stream, spoken=audio,
        audio_format=fmt, model=_typed(body, "model", str, None),
        include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")))


# The most reply tokens (or talker steps) a request may ask for: more than any context holds, small
# enough that no arithmetic on it overflows (the server's own context then says how many fit).
MAX_TOKENS = 2**31 - 1


def _check_ranges(options: ReplyOptions, names: dict[str, str]) -> None:
    """Every number of the request in its range (`ReplyOptions.check`'s rules, and the token caps at most
    MAX_TOKENS), as a 400 naming the field by the request's name for it (`names`: the options' names
    that differ)."""
    for key in ("max_text_tokens", "max_codes"):
        value = getattr(options, key)
        if value is not None and value > MAX_TOKENS:
            name = names.get(key, key)
            raise RequestError(f"{name} must be at most {MAX_TOKENS} (got {value:.3g}): no context holds more",
                               param=name)
    try:
        options.check()
    except LimitError as exc:
        raise api_error(exc, names) from None


def api_error(exc: UsageError, names: dict[str, str] | None = None) -> RequestError:
    """A UsageError of the assistant (or of a request's files) as the API's error: a `LimitError` keeps
    its status and names its field (`names`: the reply options' names the API spells otherwise)."""
    if not isinstance(exc, LimitError):
        return RequestError(str(exc))
    names = {"max_text_tokens": "max_completion_tokens", "max_codes": "omni.max_codes"} if names is None else names
    param = names.get(exc.param or "", exc.param)
    message = str(exc)
    if param and exc.param and param != exc.param and message.startswith(exc.param):
        message = param + message[len(exc.param):]
    return RequestError(message, exc.status, param=param)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {\"role\": ..., \"content\": ...}", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role", param=f"messages[{i}]")
        role = "system" if message["role"] == "developer" else message["role"]
        if role not in ("system", "user", "assistant"):
            raise RequestError(f"messages[{i}] has role {message['role']!r}: system, user or assistant only",
                               param=f"messages[{i}].role")
        text, audio, images = _content(message, i)
        out.append({"role": role, "content": text, "audio": audio, "images": images})
    return out


def _content(message: dict, i: int) -> tuple[str, list[bytes], list[bytes]]:
    """A message's text, audio and images: a string, or text parts and (a user's) `input_audio` parts
    (base64 audio files) and `image_url` parts (data: URLs; the server fetches nothing); other parts are
    input this server does not take."""
    content = message.get("content")
    if content is None and message["role"] == "assistant" and isinstance(message.get("audio"), dict):
        content = message["audio"].get("transcript")  # a spoken reply given back with its transcript
    if isinstance(content, str):
        return content, [], []
    if isinstance(content, list):
        texts, audio, images = [], [], []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            user = message["role"] == "user"
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "input_audio" and user:
                audio.append(_audio_part(part, i))
            elif kind == "image_url" and user:
                images.append(_image_part(part, i))
            else:
                raise RequestError(f"messages[{i}] has a {kind!r} part: this server takes text parts, and "
                                   "input_audio and image_url parts in user messages", param=f"messages[{i}].content")
        return "".join(texts), audio, images
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts",
                       param=f"messages[{i}].content")


# Characters of base64 decoded at a time (a multiple of 4): binascii holds the GIL through one call, 40 ms
# for 16 MB, and the server's event loop (its /health) needs the GIL between slices.
B64_SLICE = 1 << 20


def b64_bytes(text: str) -> bytes:
    """Strict base64 (`validate=True`: a ValueError for any other character or bad padding), decoded slice
    by slice: the same bytes as one call."""
    if len(text) <= B64_SLICE:
        return base64.b64decode(text, validate=True)
    return b"".join(base64.b64decode(text[at:at + B64_SLICE], validate=True) for at in range(0, len(text), B64_SLICE))


def _image_part(part: dict, i: int) -> bytes:
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise RequestError(f"messages[{i}] has an image_url that is not a base64 data: URL (this server fetches "
                           "nothing: send the image inline)", param=f"messages[{i}].content")
    try:
        return b64_bytes(url.split(";base64,", 1)[1])
    except ValueError:
        raise RequestError(f"messages[{i}]'s image_url data is not base64", param=f"messages[{i}].content") from None


def _audio_part(part: dict, i: int) -> bytes:
    spec = part.get("input_audio")
    data = spec.get("data") if isinstance(spec, dict) else None
    if not isinstance(data, str) or not data:
        raise RequestError(f"messages[{i}] has an input_audio part without base64 data",
                           param=f"messages[{i}].content")
    try:
        return b64_bytes(data)
    except ValueError:
        raise RequestError(f"messages[{i}]'s input_audio data is not base64", param=f"messages[{i}].content") from None


def _typed(obj: dict, key: str, kind: type, default, name: str | None = None):
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        what = {int: "an integer", str: "a string", bool: "true or false"}.get(kind, f"a {kind.__name__}")
        raise RequestError(f"{name or key} must be {what}", param=name or key)
    return value


def _number(value, name: str, kind: type):
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (kind is int and value != int(value))):
        raise RequestError(f"{name} must be a{'n integer' if kind is int else ' number'}", param=name)
    return kind(value)


# -- responses -----------------------------------------------------------------------------------------


def new_ids() -> tuple[str, str, int]:
    """(completion id, audio id, created): a reply's identifiers."""
    return f"chatcmpl-{uuid.uuid4().hex}", f"audio_{uuid.uuid4().hex}", int(time.time())


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def chunk(ids: tuple[str, str, int], model: str, delta: dict | None = None, finish: str | None = None,
          **extra) -> dict:
    """One `chat.completion.chunk`; `extra`: top-level fields (usage, omni)."""
    cid, _audio_id, created = ids
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, **extra}


def sse(data: dict | str) -> bytes:
    """One server-sent event (`data: ...` and a blank line)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode("utf-8")


def audio_file(pcm: "np.ndarray", fmt: str) -> bytes:
    """A whole reply's speech as a file in `fmt` (WAV PCM16 by default; pcm16: raw samples). 16-bit
    samples (pcm16, WAV, FLAC) by the one PCM16 rule (audio/format.py), as omni-say's own files have them."""
    if fmt == "pcm16":
        return pcm16(pcm)
    if fmt == "wav":
        return wav_bytes(pcm, SAMPLE_RATE)
    import numpy as np
    import soundfile

    from ..audio.sinks import FILE_FORMATS

    major, subtype, _ = FILE_FORMATS["ogg" if fmt == "opus" else fmt]
    if fmt == "opus":
        subtype = "OPUS"
    samples = to_int16(pcm) if subtype == "PCM_16" else np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)
    out = io.BytesIO()
    soundfile.write(out, samples, SAMPLE_RATE, format=major, subtype=subtype)
    return out.getvalue()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: the prompt's tokens found in the kept context (not prefilled)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def reply_usage(reply) -> dict:
    """The usage of a reply (runtime.events.Reply): its stats' prompt and prefilled tokens, its text ids."""
    prompt = reply.stats.get("prompt_tokens", 0)
    return usage(prompt, len(reply.text_ids), prompt - reply.stats.get("prefill_tokens", prompt))


def completion(ids: tuple[str, str, int], model: str, text: str, finish: str, use: dict, audio: bytes | None,
               omni: dict) -> dict:
    """A whole `chat.completion`: the text as `content`, or, spoken, as the audio's transcript."""
    cid, audio_id, created = ids
    message: dict = {"role": "assistant", "content": text, "refusal": None}
    if audio is not None:
        message["content"] = None
        message["audio"] = {"id": audio_id, "data": b64(audio), "expires_at": created + 3600, "transcript": text}
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": use, "omni": omni}


def models_list(name: str, info: dict) -> dict:
    """`GET /v1/models`: the one model served, with what a client needs to act like a local one."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "omni-cli",
                                        "omni": info}]}
