"""Where a process's first replies lose time: one engine, a warm-up reply (as omni-serve's), then replies
that differ from it one way at a time (a new prompt length, sampling, a longer reply), each twice.
Prints each reply's time to first token and first audio. Diagnostic for a GPU machine:

    python scripts/first_replies.py DIR            # a model folder (scripts/make_random_checkpoint.py)
"""

from __future__ import annotations

import sys

import omni_cli


def main(folder: str) -> None:
    assistant = omni_cli.load(folder)
    assistant.warm_up()
    cases = [
        ("warm-up again", "Hello.", dict(greedy=True, max_codes=75, max_text_tokens=8)),
        ("new prompt length, greedy", "Hello there, how are you today?", dict(greedy=True, max_codes=75, max_text_tokens=8)),
        ("same, sampled", "Hello there, how are you today?", dict(max_codes=75, max_text_tokens=8)),
        ("same, 250 codes", "Hello there, how are you today?", dict(max_codes=250, max_text_tokens=32)),
        ("another length", "Tell me, in a few words, what the sea looks like at night.", dict(max_codes=250, max_text_tokens=32)),
    ]
    for label, prompt, kw in cases:
        for attempt in (1, 2):
            s = assistant.say(prompt, seed=0, **kw).stats
            print(f"{label:28s} #{attempt}: first token {1000 * s['time_to_first_token']:6.1f} ms, "
                  f"first audio {1000 * s['time_to_first_audio']:6.1f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
