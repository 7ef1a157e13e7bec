"""omni-serve's HTTP side: a Starlette app that serves one loaded `Assistant` with the OpenAI-compatible
chat completions API (api/protocol.py), streamed as server-sent events or whole.

The engine answers one request at a time. Requests queue on one worker thread (`EngineWorker`) in arrival
order; each response says how many were ahead of it (`X-Omni-Queue-Position`). A job hands its events to
the request's asyncio task through a queue; when the client goes away (Starlette cancels the streaming
task, or a whole-reply request sees the disconnect), the job is cancelled: a queued job is skipped, a
running one is stopped at once (`Engine.interrupt`: its event stream raises, its threads stop).
`--api-key` makes every endpoint but `/health` need `Authorization: Bearer <key>`; `/health?challenge=N`
also answers the proof that this server is the user's own (api/ownership.py). A bad body is a 400
with an OpenAI-shaped error; no request can take the server down.

What a request may cost is bounded (`Limits`): the body is read in pieces on the event loop, its size
checked against `Content-Length` first and counted as it comes (413 over `body_bytes`), a body that
stalls or drags is a 408; everything that takes time with what was read (the JSON's depth scanned and the
JSON parsed, base64 and the audio and images decoded, a whole reply's audio encoded) runs on a worker
thread, so that the loop always answers `/health` at once. A server without a key refuses (403) a
request whose `Host` is not a loopback name of its port (DNS rebinding) or whose `Origin` is another
site's (a web page the user visits); a POST must be `application/json` (415: a page's form or `text/plain`
fetch). Every refusal and every failure is an OpenAI-shaped JSON error; nothing a client sends is a 500.
`stop_replies` (omni-serve calls it when a shutdown begins) stops the running reply and the queued ones:
a stream then ends with a last chunk and `[DONE]`, a waiting request gets a 503.

`/v1/realtime` (OpenAI's Realtime API over a WebSocket: a spoken conversation with server VAD and
barge-in) is api/realtime.py's; its replies are jobs on the same worker, its handshake passes the same
key check and `Guard`. Connections (head deadlines, the cap) are api/connections.py's. It knows no terminal (serve.py is the
face) and no model family; it imports torch only through the assistant it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import re
import threading
import time
from urllib.parse import urlsplit

import anyio
import numpy as np
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute

from ..config import ReplyOptions
from ..errors import OmniError, UsageError
from ..limits import DEFAULT, LimitError, Limits
from ..media import read_audio, read_image
from ..prompt import Conversation
from ..runtime.events import AudioBlock, Done, TextDelta, TurnInterrupted
from . import ownership
from . import protocol as p

log = logging.getLogger(__name__)

END = object()  # the last item a job puts on its queue
POLL = 0.05  # seconds between disconnect checks of a whole-reply request
PREPARERS = 2  # requests read and decoded at once on threads (the engine works on one; the next is made ready)
JOIN_SECONDS = 10.0  # how long a shutdown waits for the engine's worker to end the stopped reply
SHUTTING_DOWN = "the server is shutting down"
HOLDERS = 256  # clients remembered as holding the server open (/health?hold=ID)


class Job:
    """One request's reply, made on the worker thread and read by the request's task."""

    def __init__(self, req: p.ChatRequest, loop: asyncio.AbstractEventLoop, clips: list | None = None,
                 pictures: list | None = None) -> None:
        self.req = req
        self.clips = clips or []  # the last user message's audio, read and checked
        self.pictures = pictures or []  # and its images
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.worker: EngineWorker | None = None
        self.why: str | None = None  # why the server stopped it (a shutdown), for its client

    def stop(self, why: str) -> None:
        """The server stops the job (its reply ends with a last chunk saying `why`)."""
        self.why = why
        self.cancel()

    def cancel(self) -> None:
        """The client left: skip the job if it waits, stop its reply now if it runs."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.worker is not None:
                self.worker.interrupt(self)

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.items.put_nowait, item)

    def events(self, assistant):
        """Worker thread: the reply's event stream (a realtime session's job makes its own)."""
        req = self.req
        conv = Conversation(system=assistant.default_system if req.system is None else req.system,
                            turns=[dict(t) for t in req.turns])
        media = {**({"audio": self.clips} if self.clips else {}),
                 **({"images": self.pictures} if self.pictures else {})}
        return assistant.stream(req.prompt, req.options, conversation=conv, **media)

    def run(self, assistant) -> None:
        """Worker thread: the reply's events (TextDelta, AudioBlock, Done) or the exception, then END."""
        try:
            events = self.events(assistant)
            try:
                for event in events:
                    if self.cancelled.is_set():  # stopped before its turn began (`interrupt` had no turn)
                        break
                    self.put(event)
            finally:
                events.close()  # stops the engine's threads if the reply did not end
        except TurnInterrupted:
            pass  # cancelled: nobody is listening
        except BaseException as exc:  # noqa: BLE001 - travels to the request as a value
            self.put(exc)
        self.put(END)


class EngineWorker:
    """The one thread that runs jobs, one at a time, in arrival order."""

    def __init__(self, assistant) -> None:
        self.assistant = assistant
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0  # jobs queued or running
        self.served = 0
        self.closing = False  # a shutdown began: no new job
        self.asked = 0  # HTTP requests of any kind (a client that holds the server open pings /health)
        # When each client that holds the server (an open omni-chat: /health?hold=ID) last said so; it lets go
        # with /health?release=ID when it ends.
        self.holders: dict[str, float] = {}
        self.running: Job | None = None
        self.open: set[Job] = set()  # queued or running
        self.after_first_job = None  # called once, on this thread, when the first job has ended (omni-serve)
        self.thread = threading.Thread(target=self._main, name="omni-serve-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> int:
        """Queue `job`; return how many jobs are ahead of it."""
        job.worker = self
        with self.lock:
            ahead = self.waiting
            self.waiting += 1
            self.open.add(job)
        self.jobs.put(job)
        return ahead

    def interrupt(self, job: Job) -> None:
        """Stop `job`'s reply if it is the one running (under the lock: never the next job's)."""
        with self.lock:
            if self.running is job:
                self.assistant.interrupt()

    def stop_all(self, why: str) -> None:
        """Stop the running job and skip the queued ones (a shutdown)."""
        with self.lock:
            jobs = list(self.open)
        for job in jobs:
            job.stop(why)

    def stop(self) -> None:
        self.jobs.put(None)

    def _main(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            with self.lock:
                self.running = job
            try:
                if job.cancelled.is_set():  # its client left while it waited
                    job.put(END)
                else:
                    job.run(self.assistant)
            finally:
                with self.lock:
                    self.running = None
                    self.open.discard(job)
                    self.waiting -= 1
                    self.served += 1
                then, self.after_first_job = self.after_first_job, None
                if then is not None:
                    then()


def create_app(assistant, name: str, api_key: str | None = None, key: str | None = None,
               defaults: ReplyOptions | None = None, limits: Limits = DEFAULT) -> Starlette:
    """The ASGI app serving `assistant` as model `name`. `api_key`: the Bearer token every request needs;
    `key`: how the commands recognise the model (`client.model_key`); `defaults`: reply options a
    request's own fields override; `limits`: what one request may cost (body, depth, read times).
    `app.state.stop_replies()` ends the replies for a shutdown."""
    worker = EngineWorker(assistant)
    defaults = defaults or ReplyOptions()
    eos = set(assistant.eos_ids)
    steps_name, per_second = assistant.speech_steps
    model = assistant.model_info
    info = {"title": model.title, "max_steps": model.max_steps,
            "text_sampling": {**model.text_sampling, "do_sample": model.text_samples},"voices": assistant.voices, "default_voice": assistant.default_voice if assistant.has_audio else None,
            "default_system": assistant.default_system, "sample_rate": assistant.sample_rate,
            "has_audio": assistant.has_audio, "speech_steps": [steps_name, per_second],
            "speaks_only_under_default_system": assistant.speaks_only_under_default_system,
            "is_demo": bool(getattr(assistant, "is_demo", False)), "limits": dict(assistant.limits), "key": key,
            "max_context": getattr(assistant, "max_context", None),  # tokens of conversation a request keeps
            # device, dtype, graphs, compile, ...: how the model runs (`RuntimeOptions.to_json`, the commands
            # note where their flags differ); read again at each request (`runtime_info`), as compiled steps
            # may take over
            "runtime": runtime_info(assistant),
            # where the server's start went (phase -> seconds, in order; omni-say --verbose shows it)
            "startup": dict(getattr(assistant, "startup", None) or {})}

    def refused(request: Request) -> Response | None:
        if bearer_ok(request.headers, api_key):
            return None
        return error(p.RequestError("a valid API key is needed: Authorization: Bearer <key>", 401,
                                    code="invalid_api_key"))

    async def health(request: Request) -> Response:
        worker.asked += 1
        # keep_alive: the seconds without a request after which the server stops (omni-serve --keep-alive);
        # held: a client (an open omni-chat) said within that time that it holds the server, so another
        # model's command must not stop it as idle.
        keep = getattr(request.app.state, "keep_alive", None)
        holder, released = request.query_params.get("hold"), request.query_params.get("release")
        if holder:
            if len(worker.holders) >= HOLDERS and holder[:64] not in worker.holders:  # bounded: drop the oldest
                del worker.holders[min(worker.holders, key=worker.holders.__getitem__)]
            worker.holders[holder[:64]] = time.monotonic()
        if released:
            worker.holders.pop(released[:64], None)
        now = time.monotonic()
        for old in [h for h, at in worker.holders.items() if now - at >= (keep or 60.0)]:
            del worker.holders[old]
        held = bool(worker.holders)
        runtime = runtime_info(assistant) or {}
        # steps: "compiling" while omni-serve compiles in the background, then "compiled"; else "plain"
        steps = ("compiling" if getattr(assistant, "compiling", False) else "compiled" if runtime.get("compile")
                 else "plain")
        answer = {"status": "ok", "model": name, "queued": worker.waiting, "served": worker.served,
                  "keep_alive": keep, "held": held, "steps": steps}
        if "challenge" in request.query_params:  # the commands' check that this server is the user's own
            answer["proof"] = ownership.answer(request.query_params["challenge"], _bound_port(request), key)
        return JSONResponse(answer)

    async def models(request: Request) -> Response:
        worker.asked += 1
        return refused(request) or JSONResponse(p.models_list(name, {**info, "runtime": runtime_info(assistant)}))

    async def completions(request: Request) -> Response:
        worker.asked += 1
        if (no := refused(request)) is not None:
            return no
        if worker.closing:
            return error(p.RequestError(SHUTTING_DOWN, 503, code="server_shutting_down"))
        try:
            body = await read_body(request, limits)
            req, clips, pictures = await anyio.to_thread.run_sync(prepare, body, limiter=preparers())
        except ClientDisconnect:
            return Response(status_code=499)
        except (p.RequestError, UsageError) as exc:
            return error(as_request_error(exc))
        job = Job(req, asyncio.get_running_loop(), clips, pictures)
        ahead = worker.submit(job)
        headers = {p.QUEUE_HEADER: str(ahead)}
        first = await _first_item(job, request)
        if first is None:  # the client left while the request waited
            return Response(status_code=499)
        if first is END and job.why is not None:  # stopped (a shutdown) while it waited
            return error(p.RequestError(job.why, 503, code="server_shutting_down"), headers)
        if isinstance(first, BaseException):
            return error(as_request_error(first), headers)
        ids = p.new_ids()
        if req.stream:
            return StreamingResponse(_stream(job, first, req, ids), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        return await _whole(job, first, req, ids, request, headers)

    def prepare(body: bytearray) -> tuple[p.ChatRequest, list, list]:
        """Worker thread: the body parsed and checked, its audio and images decoded (the event loop must
        not: a 12000x12000 PNG takes seconds)."""
        req = p.parse_chat_request(parse_json(body, limits.json_depth))
        if req.model is not None and req.model != name:
            raise p.RequestError(f"this server serves {name!r}, not {req.model!r}", 404, param="model",
                                 code="model_not_found")
        if req.spoken and not assistant.has_audio:
            raise p.RequestError("this model has no talker: ask for modalities [\"text\"]", param="modalities")
        req.options = with_defaults(req.options, defaults).check()
        # Seconds and pixels from the headers, before anything is decoded.
        clips = [read_audio(data, f"input_audio {n + 1}", limits=limits) for n, data in enumerate(req.audio)]
        pictures = [read_image(data, f"image_url {n + 1}", limits=limits) for n, data in enumerate(req.images)]
        for i, turn in enumerate(req.turns):  # earlier turns' files, read as the last message's
            if "media" in turn:
                files = turn["media"]
                turn["media"] = {
                    "audio": [read_audio(d, f"turn {i + 1}'s input_audio {n + 1}", limits=limits)
                              for n, d in enumerate(files["audio"])],
                    "images": [read_image(d, f"turn {i + 1}'s image_url {n + 1}", limits=limits)
                               for n, d in enumerate(files["images"])]}
        return req, clips, pictures

    limiter: list[anyio.CapacityLimiter] = []

    def preparers() -> anyio.CapacityLimiter:
        """The threads that prepare requests (made in the loop, at the first request)."""
        if not limiter:
            limiter.append(anyio.CapacityLimiter(PREPARERS))
        return limiter[0]

    def stop_replies() -> None:
        """A shutdown begins: no new request, the queued ones refused, the running reply stopped."""
        worker.closing = True
        worker.stop_all(SHUTTING_DOWN)

    def _finish(reply) -> str:
        return "stop" if reply.text_ids and reply.text_ids[-1] in eos else "length"

    def _omni(reply) -> dict:
        stats = {k: v for k, v in reply.stats.items() if isinstance(v, (int, float, str, bool)) and k != "started_at"}
        return {"stats": stats, "audio_seconds": len(reply.audio) / reply.sample_rate if len(reply.audio) else 0.0}

    async def _stream(job: Job, first, req: p.ChatRequest, ids):
        audio_id, ended, samples = ids[1], False, 0
        try:
            yield p.sse(p.chunk(ids, name, {"role": "assistant", "content": None if req.spoken else ""}))
            item = first
            while item is not END:
                if isinstance(item, TextDelta):
                    delta = {"audio": {"id": audio_id, "transcript": item.text}} if req.spoken else {"content": item.text}
                    yield p.sse(p.chunk(ids, name, delta))
                elif isinstance(item, AudioBlock):
                    samples += len(item.pcm)
                    yield p.sse(p.chunk(ids, name, {"audio": {"id": audio_id, "data": p.b64(p.pcm16(item.pcm)),
                                                               "expires_at": ids[2] + 3600}}))
                elif isinstance(item, Done):
                    ended = True
                    reply = item.reply
                    yield p.sse(p.chunk(ids, name, {}, _finish(reply), omni=_omni(reply)))
                    if req.include_usage:
                        yield p.sse(p.chunk(ids, name, None, usage=p.reply_usage(reply)))
                elif isinstance(item, BaseException):  # failed mid-reply: the stream says so and ends
                    ended = True
                    yield p.sse(as_request_error(item).body())
                item = await job.items.get()
            if not ended and job.why is not None:  # stopped by the server (a shutdown): a last chunk says so
                yield p.sse(p.chunk(ids, name, {}, "stop", omni={
                    "stats": {}, "audio_seconds": samples / assistant.sample_rate, "stopped": job.why}))
            yield p.sse("[DONE]")
        finally:
            job.cancel()  # the client left (or the reply ended): its reply stops now

    async def _whole(job: Job, first, req: p.ChatRequest, ids, request: Request, headers: dict) -> Response:
        text, pcm, reply, item = [], [], None, first
        try:
            while item is not END:
                if isinstance(item, BaseException):
                    return error(as_request_error(item), headers)
                if isinstance(item, TextDelta):
                    text.append(item.text)
                elif isinstance(item, AudioBlock):
                    pcm.append(item.pcm)
                elif isinstance(item, Done):
                    reply = item.reply
                item = await _next_item(job, request)
                if item is None:
                    return Response(status_code=499)
        finally:
            job.cancel()
        if reply is None:  # the events ended (END) without Done nor an error: stopped (a shutdown)
            return error(p.RequestError(job.why or "the reply ended without its last event", 503 if job.why else 500,
                                        code="server_shutting_down" if job.why else "server_error"), headers)

        def whole() -> bytes:  # a thread: encoding minutes of audio (FLAC, MP3) and base64 take a while
            audio = None
            if req.spoken:
                audio = p.audio_file(np.concatenate(pcm) if pcm else np.zeros(0, np.float32), req.audio_format)
            use = p.reply_usage(reply)
            return json.dumps(p.completion(ids, name, reply.text, _finish(reply), use, audio, _omni(reply)),
                              ensure_ascii=False, separators=(",", ":")).encode("utf-8")

        return Response(await anyio.to_thread.run_sync(whole, limiter=preparers()), media_type="application/json",
                        headers=headers)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # anyio loads its asyncio backend (a few dozen modules) at the first task group, which starlette
        # opens for the first streamed response: 12-20 ms of the first request on a CPU box. Here instead.
        async with anyio.create_task_group():
            pass
        yield
        stop_replies()  # where the server did not say a shutdown began (an in-process test's app)
        worker.stop()
        await anyio.to_thread.run_sync(worker.thread.join, JOIN_SECONDS)  # the stopped reply's threads end first
        log.info("omni-serve stopped")

    from .realtime import realtime_endpoint

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        WebSocketRoute("/v1/realtime", realtime_endpoint(worker, name, api_key, defaults, limits)),
    ], lifespan=lifespan, middleware=[Middleware(Guard, keyless=api_key is None)],
        exception_handlers={HTTPException: _http_error, Exception: _failed})
    app.state.worker = worker
    app.state.stop_replies = stop_replies
    return app


async def _first_item(job: Job, request: Request):
    """The job's first item (an event, an exception or the end); None if the client left first (the job
    is then cancelled: skipped if still queued)."""
    item = await _next_item(job, request)
    if item is None:
        job.cancel()
    return item


async def _next_item(job: Job, request: Request):
    while True:
        try:
            return await asyncio.wait_for(job.items.get(), POLL)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                return None


def bearer_ok(headers: Headers, api_key: str | None) -> bool:
    """Whether a request's `Authorization: Bearer` token is `api_key` (any request, when there is none)."""
    if api_key is None:
        return True
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def _bound_port(request: Request) -> int | None:
    """The port this server listens on, as the connection's server address says (not the Host header,
    which the client writes)."""
    server = request.scope.get("server") or (None, None)
    return server[1] if len(server) > 1 and isinstance(server[1], int) else None


def runtime_info(assistant) -> dict | None:
    """How `assistant` runs its model, as JSON (`RuntimeOptions.to_json` of `assistant.runtime`), or None
    for one that does not say (a test's stand-in)."""
    runtime = getattr(assistant, "runtime", None)
    if runtime is None or isinstance(runtime, dict):
        return runtime
    return runtime.to_json()


def with_defaults(options: ReplyOptions, defaults: ReplyOptions) -> ReplyOptions:
    """The request's options, its unset fields taken from the server's defaults."""
    from dataclasses import fields, replace

    given = {f.name: getattr(options, f.name) for f in fields(options) if getattr(options, f.name) is not None}
    given["greedy"] = options.greedy or defaults.greedy
    return replace(defaults, **given)


def as_request_error(exc: BaseException) -> p.RequestError:
    if isinstance(exc, p.RequestError):
        return exc
    if isinstance(exc, UsageError):  # a LimitError keeps its status and names the API's field
        return p.api_error(exc)
    if isinstance(exc, OmniError):
        return p.RequestError(str(exc), 500, code="server_error")
    log.error("reply failed", exc_info=exc)
    return p.RequestError(f"the reply failed: {type(exc).__name__}: {exc}", 500, code="server_error")


# Refusals made before the body is read (or with the rest of it unread) close the connection: what the
# client still sends would otherwise be taken for its next request.
CLOSES = frozenset({403, 408, 413, 415})


def error(exc: p.RequestError, headers: dict | None = None) -> JSONResponse:
    headers = {**(headers or {}), **({"Connection": "close"} if exc.status in CLOSES else {})}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


# -- the body ------------------------------------------------------------------------------------------


async def read_body(request: Request, limits: Limits) -> bytearray:
    """The request's body, read in the pieces it comes in: a 413 (`LimitError`) as soon as `Content-Length`
    or the bytes come over `limits.body_bytes`, a 408 if it pauses longer than `body_stall_seconds` or
    takes longer than `body_seconds` in all (uvicorn has no body timeout). Cheap: no parsing here."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.body_bytes:
        raise _too_big(limits)
    body = bytearray()
    pieces = request.stream().__aiter__()
    deadline = time.monotonic() + limits.body_seconds
    while True:
        left = deadline - time.monotonic()
        with anyio.move_on_after(max(0.0, min(limits.body_stall_seconds, left))) as waited:
            try:
                piece = await pieces.__anext__()
            except StopAsyncIteration:
                return body
        if waited.cancelled_caught:
            said = (f"it stopped for {limits.body_stall_seconds:g} s" if left > limits.body_stall_seconds
                    else f"it took over {limits.body_seconds:g} s")
            raise p.RequestError(f"the request's body came too slowly ({said}, {len(body)} bytes read)", 408,
                                 code="request_timeout")
        body += piece
        if len(body) > limits.body_bytes:
            raise _too_big(limits)


def _too_big(limits: Limits) -> LimitError:
    return LimitError(f"the request's body is over {limits.body_bytes} bytes (omni-serve --max-body-mb): send "
                      "smaller media, or fewer turns", 413)


def parse_json(body: bytes | bytearray, depth: int) -> object:
    """`body` as JSON, nesting at most `depth` levels (scanned before parsing: Python's parser recurses)."""
    if too_deep(body, depth):
        raise LimitError(f"the body's JSON nests deeper than {depth} levels")
    try:
        return json.loads(body)
    except RecursionError:  # not found by the scan (an odd encoding): the parser's own limit
        raise LimitError(f"the body's JSON nests deeper than {depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, or an integer of 4300+ digits
        raise p.RequestError(f"the body is not JSON: {str(exc)[:200]}") from None


# A JSON string (its escapes included): what is inside one is text, not structure.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP = np.zeros(256, np.int8)  # +1 for a byte that opens a level, -1 for one that closes it
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_SCAN = 1 << 22  # bytes of brackets counted at a time (the cumulative sum's memory: 16 MiB)


def too_deep(body: bytes | bytearray, depth: int) -> bool:
    """Whether `body`'s brackets, outside its strings, nest more than `depth` levels: C-speed passes (a
    regular expression drops the strings, numpy sums the rest), linear in the body's size."""
    if body.count(b"[") + body.count(b"{") <= depth:  # most bodies: too few brackets to nest that deep
        return False
    skeleton = np.frombuffer(_STRING.sub(b"", body), np.uint8)
    level = 0
    for start in range(0, len(skeleton), _SCAN):
        levels = np.cumsum(_STEP[skeleton[start:start + _SCAN]], dtype=np.int64) + level
        if len(levels) and int(levels.max()) > depth:
            return True
        level = int(levels[-1]) if len(levels) else level
    return False


# -- who may ask ---------------------------------------------------------------------------------------


class Guard:
    """Refusals made from the request's head alone, for every route (pure ASGI, before routing): without
    an API key, a `Host` that is not a loopback name (at this server's port, if it says one: a
    DNS-rebinding page's is its own name) and an
    `Origin` that is not a loopback origin of it (a page's cross-site request) are 403s; a POST whose body
    is not `application/json` is a 415 (the only kinds a page can send without CORS's preflight are
    forms and `text/plain`)."""

    def __init__(self, app, keyless: bool) -> None:
        self.app = app
        self.keyless = keyless

    async def __call__(self, scope, receive, send) -> None:
        # A WebSocket's handshake too: a web page may open one to localhost (browsers apply no CORS to them),
        # so a keyless server checks its Host and Origin the same way; the refusal is an HTTP answer to the
        # handshake (ASGI's websocket.http.response), as uvicorn sends it.
        why = self.refusal(scope) if scope["type"] in ("http", "websocket") else None
        if why is not None:
            await error(why)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> p.RequestError | None:
        headers = Headers(scope=scope)
        port = (scope.get("server") or (None, None))[1]
        if self.keyless:
            host, origin = headers.get("host"), headers.get("origin")
            if host is None or not _loopback_at("//" + host, port, default_port=port):
                return p.RequestError(f"Host {host!r} is not this machine's loopback name: a server without an "
                                      "API key answers only http://localhost or 127.0.0.1 at its port", 403,
                                      param="Host", code="forbidden_host")
            if origin is not None and not _loopback_at(origin, port, schemes=("http", "https")):
                return p.RequestError(f"Origin {origin[:100]!r} is another site: a server without an API key "
                                      "answers no web page but its own machine's", 403, param="Origin",
                                      code="forbidden_origin")
        if scope.get("method") == "POST":
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return p.RequestError(f"the body must be application/json (got {kind or 'no Content-Type'!r})",
                                      415, param="Content-Type", code="unsupported_media_type")
        return None


def _loopback_at(url: str, port: int | None, schemes: tuple[str, ...] | None = None,
                 default_port: int | None = None) -> bool:
    """Whether `url` (a `//host:port` or an origin) names a loopback host at `port` (any, if None); a URL
    without a port means `default_port`, else its scheme's (an origin's http://localhost is port 80)."""
    try:
        parts = urlsplit(url)
        given = parts.port
    except ValueError:  # a port that is not a number, a bracket unclosed
        return False
    if schemes is not None and parts.scheme not in schemes:
        return False
    if not parts.hostname or not p.is_loopback(parts.hostname):
        return False
    if given is None:
        given = default_port if default_port is not None else 443 if parts.scheme == "https" else 80
    return port is None or given == port


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (an unknown path, a method a route does not take), in the API's shape."""
    status = getattr(exc, "status_code", 400)
    detail = getattr(exc, "detail", None) or "refused"
    return error(p.RequestError(f"{request.method} {request.url.path[:100]}: {detail}", status))


async def _failed(request: Request, exc: Exception) -> Response:
    """Last resort (a bug of ours, never a client's doing): one line, in the API's shape."""
    log.error("request failed", exc_info=exc)
    return error(p.RequestError(f"the server failed: {type(exc).__name__}: {str(exc)[:200]}", 500,
                                code="server_error"))
