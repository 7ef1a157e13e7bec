"""`omni-bench --turns N`: a spoken conversation of N turns on one engine, timed turn by turn.

Each user turn holds a clip of `--audio-seconds` (noise and a tone: the encoders' cost depends on its
length, not on what it says) and a few words; each reply is forced to `--text-tokens` and `--codes`; the
next prompt is the whole conversation so far, as a chat sends it. The conversation runs twice on the same
engine, side by side: with the thinker's context kept between turns (runtime/context.py, the default) and
with every prompt prefilled whole (as before it), after one warm-up reply with a clip (the encoders' first
run). Per turn: first audio, real-time factor, prompt and prefilled tokens, the talker prompt's rows
kept from the turn before (kept: the rows of the positions the thinker kept), the audio encoder's time,
the time until the prefill is issued, and the host's feature extraction for the clips before the turn
(kept: the new clip's only, as an assistant's conversation keeps each clip's features,
encoder_inputs.py; whole: every clip the conversation holds, as before). Before each turn the engine
settles (`Engine.settle`: the step graphs a finished turn captures ahead, in the pause a person leaves
between turns).

It knows the families only through their presets modules (`spoken_turn`, `reply_end`, `spoken_inputs`).
"""

from __future__ import annotations

import time
import zlib

import numpy as np

from ..encoder_inputs import EncoderInputs

MODES = {"kept": True, "whole": False}  # whether the thinker keeps its context between turns


def clip(seconds: float, seed: int):
    """A 16 kHz clip: a tone in noise."""
    from ..media import AudioClip

    t = np.arange(int(seconds * 16_000)) / 16_000
    noise = np.random.default_rng(seed).standard_normal(len(t))
    return AudioClip((0.3 * np.sin(2 * np.pi * (200 + 20 * seed) * t) + 0.05 * noise).astype(np.float32), 16_000)


def media_ids(model) -> set[int]:
    """The thinker's media marker ids (its config's audio, image, video and vision token ids). A reply's
    text ids go into the next prompt without them: random weights may pick one, which the next prompt
    would hold as a clip's place without a clip (an assistant keeps a reply as text without special
    tokens, prompt.py), and its placeholder scatter would fail."""
    config = model.config.thinker_config.to_dict()
    return {v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)
            and k.endswith(("_token_id", "_token_index")) and any(w in k for w in ("audio", "image", "video", "vision"))}


def conversation(engine, subject, turns: int, audio_seconds: float, reply) -> dict:
    """{"kept": [turn stats], "whole": [...]}: the conversation in each mode on `engine`, each after a
    warm-up reply with a clip. `reply(prompt, media, i, label, text_ids)` times one turn (bench._reply) and
    appends the reply's text ids to `text_ids`."""
    family, model, thinker = subject.family, subject.model, engine.steps.thinker
    kept_context = thinker.context
    markers = media_ids(model)
    out: dict = {}
    try:
        for mode, keep in MODES.items():
            thinker.context = kept_context if keep else None
            if kept_context is not None:
                kept_context.clear()
            media, counts = family.spoken_inputs([clip(audio_seconds, 99)])
            reply(family.spoken_turn(model, counts[0], 99), media, 0, f"{mode}, warm-up with a clip, ", [])
            clips: list = []
            features = EncoderInputs() if keep else None  # None: every clip's features made each turn
            prompt: list[int] = []
            rows = []
            for i in range(turns):
                clips.append(clip(audio_seconds, i))
                engine.settle()  # the pause a person leaves between turns (the capture ahead), untimed
                t = time.perf_counter()
                media, counts = family.spoken_inputs(clips, features)  # every clip of the conversation, as a face
                features_ms = 1000 * (time.perf_counter() - t)
                prompt = prompt + family.spoken_turn(model, counts[-1], i)
                text_ids: list[int] = []
                row = reply(prompt, media, i + 1, f"{mode}, turn {i + 1}, ", text_ids)
                said = [t for t in text_ids if t not in markers]
                # The reply's ids as a checksum: runs of one preset compare (greedy replies the same?)
                rows.append(dict(row, features_ms=features_ms, reply_crc32=zlib.crc32(str(text_ids).encode()),
                                 markers_dropped=len(text_ids) - len(said)))
                prompt = prompt + said + family.reply_end(model)
            out[mode] = rows
    finally:
        thinker.context = kept_context
    return out


def table(result: dict) -> str:
    """Each turn side by side, kept vs whole: prefilled tokens, the talker's kept rows and prefill, first
    audio (and when a speaker would start, kept), RTF, the encoder's and the features' times."""
    lines = [f"{'turn':>4}  {'prompt':>6}  {'prefill kept/whole':>18}  {'talker kept':>11}  "
             f"{'talker prefill ms kept/whole':>28}  {'first audio ms kept/whole':>26}  {'speaker ms':>10}  "
             f"{'RTF kept/whole':>15}  {'encoder ms kept/whole':>22}  {'features ms kept/whole':>22}"]
    for i, (k, w) in enumerate(zip(result["kept"], result["whole"]), 1):
        lines.append(f"{i:>4}  {k['prompt_tokens']:>6}  {k['prefill_tokens']:>8}/{w['prefill_tokens']:<9}  "
                     f"{k.get('talker_kept_rows') or 0:>11}  "
                     f"{k['talker_prefill_ms'] or 0:>13.1f}/{w['talker_prefill_ms'] or 0:<14.1f}  "
                     f"{k['time_to_first_audio_ms']:>12.0f}/{w['time_to_first_audio_ms']:<13.0f}  "
                     f"{k.get('speaker_start_ms') or 0:>10.0f}  "
                     f"{k['real_time_factor']:>7.3f}/{w['real_time_factor']:<7.3f}  "
                     f"{k['audio_encoder_ms'] or 0:>10.1f}/{w['audio_encoder_ms'] or 0:<11.1f}  "
                     f"{k['features_ms']:>10.1f}/{w['features_ms']:<11.1f}")
    return "\n".join(lines)
