"""Record what talk mode's listener is given, and replay it through the listener as it is now.

    python scripts/listener_record.py record OUT -- [omni-chat flags]   omni-chat with its inputs recorded
    python scripts/listener_record.py replay OUT [OUT ...]               each recording's decisions now

`record` runs omni-chat (`omni_cli.faces.chat.main`) in this process with `Listener.feed` wrapped: every
microphone block, the speaker's reference placed on the microphone's clock for it, and whether a reply was
playing are kept, and written at exit as OUT.flac (microphone and reference, 16-bit by the echo canceller's
own rounding, so a replay gives it the very samples it had) and OUT.json (the 10 ms blocks while a reply
played, where each reply started, and where the live listener called barge-in). `scripts/measure_talk.py
room` does this with `$TALK_RECORD=OUT`.

`replay` feeds a recording to a fresh listener block by block, the reference as recorded, and prints when
it would call barge-in, the replies' spans, and in each reply the most voiced time the judge counted in one
stretch (how near a false cut came). The echo canceller (AEC3) is deterministic, so a replay gives the live
run's decisions where the rule is unchanged: rules can be compared on one set of rooms
(docs/benchmarks.md, sixteenth pass). tests/test_talk_remote.py replays one such recording.

It knows nothing of the devices: the recording starts at the listener's first block.
"""

from __future__ import annotations

import atexit
import json
import sys
from pathlib import Path

import numpy as np

BLOCK = 160  # the listener's blocks: 10 ms at 16 kHz


def record(out: str, args: list[str]) -> None:
    from omni_cli.audio import listener as listening

    blocks: list[tuple[np.ndarray, np.ndarray, bool, bool, bool]] = []
    feed, take = listening.Listener.feed, listening.Listener._take_reference

    def taking(self, n):
        self._recorded_reference = take(self, n)
        return self._recorded_reference

    def feeding(self, block):
        new, playing = self._new_reply, self.speaking.is_set()  # before: a barge-in in this block clears it
        before = len(self.barge_ins)
        feed(self, block)
        blocks.append((block.copy(), self._recorded_reference.copy(), playing, new, len(self.barge_ins) > before))

    listening.Listener._take_reference, listening.Listener.feed = taking, feeding
    atexit.register(lambda: save(out, blocks))
    sys.argv = ["omni-chat", *args]
    from omni_cli.faces.chat.main import main

    main()


def save(out: str, blocks: list) -> None:
    import soundfile as sf

    from omni_cli.audio.format import to_int16

    if not blocks:
        return
    pcm = np.stack([np.concatenate([b[0] for b in blocks]), np.concatenate([b[1] for b in blocks])], axis=1)
    # By the canceller's own rule (to_int16), so a replay hands it the very int16 samples it had live.
    sf.write(f"{out}.flac", to_int16(pcm), 16_000, subtype="PCM_16")
    playing = [b[2] for b in blocks]
    spans, j = [], 0
    while j < len(playing):
        if playing[j]:
            k = j
            while k < len(playing) and playing[k]:
                k += 1
            spans.append([j, k])
            j = k
        else:
            j += 1
    starts = [j for j, b in enumerate(blocks) if b[3]]
    live = [round((j + 1) * BLOCK / 16_000, 2) for j, b in enumerate(blocks) if b[4]]
    Path(f"{out}.json").write_text(json.dumps({"speaking": spans, "reply_starts": starts, "barge_in_s": live}, indent=1))


def replay(path: str) -> dict:
    import soundfile as sf

    from omni_cli.audio.listener import Listener, ListenOptions

    pcm, rate = sf.read(f"{path}.flac", dtype="float32")
    script = json.loads(Path(f"{path}.json").read_text())
    listener = Listener(ListenOptions(echo="webrtc"), find_turns=True)
    fired: list[float] = []
    listener.on_barge_in = lambda: fired.append(round(listener._samples / rate, 2))
    at = iter(range(0, pcm.shape[0], BLOCK))
    listener._take_reference = lambda n: pcm[next(at):][:n, 1]
    spans = [tuple(s) for s in script["speaking"]]
    peaks = [0] * len(spans)
    for j in range(pcm.shape[0] // BLOCK):
        if j in script["reply_starts"]:
            listener.reply_started()
        inside = [i for i, (a, b) in enumerate(spans) if a <= j < b]
        if inside:
            listener.speaking.set()
        else:
            listener.speaking.clear()
        listener.feed(pcm[j * BLOCK:(j + 1) * BLOCK, 0])
        if inside:
            peaks[inside[0]] = max(peaks[inside[0]], listener._barge_voiced * listener._frame_ms)
    return {"barge_in_s": fired, "live_barge_in_s": script.get("barge_in_s"),
            "replies_s": [(a / 100, b / 100) for a, b in spans], "most_voiced_ms": peaks}


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        rest = sys.argv[3:]
        record(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest)
    elif len(sys.argv) >= 3 and sys.argv[1] == "replay":
        for path in sys.argv[2:]:
            print(path, json.dumps(replay(path)))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
