"""Where a process's first replies lose time: one engine, a warm-up reply (as omni-serve's), then replies
that differ from it one way at a time (a new prompt length, sampling, a longer reply, a spoken clip), each
twice. Prints each reply's time to first token and first audio (and the audio encoder's time). Diagnostic
for a GPU machine:

    python scripts/first_replies.py DIR            # a model folder (scripts/make_random_checkpoint.py)
    python scripts/first_replies.py DIR --text-warm-up   # the warm-up as it was: "Hello." without a clip
    python scripts/first_replies.py assets/tiny-qwen2.5-omni   # checks that it runs (CPU)
"""

from __future__ import annotations

import sys

import numpy as np

import omni_cli
from omni_cli.media import AudioClip


def main(folder: str, text_warm_up: bool = False) -> None:
    assistant = omni_cli.load(folder)
    if text_warm_up:  # before the twenty-first pass: the audio encoder's first run came with the first clip
        _, per_second = assistant.speech_steps
        assistant._warm_up_reply = lambda: assistant.say("Hello.", seed=0, max_text_tokens=8,
                                                         max_codes=max(1, round(1.5 * per_second)))
    assistant.warm_up()
    cases = [
        ("warm-up again", "Hello.", dict(greedy=True, max_codes=75, max_text_tokens=8)),
        ("new prompt length, greedy", "Hello there, how are you today?", dict(greedy=True, max_codes=75, max_text_tokens=8)),
        ("same, sampled", "Hello there, how are you today?", dict(max_codes=75, max_text_tokens=8)),
        ("same, 250 codes", "Hello there, how are you today?", dict(max_codes=250, max_text_tokens=32)),
        ("another length", "Tell me, in a few words, what the sea looks like at night.", dict(max_codes=250, max_text_tokens=32)),
        # the first spoken turn: the warm-up says a second of noise, so the encoder's first run is behind it
        ("a 5 s clip", "What did I just say?", dict(max_codes=250, max_text_tokens=32, audio=5.0)),
    ]
    for label, prompt, kw in cases:
        for attempt in (1, 2):
            if "audio" in kw:  # another clip each time: the same request again would reuse the kept context
                kw = {**kw, "audio": [_clip(5.0, attempt)]}
            s = assistant.say(prompt, seed=0, **kw).stats
            encoder = s.get("audio_encoder_ms")
            print(f"{label:28s} #{attempt}: first token {1000 * s['time_to_first_token']:6.1f} ms, "
                  f"first audio {1000 * s['time_to_first_audio']:6.1f} ms"
                  + (f", audio encoder {encoder:.1f} ms" if encoder is not None else ""), flush=True)


def _clip(seconds: float, seed: int) -> AudioClip:
    pcm = (np.random.default_rng(seed).standard_normal(int(16_000 * seconds)) * 0.1).astype(np.float32)
    return AudioClip(pcm, 16_000, source="noise")


if __name__ == "__main__":
    main(sys.argv[1], "--text-warm-up" in sys.argv[2:])
