"""The commands' side of a server: `RemoteAssistant` talks to `omni-serve` (or a vLLM-Omni deployment) over
the OpenAI-compatible chat completions API and acts like a local `Assistant` for omni-say and omni-chat:
`stream(prompt, options, sink=..., conversation=...)` yields the same `TextDelta`, `AudioBlock` and
`Done(Reply)` events, and feeds the sink the same way (started, written block by block, closed at the end,
aborted on an interrupt or an error), so the faces need no second code path.

It reads both streamed shapes: OpenAI's (`delta.content`, or for a spoken reply `delta.audio.transcript`
and `delta.audio.data`, base64 PCM16 at 24 kHz) and vLLM-Omni's (a top-level `"modality"`; audio as base64
in `delta.content` with `audio_metadata` {format, sample_rate_hz, ...}). Closing the event stream closes
the connection: the server stops the reply.

No torch here, nor anywhere it imports: a client face starts in a fraction of a second. HTTP is the
standard library's `http.client` over one kept-alive connection (`_Connection`), not httpx: importing httpx
and setting up its client took ~0.13 s of a command's start on a CPU box, more than the rest of the client
(the server's side uses httpx only in tests). A server elsewhere is reached through the proxy the
environment names (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`, as curl and httpx read them; an
http:// proxy, tunnelled for an https:// server); this machine's own servers never are.
"""

from __future__ import annotations

import base64
import http.client as http_client
import io
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Generator, Iterator

from ..audio.format import audio_file_kind
from ..config import ReplyOptions
from ..interface import ModelInfo, OmniAssistant
from ..errors import OmniError, UsageError
from ..prompt import Chat, Conversation
from ..runtime.events import AudioBlock, Done, Reply, TextDelta
from ..warm_up import WarmsUp
from . import protocol as p

if TYPE_CHECKING:  # imported once audio comes: the request goes out before numpy loads
    import numpy as np

SERVER_ENV = "OMNI_SERVER"
API_KEY_ENV = "OMNI_API_KEY"
DEFAULT_URL = f"http://127.0.0.1:{p.DEFAULT_PORT}"
PROBE_TIMEOUT = 0.5  # seconds a command waits for a local omni-serve to answer before loading the model


class ServerError(OmniError):
    """The server answered with an error, or could not be reached. Exit code 1 (2 for a request it refused)."""


def model_key(model: str | os.PathLike | None) -> str:
    """What names a model the same way on both sides without loading or downloading it: a digest of a
    folder's resolved path, else of the text (a hub id); None: $OMNI_MODEL, else the built-in tiny model.
    A digest, not the path: a server's /v1/models is read by whoever can reach it, and the folders of the
    machine it runs on are none of their business."""
    import hashlib

    from ..loader import MODEL_ENV, TINY_MODEL_DIR

    if model is None:
        model = os.environ.get(MODEL_ENV, "").strip() or TINY_MODEL_DIR
    path = Path(os.fspath(model)).expanduser()
    named = str(path.resolve()) if path.exists() else os.fspath(model)
    return "sha256:" + hashlib.sha256(named.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def base_url(url: str) -> str:
    """`url` without a trailing slash or `/v1`; http:// added when no scheme is given."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url[: -len("/v1")] if url.endswith("/v1") else url


def proxy_for(scheme: str, host: str) -> str | None:
    """The proxy URL the environment names for a server at `host` (`scheme`: http or https), or None:
    none is set, NO_PROXY names the host, or the host is this machine's (a proxy cannot reach that)."""
    if not any(name.lower().endswith("_proxy") for name in os.environ) or p.is_loopback(host):
        return None  # the common cases, without urllib.request's import
    import urllib.request

    # Undocumented (it is what urllib.request's own proxy handling calls), and absent from typeshed.
    if urllib.request.proxy_bypass_environment(host):  # type: ignore[attr-defined]
        return None
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(scheme) or proxies.get("all")
    if proxy and "://" not in proxy:
        proxy = f"http://{proxy}"
    return proxy or None


def listening(url: str) -> bool:
    """Whether something accepts connections at `url`'s host and port (within PROBE_TIMEOUT)."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    if where.port is None:  # nothing to probe (a connection to port 0, what the socket would try, fails)
        return False
    try:
        socket.create_connection((where.hostname, where.port), timeout=PROBE_TIMEOUT).close()
    except OSError:
        return False
    return True


def health(url: str, timeout: float, hold: str | None = None, release: str | None = None,
           challenge: str | None = None) -> dict:
    """A server's `GET /health` (`hold`: as the client of that id that holds it open, `release`: that lets it
    go: api/keep_alive.py; `challenge`: a nonce the server proves the user's secret with, api/ownership.py),
    on a connection of its own (a proxy as for the server's other requests), never with the API key.
    OSError or ValueError if it does not answer 200 with a JSON object within `timeout` seconds."""
    conn = _Connection(base_url(url), {}, timeout)
    query = "&".join(f"{k}={v}" for k, v in (("hold", hold), ("release", release), ("challenge", challenge)) if v)
    try:
        response = conn.request("GET", "/health" + (f"?{query}" if query else ""))
        body = response.read()
    except (http_client.HTTPException, ServerError) as exc:
        raise OSError(str(exc)) from exc
    finally:
        conn.close()
    if response.status_code != 200:
        raise OSError(f"GET /health: {response.status_code}")
    answer = json.loads(body)
    if not isinstance(answer, dict):
        raise ValueError("GET /health: not a JSON object")  # noqa: TRY004 - the callers take ValueError: not an answer
    return answer


def ask_proof(url: str, timeout: float) -> dict | None:
    """A server's `/health` with a fresh challenge (api/ownership.py): its answer, whose "proof" is what it
    proved (pid, started, port, key) or None where it answered without proving it is this user's
    omni-serve; None for no answer within `timeout`. Nothing but the nonce is sent: no key, no prompt."""
    from urllib.parse import urlsplit

    from . import ownership

    nonce = ownership.new_nonce()
    try:
        port = urlsplit(base_url(url)).port
        answer = health(url, timeout, challenge=nonce)
    except (OSError, ValueError):
        return None
    return {**answer, "proof": ownership.verify(answer.get("proof"), nonce, port)}


def proven_health(url: str, timeout: float) -> dict | None:
    """`ask_proof`'s answer from a server that proved it is this user's omni-serve, else None."""
    found = ask_proof(url, timeout)
    return found if found is not None and found["proof"] is not None else None


def find_local_server(model: str | None, api_key: str | None = None) -> "RemoteAssistant | None":
    """An omni-serve on the default address serving the same model, or None (nothing there, another
    model, no answer within PROBE_TIMEOUT, or a server that does not prove it is this user's: that one
    is sent neither the key nor a prompt)."""
    if not listening(DEFAULT_URL):  # the common case: a refused connection costs no HTTP client import
        return None
    key = model_key(model)
    found = proven_health(DEFAULT_URL, PROBE_TIMEOUT)
    if found is None or found["proof"]["key"] != key:
        return None
    try:
        remote = RemoteAssistant.connect(DEFAULT_URL, api_key, timeout=PROBE_TIMEOUT)
    except OmniError:
        return None
    return remote if remote.info.get("key") == key else None


class RemoteAssistant(WarmsUp):
    """A served model, used like a local `Assistant` (the attributes the faces read, and `stream`)."""

    keeps_media = True  # a conversation's turns keep their clips and images: each request sends them again

    def __init__(self, url: str, api_key: str | None, model: dict, http: "_Connection") -> None:
        """`model`: the server's entry in `GET /v1/models`; `http`: the connection that asked for it."""
        self.url = base_url(url)
        self.api_key = api_key
        self.name = model.get("id", "?")
        self.info = model.get("omni") or {}
        self.is_demo = bool(self.info.get("is_demo", False))
        self.http = http
        self._sent: tuple[str, float] | None = None  # the prompt `send` sent, and when, for `stream`
        # Where a command's wait went before the reply (`--verbose`): the faces fill it.
        self.startup: dict[str, float] = {}

    @classmethod
    def connect(cls, url: str, api_key: str | None = None, timeout: float = 10.0, transport=None) -> "RemoteAssistant":
        """Ask the server what it serves (`GET /v1/models`); a ServerError if it cannot say. `transport`:
        tests' stand-in for the network (see `_Connection`)."""
        url = base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        http = _Connection(url, headers, timeout, transport)
        try:
            response = http.request("GET", "/v1/models")
            body = response.read()
            response.close()  # read to its end: the connection is kept for the reply
        except _NETWORK_ERRORS as exc:
            http.close()
            via = f" through the proxy {http.proxy}" if http.proxy else ""
            raise ServerError(f"no server answers at {url}{via} ({type(exc).__name__}): start one with omni-serve, "
                              "or leave out --server to load the model here") from None
        if response.status_code != 200:
            http.close()
            _check(response, url)
        try:
            models = json.loads(body).get("data") or []
        except (ValueError, AttributeError):
            models = []
        if not models:
            http.close()
            raise ServerError(f"the server at {url} serves no model")
        http.read_timeout = None  # from now on: a queued request waits for the ones before it
        return cls(url, api_key, models[0], http)

    # -- what the faces read --------------------------------------------------------------------------
    @property
    def voices(self) -> list[str]:
        return list(self.info.get("voices") or [])

    @property
    def has_audio(self) -> bool:
        return bool(self.info.get("has_audio", True))

    @property
    def default_voice(self) -> str | None:
        return self.info.get("default_voice") or (self.voices[0] if self.voices else None)

    @property
    def default_system(self) -> str:
        return self.info.get("default_system", "")

    @property
    def sample_rate(self) -> int:
        return int(self.info.get("sample_rate", p.SAMPLE_RATE))

    @property
    def speech_steps(self) -> tuple[str, float | None]:
        """What the server's talker steps are called and how many make a second of audio (its model info,
        from the family's CODES_PER_SECOND); ("codes", None) from a server that does not say."""
        name, rate = self.info.get("speech_steps") or ("codes", None)
        return str(name), (None if rate is None else float(rate))

    @property
    def speaks_only_under_default_system(self) -> bool:
        return bool(self.info.get("speaks_only_under_default_system", False))

    @property
    def model_info(self) -> ModelInfo:
        """The served model as the faces show it, from what the server says of it (an omni-serve says all;
        another server little: then the fields are left at their defaults)."""
        unit, per_second = self.speech_steps
        limits = self.info.get("limits") or {}
        sampling = self.info.get("text_sampling") or {}
        return ModelInfo(
            name=self.name, title=self.info.get("title"), where=self.url, is_demo=self.is_demo,
            has_audio=self.has_audio, voices=tuple(self.voices), default_voice=self.default_voice,
            default_system=self.default_system, speaks_only_under_default_system=self.speaks_only_under_default_system,
            sample_rate=self.sample_rate, step_unit=unit, steps_per_second=per_second if self.info else None,
            default_text_tokens=limits.get("text"), default_steps=limits.get("codes"),
            max_steps=self.info.get("max_steps"), max_context=self.info.get("max_context"),
            text_sampling={k: v for k, v in sampling.items() if k != "do_sample"},
            text_samples=bool(sampling.get("do_sample", True)))

    def interrupt(self) -> None:
        """Stop the reply that is streaming: the connection is closed, which the server takes as its client
        leaving (it stops generating); the next request opens a new one."""
        self._sent = None
        self.http.close()

    def conversation(self, system: str | None = None) -> Chat:
        return Chat(self, Conversation(system=self.default_system if system is None else system))

    def close(self) -> None:
        self._sent = None
        self.http.close()

    # -- a reply --------------------------------------------------------------------------------------
    def say(self, prompt: str, options: ReplyOptions | None = None, **kwargs) -> Reply:
        events = self.stream(prompt, options, **kwargs)
        try:
            for event in events:
                if isinstance(event, Done):
                    return event.reply
        finally:
            events.close()
        raise ServerError("the reply ended without its last event")

    def send(self, prompt: str, options: ReplyOptions | None = None, *, conversation: Conversation | None = None,
             audio=None, images=None, **fields) -> None:
        """Send the request of the next `stream` call (the same arguments, but the sink) now: the server works
        on the reply while this side sets up its outputs (omni-say). `close` withdraws it."""
        self._sent = (prompt, self._post(prompt, options, conversation, audio, images, fields))

    def stream(self, prompt: str, options: ReplyOptions | None = None, *, sink=None,
               conversation: Conversation | None = None, audio=None, images=None,
               **fields) -> Generator[TextDelta | AudioBlock | Done, None, None]:
        """The reply's events as the server streams them; the audio also goes to `sink`. `audio`: clips
        (`media.AudioClip`s) said with the prompt, sent as `input_audio` parts (WAV); `images`: PIL images
        shown with it, sent as `image_url` parts (PNG data: URLs). The request is the one `send` sent, if
        it sent this prompt's."""
        sent, self._sent = self._sent, None
        if sent is not None and sent[0] != prompt:
            self.http.close()
            sent = None
        reader = _Reader(sink)
        try:
            t0 = sent[1] if sent is not None else self._post(prompt, options, conversation, audio, images, fields)
            response = self.http.receive()
            try:
                if response.status_code != 200:
                    response.read()
                    _check(response, self.url)
                for data in _events(response):
                    for event in reader.feed(data, t0):
                        yield event
                response.read()  # what follows `[DONE]` (the body's end): the connection serves the next turn
            finally:
                response.close()  # before its end (an interrupt, an error): the server sees us go
            reply = reader.reply(t0)
        except _NETWORK_ERRORS as exc:
            reader.abort()
            self.http.close()
            raise self._broken(exc) from None
        except BaseException:
            reader.abort()
            raise
        if conversation is not None:
            dropped = int(reply.stats.get("dropped_exchanges") or 0)
            if dropped:  # the server fit the conversation to its context as a local model does: so does its history
                logging.getLogger(__name__).info("dropped the oldest %d exchange(s) to fit the context", dropped)
                del conversation.turns[: 2 * dropped]
            conversation.add(prompt, reply.text, {"audio": audio, "images": images})
        yield Done(reply)

    def _post(self, prompt, options, conversation, audio, images, fields) -> float:
        """POST the request (its response is `self.http.receive()`); when it was sent."""
        from dataclasses import replace

        self._after_warm_up()  # a background warm-up's reply holds the connection until it ends
        opts = replace(options or ReplyOptions(), **fields).check()
        body = self._body(prompt, opts, conversation, audio, images)
        t0 = time.perf_counter()
        try:
            self.http.send("POST", "/v1/chat/completions", body)
            return t0
        except _NETWORK_ERRORS as exc:
            raise self._broken(exc) from None

    def _broken(self, exc: BaseException) -> ServerError:
        return ServerError(f"the connection to {self.url} broke ({type(exc).__name__}: {exc})")

    def _body(self, prompt: str, opts: ReplyOptions, conversation: Conversation | None, audio=None,
              images=None) -> dict:
        messages = [{"role": "user", "content": _content(prompt, audio, images)}]
        if conversation is not None:  # each earlier turn with its clips and images, as the model heard them
            turns = [{"role": t["role"], "content": _content(t["content"], *_media(t))} for t in conversation.turns]
            messages = ([{"role": "system", "content": conversation.system}] if conversation.system else []) \
                + turns + messages
        spoken = not opts.text_only and self.has_audio
        body: dict = {"model": self.name, "messages": messages, "stream": True,
                      "modalities": ["text", "audio"] if spoken else ["text"]}
        if spoken:
            voice = opts.voice or self.default_voice
            body["audio"] = {"format": "pcm16", **({"voice": voice} if voice else {})}
            if voice and not self.info:  # not an omni-serve: vLLM-Omni reads the voice from a top-level field
                body["voice"] = voice
        for key, value in (("temperature", opts.temperature), ("top_p", opts.top_p), ("top_k", opts.top_k),
                           ("seed", opts.seed), ("max_completion_tokens", opts.max_text_tokens)):
            if value is not None:
                body[key] = value
        extra = {k: v for k, v in (("max_codes", opts.max_codes), ("greedy", opts.greedy or None)) if v is not None}
        if extra:
            body["omni"] = extra
        return body


if TYPE_CHECKING:  # pragma: no cover - the type checker holds the class to what the faces use of it
    def _an_omni_assistant(assistant: RemoteAssistant) -> OmniAssistant:
        return assistant


class _Reader:
    """Streamed chunks -> events; the sink fed as the local engine feeds it."""

    def __init__(self, sink) -> None:
        self.sink = sink
        self.started = False
        self.text: list[str] = []
        self.pcm: list[np.ndarray] = []
        self.rate = p.SAMPLE_RATE
        self.omni: dict = {}
        self.times: dict[str, float] = {}

    def feed(self, data: dict, t0: float) -> list[TextDelta | AudioBlock]:
        if "error" in data:  # the reply failed on the server after it started
            raise ServerError(f"the server's reply failed: {_message(data)}")
        self.omni = data.get("omni") or self.omni
        events: list[TextDelta | AudioBlock] = []
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            text, audio, rate = _delta_parts(data, choice, delta)
            if text:
                self.times.setdefault("time_to_first_text", time.perf_counter() - t0)
                self.text.append(text)
                events.append(TextDelta(text))
            if audio is not None and len(audio):
                self.times.setdefault("time_to_first_audio", time.perf_counter() - t0)
                events.append(self._audio(audio, rate))
        return events

    def _audio(self, pcm: "np.ndarray", rate: int) -> AudioBlock:
        if self.pcm and rate != self.rate:
            raise ServerError(f"the server changed the sample rate mid-reply ({self.rate} -> {rate} Hz)")
        self.rate = rate
        if self.sink is not None:
            if not self.started:
                self.sink.start(rate)
                self.started = True
            self.sink.write(pcm)
        self.pcm.append(pcm)
        return AudioBlock(pcm, rate)

    def reply(self, t0: float) -> Reply:
        if self.sink is not None and self.started:
            self.sink.close()
        stats = dict(self.omni.get("stats") or {})
        server = {f"server_{k}": stats.pop(k) for k in ("time_to_first_audio", "time_to_first_text", "total_time")
                  if k in stats}
        stats.update(server, **self.times, total_time=time.perf_counter() - t0, started_at=t0)
        import numpy as np

        audio = np.concatenate(self.pcm) if self.pcm else np.zeros(0, dtype=np.float32)
        return Reply("".join(self.text), [], [], audio, self.rate, stats)

    def abort(self) -> None:
        if self.sink is not None and self.started:
            try:
                self.sink.abort()
            except Exception:  # noqa: BLE001 - the error being raised is what counts
                pass


def _media(turn: dict) -> tuple[list, list]:
    media = turn.get("media") or {}
    return media.get("audio") or [], media.get("images") or []


def _content(text: str, audio, images) -> str | list[dict]:
    """A user message's content: the text, or with clips or images, parts (the images as PNG data: URLs,
    the clips as WAV `input_audio`, then the text), the order the model takes them in."""
    if not (audio or images):
        return text
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + p.b64(_png(image))}}
             for image in images or []]
    parts += [{"type": "input_audio", "input_audio": {"data": p.b64(_wav(clip)), "format": "wav"}}
              for clip in audio or []]
    return parts + ([{"type": "text", "text": text}] if text else [])


def _png(image) -> bytes:
    """A PIL image as PNG bytes (lossless: the server sees what this side opened)."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _wav(clip) -> bytes:
    """A clip as a float WAV file (lossless: the server reads it as it would the file)."""
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, clip.pcm, clip.sample_rate, format="WAV", subtype="FLOAT")
    return out.getvalue()


def _delta_parts(data: dict, choice: dict, delta: dict) -> tuple[str, np.ndarray | None, int]:
    """(text, audio, sample rate) of one choice's delta, in either server's shape."""
    modality = data.get("modality")
    if modality == "audio":  # vLLM-Omni: base64 audio in delta.content, described by audio_metadata
        meta = choice.get("audio_metadata") or data.get("audio_metadata") or {}
        content = delta.get("content")
        if not content:
            return "", None, p.SAMPLE_RATE
        return "", *_decode_audio(base64.b64decode(content), meta)
    text = delta.get("content") or ""
    audio = delta.get("audio") or {}
    text += audio.get("transcript") or ""
    data_b64 = audio.get("data")
    return text, (p.from_pcm16(base64.b64decode(data_b64)) if data_b64 else None), p.SAMPLE_RATE


def _decode_audio(raw: bytes, meta: dict) -> tuple[np.ndarray, int]:
    """Audio bytes as vLLM-Omni describes them: a WAV (or other file) or raw PCM16 / float32 samples."""
    fmt = str(meta.get("format", "")).lower()
    rate = int(meta.get("sample_rate_hz") or meta.get("sample_rate") or p.SAMPLE_RATE)
    if audio_file_kind(raw) is not None or fmt in ("wav", "flac", "ogg", "mp3"):
        import soundfile

        pcm, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
        return pcm.mean(axis=1) if pcm.shape[1] > 1 else pcm[:, 0], int(rate)
    if fmt in ("f32", "f32le", "float32", "pcm_f32le"):
        import numpy as np

        return np.frombuffer(raw, dtype="<f4").astype(np.float32), rate
    return p.from_pcm16(raw), rate  # pcm, pcm16, s16le, or not said


def _events(response) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream, until `[DONE]`."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue  # comments, event names, blank separators
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            yield json.loads(payload)
        except json.JSONDecodeError:
            raise ServerError(f"the server sent something that is not JSON: {payload[:80]!r}") from None


def _message(data: dict) -> str:
    err = data.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err or data.get("detail") or data)


def _check(response: "_Response", url: str) -> None:
    """A ServerError (UsageError for what the request itself got wrong) for a response that is not 200
    (whose body has been read)."""
    if response.status_code == 200:
        return
    text = response.body.decode("utf-8", "replace")
    try:
        message = _message(json.loads(text))
    except (json.JSONDecodeError, ValueError, AttributeError):
        message = text[:200] or response.reason_phrase
    if response.status_code == 401:
        raise ServerError(f"the server at {url} wants an API key: {message} (give --api-key or set {API_KEY_ENV})")
    if 400 <= response.status_code < 500:
        raise UsageError(f"the server refused the request ({response.status_code}): {message}")
    raise ServerError(f"the server failed ({response.status_code}): {message}")


# -- HTTP -------------------------------------------------------------------------------------------------

_NETWORK_ERRORS = (OSError, http_client.HTTPException)


class _Response:
    """A response's status and body: the body read whole (`read`) or line by line (`iter_lines`)."""

    def __init__(self, status: int, reason: str, pieces: Iterator[bytes], close) -> None:
        self.status_code, self.reason_phrase = status, reason
        self.body = b""
        self._pieces, self._close = pieces, close

    def read(self) -> bytes:
        self.body = b"".join(self._pieces)
        return self.body

    def iter_lines(self) -> Iterator[str]:
        """Lines without their ends (LF or CRLF), as they arrive."""
        rest = b""
        for piece in self._pieces:
            rest += piece
            *lines, rest = rest.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8")
        if rest:
            yield rest.rstrip(b"\r").decode("utf-8")

    def close(self) -> None:
        self._close()


class _Connection:
    """One kept-alive HTTP/1.1 connection to a server (http or https), opened on first use and again after
    the server or a broken stream closed it. A request on a kept connection that the server had closed
    meanwhile (it closes idle ones: uvicorn after 5 s, while a person types the next turn) is sent once
    more on a new one; no response had begun, so the server never saw it.

    `timeout`: seconds for connecting, and for each read until `read_timeout` is set otherwise (None: reads
    wait as long as the server takes). `transport`, for tests: a callable (method, path, headers, body
    bytes) -> (status, headers, iterable of body pieces), used instead of the network; a body iterable
    with a `close` method is closed when the response is."""

    _STALE = (http_client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)

    def __init__(self, url: str, headers: dict, timeout: float | None, transport=None) -> None:
        from urllib.parse import urlsplit

        where = urlsplit(url)
        self.https = where.scheme == "https"
        self.host, self.port = where.hostname or "127.0.0.1", where.port
        self.prefix = where.path.rstrip("/")
        self.headers = {"Accept": "application/json, text/event-stream", **headers}
        self.timeout = self.read_timeout = timeout
        self.transport = transport
        self.conn: http_client.HTTPConnection | None = None
        self.proxy = proxy_for(where.scheme or "http", self.host) if transport is None else None
        self.reused = False  # the open connection has carried a whole response before
        self._request: tuple | None = None  # the request between `send` and `receive` (method, path, headers, body)

    def request(self, method: str, path: str, body: dict | None = None) -> _Response:
        self.send(method, path, body)
        return self.receive()

    def send(self, method: str, path: str, body: dict | None = None) -> None:
        """Write a request (a JSON body); its response is `receive`'s."""
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = dict(self.headers, **({"Content-Type": "application/json"} if data is not None else {}))
        self._request = (method, self.prefix + path, headers, data)
        if self.transport is None:
            self._write(retry=self.reused)

    def _open(self) -> http_client.HTTPConnection:
        """A connection to the server, or to the proxy (`self.proxy`): for an https:// server through a
        tunnel (CONNECT) that TLS runs in; an http:// server's requests go to the proxy whole (`_write`)."""
        kind = http_client.HTTPSConnection if self.https else http_client.HTTPConnection
        if self.proxy is None:
            return kind(self.host, self.port, timeout=self.timeout)
        host, port, auth = _proxy_parts(self.proxy, self.host)
        conn = kind(host, port, timeout=self.timeout)
        if self.https:
            conn.set_tunnel(self.host, self.port or 443, headers=auth)
        return conn

    def _write(self, retry: bool) -> None:
        if self.conn is None:
            self.conn = self._open()
            self.reused = False
        assert self._request is not None  # `send` set it, then called this
        method, path, headers, data = self._request
        if self.proxy is not None and not self.https:  # the proxy is sent the whole URL, and its login
            path = f"http://{self.host}:{self.port or 80}{path}"
            headers = {**headers, **_proxy_parts(self.proxy, self.host)[2]}
        try:
            self.conn.request(method, path, body=data, headers=headers)
        except self._STALE:
            self.close()
            if not retry:
                raise
            self._write(retry=False)
        except BaseException:
            self.close()
            raise

    def receive(self) -> _Response:
        """The response to the request `send` wrote, once its status and headers are in."""
        if self._request is None:
            raise RuntimeError("receive() without a request: call send() first")
        if self.transport is not None:
            status, _headers, pieces = self.transport(*self._request)
            return _Response(status, "", iter(pieces), getattr(pieces, "close", lambda: None))
        retry = self.reused
        while True:
            try:
                # `send` connected (`_write`), and so does a retry below; a failed one has raised.
                assert self.conn is not None
                if self.conn.sock is not None:
                    self.conn.sock.settimeout(self.read_timeout)
                raw = self.conn.getresponse()
                break
            except self._STALE:
                self.close()
                if not retry:
                    raise
                retry = False
                self._write(retry=False)
            except BaseException:
                self.close()
                raise
        return _Response(raw.status, raw.reason, _pieces(raw), lambda: self._done(raw))

    def _done(self, raw: http_client.HTTPResponse) -> None:
        """A response is finished with: the connection is kept for the next request if the body was read
        to its end, else closed (the server sees a reply it still sends stopped)."""
        if raw.isclosed() and self.conn is not None:
            self.reused = True
        else:
            self.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _proxy_parts(proxy: str, server: str) -> tuple[str, int, dict]:
    """(host, port, Proxy-Authorization header if the URL holds a login) of an http:// proxy URL."""
    from urllib.parse import unquote, urlsplit

    where = urlsplit(proxy)
    if where.scheme != "http" or not where.hostname:
        raise ServerError(f"cannot use the proxy {proxy}: only http://HOST:PORT proxies are supported (NO_PROXY={server} "
                          "reaches the server without it)")
    auth = {}
    if where.username:
        login = f"{unquote(where.username)}:{unquote(where.password or '')}".encode()
        auth["Proxy-Authorization"] = "Basic " + base64.b64encode(login).decode("ascii")
    return where.hostname, where.port or 80, auth


def _pieces(raw: http_client.HTTPResponse) -> Iterator[bytes]:
    """A response's body as it arrives (chunked transfer undone), up to 64 KiB at a time."""
    while True:
        piece = raw.read1(65536)
        if not piece:
            raw.read()  # closes a Content-Length body read to its end (read1 leaves it open), so the connection is free
            return
        yield piece
