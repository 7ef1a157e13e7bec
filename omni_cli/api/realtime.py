"""omni-serve's `/v1/realtime`: OpenAI's Realtime API over a WebSocket, a spoken conversation with the
one loaded model (shapes: api/realtime_protocol.py).

A session holds a conversation (`prompt.Conversation`, its system prompt the session's `instructions`),
the input audio buffer (PCM16 at 24 kHz, appended by the client) and, with `server_vad`, a turn detector
over it (WebRTC's VAD and `Endpoint`, audio/vad.py). A turn's audio becomes a user item, its reply a job on
the server's one `EngineWorker` (queued with the HTTP requests, in arrival order), streamed back as
`response.output_audio.delta` and `response.output_audio_transcript.delta` events. The conversation goes
to `Assistant.stream` whole each turn, so the engine's kept context (runtime/context.py) prefills only
what is new, as the HTTP chat's turns do.

Barge-in (`interrupt_response`): speech detected while a reply runs cancels it on the server: the engine
is stopped (`Job.cancel`), `response.done` says `cancelled` (reason `turn_detected`) once the engine's
stream has ended, or after `CANCEL_GRACE` at the most, and the conversation keeps the reply cut to what
the client can have played by then (`heard.heard_text`: the audio sent, at most the wall time since its
first delta went out, as a client that plays as it receives). A client that knows what it played says so
with `conversation.item.truncate` (`audio_end_ms`), which cuts the item's text by the same rule. The new
speech is the next turn once it ends (`create_response`).

Every client event is checked (api/realtime_protocol.py, sizes before decoding: `Limits`); one that
cannot be taken is an `error` event and the session goes on. A client that goes away ends its session:
its running or queued reply is cancelled, the engine freed. The API key is the HTTP side's (`Authorization:
Bearer`, or the `openai-insecure-api-key.KEY` subprotocol a browser's WebSocket can send); a wrong one is a
401 answer to the handshake.

It knows the worker, the assistant's declared interface and the events a stream yields; no terminal, no
model family and no torch of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..audio.vad import VAD_FRAME_MS, Endpoint, WebRtcVad
from ..config import ReplyOptions
from ..heard import heard_text
from ..limits import Limits
from ..media import AudioClip
from ..prompt import Conversation
from ..runtime.events import AudioBlock, Done, TextDelta
from . import protocol as p
from . import realtime_protocol as rt
from .realtime_protocol import RATE, RealtimeError
from .server import END, Job, as_request_error, bearer_ok, error, with_defaults

log = logging.getLogger(__name__)

# The longest a cancelled reply's `response.done` waits for the engine's stream to end; past it the
# response is over for the client all the same (its later events are dropped) and the engine stops behind.
CANCEL_GRACE = 0.15
TAIL_MS = 100  # audio kept after the speech's end in the user's item (the VAD's own hangover is in it)
SUBPROTOCOL_KEY = "openai-insecure-api-key."


def realtime_endpoint(worker, name: str, api_key: str | None, defaults: ReplyOptions, limits: Limits):
    """The ASGI WebSocket endpoint of `/v1/realtime` for the server's `worker` (and its assistant)."""
    open_sessions: set[Session] = set()

    async def endpoint(ws: WebSocket) -> None:
        worker.asked += 1
        refusal, subprotocol = _refusal(ws, worker, name, api_key, len(open_sessions), limits)
        if refusal is not None:
            await ws.send_denial_response(refusal)
            return
        await ws.accept(subprotocol=subprotocol)
        session = Session(ws, worker, name, defaults, limits)
        open_sessions.add(session)
        try:
            await session.run()
        finally:
            open_sessions.discard(session)

    return endpoint


def _refusal(ws: WebSocket, worker, name: str, api_key: str | None, sessions: int, limits: Limits):
    """(the handshake's HTTP refusal or None, the subprotocol to accept)."""
    offered = [s.strip() for s in ws.headers.get("sec-websocket-protocol", "").split(",") if s.strip()]
    keyed = [s[len(SUBPROTOCOL_KEY):] for s in offered if s.startswith(SUBPROTOCOL_KEY)]
    subprotocol = "realtime" if "realtime" in offered else None
    if not bearer_ok(ws.headers, api_key) and not (
            api_key is not None and any(hmac.compare_digest(k.encode(), api_key.encode()) for k in keyed)):
        return error(p.RequestError("a valid API key is needed: Authorization: Bearer <key>", 401,
                                    code="invalid_api_key")), None
    model = ws.query_params.get("model")
    if model and model != name:
        return error(p.RequestError(f"this server serves {name!r}, not {model[:100]!r}", 404, param="model",
                                    code="model_not_found")), None
    if worker.closing:
        return error(p.RequestError("the server is shutting down", 503, code="server_shutting_down")), None
    if sessions >= limits.realtime_sessions:
        return error(p.RequestError(f"{sessions} realtime sessions are open, the most this server holds", 503,
                                    code="too_many_sessions")), None
    return None, subprotocol


# -- turn detection ------------------------------------------------------------------------------------


class _Stretch(Endpoint):
    """`Endpoint`, also saying at which frame the stretch that became speech began (its first voiced frame)."""

    start = 0

    def push(self, speech: bool) -> bool:
        # A stretch begins where Endpoint's own count of its voiced frames is still 0 (its attribute, read
        # here rather than the stretch logic copied: one rule for where speech starts and ends).
        if speech and not self.heard and self._voiced == 0:
            self.start = self.frames
        return super().push(speech)


class TurnDetector:
    """server_vad over the input stream: ("started", audio_start_ms) and ("stopped", audio_end_ms), in
    milliseconds of the session's input audio (the prefix padding included in the start)."""

    def __init__(self, vad: rt.ServerVad, at_ms: float) -> None:
        self.config = vad
        self.vad = WebRtcVad(RATE, vad.vad_mode())
        self.base_ms = at_ms  # the session's input time of this detector's first frame
        self.frames = 0
        self.turn = self._new()

    def _new(self) -> _Stretch:
        return _Stretch(math.ceil(self.config.min_speech_ms / VAD_FRAME_MS),
                        math.ceil(self.config.silence_duration_ms / VAD_FRAME_MS))

    def feed(self, pcm: np.ndarray) -> list[tuple[str, float]]:
        found = []
        for flag in self.vad.feed(pcm):
            base = self.base_ms + self.frames * VAD_FRAME_MS  # where the current turn's frame 0 is
            heard = self.turn.heard
            ended = self.turn.push(flag)
            if self.turn.heard and not heard:
                found.append(("started", max(0.0, base + self.turn.start * VAD_FRAME_MS - self.config.prefix_padding_ms)))
            if ended:
                found.append(("stopped", base + self.turn.speech_end * VAD_FRAME_MS))
                self.frames += self.turn.frames
                self.turn = self._new()
        return found

    @property
    def speaking(self) -> bool:
        return self.turn.heard


class InputBuffer:
    """The input audio since the last commit or clear, addressed in ms of the session's input."""

    def __init__(self, most_seconds: float) -> None:
        self.most = int(most_seconds * RATE)
        self.blocks: list[np.ndarray] = []
        self.start = 0  # the session's input sample of the buffer's first sample
        self.size = 0
        self.total = 0  # samples appended in the session

    def append(self, pcm: np.ndarray) -> None:
        if self.size + len(pcm) > self.most:
            raise RealtimeError(f"the input audio buffer holds {self.most / RATE:g} s at the most: commit it (or clear "
                                "it) before appending more", code="input_audio_buffer_full")
        self.blocks.append(pcm)
        self.size += len(pcm)
        self.total += len(pcm)

    @property
    def end_ms(self) -> float:
        return self.total * 1000 / RATE

    def take(self, from_ms: float | None = None, to_ms: float | None = None) -> np.ndarray:
        """The samples from `from_ms` (the buffer's start if None) to `to_ms` (its end); what comes before
        `to_ms` leaves the buffer."""
        whole = np.concatenate(self.blocks) if self.blocks else np.zeros(0, np.float32)
        lo = 0 if from_ms is None else max(0, int(from_ms * RATE / 1000) - self.start)
        hi = len(whole) if to_ms is None else min(len(whole), max(0, int(to_ms * RATE / 1000) - self.start))
        self.drop_before(self.start + hi, whole)
        return whole[lo:hi]

    def keep_last(self, ms: float) -> None:
        """Drop all but the last `ms` (silence before any speech: only the prefix padding may be needed)."""
        keep = int(ms * RATE / 1000)
        if self.size > 2 * keep + RATE:  # now and then, not at every append
            whole = np.concatenate(self.blocks)
            self.drop_before(self.start + len(whole) - keep, whole)

    def drop_before(self, sample: int, whole: np.ndarray | None = None) -> None:
        whole = np.concatenate(self.blocks) if whole is None and self.blocks else whole
        cut = max(0, sample - self.start)
        rest = whole[cut:] if whole is not None else np.zeros(0, np.float32)
        self.blocks = [rest] if len(rest) else []
        self.start += min(cut, self.size)
        self.size = len(rest)

    def clear(self) -> None:
        self.drop_before(self.total)


# -- responses -----------------------------------------------------------------------------------------


@dataclass
class Said:
    """An assistant item: its reply's text pieces and audio, and its turn in the conversation."""

    pieces: list[str] = field(default_factory=list)
    made: float = 0.0  # seconds of audio made (sent)
    audio: bool = True
    turn: dict | None = None  # the conversation's assistant message (its "content" is cut by a truncate)


class Response:
    """One reply in flight: its job on the worker, what it has sent, and how it ended."""

    def __init__(self, session: "Session", prompt: str, clips: list[AudioClip], options: ReplyOptions) -> None:
        self.id, self.item_id = rt.new_id("resp"), rt.new_id("item")
        self.config = session.config
        self.prompt, self.clips = prompt, clips
        self.said = Said(audio=self.config.audio)
        self.job = _Turn(asyncio.get_running_loop(), session.conversation, prompt, clips, options)
        self.first_audio: float | None = None  # when its first audio delta went out (monotonic)
        self.cancelled: str | None = None  # the reason, once cancelled
        self.cancelled_at: float | None = None
        self.heard_ms: float | None = None  # a truncate received while it ran
        self.stopped_in: float | None = None  # seconds from the cancel to the engine's stream ending
        self.task: asyncio.Task | None = None

    def played(self) -> float:
        """Seconds a client playing as it receives can have heard by now (at most what was sent)."""
        if self.heard_ms is not None:
            return min(self.said.made, self.heard_ms / 1000)
        if self.first_audio is None:
            return 0.0
        return min(self.said.made, time.monotonic() - self.first_audio)


class _Turn(Job):
    """A realtime reply as a job of the server's `EngineWorker`: the HTTP `Job`'s queue and cancel, its own
    stream (the session's conversation, which the assistant extends when the reply completes, and the
    turn's clips)."""

    def __init__(self, loop, conversation: Conversation, prompt: str, clips: list[AudioClip],
                 options: ReplyOptions) -> None:
        super().__init__(None, loop)  # type: ignore[arg-type]
        self.conversation, self.prompt, self.clips, self.options = conversation, prompt, clips, options

    def events(self, assistant):
        return assistant.stream(self.prompt, self.options, conversation=self.conversation,
                                **({"audio": self.clips} if self.clips else {}))


# -- the session ---------------------------------------------------------------------------------------


class Session:
    """One WebSocket's conversation (see the module docstring)."""

    def __init__(self, ws: WebSocket, worker, name: str, defaults: ReplyOptions, limits: Limits) -> None:
        self.ws, self.worker, self.name, self.defaults, self.limits = ws, worker, name, defaults, limits
        assistant = worker.assistant
        self.assistant = assistant
        self.id = rt.new_id("sess")
        self.config = rt.SessionConfig(instructions=assistant.default_system,
                                       voice=assistant.default_voice if assistant.has_audio else None)
        if not assistant.has_audio:
            self.config = replace(self.config, audio=False)
        self.conversation = Conversation(system=self.config.instructions)
        self.buffer = InputBuffer(limits.realtime_buffer_seconds)
        self.detector: TurnDetector | None = TurnDetector(self.config.turn_detection, 0.0) if self.config.turn_detection else None
        self.speech_from: float | None = None  # audio_start_ms of the speech being heard
        self.speech_item: str | None = None
        self.pending_text: list[str] = []  # user input committed and not yet answered
        self.pending_clips: list[AudioClip] = []
        self.active: Response | None = None
        self.items: dict[str, Said] = {}  # assistant items, for truncate
        self.send_lock = asyncio.Lock()
        self.closed = False
        self.max_text = max(1, assistant.max_context or 4096) * limits.chars_per_token

    # -- the loop --

    async def run(self) -> None:
        await self.send(rt.server_event("session.created", session=self.session_json()))
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                self.worker.asked += 1  # an open session keeps a --keep-alive server up
                text = message.get("text")
                await self.handle(text if isinstance(text, str) else message.get("bytes") or b"")
        except WebSocketDisconnect:
            pass
        finally:
            self.closed = True
            await self.end()

    async def end(self) -> None:
        """The client left: its reply (running or queued) stops now, the engine is free for the next."""
        response, self.active = self.active, None
        if response is not None:
            response.cancelled = response.cancelled or "client_gone"
            response.job.cancel()
            if response.task is not None:
                response.task.cancel()
                with contextlib.suppress(BaseException):
                    await response.task

    async def handle(self, text: str | bytes) -> None:
        event_id = None
        try:
            event = rt.parse_event(text, self.limits.realtime_event_bytes, self.limits.json_depth)
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            await getattr(self, "on_" + event["type"].replace(".", "_"))(event)
        except RealtimeError as exc:
            await self.send(rt.error_event(exc, event_id))
        except WebSocketDisconnect:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug of ours: said to the client, the session goes on
            await self.failed(exc, event_id)

    async def failed(self, exc: BaseException, event_id: str | None) -> None:
        log.error("realtime event failed", exc_info=exc)
        await self.send(rt.error_event(RealtimeError(f"the server failed: {type(exc).__name__}: {str(exc)[:200]}",
                                                     code="server_error", kind="server_error"), event_id))

    async def send(self, event: dict) -> None:
        if self.closed:
            return
        text = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        async with self.send_lock:  # one message at a time: the reply's task and the event loop both send
            try:
                await self.ws.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.closed = True  # gone: the receive loop ends the session

    def session_json(self) -> dict:
        return self.config.to_json(self.name, self.id)

    # -- client events --

    async def on_session_update(self, event: dict) -> None:
        config = rt.updated(self.config, event.get("session"), self.assistant.voices, self.max_text)
        if config.audio and not self.assistant.has_audio:
            raise RealtimeError("this model has no talker: output_modalities must be [\"text\"]",
                                param="session.output_modalities")
        if config.turn_detection != self.config.turn_detection:
            self.detector = TurnDetector(config.turn_detection, self.buffer.end_ms) if config.turn_detection else None
            self.speech_from = self.speech_item = None
        if config.instructions != self.config.instructions:
            self.conversation.system = config.instructions
        self.config = config
        await self.send(rt.server_event("session.updated", session=self.session_json()))

    async def on_input_audio_buffer_append(self, event: dict) -> None:
        pcm = rt.audio_of(event, self.limits.realtime_event_bytes)
        self.buffer.append(pcm)
        if self.detector is None:
            return
        for kind, ms in self.detector.feed(pcm):
            if kind == "started":
                await self.speech_started(ms)
            else:
                await self.speech_stopped(ms)
        if not self.detector.speaking:  # before speech only a stretch in the making and the padding are needed
            vad = self.detector.config
            self.buffer.keep_last(vad.prefix_padding_ms + vad.silence_duration_ms + vad.min_speech_ms)

    async def speech_started(self, ms: float) -> None:
        self.speech_from, self.speech_item = ms, rt.new_id("item")
        await self.send(rt.server_event("input_audio_buffer.speech_started", audio_start_ms=int(ms),
                                        item_id=self.speech_item))
        vad = self.detector.config if self.detector else None
        if vad is not None and vad.interrupt_response and self.active is not None:
            self.cancel(self.active, "turn_detected")

    async def speech_stopped(self, ms: float) -> None:
        item = self.speech_item or rt.new_id("item")
        await self.send(rt.server_event("input_audio_buffer.speech_stopped", audio_end_ms=int(ms), item_id=item))
        pcm = self.buffer.take(self.speech_from, ms + TAIL_MS)
        self.speech_from = self.speech_item = None
        await self.committed(item, pcm)
        vad = self.detector.config if self.detector else None
        if vad is not None and vad.create_response:
            if self.active is not None and not self.active.cancelled:
                raise RealtimeError("a response is in progress: the turn was committed, not answered "
                                    "(interrupt_response false)", code="conversation_already_has_active_response")
            await self.respond()

    async def on_input_audio_buffer_commit(self, event: dict) -> None:
        if self.buffer.size < RATE // 10:
            raise RealtimeError(f"the input audio buffer holds {self.buffer.size * 1000 // RATE} ms of audio; a commit "
                                "needs at least 100 ms", code="input_audio_buffer_commit_empty")
        pcm = self.buffer.take()
        self.speech_from = self.speech_item = None
        await self.committed(rt.new_id("item"), pcm)

    async def committed(self, item_id: str, pcm: np.ndarray) -> None:
        clip = AudioClip(pcm.astype(np.float32), RATE, source="realtime").at()  # the encoder's rate, once
        self.pending_clips.append(clip)
        await self.send(rt.server_event("input_audio_buffer.committed", item_id=item_id, previous_item_id=None))
        await self.send(rt.server_event("conversation.item.created", previous_item_id=None,
                                        item=rt.user_message(item_id, "", 1)))

    async def on_input_audio_buffer_clear(self, event: dict) -> None:
        self.buffer.clear()
        self.speech_from = self.speech_item = None
        if self.detector is not None:
            self.detector = TurnDetector(self.detector.config, self.buffer.end_ms)
        await self.send(rt.server_event("input_audio_buffer.cleared"))

    async def on_conversation_item_create(self, event: dict) -> None:
        item = event.get("item")
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise RealtimeError("item must be a message item", param="item")
        given = item.get("id")
        item_id = given if isinstance(given, str) and given else rt.new_id("item")
        role = item.get("role")
        if role == "user":
            text, clips = rt.user_item(item, self.limits.realtime_event_bytes, self.max_text)
            self.pending_text += [text] if text else []
            self.pending_clips += [AudioClip(c.astype(np.float32), RATE, source="realtime").at() for c in clips]
            shown = rt.user_message(item_id, text, len(clips))
        elif role == "assistant":
            if self.active is not None:
                raise RealtimeError("a response is in progress: add the assistant's message after it",
                                    code="conversation_already_has_active_response")
            text = rt.assistant_text(item, self.max_text)
            self.conversation.add(" ".join(self.pending_text), text, {"audio": self.pending_clips})
            self.pending_text, self.pending_clips = [], []
            self.items[item_id] = Said([text], 0.0, False, self.conversation.turns[-1])
            shown = rt.assistant_message(item_id, text, False, "completed")
        else:
            raise RealtimeError(f"item.role {role!r}: this server takes user and assistant messages (the system "
                                "prompt is the session's instructions)", param="item.role")
        await self.send(rt.server_event("conversation.item.created", previous_item_id=None, item=shown))

    async def on_response_create(self, event: dict) -> None:
        given = event.get("response")
        if given is not None and not isinstance(given, dict):
            raise RealtimeError("response must be an object", param="response")
        await self.respond(rt.max_tokens((given or {}).get("max_output_tokens")) if given else None)

    async def on_response_cancel(self, event: dict) -> None:
        wanted = event.get("response_id")
        response = self.active
        if response is None or response.cancelled or (wanted and wanted != response.id):
            raise RealtimeError("there is no response in progress to cancel" if response is None or response.cancelled
                                else f"response {str(wanted)[:60]!r} is not the one in progress",
                                code="response_cancel_not_active")
        self.cancel(response, "client_cancelled")

    async def on_conversation_item_truncate(self, event: dict) -> None:
        item_id, end_ms = rt.truncation(event)
        said = self.items.get(item_id)
        running = self.active is not None and self.active.item_id == item_id
        if said is None and running and self.active is not None:
            said = self.active.said
        if said is None:
            raise RealtimeError(f"no assistant item {item_id[:60]!r} in this conversation", code="item_not_found",
                                param="item_id")
        if end_ms > round(said.made * 1000) and not running:
            raise RealtimeError(f"audio_end_ms {end_ms} is past the item's {round(said.made * 1000)} ms of audio",
                                param="audio_end_ms")
        if running and self.active is not None:
            self.active.heard_ms = end_ms  # applied when the reply ends
        elif said.turn is not None:
            said.turn["content"] = cut_text(said, end_ms / 1000, self.assistant)
        await self.send(rt.server_event("conversation.item.truncated", item_id=item_id, content_index=0,
                                        audio_end_ms=end_ms))

    # -- replies --

    async def respond(self, max_tokens: int | None = None) -> None:
        if self.active is not None and self.active.cancelled and self.active.task is not None:
            await asyncio.wait([self.active.task])  # its cut turn goes into the conversation first (<= CANCEL_GRACE)
        if self.active is not None:
            raise RealtimeError("a response is in progress: cancel it first (response.cancel)",
                                code="conversation_already_has_active_response")
        if not self.pending_clips and not self.pending_text:
            raise RealtimeError("nothing to answer: append audio and commit it, or create a user message first",
                                code="input_missing")
        cap = max_tokens or self.config.max_output_tokens
        options = with_defaults(ReplyOptions(voice=self.config.voice, text_only=not self.config.audio,
                                             max_text_tokens=cap), self.defaults).check()
        response = Response(self, " ".join(self.pending_text), self.pending_clips, options)
        self.pending_text, self.pending_clips = [], []
        self.active = response
        await self.send(rt.server_event("response.created", response=rt.response(response.id, "in_progress", response.config)))
        item = rt.assistant_message(response.item_id, "", response.config.audio, "in_progress")
        await self.send(rt.server_event("response.output_item.added", response_id=response.id, output_index=0, item=item))
        await self.send(rt.server_event("conversation.item.created", previous_item_id=None, item=item))
        self.worker.submit(response.job)
        response.task = asyncio.create_task(self.stream(response))

    def cancel(self, response: Response, reason: str) -> None:
        """Stop `response` now (barge-in, response.cancel): the engine stops; its task ends it for the client."""
        if response.cancelled:
            return
        response.cancelled, response.cancelled_at = reason, time.monotonic()
        response.heard_ms = response.heard_ms if response.heard_ms is not None else response.played() * 1000
        response.job.cancel()
        response.job.items.put_nowait(_WAKE)  # the task stops forwarding at once

    async def stream(self, response: Response) -> None:
        """The reply's events to the client, then `response.done` and the conversation's turn."""
        try:
            reply, failure = await self.forward(response)
            if response.cancelled and response.cancelled != "client_gone":
                await self.stopped(response, reply)
                await self.finish(response, "cancelled", reason=response.cancelled)
            elif failure is not None:
                error = {"type": "server_error", "code": "server_error", "message": str(failure)[:500]}
                await self.finish(response, "failed", error=error)
            elif reply is not None:
                said = response.said
                said.turn = self.conversation.turns[-1]  # the assistant added the exchange before its Done
                if response.heard_ms is not None:  # a truncate came while it ran
                    said.turn["content"] = cut_text(said, response.heard_ms / 1000, self.assistant)
                await self.finish(response, "completed", reply=reply)
        finally:
            if self.active is response:
                self.active = None

    async def forward(self, response: Response):
        """(the Reply or None, the failure or None): the job's events sent on until it ends or is cancelled."""
        while True:
            item = await response.job.items.get()
            if isinstance(item, Done):
                return item.reply, None
            if item is END or response.cancelled:
                return None, None
            if isinstance(item, TextDelta):
                await self.text_delta(response, item.text)
            elif isinstance(item, AudioBlock):
                await self.audio_delta(response, item)
            elif isinstance(item, BaseException):
                return None, as_request_error(item)

    async def stopped(self, response: Response, reply) -> None:
        """A cancelled reply: wait (CANCEL_GRACE at most) for the engine to stop, then keep what was heard of
        it. A reply whose Done came before the cancel took effect is in the conversation whole already: it is
        cut there instead of added."""
        deadline = time.monotonic() + CANCEL_GRACE
        try:
            while reply is None or response.job.items.qsize():
                item = await asyncio.wait_for(response.job.items.get(), max(0.0, deadline - time.monotonic()))
                if item is END:
                    break
                reply = item.reply if isinstance(item, Done) else reply
            response.stopped_in = time.monotonic() - (response.cancelled_at or time.monotonic())
        except asyncio.TimeoutError:
            log.info("realtime: the cancelled reply's engine did not stop within %.0f ms", CANCEL_GRACE * 1000)
        text = cut_text(response.said, (response.heard_ms or 0.0) / 1000, self.assistant)
        if reply is None:
            self.conversation.add(response.prompt, text, {"audio": response.clips})
        else:
            self.conversation.turns[-1]["content"] = text
        response.said.turn = self.conversation.turns[-1]

    async def text_delta(self, response: Response, text: str) -> None:
        response.said.pieces.append(text)
        kind = "response.output_audio_transcript.delta" if response.config.audio else "response.output_text.delta"
        await self.send(rt.server_event(kind, response_id=response.id, item_id=response.item_id, output_index=0,
                                        content_index=0, delta=text))

    async def audio_delta(self, response: Response, block: AudioBlock) -> None:
        pcm = block.pcm
        if block.sample_rate != RATE:
            import soxr

            pcm = soxr.resample(pcm, block.sample_rate, RATE).astype(np.float32)
        if response.first_audio is None:
            response.first_audio = time.monotonic()
        response.said.made += len(pcm) / RATE
        await self.send(rt.server_event("response.output_audio.delta", response_id=response.id,
                                        item_id=response.item_id, output_index=0, content_index=0,
                                        delta=rt.b64_pcm16(pcm)))

    async def finish(self, response: Response, status: str, reason: str | None = None, reply=None,
                     error: dict | None = None) -> None:
        said = response.said
        self.items[response.item_id] = said
        text = said.turn["content"] if said.turn is not None else "".join(said.pieces)
        item = rt.assistant_message(response.item_id, text, said.audio, "completed" if status == "completed" else "incomplete")
        use = None
        if reply is not None:
            u = p.reply_usage(reply)
            use = rt.usage(u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"])
        if status == "completed":
            done = "response.output_audio_transcript.done" if said.audio else "response.output_text.done"
            await self.send(rt.server_event(done, response_id=response.id, item_id=response.item_id, output_index=0,
                                            content_index=0, **({"transcript": text} if said.audio else {"text": text})))
            if said.audio:
                await self.send(rt.server_event("response.output_audio.done", response_id=response.id,
                                                item_id=response.item_id, output_index=0, content_index=0))
        await self.send(rt.server_event("response.output_item.done", response_id=response.id, output_index=0, item=item))
        body = rt.response(response.id, status, response.config, [item], reason=reason, usage=use, error=error)
        if response.stopped_in is not None:
            body["omni"] = {"engine_stopped_ms": round(response.stopped_in * 1000, 1)}
        await self.send(rt.server_event("response.done", response=body))


_WAKE = object()  # put on a cancelled reply's queue so that its task stops waiting for the engine's next event


def cut_text(said: Said, played: float, assistant) -> str:
    """What `played` seconds of an item's audio carried of its text (`heard_text`); a text reply's whole."""
    if not said.audio:
        return "".join(said.pieces)
    # At most one text token a talker step (heard.py): the steps' rate bounds what `played` can carry.
    return heard_text(said.pieces, played, said.made, assistant.speech_steps[1])


