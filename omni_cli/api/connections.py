"""omni-serve's connections, below the app: uvicorn's h11 protocol with the deadlines and the cap that
uvicorn itself does not have, and the uvicorn `Server` that stops the replies before it shuts down.

- A request head must arrive within `Limits.header_seconds` of connecting (or of the last reply on a
  kept connection): uvicorn starts no timer until a first response is sent, so a socket that sends
  nothing, or a head a byte at a time, would be held forever. The head's size is h11's incomplete-event
  limit (`HEAD_BYTES`).
- At most `Limits.connections` connections are open (fewer where the process may open fewer files): a
  new one beyond the cap closes the oldest idle one (no request under way), or itself when none is idle.
  uvicorn's `limit_concurrency` only answers 503 once a head has arrived, and counts idle sockets against
  everyone, so it cannot keep the user's own commands in; this can, and keeps the process away from
  EMFILE.
- The event loop's "socket.accept() out of system resource" (EMFILE) is logged once per `LOG_EVERY`
  seconds with a count, not once per attempt: asyncio retries the accept up to `backlog` times a tick
  and logs each with a traceback (1.6 million lines in minutes, before).
- h11's protocol errors (a malformed or oversized head) are answered with an OpenAI-shaped JSON 400,
  not uvicorn's plain text.
- A response sent before the request's body was read (a 413 for a body over the cap) is followed by a
  lingering close, as web servers do: our side of the connection is shut, what the client still sends is
  read and dropped for up to `LINGER_SECONDS`, then it is closed. Closing at once, with the body still
  arriving, makes the kernel reset the connection, and the client loses the answer it had been sent.

It knows uvicorn, h11 and asyncio, and nothing of the API's routes, models or terminals (api/server.py
is the app, faces/serve.py the face).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..limits import DEFAULT, Limits

log = logging.getLogger(__name__)

HEAD_BYTES = 32 * 1024  # a request's line and headers (h11's default is 16 KiB; ours carry one bearer token)
BACKLOG = 128  # connections the kernel holds before we accept them (uvicorn's default, 2048, is also how
# many times asyncio retries a failed accept in one tick)
LOG_EVERY = 10.0  # seconds between two reports of the same kind of connection trouble
RESERVED_FILES = 64  # open files kept for everything but connections (the model's files, pipes, logs)
LINGER_SECONDS = 2.0  # the most a connection is read and dropped after its answer (a lingering close)


class Throttled:
    """A warning said at most once per `every` seconds, with how many times it happened meanwhile."""

    def __init__(self, every: float = LOG_EVERY) -> None:
        self.every = every
        self.last = -float("inf")
        self.count = 0

    def __call__(self, message: str, *args: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            log.warning(message + " (%d time(s) since the last report)", *args, self.count)
            self.last, self.count = now, 0


def connection_cap(limits: Limits) -> int:
    """`limits.connections`, or fewer where the process may not open that many files (and more)."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return limits.connections
    if soft == resource.RLIM_INFINITY:
        return limits.connections
    return max(1, min(limits.connections, soft - RESERVED_FILES))


def protocol(limits: Limits = DEFAULT) -> type[H11Protocol]:
    """The h11 protocol class for uvicorn (`Config(http=...)`), with `limits`' head deadline and cap."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_seconds": limits.header_seconds, "cap": connection_cap(limits)})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head and a cap on open connections."""

    header_seconds: float = DEFAULT.header_seconds
    cap: int = DEFAULT.connections
    evicting = Throttled()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # The request cycles close the connection through this: a lingering close where the body is unread.
        self.transport = _Lingering(transport, self)  # type: ignore[assignment]
        self.lingering = False
        self.opened = time.monotonic()
        self.head_timer: asyncio.TimerHandle | None = None
        self._await_head()
        self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a body that was answered already: dropped
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole head came: the request runs on its own time
            self._head_arrived()

    def eof_received(self) -> None:
        if self.lingering:  # the client has sent all it had: the close need wait no longer
            self.transport.close()
            return
        super().eof_received()

    def linger(self, transport: asyncio.Transport) -> None:
        """Shut our side, drop what still comes, close after LINGER_SECONDS (or when the client is done)."""
        self.lingering = True
        self._head_arrived()
        self.flow.resume_reading()  # reading may have been paused while the body filled uvicorn's buffer
        try:
            transport.write_eof()
        except (OSError, RuntimeError):
            transport.close()
            return
        self.loop.call_later(LINGER_SECONDS, transport.close)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._await_head()  # kept open for the next request: it must come as promptly

    def idle(self) -> bool:
        """No request under way: waiting for (the rest of) a head."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _await_head(self) -> None:
        self._head_arrived()
        self.head_timer = self.loop.call_later(self.header_seconds, self._head_late)

    def _head_arrived(self) -> None:
        timer, self.head_timer = getattr(self, "head_timer", None), None
        if timer is not None:
            timer.cancel()

    def _head_late(self) -> None:
        self.head_timer = None
        if self.idle() and not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        # A closed connection stays in the set until the loop runs its connection_lost: not counted.
        open_ = [c for c in self.connections if c.transport is not None and not c.transport.is_closing()]
        if len(open_) <= self.cap:
            return
        idle = [c for c in open_ if c is not self and isinstance(c, GuardedH11Protocol) and c.idle()]
        victim = min(idle, key=lambda c: c.opened) if idle else self
        self.evicting("%d connections open (the cap): closing the oldest idle one", self.cap)
        victim.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A malformed or oversized request head: a JSON 400 (uvicorn's is plain text), then close."""
        body = json.dumps({"error": {"message": f"the request's head is malformed or over {HEAD_BYTES} bytes",
                                     "type": "invalid_request_error", "param": None, "code": None}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response had begun already: just close
            pass
        self.transport.close()


class _Lingering:
    """The connection's transport as the request cycles see it: `close()` lingers (see the module's
    docstring) when the client is still sending a body; everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        protocol, transport = self._protocol, self._transport
        if protocol.lingering or transport.is_closing():
            transport.close()
        elif protocol.conn.their_state is h11.SEND_BODY and transport.can_write_eof():
            protocol.linger(transport)
        else:
            transport.close()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Server(uvicorn.Server):
    """uvicorn's server, with accept errors logged once per interval and `before_shutdown` called when a
    shutdown begins (SIGTERM, Ctrl-C, `should_exit`), before uvicorn waits for the open responses: the
    app stops its replies then, so that they end whole instead of being cut at the grace period."""

    def __init__(self, config: uvicorn.Config, before_shutdown: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.before_shutdown = before_shutdown

    async def startup(self, sockets=None) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        await super().startup(sockets=sockets)

    async def shutdown(self, sockets=None) -> None:
        if self.before_shutdown is not None:
            self.before_shutdown()
        await super().shutdown(sockets=sockets)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log the loop's failed accepts (out of files, of memory) once per interval; the rest as before."""
    previous = loop.get_exception_handler()
    failed = Throttled()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            exc = context.get("exception")
            failed("cannot accept connections: %s", getattr(exc, "strerror", None) or exc)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def config(app, limits: Limits = DEFAULT, **options: Any) -> uvicorn.Config:
    """uvicorn's settings for omni-serve: h11 with our protocol, the head size, a short keep-alive."""
    # ws "auto": uvicorn's sans-I/O protocol over the websockets library (wsproto where only that is
    # installed; `ws="websockets"` is uvicorn's deprecated legacy one). A WebSocket message is bounded as a
    # request's body is; a realtime event's own cap is smaller, so that an oversized event is an `error`
    # event, not a closed socket.
    return uvicorn.Config(app, http=protocol(limits), h11_max_incomplete_event_size=HEAD_BYTES, backlog=BACKLOG,
                          timeout_keep_alive=5, ws="auto", ws_max_size=limits.body_bytes, **options)
