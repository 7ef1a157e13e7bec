"""`--verbose` and `/stats`: one reply's timing block, the start-up's phases, and the clock that tells
generation time from playback time.

It reads a reply's stats and the speaker's playback stats as they are given; it knows nothing of how
they were measured.
"""

from __future__ import annotations

import time
from typing import Any

from .console import print_text


def _fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def speech_steps(assistant: Any) -> tuple[str, float | None]:
    """(name, steps per second of audio) of the talker's steps of `assistant`'s model, for what people
    read: ("codes", 50.0) for Qwen2.5-Omni, ("frames", 12.5) for Qwen3-Omni (`Assistant.speech_steps`);
    ("codes", None) for an assistant that does not say."""
    return getattr(assistant, "speech_steps", ("codes", None))


def timing_lines(stats: dict, playback: dict | None = None, played: bool = False,
                 unit: str = "codes") -> list[tuple[str, str]]:
    """(label, value) rows of the --verbose timing block for one reply's stats (+ the speaker's); `unit`
    names the talker's steps (`speech_steps`: "codes" or "frames")."""
    rows = [
        ("time to first text", _fmt_seconds(stats.get("time_to_first_text"))),
        ("time to first audio", _fmt_seconds(stats.get("time_to_first_audio"))),
    ]
    # Counted from where the first text and audio are (the reply's start, or the request's through a server).
    if playback and playback.get("first_sound_at") is not None and stats.get("started_at") is not None:
        rows.append(("time to first sound", _fmt_seconds(playback["first_sound_at"] - stats["started_at"])))
    if playback and playback.get("start_reason"):
        # The speaker's adaptive start: how long it held the first audio back, and why.
        queued = playback.get("start_buffered")
        detail = playback["start_reason"] + (f", {queued:.2f} s queued" if queued is not None else "")
        rate = playback.get("production_rate")
        if rate is not None and rate < 100:  # above that, the first block came at once: no estimate yet
            detail += f", audio made at {rate:.2f}x real time"
        rows.append(("playback waited", f"{_fmt_seconds(playback.get('start_wait'))} ({detail})"))
    audio = stats.get("audio_seconds") or 0.0
    # "audio_done": when the last audio block was handed over (set by the CLI); the engine's total_time
    # also counts the wait for the speaker to play out, which is not generation time.
    made_in = stats.get("audio_done", stats.get("total_time"))
    if audio and made_in is not None:
        rows.append(("real-time factor", f"{made_in / audio:.2f} ({audio:.1f} s of audio made in {made_in:.2f} s)"))
    else:
        rows.append(("real-time factor", "- (no audio)"))
    shown = stats.get("images_in")
    if shown:
        enc = stats.get("image_encoder_ms")
        rows.append(("images in", f"{shown}" + (f" (encoder {enc:.0f} ms, in the prefill)" if enc is not None else "")))
    heard = stats.get("audio_in_seconds")
    if heard:
        enc = stats.get("audio_encoder_ms")
        rows.append(("audio in", f"{heard:.1f} s" + (f" (encoder {enc:.0f} ms, in the prefill)" if enc is not None else "")))
    th = stats.get("thinker_ms_per_token")
    tk = stats.get("talker_ms_per_step")
    rows.append(("text tokens", f"{stats.get('text_tokens', 0)}" + (f" ({th:.1f} ms/token)" if th else "")))
    rows.append((f"speech {unit}", f"{stats.get('codes', 0)}" + (f" ({tk:.1f} ms/step)" if tk else "")))
    if playback is not None:
        rows.append(("underruns", f"{playback['underruns']} ({playback['underrun_seconds'] * 1000:.0f} ms of silence)"))
        if playback.get("device_underflows"):
            rows.append(("device underflows", str(playback["device_underflows"])))
    else:
        rows.append(("underruns", "- (not playing)"))
    return rows


class AudioClock:
    """Notes when the last audio block of a reply arrived, to tell generation time from playback time."""

    def __init__(self) -> None:
        self.last: float | None = None

    def tick(self) -> None:
        self.last = time.perf_counter()

    def stats(self, stats: dict) -> dict:
        out = dict(stats)
        if self.last is not None and stats.get("started_at") is not None:
            out["audio_done"] = self.last - stats["started_at"]
        return out


def print_timing(err, stats: dict, playback: dict | None = None, title: str = "timing", unit: str = "codes") -> None:
    rows = timing_lines(stats, playback, unit=unit)
    width = max(len(label) for label, _ in rows)
    print_text(err, f"-- {title}", style="dim")
    for label, value in rows:
        print_text(err, f"{label.ljust(width)}  {value}", style="dim")  # a server's stats and a device's name


def print_startup(err, startup: dict, after: dict, since_command: float | None = None) -> None:
    """`--verbose`: where start-up went (the assistant's `startup` phases, in order; a name indented by
    spaces is a part of the phase above it, not counted twice), what came after it (`after`: name ->
    seconds), and how long after the command the first audio existed."""
    rows = [(name, f"{seconds:.2f} s") for name, seconds in startup.items()]
    if startup:
        rows.append(("start-up in all", f"{sum(v for k, v in startup.items() if not k.startswith(' ')):.2f} s"))
    rows += [(name, f"{seconds:.2f} s") for name, seconds in after.items()]
    if since_command is not None:
        rows.append(("first audio after the command", f"{since_command:.2f} s"))
    width = max(len(label) for label, _ in rows)
    print_text(err, "-- start-up", style="dim")
    for label, value in rows:
        print_text(err, f"{label.ljust(width)}  {value}", style="dim")



def print_command_startup(err, assistant, stats: dict, t_command: float) -> None:
    """`--verbose`: the start-up's phases (a local model) and the first audio's time after the command
    began (`t_command`: the process's start where known, else when omni-say's code began)."""

    first = stats.get("time_to_first_audio")
    started = stats.get("started_at")
    since = started + first - t_command if first is not None and started is not None else None
    after = {}
    ready = getattr(assistant, "ready_at", None)
    if ready is not None and started is not None:
        after["the request (chat template, tokens)"] = started - ready
    if first is not None:
        after["the reply's first audio" + (" (server and network)" if ready is None else "")] = first
        if ready is None and stats.get("server_time_to_first_audio") is not None:
            after["  of which the server's turn"] = stats["server_time_to_first_audio"]  # the rest: HTTP, queue, prompt
    print_startup(err, getattr(assistant, "startup", None) or {}, after, since)


def size_text(n: float) -> str:
    """Bytes as a person reads them: 1.23 GiB, 87.8 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def memory_rows(memory: dict | None) -> list[tuple[str, str]]:
    """(label, value) rows of a model's memory (a local `Assistant.memory`): the weights, packed and
    float, what of them waits in host memory, and the device's peak where the device counts it (CUDA);
    [] without figures (a server's model)."""
    if not memory:
        return []
    weights = size_text(memory["weights"])
    if memory.get("packed"):
        weights += (f" ({size_text(memory['packed'])} packed {memory.get('quantize') or ''}".rstrip()
                    + f" + {size_text(memory['float'])} float)")
    rows = [("weights", weights)]
    if memory.get("host"):
        rows.append(("in host memory", f"{size_text(memory['host'])} (the vision encoder, until the first image)"))
    context = memory.get("context")
    if context and context.get("held"):
        rows.append(("kept context", f"{context['held']} tokens, {size_text(context['bytes'])}"))
    if memory.get("peak") is not None:
        rows.append(("device peak", size_text(memory["peak"])))
    return rows


def print_memory(err, assistant) -> None:
    """`--verbose`: the weights' bytes and the device's peak (nothing for a server's model)."""
    rows = memory_rows(getattr(assistant, "memory", None))
    if not rows:
        return
    width = max(len(label) for label, _ in rows)
    print_text(err, "-- memory", style="dim")
    for label, value in rows:
        print_text(err, f"{label.ljust(width)}  {value}", style="dim")
