"""A small synchronous client of omni-serve's `/v1/realtime` (OpenAI's Realtime API), for a face on a
laptop that talks to a model on a GPU box: connect, set the session (voice, instructions, turn detection),
stream the microphone's audio in, read the reply's audio and transcript deltas, cancel or truncate.

    session = RealtimeSession.connect("http://gpu-box:8484", api_key="...")
    session.update(voice="Chelsie", turn_detection={"type": "server_vad", "silence_duration_ms": 500})
    session.append(block)                 # float32 (or int16) mono blocks at 24 kHz, from any thread
    for event in session.events():        # Event(type, data): .audio (float32) and .text for the deltas
        ...

The server detects the turns (server VAD) and stops a reply itself when the user speaks over it; a
client without server VAD commits (`commit`) and asks (`respond`). `send` and `append` may be called from
one thread (the microphone's) while another reads `events` (the websockets library's sync connection
allows one sender and one reader at once; its sends are serialized).

It imports neither torch nor the server; numpy is imported when audio is converted. Transport: the
websockets library's sync client. A refused handshake (a wrong key: 401) or a lost connection is a
`ServerError` with the server's message.
"""

from __future__ import annotations

import base64
import inspect
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import urlencode

from .client import ServerError, base_url

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

RATE = 24_000  # the API's PCM16 rate, both ways
MAX_MESSAGE = 16 << 20  # the largest server message read (a reply's audio comes in blocks of well under 1 MiB)


@dataclass(frozen=True)
class Event:
    """One server event: its `type` and its JSON object."""

    type: str
    data: dict

    @property
    def audio(self) -> "np.ndarray | None":
        """A `response.output_audio.delta`'s samples (float32 at 24 kHz), else None."""
        if self.type != "response.output_audio.delta":
            return None
        from ..audio.format import from_pcm16

        return from_pcm16(base64.b64decode(self.data.get("delta", "")))

    @property
    def text(self) -> str | None:
        """A transcript or text delta's text, else None."""
        if self.type in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            return str(self.data.get("delta", ""))
        return None

    @property
    def status(self) -> str | None:
        """A `response.done`'s status (completed, cancelled, failed), else None."""
        return (self.data.get("response") or {}).get("status") if self.type == "response.done" else None


def realtime_url(url: str, model: str | None = None) -> str:
    """The WebSocket URL of a server's `/v1/realtime` (http -> ws, https -> wss)."""
    base = base_url(url)
    scheme, rest = base.split("://", 1)
    ws = {"http": "ws", "https": "wss"}.get(scheme, scheme)
    return f"{ws}://{rest}/v1/realtime" + (f"?{urlencode({'model': model})}" if model else "")


class RealtimeSession:
    """One realtime session with a server (see the module docstring)."""

    def __init__(self, connection, session: dict) -> None:
        self._ws = connection
        self.session = session  # the server's session object, as last created or updated
        self._held: list[Event] = []  # events read while waiting for another (update's session.updated)

    @classmethod
    def connect(cls, url: str, api_key: str | None = None, model: str | None = None,
                timeout: float = 10.0) -> "RealtimeSession":
        """Open a session at `url` (the server's http(s) URL); a `ServerError` if it is refused or unreachable."""
        from websockets.exceptions import InvalidStatus, WebSocketException
        from websockets.sync.client import connect

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # websockets 15+ warns about a connection held outside a `with` unless it is asked for by name
        # (`legacy=True`); the session is held across calls, so it is asked for where the flag exists.
        legacy: dict[str, Any] = {"legacy": True} if "legacy" in inspect.signature(connect).parameters else {}
        try:
            ws = connect(realtime_url(url, model), additional_headers=headers, open_timeout=timeout,
                         max_size=MAX_MESSAGE, compression=None, **legacy)
        except InvalidStatus as exc:
            raise ServerError(f"{url} refused the realtime session: {_refusal(exc.response)}") from None
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise ServerError(f"cannot open a realtime session at {url}: {exc}") from None
        session = cls(ws, {})
        first = session.receive(timeout)
        if first is None or first.type != "session.created":
            session.close()
            raise ServerError(f"{url} did not start a realtime session ({first.type if first else 'nothing'} came)")
        session.session = first.data.get("session") or {}
        return session

    # -- sending --

    def send(self, event: dict) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            self._ws.send(json.dumps(event, separators=(",", ":")))
        except ConnectionClosed as exc:
            raise ServerError(f"the realtime session was closed: {exc}") from None

    def update(self, *, voice: str | None = None, instructions: str | None = None,
               turn_detection: dict | None | bool = True, text_only: bool | None = None,
               max_output_tokens: int | None = None, timeout: float = 10.0) -> dict:
        """Change the session (what is given), wait for `session.updated`; `turn_detection`: a server_vad
        object, None (the client commits and asks), True (unchanged); `max_output_tokens`: a reply's text
        tokens at most. A `ServerError` for a refused change."""
        session: dict[str, Any] = {"type": "realtime"}
        if max_output_tokens is not None:
            session["max_output_tokens"] = max_output_tokens
        if instructions is not None:
            session["instructions"] = instructions
        if text_only is not None:
            session["output_modalities"] = ["text"] if text_only else ["audio"]
        audio: dict[str, Any] = {}
        if voice is not None:
            audio["output"] = {"voice": voice}
        if turn_detection is not True:
            audio["input"] = {"turn_detection": turn_detection}
        if audio:
            session["audio"] = audio
        self.send({"type": "session.update", "session": session})
        event = self._wait("session.updated", timeout)
        self.session = event.data.get("session") or {}
        return self.session

    def append(self, pcm) -> None:
        """Send audio: float32 samples in [-1, 1] (or int16 samples, or PCM16 bytes) at 24 kHz, mono."""
        if isinstance(pcm, (bytes, bytearray, memoryview)):
            data = bytes(pcm)
        else:
            import numpy as np

            from ..audio.format import pcm16

            arr = np.asarray(pcm)
            data = arr.astype("<i2").tobytes() if arr.dtype == np.int16 else pcm16(arr)
        self.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode("ascii")})

    def commit(self) -> None:
        self.send({"type": "input_audio_buffer.commit"})

    def clear(self) -> None:
        self.send({"type": "input_audio_buffer.clear"})

    def respond(self) -> None:
        self.send({"type": "response.create"})

    def cancel(self) -> None:
        self.send({"type": "response.cancel"})

    def truncate(self, item_id: str, audio_end_ms: int) -> None:
        """The assistant item `item_id` was heard up to `audio_end_ms`: the server keeps that much of its text."""
        self.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                   "audio_end_ms": int(audio_end_ms)})

    # -- receiving --

    def receive(self, timeout: float | None = None) -> Event | None:
        """The next server event, or None after `timeout` seconds without one; a `ServerError` once closed."""
        if self._held:
            return self._held.pop(0)
        from websockets.exceptions import ConnectionClosed

        try:
            raw = self._ws.recv(timeout=timeout)
        except TimeoutError:
            return None
        except ConnectionClosed as exc:
            raise ServerError(f"the realtime session was closed: {exc}") from None
        data = json.loads(raw)
        return Event(str(data.get("type", "")), data)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Events as they come, until the session closes (or `timeout` s pass without one)."""
        while True:
            try:
                event = self.receive(timeout)
            except ServerError:
                return
            if event is None:
                return
            yield event

    def _wait(self, kind: str, timeout: float) -> Event:
        """The next `kind` event (others are held for `receive`); an `error` event raises its message."""
        seen = []
        try:
            while True:
                event = self.receive(timeout)
                if event is None:
                    raise ServerError(f"no {kind} from the server within {timeout:g} s")
                if event.type == kind:
                    return event
                if event.type == "error":
                    raise ServerError((event.data.get("error") or {}).get("message") or "the server refused it")
                seen.append(event)
        finally:
            self._held = seen + self._held

    def close(self) -> None:
        """End the session (the server stops its reply, if one runs)."""
        self._ws.close()

    def __enter__(self) -> "RealtimeSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refusal(response) -> str:
    """A refused handshake's status and the message of its OpenAI-shaped JSON body."""
    status = getattr(response, "status_code", "?")
    try:
        message = json.loads(bytes(response.body or b""))["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = bytes(getattr(response, "body", b"") or b"")[:200].decode("utf-8", "replace")
    return f"{status} {message}".strip()
