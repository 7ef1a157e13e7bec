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

It knows no terminal (serve.py is the face) and no model family; it imports torch only through the
assistant it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import threading
import time

import anyio
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..config import ReplyOptions
from ..errors import OmniError, UsageError
from ..media import read_audio, read_image
from ..prompt import Conversation
from ..runtime.events import AudioBlock, Done, TextDelta, TurnInterrupted
from . import ownership
from . import protocol as p

log = logging.getLogger(__name__)

_END = object()  # the last item a job puts on its queue
POLL = 0.05  # seconds between disconnect checks of a whole-reply request


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

    def cancel(self) -> None:
        """The client left: skip the job if it waits, stop its reply now if it runs."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.worker is not None:
                self.worker.interrupt(self)

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.items.put_nowait, item)

    def run(self, assistant) -> None:
        """Worker thread: the reply's events (TextDelta, AudioBlock, Done) or the exception, then _END."""
        req = self.req
        conv = Conversation(system=assistant.default_system if req.system is None else req.system,
                            turns=[dict(t) for t in req.turns])
        try:
            media = {**({"audio": self.clips} if self.clips else {}),
                     **({"images": self.pictures} if self.pictures else {})}
            events = assistant.stream(req.prompt, req.options, conversation=conv, **media)
            try:
                for event in events:
                    self.put(event)
            finally:
                events.close()  # stops the engine's threads if the reply did not end
        except TurnInterrupted:
            pass  # cancelled: nobody is listening
        except BaseException as exc:  # noqa: BLE001 - travels to the request as a value
            self.put(exc)
        self.put(_END)


class EngineWorker:
    """The one thread that runs jobs, one at a time, in arrival order."""

    def __init__(self, assistant) -> None:
        self.assistant = assistant
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0  # jobs queued or running
        self.served = 0
        self.asked = 0  # HTTP requests of any kind (a client that holds the server open pings /health)
        # When each client that holds the server (an open omni-chat: /health?hold=ID) last said so; it lets go
        # with /health?release=ID when it ends.
        self.holders: dict[str, float] = {}
        self.running: Job | None = None
        self.after_first_job = None  # called once, on this thread, when the first job has ended (omni-serve)
        self.thread = threading.Thread(target=self._main, name="omni-serve-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> int:
        """Queue `job`; return how many jobs are ahead of it."""
        job.worker = self
        with self.lock:
            ahead = self.waiting
            self.waiting += 1
        self.jobs.put(job)
        return ahead

    def interrupt(self, job: Job) -> None:
        """Stop `job`'s reply if it is the one running (under the lock: never the next job's)."""
        with self.lock:
            if self.running is job:
                self.assistant.interrupt()

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
                    job.put(_END)
                else:
                    job.run(self.assistant)
            finally:
                with self.lock:
                    self.running = None
                    self.waiting -= 1
                    self.served += 1
                then, self.after_first_job = self.after_first_job, None
                if then is not None:
                    then()


def create_app(assistant, name: str, api_key: str | None = None, key: str | None = None,
               defaults: ReplyOptions | None = None) -> Starlette:
    """The ASGI app serving `assistant` as model `name`. `api_key`: the Bearer token every request needs;
    `key`: how the commands recognise the model (`client.model_key`); `defaults`: reply options a
    request's own fields override."""
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
        if api_key is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode()):
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
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(p.RequestError(f"the body is not JSON: {exc}"))
        try:
            req = p.parse_chat_request(body)
            if req.model is not None and req.model != name:
                raise p.RequestError(f"this server serves {name!r}, not {req.model!r}", 404, param="model",
                                     code="model_not_found")
            if req.spoken and not assistant.has_audio:
                raise p.RequestError("this model has no talker: ask for modalities [\"text\"]", param="modalities")
            req.options = with_defaults(req.options, defaults).check()
            clips = [read_audio(data, f"input_audio {n + 1}") for n, data in enumerate(req.audio)]
            pictures = [read_image(data, f"image_url {n + 1}") for n, data in enumerate(req.images)]
            for i, turn in enumerate(req.turns):  # earlier turns' files, read as the last message's
                if "media" in turn:
                    files = turn["media"]
                    turn["media"] = {
                        "audio": [read_audio(d, f"turn {i + 1}'s input_audio {n + 1}") for n, d in enumerate(files["audio"])],
                        "images": [read_image(d, f"turn {i + 1}'s image_url {n + 1}") for n, d in enumerate(files["images"])]}
        except p.RequestError as exc:
            return error(exc)
        except UsageError as exc:
            return error(p.api_error(exc))
        job = Job(req, asyncio.get_running_loop(), clips, pictures)
        ahead = worker.submit(job)
        headers = {p.QUEUE_HEADER: str(ahead)}
        first = await _first_item(job, request)
        if first is None:  # the client left while the request waited
            return Response(status_code=499)
        if isinstance(first, BaseException):
            return error(_as_request_error(first), headers)
        ids = p.new_ids()
        if req.stream:
            return StreamingResponse(_stream(job, first, req, ids), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        return await _whole(job, first, req, ids, request, headers)

    def _finish(reply) -> str:
        return "stop" if reply.text_ids and reply.text_ids[-1] in eos else "length"

    def _omni(reply) -> dict:
        stats = {k: v for k, v in reply.stats.items() if isinstance(v, (int, float, str, bool)) and k != "started_at"}
        return {"stats": stats, "audio_seconds": len(reply.audio) / reply.sample_rate if len(reply.audio) else 0.0}

    async def _stream(job: Job, first, req: p.ChatRequest, ids):
        audio_id = ids[1]
        try:
            yield p.sse(p.chunk(ids, name, {"role": "assistant", "content": None if req.spoken else ""}))
            item = first
            while item is not _END:
                if isinstance(item, TextDelta):
                    delta = {"audio": {"id": audio_id, "transcript": item.text}} if req.spoken else {"content": item.text}
                    yield p.sse(p.chunk(ids, name, delta))
                elif isinstance(item, AudioBlock):
                    yield p.sse(p.chunk(ids, name, {"audio": {"id": audio_id, "data": p.b64(p.pcm16(item.pcm)),
                                                               "expires_at": ids[2] + 3600}}))
                elif isinstance(item, Done):
                    reply = item.reply
                    yield p.sse(p.chunk(ids, name, {}, _finish(reply), omni=_omni(reply)))
                    if req.include_usage:
                        yield p.sse(p.chunk(ids, name, None, usage=p.usage(reply.stats.get("prompt_tokens", 0),
                                                                         len(reply.text_ids))))
                elif isinstance(item, BaseException):  # failed mid-reply: the stream says so and ends
                    yield p.sse(_as_request_error(item).body())
                item = await job.items.get()
            yield p.sse("[DONE]")
        finally:
            job.cancel()  # the client left (or the reply ended): its reply stops now

    async def _whole(job: Job, first, req: p.ChatRequest, ids, request: Request, headers: dict) -> Response:
        text, pcm, reply, item = [], [], None, first
        try:
            while item is not _END:
                if isinstance(item, BaseException):
                    return error(_as_request_error(item), headers)
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
        if reply is None:  # the events ended (_END) without Done nor an error
            raise RuntimeError("the reply's events ended without its last one (Done)")
        audio = None
        if req.spoken:
            audio = p.audio_file(np.concatenate(pcm) if pcm else np.zeros(0, np.float32), req.audio_format)
        use = p.usage(reply.stats.get("prompt_tokens", 0), len(reply.text_ids))
        return JSONResponse(p.completion(ids, name, reply.text, _finish(reply), use, audio, _omni(reply)),
                            headers=headers)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # anyio loads its asyncio backend (a few dozen modules) at the first task group, which starlette
        # opens for the first streamed response: 12-20 ms of the first request on a CPU box. Here instead.
        async with anyio.create_task_group():
            pass
        yield
        worker.stop()
        log.info("omni-serve stopped")

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
    ], lifespan=lifespan)
    app.state.worker = worker
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


def _as_request_error(exc: BaseException) -> p.RequestError:
    if isinstance(exc, UsageError):
        return p.api_error(exc)
    if isinstance(exc, OmniError):
        return p.RequestError(str(exc), 500, code="server_error")
    log.error("reply failed", exc_info=exc)
    return p.RequestError(f"the reply failed: {type(exc).__name__}: {exc}", 500, code="server_error")


def error(exc: p.RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
