"""The OpenAI Realtime API's shapes as omni-serve speaks them: client events read and checked, server
events built. Plain dicts in and out; the session's behaviour is api/realtime.py's.

What it reads: `session.update` (GA shape: `audio.input.turn_detection`, `audio.output.voice`,
`output_modalities`; the beta's flat `voice`, `turn_detection`, `modalities` too), `input_audio_buffer.append`
(base64 PCM16, 24 kHz mono, its size checked before it is decoded), `commit`, `clear`, `response.create`,
`response.cancel`, `conversation.item.create` (a user message of `input_text` / `input_audio` parts, or an
assistant message of text), `conversation.item.truncate`. Anything else, or a field of the wrong kind, is
a `RealtimeError`, which the session sends back as an `error` event and goes on.

What it knows of the model: only what the session passes (voices, the default system prompt). It knows
no engine, no socket and no torch; numpy is imported when audio is decoded.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

RATE = 24_000  # the API's PCM16 rate, in and out
PCM_FORMAT = {"type": "audio/pcm", "rate": RATE}

CLIENT_EVENTS = frozenset({
    "session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
    "response.create", "response.cancel", "conversation.item.create", "conversation.item.truncate"})


class RealtimeError(Exception):
    """A client event this server cannot take: it becomes an `error` event; the session goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code, self.param, self.kind = code, param, kind


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# -- the session's settings ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerVad:
    """`turn_detection: {"type": "server_vad", ...}`, OpenAI's defaults; `min_speech_ms` is ours (not in
    OpenAI's API): voiced time a stretch needs before it counts as speech, so a click or a cough does not
    start a turn nor interrupt a reply. WebRTC's VAD keeps saying "speech" ~3 frames (90 ms) after a
    sound ends, so a 60 ms burst reads as ~150 ms voiced: 200 ms (the microphone's default too) rejects it,
    and costs real speech 200 ms before `speech_started`."""

    threshold: float = 0.5  # 0..1: mapped onto WebRTC's aggressiveness modes 0-3 (higher: stricter)
    prefix_padding_ms: int = 300  # audio kept before the speech's start in the user's item
    silence_duration_ms: int = 500  # quiet that ends the user's turn
    create_response: bool = True  # a reply starts when the turn ends
    interrupt_response: bool = True  # speech while a reply runs cancels it (barge-in)
    min_speech_ms: int = 200

    def to_json(self) -> dict:
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": None,
                "min_speech_ms": self.min_speech_ms}

    def vad_mode(self) -> int:
        return min(3, int(self.threshold * 4))


@dataclass(frozen=True)
class SessionConfig:
    """What a session's replies are made with; `session.update` replaces it field by field."""

    instructions: str  # the system prompt ("" = none)
    voice: str | None  # None: the model's default (or it does not speak)
    turn_detection: ServerVad | None = field(default_factory=ServerVad)  # None: the client commits and asks
    audio: bool = True  # output_modalities ["audio"] (with its transcript), else ["text"]
    max_output_tokens: int | None = None  # None: "inf", the server's own cap

    def to_json(self, model: str, session_id: str) -> dict:
        return {"type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
                "output_modalities": ["audio"] if self.audio else ["text"], "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens or "inf", "tools": [], "tool_choice": "auto",
                "audio": {"input": {"format": PCM_FORMAT, "transcription": None, "noise_reduction": None,
                                    "turn_detection": self.turn_detection.to_json() if self.turn_detection else None},
                          "output": {"format": PCM_FORMAT, "voice": self.voice, "speed": 1.0}}}


def updated(config: SessionConfig, session: Any, voices: list[str], max_instructions: int) -> SessionConfig:
    """`config` with the fields `session.update` gives (GA or beta shape); a `RealtimeError` for a field of
    the wrong kind, a voice the model lacks, a format other than 24 kHz PCM16, or semantic VAD."""
    s = _object(session, "session")
    audio = _object(s.get("audio"), "session.audio")
    heard, said = _object(audio.get("input"), "session.audio.input"), _object(audio.get("output"), "session.audio.output")
    for where, fmt in (("session.audio.input.format", heard.get("format")),
                       ("session.audio.output.format", said.get("format")),
                       ("session.input_audio_format", s.get("input_audio_format")),
                       ("session.output_audio_format", s.get("output_audio_format"))):
        _check_format(fmt, where)
    changes: dict[str, Any] = {}
    if "instructions" in s:
        changes["instructions"] = _text(s["instructions"], "session.instructions", max_instructions)
    voice = said.get("voice", s.get("voice"))
    if voice is not None:
        changes["voice"] = _voice(voice, voices)
    for where, given in (("session.audio.input.turn_detection", heard), ("session.turn_detection", s)):
        if "turn_detection" in given:
            changes["turn_detection"] = turn_detection(given["turn_detection"], where, config.turn_detection)
    modalities = s.get("output_modalities", s.get("modalities"))
    if modalities is not None:
        changes["audio"] = _modalities(modalities)
    if "max_output_tokens" in s or "max_response_output_tokens" in s:
        changes["max_output_tokens"] = max_tokens(s.get("max_output_tokens", s.get("max_response_output_tokens")))
    return replace(config, **changes)


def turn_detection(value: Any, where: str, now: ServerVad | None) -> ServerVad | None:
    """A `turn_detection` object (None: manual turns); its unset fields keep the session's values."""
    if value is None:
        return None
    v = _object(value, where)
    kind = v.get("type", "server_vad")
    if kind != "server_vad":
        raise RealtimeError(f"{where}.type {kind!r} is not supported: this server detects turns with server_vad "
                            "(WebRTC's VAD) or none (null)", param=f"{where}.type")
    base = now or ServerVad()
    fields: dict[str, Any] = {}
    for name, lo, hi in (("prefix_padding_ms", 0, 5000), ("silence_duration_ms", 30, 10_000),
                         ("min_speech_ms", 30, 5000)):
        if v.get(name) is not None:
            fields[name] = _int(v[name], f"{where}.{name}", lo, hi)
    if v.get("threshold") is not None:
        fields["threshold"] = _float(v["threshold"], f"{where}.threshold", 0.0, 1.0)
    for name in ("create_response", "interrupt_response"):
        if v.get(name) is not None:
            fields[name] = _bool(v[name], f"{where}.{name}")
    return replace(base, **fields)


def max_tokens(value: Any) -> int | None:
    if value is None or value == "inf":
        return None
    return _int(value, "max_output_tokens", 1, 4096)


# -- client events -------------------------------------------------------------------------------------


def parse_event(text: str | bytes, max_bytes: int, depth: int) -> dict:
    """One client message as an event object with a known `type`; a `RealtimeError` for a message over
    `max_bytes`, nesting deeper than `depth` (checked before it is parsed), not JSON, or of no known type."""
    from .server import too_deep

    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if len(raw) > max_bytes:
        raise RealtimeError(f"the event is {len(raw)} bytes, over the {max_bytes} this server reads: send audio in "
                            "smaller appends", code="event_too_large")
    if too_deep(raw, depth):
        raise RealtimeError(f"the event's JSON nests deeper than {depth} levels", code="invalid_json")
    try:
        event = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RealtimeError(f"the event is not JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(event, dict):
        raise RealtimeError("the event is JSON but not an object with a \"type\"", code="invalid_event")
    kind = event.get("type")
    if not isinstance(kind, str) or kind not in CLIENT_EVENTS:
        shown = repr(kind)[:80] if kind is not None else "none"
        raise RealtimeError(f"unknown event type {shown}: this server takes {', '.join(sorted(CLIENT_EVENTS))}",
                            code="invalid_event", param="type")
    return event


def audio_of(event: dict, max_chars: int, param: str = "audio") -> "np.ndarray":
    """The float32 samples of an event's base64 PCM16 (`event[param]`), its length checked before decoding."""
    data = event.get(param)
    if not isinstance(data, str):
        raise RealtimeError(f"{param} must be a base64 string of PCM16 at {RATE} Hz", param=param)
    if len(data) > max_chars:
        raise RealtimeError(f"{param} is {len(data)} base64 characters, over the {max_chars} one event may carry: "
                            "append the audio in smaller pieces", code="audio_too_large", param=param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError(f"{param} is not base64", code="invalid_audio", param=param) from None
    if len(raw) % 2:
        raise RealtimeError(f"{param} holds {len(raw)} bytes: PCM16 comes in whole 2-byte samples",
                            code="invalid_audio", param=param)
    from ..audio.format import from_pcm16

    return from_pcm16(raw)


def user_item(item: dict, max_chars: int, max_text: int) -> tuple[str, list["np.ndarray"]]:
    """(text, clips at 24 kHz) of a user message item (`input_text` and `input_audio` parts)."""
    texts, clips = [], []
    parts = item.get("content")
    if not isinstance(parts, list) or not parts:
        raise RealtimeError("item.content must be a list of input_text or input_audio parts", param="item.content")
    for n, part in enumerate(parts):
        where = f"item.content[{n}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_text":
            texts.append(_text(part.get("text"), f"{where}.text", max_text))
        elif kind == "input_audio":
            clips.append(audio_of(part, max_chars, "audio"))
        else:
            raise RealtimeError(f"{where} is a {kind!r} part: this server takes input_text and input_audio",
                                param=where)
    return " ".join(t for t in texts if t), clips


def assistant_text(item: dict, max_text: int) -> str:
    """The text of an assistant message item (`output_text`/`text` parts, or an audio part's transcript)."""
    parts = item.get("content")
    if not isinstance(parts, list):
        raise RealtimeError("item.content must be a list of parts", param="item.content")
    texts = []
    for n, part in enumerate(parts):
        if not isinstance(part, dict):
            raise RealtimeError(f"item.content[{n}] must be an object", param=f"item.content[{n}]")
        value = part.get("text", part.get("transcript"))
        texts.append(_text(value, f"item.content[{n}].text", max_text))
    return "".join(texts)


def truncation(event: dict) -> tuple[str, int]:
    """(item_id, audio_end_ms) of a `conversation.item.truncate`."""
    item = event.get("item_id")
    if not isinstance(item, str) or not item:
        raise RealtimeError("item_id must name an assistant item", param="item_id")
    if event.get("content_index", 0) != 0:
        raise RealtimeError("content_index must be 0 (an item has one audio part)", param="content_index")
    return item, _int(event.get("audio_end_ms"), "audio_end_ms", 0, 24 * 3600 * 1000)


# -- server events -------------------------------------------------------------------------------------


def server_event(kind: str, **fields: Any) -> dict:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(exc: RealtimeError, client_event: str | None = None) -> dict:
    return server_event("error", error={"type": exc.kind, "code": exc.code, "message": str(exc),
                                        "param": exc.param, "event_id": client_event})


def user_message(item_id: str, text: str, clips: int) -> dict:
    content = [{"type": "input_audio", "transcript": None} for _ in range(clips)]
    content += [{"type": "input_text", "text": text}] if text else []
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
            "content": content}


def assistant_message(item_id: str, text: str, audio: bool, status: str) -> dict:
    part = {"type": "output_audio", "transcript": text} if audio else {"type": "output_text", "text": text}
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant", "status": status,
            "content": [part]}


def response(response_id: str, status: str, config: SessionConfig, output: list[dict] | None = None,
             reason: str | None = None, usage: dict | None = None, error: dict | None = None) -> dict:
    details = None
    if status != "in_progress" and status != "completed":
        details = {"type": status, "reason": reason, "error": error}
    return {"id": response_id, "object": "realtime.response", "status": status, "status_details": details,
            "output": output or [], "conversation_id": None, "output_modalities": ["audio" if config.audio else "text"],
            "max_output_tokens": config.max_output_tokens or "inf",
            "audio": {"output": {"format": PCM_FORMAT, "voice": config.voice}}, "usage": usage, "metadata": None}


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    return {"total_tokens": prompt_tokens + output_tokens, "input_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "input_token_details": {"cached_tokens": cached, "text_tokens": None, "audio_tokens": None},
            "output_token_details": {"text_tokens": output_tokens, "audio_tokens": None}}


def b64_pcm16(pcm: "np.ndarray") -> str:
    from ..audio.format import pcm16

    return base64.b64encode(pcm16(pcm)).decode("ascii")


# -- field checks --------------------------------------------------------------------------------------


def _object(value: Any, name: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RealtimeError(f"{name} must be an object", param=name)
    return value


def _text(value: Any, name: str, most: int) -> str:
    if not isinstance(value, str):
        raise RealtimeError(f"{name} must be a string", param=name)
    if len(value) > most:
        raise RealtimeError(f"{name} is {len(value)} characters, over the {most} the context can hold",
                            code="string_above_max_length", param=name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RealtimeError(f"{name} holds a lone surrogate, which is not text", param=name) from None
    return value


def _voice(value: Any, voices: list[str]) -> str:
    name = value.get("id") if isinstance(value, dict) else value
    if not isinstance(name, str):
        raise RealtimeError("voice must be a string", param="session.audio.output.voice")
    for voice in voices:
        if voice.lower() == name.lower():
            return voice
    offered = ", ".join(voices) or "none: this model does not speak"
    raise RealtimeError(f"unknown voice {name[:60]!r}; this model's voices: {offered}", param="session.audio.output.voice")


def _check_format(fmt: Any, where: str) -> None:
    if fmt is None or fmt == "pcm16":
        return
    if isinstance(fmt, dict) and fmt.get("type", "audio/pcm") == "audio/pcm" and fmt.get("rate", RATE) == RATE:
        return
    raise RealtimeError(f"{where}: this server takes and sends PCM16 at {RATE} Hz only ({{\"type\": \"audio/pcm\", "
                        f"\"rate\": {RATE}}})", param=where)


def _modalities(value: Any) -> bool:
    if value in (["audio"], ["text", "audio"], ["audio", "text"]):
        return True
    if value == ["text"]:
        return False
    raise RealtimeError("output_modalities must be [\"audio\"] or [\"text\"]", param="session.output_modalities")


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value):
        raise RealtimeError(f"{name} must be an integer", param=name)
    if not lo <= value <= hi:
        raise RealtimeError(f"{name} must be between {lo} and {hi}", param=name)
    return int(value)


def _float(value: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RealtimeError(f"{name} must be a number", param=name)
    if not lo <= value <= hi:
        raise RealtimeError(f"{name} must be between {lo:g} and {hi:g}", param=name)
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise RealtimeError(f"{name} must be true or false", param=name)
    return value
