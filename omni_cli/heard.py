"""What a listener heard of a reply that was cut short: its text cut to the audio actually played.

One rule, shared by omni-chat's talk mode (barge-in) and the realtime server
(`conversation.item.truncate` with `audio_end_ms`, and server-side barge-in), so that a conversation's
history holds only what was heard, the same way on both sides.

It knows: the reply's text pieces in order (one per text token, as a stream gives them), the seconds of
its audio made and played, and optionally the talker's steps per second. It assumes an even speaking
rate over the audio made — no engine gives per-token audio positions — and that a talker step carries
at most one text token (Qwen2.5-Omni feeds text token i at talker step i), so s steps of audio were
made from at most s tokens. The text runs ahead of the audio (the thinker is faster than speech): of a
cut reply whose text was all written while a third of its speech was made, the played share of the
audio made is not the played share of the text. So the pieces kept are also held to a speaking rate,
SPOKEN_PIECES_PER_SECOND of audio played (speech carries ~3-4 English tokens, ~4-5 Chinese characters,
a second; the cap is set above both, so that it cuts only text that cannot have been spoken yet).
It does not know tokenizers, models, sinks or devices; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


SPOKEN_PIECES_PER_SECOND = 6.0


def heard_text(pieces: Sequence[str], played: float, made: float, steps_per_second: float | None = None,
               pieces_per_second: float | None = SPOKEN_PIECES_PER_SECOND) -> str:
    """The text that `played` seconds of a reply's `made` seconds of audio carried.

    The pieces kept are the played share of the audio made (`played / made`), never more than the
    talker steps played (when `steps_per_second` is given), and only up to the last whole word: a
    word half spoken is not kept. The result has no trailing whitespace; "" when nothing was played."""
    if not pieces or made <= 0 or played <= 0:
        return ""
    keep = _pieces_played(len(pieces), played, made, steps_per_second, pieces_per_second)
    if keep >= len(pieces):
        return "".join(pieces)
    text = "".join(pieces[:keep])
    if not text or text[-1].isspace() or pieces[keep][:1].isspace():
        return text.rstrip()  # the kept text already ends at a word's end
    cut = max(text.rfind(" "), text.rfind("\n"), text.rfind("\t"))
    return text[:cut].rstrip() if cut >= 0 else ""


def _pieces_played(count: int, played: float, made: float, steps_per_second: float | None,
                   pieces_per_second: float | None) -> int:
    keep = math.floor(count * min(1.0, played / made))
    for rate in (steps_per_second, pieces_per_second):  # what `played` seconds can have carried at most
        if rate:
            keep = min(keep, math.floor(played * rate))
    return keep
