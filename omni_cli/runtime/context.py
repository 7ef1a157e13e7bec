"""The thinker's context kept between turns: the next prompt that extends the last one prefills only
what is new.

After a prefill the thinker's static cache holds the keys and values of the prompt's positions; the
turn's decode steps write the reply's after them. A conversation's next prompt is the last prompt, the
reply as the chat template renders it, and the new user turn. `KeptContext` remembers the last prompt
(its ids, its media items, the per-position tensors the talker reads of it) and says how much of a new
prompt the cache already holds: the longest common prefix of ids, up to the last prompt's end (the
reply is read again as the template renders it, which need not be the ids the turn sampled), cut back
to the first clip or image that is not the same one (placeholder ids are equal for any two clips of one
length, so the media's encoder inputs are compared too). The suffix is then prefilled over the kept
positions, and only its clips and images go through the encoders.

A causal prefix's keys, values and outputs do not depend on what follows it, so the kept positions are
what a fresh prefill of the whole prompt computes, up to the rounding of matmuls of other row counts
(float32: exact greedy picks, tests/test_context.py states the bound).

The talker's prompt is made of rows that each come from one thinker prompt position (Qwen2.5-Omni:
every position; Qwen3-Omni: the user turns' positions) and a few rows of its own at the end (the
assistant opener, the voice, the first reply token). `TalkerRows` says how many leading rows of the
talker's cache the next talker prompt can keep: those made from the same positions, where the thinker
kept those positions (so the talker reads the same vectors there); its own rows and the reply's codes
after them are always made again.

It knows neither the family (the thinker passes its placeholder ids and its tensors by name, a talker
the positions its rows come from) nor the caches' layout. It does not look at the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MediaItems:
    """A prompt's encoder inputs split per clip and per image, in prompt order (host tensors)."""

    clips: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (features row, mask row)
    images: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (pixel rows, grid row)

    @classmethod
    def of(cls, media: dict | None) -> "MediaItems":
        items = cls()
        if not media:
            return items
        if media.get("input_features") is not None:
            items.clips = list(zip(media["input_features"], media["feature_attention_mask"]))
        if media.get("pixel_values") is not None:
            grids = media["image_grid_thw"]
            rows = [int(g.prod()) for g in grids]  # an image's patches: t * h * w rows of pixel_values
            starts = [sum(rows[:i]) for i in range(len(rows))]
            items.images = [(media["pixel_values"][s:s + n], g) for s, n, g in zip(starts, rows, grids)]
        return items

    def media_from(self, n_clips: int, n_images: int) -> dict:
        """The encoder inputs of the clips from `n_clips` on and the images from `n_images` on."""
        out: dict = {}
        if self.clips[n_clips:]:
            out["input_features"] = torch.stack([f for f, _ in self.clips[n_clips:]])
            out["feature_attention_mask"] = torch.stack([m for _, m in self.clips[n_clips:]])
        if self.images[n_images:]:
            out["pixel_values"] = torch.cat([p for p, _ in self.images[n_images:]])
            out["image_grid_thw"] = torch.stack([g for _, g in self.images[n_images:]])
        return out


def _runs(ids: list[int], token: int, end: int) -> list[int]:
    """Where each run of `token` starts in ids[:end] (one run per clip or image)."""
    return [i for i in range(end) if ids[i] == token and (i == 0 or ids[i - 1] != token)]


def _same_clip(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """The same frames: a clip's row is padded to the longest clip of its prompt (Qwen3-Omni's processor),
    which a later, longer clip changes; the encoder reads the frames its mask keeps."""
    n = int(a[1].sum())
    return n == int(b[1].sum()) and torch.equal(a[0][..., :n], b[0][..., :n])


def _same_image(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@dataclass
class Reuse:
    """How a prompt's prefill goes over the kept context: `start` positions kept, the suffix's media."""

    start: int  # 0: a fresh prefill of the whole prompt
    media: dict | None  # the encoder inputs of the suffix's clips and images (None: none there)


class KeptContext:
    def __init__(self, audio_token: int, image_token: int) -> None:
        self.audio_token, self.image_token = audio_token, image_token
        self.ids: list[int] = []  # the last prompt, whose positions the cache holds (empty: nothing kept)
        self.items = MediaItems()
        self.tensors: dict[str, torch.Tensor | None] = {}  # name -> [1, L, W] of the last prompt
        self.rope_delta = 0

    def clear(self) -> None:
        """Nothing kept (the cache was written otherwise: a warm-up, a failed prefill)."""
        self.ids, self.items, self.tensors, self.rope_delta = [], MediaItems(), {}, 0

    def nbytes(self) -> int:
        """Device bytes of the kept per-position tensors (the cache's own are reserved anyway)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values() if t is not None)

    def reuse(self, ids: list[int], media: dict | None) -> Reuse:
        """How much of the prompt `ids` (with `media`) the cache holds, and what is left to encode. It takes
        the context over: nothing is kept for another prompt until `keep` (a prefill that fails midway
        leaves the cache written in part), though `joined` still reads the kept tensors."""
        kept_ids, self.ids = self.ids, []
        n = 0
        limit = min(len(kept_ids), len(ids) - 1)  # at least one position to prefill: the next logits
        while n < limit and kept_ids[n] == ids[n]:
            n += 1
        if n == 0:
            return Reuse(0, media)
        new = MediaItems.of(media)
        for token, kept, given, same in ((self.audio_token, self.items.clips, new.clips, _same_clip),
                                         (self.image_token, self.items.images, new.images, _same_image)):
            if n > 0 and ids[n - 1] == token and ids[n] == token:
                n = _runs(ids, token, n)[-1]  # never inside a clip's or an image's run
            for k, start in enumerate(_runs(ids, token, n)):
                if k >= len(kept) or k >= len(given) or not same(kept[k], given[k]):
                    n = start  # this item and everything after it are new
                    break
        if n == 0:
            return Reuse(0, media)
        clips, images = len(_runs(ids, self.audio_token, n)), len(_runs(ids, self.image_token, n))
        return Reuse(n, new.media_from(clips, images) or None)

    def keep(self, ids: list[int], media: dict | None, tensors: dict[str, torch.Tensor | None],
             rope_delta: int) -> None:
        """Remember the prompt just prefilled (all of it: `tensors` cover every position)."""
        self.ids, self.items, self.tensors, self.rope_delta = list(ids), MediaItems.of(media), dict(tensors), rope_delta

    def joined(self, name: str, start: int, suffix: torch.Tensor | None) -> torch.Tensor | None:
        """The kept tensor `name`'s first `start` positions, then the suffix's (None if either lacks it)."""
        kept = self.tensors.get(name)
        if kept is None or suffix is None:
            return None
        return torch.cat([kept[:, :start], suffix], dim=1)


class TalkerRows:
    """Which thinker positions the leading rows of a talker's cache were made from, and of which prompt
    (the thinker's prefill count, `Thinker.prompts`): the next talker prompt keeps the rows it shares.

    Kept only across consecutive prompts: the thinker's `found` (the positions its prefill kept) is
    counted against the prompt just before, so rows made from an older prompt (a text-only turn came
    between, or a turn stopped before its talker ran) are made again."""

    def __init__(self) -> None:
        self.sources: list[int] = []  # the thinker position of each row (-1: a row of the talker's own)
        self.prompt = -2  # the thinker prompt they were made from (never one before the first: -2)
        self.found = 0  # rows the last talker prompt kept

    def clear(self) -> None:
        """Nothing kept (the talker's cache was written otherwise: a warm-up, a graph's capture)."""
        self.sources, self.prompt = [], -2

    def reuse(self, sources: list[int], prompt: int, thinker_found: int) -> int:
        """How many leading rows of the talker prompt made from `sources` (as above) out of the thinker's
        prompt number `prompt`, which kept its first `thinker_found` positions, the cache holds. Like
        `KeptContext.reuse` it takes the rows over until `keep`."""
        kept, self.sources = (self.sources if prompt == self.prompt + 1 else []), []
        n, limit = 0, min(len(kept), len(sources))
        while n < limit and 0 <= sources[n] < thinker_found and kept[n] == sources[n]:
            n += 1
        self.found = n
        return n

    def keep(self, sources: list[int], prompt: int) -> None:
        """Remember the talker prompt just prefilled."""
        self.sources, self.prompt = list(sources), prompt

    def shared(self) -> int:
        """The leading rows made from thinker positions: the most the next prompt can keep."""
        return next((i for i, s in enumerate(self.sources) if s < 0), len(self.sources))


def context_figures(thinker, talker=None) -> dict:
    """A thinker's kept context as `ModelSteps.kept_context` gives it (`found`, `held`, `bytes`), and the
    rows of its last prompt the talker found kept (`talker_found`; 0 without a talker); a thinker has
    `context` (a KeptContext or None), `kept_positions` and `cache` (a StaticKVCache), a talker `rows`."""
    context = thinker.context
    held = len(context.ids) if context is not None else 0
    cache = thinker.cache
    per_position = sum(t[0, :, 0].numel() * t.element_size() for t in cache.keys + cache.values)
    extra = context.nbytes() if context is not None else 0
    return {"found": thinker.kept_positions, "held": held, "bytes": held * per_position + extra,
            "talker_found": talker.rows.found if talker is not None else 0}
