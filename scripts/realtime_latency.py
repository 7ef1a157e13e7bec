"""Time omni-serve's /v1/realtime as a talking client sees it, and print the figures as JSON.

    python scripts/realtime_latency.py --url http://127.0.0.1:8484 [--api-key KEY] [--wav speech.wav]
        [--silence-ms 500] [--rounds 3]

A sender thread streams audio at real time in 40 ms appends, as a microphone would: faint noise, and the
speech clip (`--wav`, any rate, resampled to 24 kHz; else a built-in speech-like signal WebRTC's VAD
hears as speech) when a turn is due. Each round is three turns: (1) speech, the server VAD ends it, the
reply plays through; (2) speech, and once the reply's first audio arrives the clip is spoken again over
it (barge-in: the server must cancel the reply); (3) the reply to that interrupting speech. Measured
(seconds, from this client's clock: send and arrival times):

- `speech_end_to_first_audio`: the last speech sample sent -> the reply's first audio delta received
  (turns 1 and 3; it holds `silence_ms` of the VAD's wait, stated in the output);
- `speech_end_to_stopped`: -> `input_audio_buffer.speech_stopped`;
- `speech_start_to_started`: the interrupting speech's first voiced sample sent -> `speech_started`;
- `started_to_cancelled`: `speech_started` -> `response.done` (status cancelled) received;
- `engine_stopped_ms`: the server's own count from the cancel to the engine's stream ending.

For a real-size model on a GPU box, run the server there and this anywhere (it needs the omni-cli
package for its torch-free client, numpy, soundfile and soxr). Not imported by the package.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time

import numpy as np

from omni_cli.api.realtime_client import RATE, RealtimeSession

BLOCK = 0.04  # seconds an append carries
LEAD = 0.2  # seconds of noise before the speech in a queued clip


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """Voiced syllables: a wavering ~120 Hz source's harmonics weighted by vowel formants, 4 a second."""
    n = int(RATE * seconds)
    t = np.arange(n) / RATE
    f0 = 120 * (1 + 0.08 * np.sin(2 * np.pi * 0.7 * t + seed))
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    formants = [(700, 1220, 2600), (300, 2300, 3000), (500, 900, 2400), (400, 1900, 2550)]
    which = (t // 0.25).astype(int) % len(formants)
    out = np.zeros(n)
    for k in range(1, 40):
        gain = np.zeros(n)
        for v, peaks in enumerate(formants):
            at = which == v
            gain[at] = sum(1 / (1 + ((k * f0[at] - f) / bw) ** 2) for f, bw in zip(peaks, (80, 100, 120)))
        out += gain / math.sqrt(k) * np.sin(k * phase)
    out *= np.sin(np.pi * (t % 0.25) / 0.25) ** 0.6
    return (0.3 * out / np.abs(out).max()).astype(np.float32)


def quiet(seconds: float, seed: int) -> np.ndarray:
    return (10 ** (-70 / 20) * np.random.default_rng(seed).standard_normal(int(RATE * seconds))).astype(np.float32)


def read_wav(path: str) -> np.ndarray:
    import soundfile
    import soxr

    pcm, rate = soundfile.read(path, dtype="float32", always_2d=True)
    mono = pcm.mean(axis=1)
    return mono if rate == RATE else soxr.resample(mono, rate, RATE).astype(np.float32)


class Microphone(threading.Thread):
    """Streams noise at real time, and a queued clip when asked; records when its speech was sent."""

    def __init__(self, session: RealtimeSession, clip: np.ndarray) -> None:
        super().__init__(daemon=True)
        self.session, self.clip = session, np.concatenate([quiet(LEAD, 1), clip])
        self.due = threading.Event()
        self.done = threading.Event()
        self.speech_start: float | None = None  # when the clip's first speech sample was sent
        self.speech_end: float | None = None

    def say(self) -> None:
        self.speech_start = self.speech_end = None
        self.due.set()

    def run(self) -> None:
        n, sent, start = int(BLOCK * RATE), 0, time.monotonic()
        noise = quiet(BLOCK, 2)
        while not self.done.is_set():
            if self.due.is_set():
                self.due.clear()
                lead = int(LEAD * RATE)
                for at in range(0, len(self.clip), n):
                    if at <= lead < at + n:
                        self.speech_start = time.monotonic()
                    self.session.append(self.clip[at:at + n])
                    sent += 1
                    time.sleep(max(0.0, start + sent * BLOCK - time.monotonic()))
                self.speech_end = time.monotonic()
            else:
                self.session.append(noise)
                sent += 1
                time.sleep(max(0.0, start + sent * BLOCK - time.monotonic()))


def wait(session: RealtimeSession, kind: str, timeout: float = 120.0):
    """(the first `kind` event, its arrival time); an `error` event stops the script."""
    deadline = time.monotonic() + timeout
    while True:
        event = session.receive(max(0.01, deadline - time.monotonic()))
        if event is None:
            raise SystemExit(f"no {kind} within {timeout:g} s")
        if event.type == "error":
            raise SystemExit(f"the server said: {event.data.get('error')}")
        if event.type == kind:
            return event, time.monotonic()


def one_round(session: RealtimeSession, mic: Microphone) -> dict:
    figures: dict = {}
    mic.say()  # turn 1: spoken, answered, played through
    _, stopped = wait(session, "input_audio_buffer.speech_stopped")
    _, first = wait(session, "response.output_audio.delta")
    assert mic.speech_end is not None
    figures["speech_end_to_stopped"] = [stopped - mic.speech_end]
    figures["speech_end_to_first_audio"] = [first - mic.speech_end]
    done, _ = wait(session, "response.done")
    mic.say()  # turn 2: spoken over once its reply starts
    wait(session, "response.output_audio.delta")
    while mic.speech_end is None:  # the clip must have been sent whole before it is said again
        time.sleep(0.01)
    mic.say()
    _, started = wait(session, "input_audio_buffer.speech_started")
    done, cancelled = wait(session, "response.done")
    if done.status != "cancelled":
        raise SystemExit(f"the spoken-over reply ended {done.status}, not cancelled: a longer reply is needed "
                         "(omni-serve --max-codes) or the speech came too late")
    figures["speech_start_to_started"] = [started - (mic.speech_start or started)]
    figures["started_to_cancelled"] = [cancelled - started]
    figures["engine_stopped_ms"] = [(done.data["response"].get("omni") or {}).get("engine_stopped_ms")]
    _, first = wait(session, "response.output_audio.delta")  # turn 3: the interrupting speech's reply
    while mic.speech_end is None:
        time.sleep(0.01)
    figures["speech_end_to_first_audio"].append(first - mic.speech_end)
    wait(session, "response.done")
    return figures


def summary(values: list) -> dict:
    found = [v for v in values if v is not None]
    if not found:
        return {}
    return {"median": round(statistics.median(found), 4), "min": round(min(found), 4), "max": round(max(found), 4),
            "n": len(found), "all": [round(v, 4) for v in found]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8484")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--wav", default=None, help="the speech clip (default: a built-in speech-like signal)")
    parser.add_argument("--seconds", type=float, default=1.0, help="the built-in clip's speech length")
    parser.add_argument("--silence-ms", type=int, default=500, help="server VAD's silence_duration_ms")
    parser.add_argument("--voice", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None, help="a reply's text tokens at most (max_output_tokens)")
    args = parser.parse_args()
    clip = read_wav(args.wav) if args.wav else speech_like(args.seconds)
    vad = {"type": "server_vad", "silence_duration_ms": args.silence_ms, "create_response": True,
           "interrupt_response": True}
    with RealtimeSession.connect(args.url, api_key=args.api_key) as session:
        session.update(voice=args.voice, turn_detection=vad, max_output_tokens=args.max_tokens)
        mic = Microphone(session, np.concatenate([clip, quiet(0.1, 3)]))
        mic.start()
        rounds = [one_round(session, mic) for _ in range(args.rounds)]
        mic.done.set()
    merged: dict = {}
    for figures in rounds:
        for key, values in figures.items():
            merged.setdefault(key, []).extend(values)
    out = {"url": args.url, "model": session.session.get("model"), "silence_duration_ms": args.silence_ms,
           "max_output_tokens": args.max_tokens,
           "clip_seconds": round(len(clip) / RATE, 3), "rounds": args.rounds,
           "figures": {key: summary(values) for key, values in merged.items()}}
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
