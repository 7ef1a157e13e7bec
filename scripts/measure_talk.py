"""Talk mode's figures, measured on this machine (CPU, no sound card): `python scripts/measure_talk.py [PART ...]`.

Parts (all by default):
  room     omni-chat --talk with the built-in tiny model ($TALK_FLAGS: more flags; $TALK_RECORD=OUT: the listener's
           inputs recorded, scripts/listener_record.py) in tests/room.py's room (the real PortAudio path,
           ALSA FIFO devices; echo at 60 ms, half level): three spoken turns, the third over the second
           reply. Speech start -> sound stopped (the room's last sound), barge-in -> sound off and ->
           reply stopped (the app's --verbose figures), end of speech -> first sound.
  ten      the same room, ten spoken turns each after the previous reply, no barge-in: replies
           interrupted by their own echo, with echo cancelling (default) and with --headphones.
  echo     what the canceller leaves (ERLE, dB) over ten speech-like replies, and replies interrupted
           by their echo through the listener (no device); libspeexdsp's canceller beside it when the
           system has libspeexdsp.so.1 (apt-get install libspeexdsp1), for comparison only.
  vad      WebRTC's VAD vs Silero's on speech-like clips in pink noise: turns ended in a pause
           (false ends), turns ended later than end-of-speech + end_silence + 0.3 s (late ends).

The signals are tests/speechlike.py's (speech-like, not speech). Prints a line per figure.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from audio_device import room_device  # noqa: E402
from speechlike import at_snr, noise, utterance  # noqa: E402

RATE = 16000


def room_run(lines: list[tuple[str, int, int]], flags: list[str], limit: float) -> dict:
    """omni-chat --talk --verbose in the room with `lines` ((when, n, words)); its stderr and the room's log."""
    from conftest import cli_env

    folder = Path(tempfile.mkdtemp(prefix="talk-room-"))
    env = room_device(folder / "dev")
    turns = []
    for i, (when, n, words) in enumerate(lines):
        path = folder / f"line{i + 1}.raw"
        utterance(words, seed=i + 3).tofile(path)
        turns.append({"file": str(path), "when": when, "n": n, "into": 0.8})
    (folder / "script.json").write_text(json.dumps({"delay_ms": 60, "echo_gain": 0.5, "turns": turns}))
    room = subprocess.Popen([sys.executable, str(ROOT / "tests" / "room.py"), str(folder / "dev"), str(folder / "script.json")])
    # $TALK_RECORD=OUT: the listener's inputs recorded as OUT.flac and OUT.json (scripts/listener_record.py).
    record = os.environ.get("TALK_RECORD")
    program = ([str(ROOT / "scripts" / "listener_record.py"), "record", record, "--"] if record
               else ["-m", "omni_cli.faces.chat.main"])
    app = subprocess.Popen([sys.executable, *program, "--talk", "--seed", "1", "--verbose", *flags],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=cli_env(**env, XDG_DATA_HOME=str(folder / "data")), cwd=ROOT)
    log_path = folder / "dev" / "room.log"

    def log() -> list[dict]:
        return [json.loads(x) for x in log_path.read_text().splitlines()] if log_path.exists() else []

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and app.poll() is None:
        done = [e for e in log() if e["event"] == "line_end"]
        ends = [e for e in log() if e["event"] == "sound_end"]
        if len(done) == len(lines) and ends and ends[-1]["at"] > done[-1]["t"]:
            break
        time.sleep(0.2)
    _, err = app.communicate("\n/bye\n", timeout=60)
    (folder / "dev" / "stop").touch()
    room.wait(timeout=10)
    return {"err": err, "log": log()}


def part_room() -> None:
    # $TALK_FLAGS: more omni-chat flags, e.g. "--server http://127.0.0.1:8484" for a model served elsewhere.
    run = room_run([("start", 0, 5), ("after_reply", 1, 5), ("during_reply", 2, 6)],
                   shlex.split(os.environ.get("TALK_FLAGS", "")), 240)
    if os.environ.get("TALK_LOG"):  # the app's stderr and the room's log, to read what happened
        Path(os.environ["TALK_LOG"]).write_text(run["err"] + "\n" + "\n".join(map(json.dumps, run["log"])))
    ev = run["log"]
    starts = [e for e in ev if e["event"] == "sound_start"]
    ends = [e for e in ev if e["event"] == "sound_end"]
    lines = [e for e in ev if e["event"] == "line_start"]
    line_ends = [e for e in ev if e["event"] == "line_end"]
    heard = lines[2]["t"] + lines[2]["queued_s"]
    print(f"room: speech start -> the reply's last sound in the room: {(ends[1]['at'] - heard) * 1000:.0f} ms "
          f"(--barge-in-ms 300 of it)")
    m = re.search(r"barge-in: sound off (\S+) ms, reply stopped (\S+) ms[^(\n]*(?:\((\d+) ms of the microphone)?",
                  run["err"], re.M)
    if m is None:  # talk mode over a server: who heard the speech, then the sound off, then the server's stop
        off = re.search(r"barge-in: sound off (\S+) ms after (this side|the server) heard the speech"
                        r"(?: \((\d+) ms of the microphone)?", run["err"])
        stop = re.search(r"barge-in: the server stopped the reply (\S+) ms after", run["err"])
        if off:
            print(f"room: barge-in heard by {'this side' if off[2] == 'this side' else 'the server'}")
            m = [None, off[1], stop[1] if stop else "?", off[3]]
    print(f"room: barge-in decided -> sound off {m[1] if m else '?'} ms, -> reply stopped (stream ended, engine "
          f"threads stopped) {m[2] if m else '?'} ms; first counted voiced frame -> decision "
          f"{m[3] if m and m[3] else '?'} ms of microphone audio")
    for k in (0, 1):  # end of the user's line -> the next burst of the reply's sound (end_silence_ms 800)
        end = line_ends[k]["t"] + line_ends[k]["queued_s"]
        print(f"room: end of speech {k + 1} -> first sound of reply {k + 1}: {(starts[k]['t'] - end) * 1000:.0f} ms "
              f"(--end-silence-ms 800 of it)")
    for m in re.finditer(r"first sound (\d+) ms after the turn ended", run["err"]):
        print(f"room: turn ended (VAD) -> first sound (app): {m[1]} ms")
    print(f"room: interruptions: {run['err'].count('interrupted:')} (1 expected)")


def part_ten() -> None:
    lines = [("start", 0, 4)] + [("after_reply", n, 4) for n in range(1, 10)]
    for flags, name in (([], "echo cancelling on"), (["--headphones"], "--headphones (off)")):
        run = room_run(lines, flags, 240)
        replies = run["err"].count("thinking")
        print(f"ten: {name}: {run['err'].count('interrupted:')} of {replies} replies interrupted with nobody "
              f"speaking over them")


def part_echo() -> None:
    import soxr

    import test_talk as T
    from omni_cli.audio.echo import WebRtcEcho, erle_db

    class Speex:
        """libspeexdsp's echo canceller through ctypes (500 ms filter): for comparison only."""

        def __init__(self, rate: int) -> None:
            lib = ctypes.CDLL("libspeexdsp.so.1")
            lib.speex_echo_state_init.restype = ctypes.c_void_p
            lib.speex_echo_state_init.argtypes = [ctypes.c_int, ctypes.c_int]
            lib.speex_echo_cancellation.argtypes = [ctypes.c_void_p] + [ctypes.POINTER(ctypes.c_int16)] * 3
            lib.speex_echo_ctl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            self.lib, self.state = lib, lib.speex_echo_state_init(160, rate // 2)
            lib.speex_echo_ctl(self.state, 24, ctypes.byref(ctypes.c_int(rate)))  # SET_SAMPLING_RATE

        def process(self, mic, ref):
            def pcm(x):
                return np.clip(x * 32768, -32768, 32767).astype(np.int16)

            near, far = pcm(mic), pcm(ref)
            out = np.zeros_like(near)
            ptr = ctypes.POINTER(ctypes.c_int16)
            self.lib.speex_echo_cancellation(self.state, near.ctypes.data_as(ptr), far.ctypes.data_as(ptr),
                                             out.ctypes.data_as(ptr))
            return out.astype(np.float32) / 32768

    makers = [("webrtc-aec3", lambda: WebRtcEcho(RATE))]
    try:
        Speex(RATE)
        makers.append(("speexdsp", lambda: Speex(RATE)))
    except OSError:
        print("echo: libspeexdsp.so.1 not found: speexdsp not measured")
    for delay in (60, 260):
        for name, make in makers:
            aec, erle = make(), []
            for n in range(10):
                voice = T.assistant_voice(3.0, n)
                ref = soxr.resample(voice, 24000, RATE).astype(np.float32)
                mic = T.echo_of(voice, delay, 0.5)
                k = min(ref.shape[0], mic.shape[0]) // 160 * 160
                out = np.concatenate([aec.process(mic[i:i + 160], ref[i:i + 160]) for i in range(0, k, 160)])
                erle.append(erle_db(mic[:out.shape[0]], out))
            print(f"echo: {name}, echo {delay} ms late at half level: ERLE per reply (dB) "
                  + " ".join(f"{x:.1f}" for x in erle) + f"; median {np.median(erle):.1f}")
    for delay in (60, 260):
        on, off = T.ten_replies("webrtc", delay_ms=delay), T.ten_replies("off", delay_ms=delay)
        print(f"echo: listener, ten speech-like replies, echo {delay} ms: interrupted with AEC3 {on}, "
              f"without {len(off)} of 10")


def vad_clip(seed: int, snr_db: float | None) -> tuple[np.ndarray, float, list[tuple[float, float]]]:
    """Two phrases with a 0.5 s pause (shorter than end_silence), then 3 s of noise; (clip, speech end, pauses)."""
    lead = np.zeros(RATE // 2, np.float32)
    one, two = utterance(5, seed=seed), utterance(4, seed=seed + 50)
    pause = np.zeros(RATE // 2, np.float32)
    speech = np.concatenate([lead, one, pause, two])
    end = speech.shape[0] / RATE
    clip = np.concatenate([speech, np.zeros(3 * RATE, np.float32)])
    if snr_db is not None:
        clip = at_snr(clip, noise(clip.shape[0] / RATE + 1, seed=seed), snr_db)
    pause_at = (lead.shape[0] + one.shape[0]) / RATE
    return clip, end, [(pause_at, pause_at + 0.5)]


def part_vad() -> None:
    from omni_cli.audio.listener import Listener, ListenOptions

    for snr in (None, 20.0, 10.0, 5.0, 0.0):
        for kind in ("webrtc", "silero"):
            false_ends = late_ends = never = 0
            lateness = []
            for seed in range(10):
                clip, end, _ = vad_clip(seed, snr)
                heard = Listener(ListenOptions(echo="off", vad=kind, end_silence_ms=800))
                ended_at = None
                for i in range(0, clip.shape[0], 160):
                    heard.feed(clip[i:i + 160])
                    if ended_at is None and heard.turns.qsize():
                        ended_at = (i + 160) / RATE
                if ended_at is None:
                    never += 1
                    continue
                if ended_at < end:
                    false_ends += 1
                else:
                    lateness.append(ended_at - end - 0.8)
                    late_ends += ended_at > end + 0.8 + 0.3
            label = "clean" if snr is None else f"{snr:.0f} dB SNR pink noise"
            print(f"vad: {kind:6s} {label:22s}: false ends {false_ends}/10, late ends {late_ends}/10, never ended "
                  f"{never}/10, end after end-of-speech + 800 ms: median "
                  f"{np.median(lateness) * 1000 if lateness else float('nan'):.0f} ms")


PARTS = {"room": part_room, "ten": part_ten, "echo": part_echo, "vad": part_vad}

if __name__ == "__main__":
    asked = sys.argv[1:] or list(PARTS)
    for name in asked:
        if name not in PARTS:
            sys.exit(f"error: unknown part '{name}': choose from {', '.join(PARTS)}")
    for name in asked:
        PARTS[name]()
