"""What a spoken question costs against a typed one: one process, one model, a clip of N seconds (5 by
default) beside a text prompt of as many prompt tokens, each asked `--runs` times after a warm-up reply.

Prints, per run, the prompt's tokens, the audio encoder's ms, the time to first text and to first audio,
and the medians. On random weights the clip's content does not matter: it is a tone sweep with noise.

    python scripts/audio_vs_text.py MODEL_DIR [--seconds 5] [--runs 3] [--device cuda]

It does not measure start-up (scripts/cold_start.sh does) nor judge the reply.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import omni_cli  # noqa: E402
from omni_cli.media import AudioClip  # noqa: E402

REPLY = dict(seed=0, max_text_tokens=32, max_codes=100)


def clip(seconds: float, rate: int = 16_000) -> AudioClip:
    t = np.arange(int(seconds * rate)) / rate
    sweep = 0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t)
    noise = 0.02 * np.random.default_rng(0).standard_normal(t.shape)
    return AudioClip((sweep + noise).astype(np.float32), rate, "sweep")


def text_of(assistant, tokens: int) -> str:
    """A text prompt whose whole prompt has `tokens` tokens (to within a word)."""
    words = "please tell me about the weather and the news of today in a few words".split()
    text = ""
    for i in range(10_000):
        text = " ".join(words[j % len(words)] for j in range(i + 1))
        if _prompt_tokens(assistant, text) >= tokens:
            return text
    return text


def _prompt_tokens(assistant, text: str) -> int:
    from omni_cli.prompt import Conversation, build_ids

    return len(build_ids(assistant.loaded.tokenizer, Conversation(system=assistant.default_system).messages(text)))


def row(stats: dict) -> dict:
    return {
        "prompt_tokens": stats.get("prompt_tokens"),
        "audio_encoder_ms": stats.get("audio_encoder_ms"),
        # a random model's text can decode to nothing (ids past the tiny tokenizer's): no first text then
        "first_text_ms": 1000 * (stats["time_to_first_text"] or float("nan")),
        "first_audio_ms": 1000 * stats["time_to_first_audio"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()

    assistant = omni_cli.load(args.model, device=args.device)
    spoken = clip(args.seconds)
    heard = assistant.say("", audio=[spoken], **REPLY)  # warm-up: the encoder's first call
    text = text_of(assistant, heard.stats["prompt_tokens"])
    assistant.say(text, **REPLY)
    results = {"audio": [], "text": []}
    for _ in range(args.runs):
        results["audio"].append(row(assistant.say("", audio=[spoken], **REPLY).stats))
        results["text"].append(row(assistant.say(text, **REPLY).stats))
    for kind, rows in results.items():
        for r in rows:
            print(kind, r)
        med = {k: statistics.median(r[k] for r in rows) for k in ("first_text_ms", "first_audio_ms")}
        enc = [r["audio_encoder_ms"] for r in rows if r["audio_encoder_ms"] is not None]
        print(f"{kind}: {args.seconds:g} s clip" if kind == "audio" else f"{kind}: same prompt length",
              f"prompt {rows[0]['prompt_tokens']} tokens, encoder {statistics.median(enc):.1f} ms," if enc else
              f"prompt {rows[0]['prompt_tokens']} tokens,",
              f"first text {med['first_text_ms']:.0f} ms, first audio {med['first_audio_ms']:.0f} ms (medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
