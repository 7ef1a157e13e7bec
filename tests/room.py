"""A room for talk-mode tests: the speaker's sound comes back into the microphone, and a scripted user speaks.

Run as a process beside the app (`python room.py FOLDER SCRIPT.json`). ALSA's default device (the
config `room_device()` in tests/audio_device.py writes) plays into the FIFO FOLDER/spk.fifo and
records from FOLDER/mic.fifo (paced by the reader of its copy, as audio_device's capture device is). Every 10 ms of its own clock this process reads at most 10 ms of what was
played (24 kHz float32; the pipe's back-pressure paces the app's output stream at real time: the pipe
is shrunk to 4 KiB, 43 ms), and keeps the microphone's FIFO `lead_ms` full (100 ms: the microphone's
latency; what the capture took since was taken at the capture's pace, and a FIFO read short would hand
the app stale samples) with what was played, resampled to 16 kHz, delayed by `delay_ms` and scaled by
`echo_gain`, with the user's speech, and writes 10 ms to the microphone (16 kHz float32). While no
stream plays, the speaker is silent; while no stream records, the room's sound is lost, as in a room.

The user's lines (SCRIPT's "turns", each a raw float32 16 kHz file) are started by events, not by a
timer: "start" (the microphone has been read for 0.5 s), "after_reply N" (the Nth burst of the
speaker's sound ended 0.6 s ago), "during_reply N" (the Nth burst has sounded for `into` seconds). A line's samples are written after
what is queued (`queued_s` in its log line): it is heard that much later than its logged start.
It logs JSON lines to FOLDER/room.log, times on CLOCK_MONOTONIC (Python's time.monotonic and
perf_counter on Linux, so the app's times compare): each line's start and end, each burst's first and
last sound. It ends when FOLDER/stop exists.
"""

import fcntl
import struct
import termios
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import soxr

F_SETPIPE_SZ = 1031
TICK = 0.01
JITTER_TICKS = 6  # the playback buffer read ahead (60 ms)
SPK_RATE, MIC_RATE = 24000, 16000


def main() -> None:
    folder = Path(sys.argv[1])
    script = json.loads(Path(sys.argv[2]).read_text())
    delay = int(script.get("delay_ms", 50) * MIC_RATE / 1000)
    gain = float(script.get("echo_gain", 0.5))
    quiet_end = float(script.get("quiet_end", 0.6))
    lines = [dict(t, pcm=np.fromfile(t["file"], np.float32)) for t in script["turns"]]
    log = open(folder / "room.log", "a", buffering=1)

    def note(**event):
        log.write(json.dumps({"t": time.monotonic(), **event}) + "\n")

    # O_RDWR: opening never waits for the other side, and the reader never sees an end of file when
    # the app closes its stream between replies.
    spk = os.open(folder / "spk.fifo", os.O_RDWR | os.O_NONBLOCK)
    mic = os.open(folder / "mic.fifo", os.O_RDWR | os.O_NONBLOCK)
    fcntl.fcntl(spk, F_SETPIPE_SZ, 4096)
    lead = int(script.get("lead_ms", 100) * MIC_RATE / 1000)
    written = 0
    down = soxr.ResampleStream(SPK_RATE, MIC_RATE, 1, dtype="float32")
    echo_line = np.zeros(delay, np.float32)
    spk_tick = int(SPK_RATE * TICK)
    pending = b""
    bursts, sounding, last_sound, burst_start = 0, False, 0.0, 0.0
    speaking, at, next_line = None, 0, 0
    start = time.monotonic()
    ticks = 0
    note(event="room", delay_ms=script.get("delay_ms", 50), echo_gain=gain)
    while not (folder / "stop").exists():
        ticks += 1
        # -- what the speaker played in this tick
        # The device's buffer: PortAudio writes in bursts (a whole buffer every few tens of ms), so up to
        # JITTER_TICKS of it is read ahead and one tick is played from it, as a DAC would; only when it
        # runs dry is silence played (an underrun). Reading no further keeps the pipe's back-pressure.
        want = spk_tick * 4 * JITTER_TICKS - len(pending)
        try:
            pending += os.read(spk, want) if want > 0 else b""
        except BlockingIOError:
            pass
        take = min(len(pending) // 4, spk_tick) * 4
        played = np.frombuffer(pending[:take], np.float32)
        pending = pending[take:]
        if played.shape[0] < spk_tick:
            played = np.concatenate([played, np.zeros(spk_tick - played.shape[0], np.float32)])
        now = time.monotonic()
        loud = bool(np.any(np.abs(played) > 1e-4))
        if loud:
            if not sounding:
                sounding, burst_start = True, now
                bursts += 1
                note(event="sound_start", burst=bursts)
            last_sound = now
        elif sounding and now - last_sound > 0.3:
            sounding = False
            note(event="sound_end", burst=bursts, at=last_sound)
        # -- the microphone: keep LEAD of sound queued in its FIFO (what the capture took since, it took:
        # the capture is paced by its copy's reader, so this follows its clock; a short read would
        # hand the app stale samples). Each sample written is echo plus the user's line, in order.
        echo_line = np.concatenate([echo_line, down.resample_chunk(played) * gain])
        fill = struct.unpack("i", fcntl.ioctl(mic, termios.FIONREAD, b"\0\0\0\0"))[0] // 4
        need = max(0, lead - fill)
        consumed = written - fill
        if need:
            if speaking is None and next_line < len(lines):
                line = lines[next_line]
                when = line["when"]
                go = ((when == "start" and consumed > MIC_RATE // 2)
                      or (when == "after_reply" and bursts >= line["n"] and not sounding and now - last_sound > quiet_end)
                      or (when == "during_reply" and bursts >= line["n"] and sounding
                          and now - burst_start > line.get("into", 0.6)))
                if go:
                    speaking, at = line, 0
                    next_line += 1
                    # Heard once the FIFO's `fill` ahead of it is read: that is when the app can hear it.
                    note(event="line_start", line=next_line, queued_s=fill / MIC_RATE)
            out = echo_line[:need].copy()
            echo_line = echo_line[need:]
            if out.shape[0] < need:
                out = np.concatenate([out, np.zeros(need - out.shape[0], np.float32)])
            if speaking is not None:
                part = speaking["pcm"][at:at + need]
                out[:part.shape[0]] += part
                at += need
                if at >= speaking["pcm"].shape[0]:
                    note(event="line_end", line=next_line, queued_s=(fill + need) / MIC_RATE)
                    speaking = None
            written += os.write(mic, out.astype(np.float32).tobytes()) // 4
        echo_line = echo_line[-MIC_RATE:]  # nobody records: the room's sound is lost
        # -- keep to the clock
        ahead = start + ticks * TICK - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)


if __name__ == "__main__":
    main()
