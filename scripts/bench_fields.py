"""One line of an omni-bench JSON's figures that a GPU call's output should show (the rest stays in the
file): first text and audio, prefills, steps, the vocoder's first chunk, the least lead of a block over its
play-out, RTF, peak.

    python scripts/bench_fields.py OUT.json [...]
"""

from __future__ import annotations

import json
import sys

FIELDS = [("text", "time_to_first_text_ms"), ("audio", "time_to_first_audio_ms"), ("spk", "speaker_start_ms"),
          ("th_pre", "thinker_prefill_ms"), ("tk_pre", "talker_prefill_ms"),
          ("th_step", "thinker_ms_per_token"), ("tk_step", "talker_ms_per_step"),
          ("voc1", "vocoder_first_chunk_ms"), ("lead", "audio_min_lead_ms"),
          ("rtf", "real_time_factor"), ("peak", "peak_gib")]


def line(path: str) -> str:
    try:
        with open(path) as f:
            ours = json.load(f)["omni_cli"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{path}: {exc!r:.200}"
    parts = [f"{name} {ours[key]:.3g}" for name, key in FIELDS if isinstance(ours.get(key), (int, float))]
    return f"{path.rsplit('/', 1)[-1]}: " + ", ".join(parts)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(line(p))
