"""Pure next-token selection without host sync: repetition penalty, suppression, temperature, top-k,
top-p, and either greedy argmax or a draw.

The order and the float operations follow transformers' logits processors (repetition penalty, token
suppression, temperature, top-k, top-p), so greedy picks are bit-identical to the reference and the
sampled distribution is the reference's (tests/test_sampling.py checks both against the library).
`distribution` is that filtered distribution; `draw` picks from it with the exponential-race trick
(argmax of p / Exp(1)), an exact categorical sample that, unlike `torch.multinomial`, never waits for
the device. Everything stays a device tensor: no `.item()`, no Python branch on a tensor value. The
penalty needs the set of tokens seen so far; the caller keeps it as a boolean mask (`seen`) and
updates it with `mark_seen`.
"""

from __future__ import annotations

import torch

from ..config import SamplingOptions
from .graphs import tracing


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """Divide positive / multiply negative logits of already-seen tokens (transformers' rule). `penalty`: a
    number (1.0 skips the work), or a device scalar (`SamplingParams.penalty`, for a graph that serves every
    setting: at 1 it multiplies and divides by one, which changes no value)."""
    if not isinstance(penalty, torch.Tensor) and penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def _constrain(logits: torch.Tensor, penalty, seen: torch.Tensor | None, suppress: torch.Tensor | None) -> torch.Tensor:
    """The repetition penalty over `seen`, then the `suppress`ed ids at -inf: the first two logits
    processors of both samplers (`constrained`, `pick`)."""
    if seen is not None:
        logits = repetition_penalty(logits, seen, penalty)
    if suppress is not None:
        logits = logits.masked_fill(suppress, float("-inf"))
    return logits


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k)[0][..., -1, None]
    # `<`, not `<=`: every token tied with the k-th survives, as in transformers (more than k may remain).
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def constrained(
    logits: torch.Tensor, opts: SamplingOptions, seen: torch.Tensor | None = None, suppress: torch.Tensor | None = None
) -> torch.Tensor:
    """`logits` after the repetition penalty and suppression: what greedy decoding takes the argmax of.

    `seen`: bool [1, vocab] mask for the repetition penalty; `suppress`: bool [1, vocab] of banned ids.
    """
    return _constrain(logits, opts.repetition_penalty, seen, suppress)


def distribution(
    logits: torch.Tensor, opts: SamplingOptions, seen: torch.Tensor | None = None, suppress: torch.Tensor | None = None
) -> torch.Tensor:
    """The probabilities a sampled pick is drawn from: `constrained` logits, then temperature, top-k and
    top-p (each skipped at its "off" value, as transformers' generate skips it), then softmax. Filtered
    tokens have probability exactly 0. `opts.do_sample` is not consulted: this is the sampled path.
    """
    logits = constrained(logits, opts, seen, suppress)
    if opts.temperature != 1.0:
        logits = logits / opts.temperature
    if opts.top_k:
        logits = top_k_filter(logits, opts.top_k)
    if opts.top_p < 1.0:
        logits = top_p_filter(logits, opts.top_p)
    return logits.softmax(dim=-1)


def race_winner(probs: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """argmax of probs / race over the last dim, `race` being i.i.d. Exp(1): token i wins with probability
    probs[i]. A token of probability 0 is given a score below every other (-1) rather than 0 / race: an
    exponential sample of exactly 0 would make that NaN, which argmax would pick. Where race > 0 this
    changes no pick (a kept token's score is > 0 > -1)."""
    return torch.where(probs > 0, probs / race, -1.0).argmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One categorical sample per row of `probs` ([..., vocab]), without a host sync."""
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return race_winner(probs, race)


def select(
    logits: torch.Tensor,
    opts: SamplingOptions,
    seen: torch.Tensor | None = None,
    suppress: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token from `logits` [1, vocab] (float32). Returns a [1] long tensor on the same device.

    `seen`: bool [1, vocab] mask for the repetition penalty; `suppress`: bool [1, vocab] of banned ids.
    (Rows beyond the first are handled alike, one pick each: the tests draw many at once that way.)
    """
    if not opts.do_sample:
        return constrained(logits, opts, seen, suppress).argmax(dim=-1)
    return draw(distribution(logits, opts, seen, suppress), generator)


def mark_seen(seen: torch.Tensor, token: torch.Tensor) -> None:
    """Add `token` ([1] long) to the `seen` mask in place (device-side)."""
    seen.scatter_(1, token.view(1, 1), True)


class SamplingParams:
    """`SamplingOptions` as device tensors, refilled in place by `set`: a CUDA graph captured once over
    `pick` serves every setting (greedy or sampled, any temperature, top-k, top-p or penalty)."""

    def __init__(self, vocab: int, device) -> None:
        self.vocab = vocab
        self.do_sample = torch.zeros((), dtype=torch.bool, device=device)
        self.temperature = torch.ones((), device=device)
        self.top_k = torch.full((), vocab, dtype=torch.long, device=device)
        self.top_p = torch.ones((), device=device)
        self.penalty = torch.ones((), device=device)

    def set(self, opts: SamplingOptions) -> None:
        """Host -> device copies: call between turns, not in a hot loop."""
        self.do_sample.fill_(bool(opts.do_sample))
        self.temperature.fill_(float(opts.temperature))
        self.top_k.fill_(min(opts.top_k, self.vocab) if opts.top_k else self.vocab)  # 0 = off = keep all
        self.top_p.fill_(float(opts.top_p))
        self.penalty.fill_(float(opts.repetition_penalty))


def pick(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None, suppress: torch.Tensor | None,
         race: torch.Tensor) -> torch.Tensor:
    """`select` with the settings as device tensors and the randomness given (`race` [1, vocab], i.i.d.
    Exp(1), drawn by the caller outside any graph): the same picks and the same distribution as `select`
    (a filter at its "off" value removes nothing: temperature 1 divides exactly, top-k of the whole
    vocabulary keeps all, top-p 1 removes only tokens of probability 0). Both picks are computed and one
    is kept on the device. Compiled, the kept tokens are found without a sort (`_kept_by_rank`): the same
    ones but where a cumulative sum lies within rounding of the top-p boundary. Returns [1] long."""
    logits = _constrain(logits, params.penalty, seen, suppress)
    greedy = logits.argmax(dim=-1)
    scaled = logits / params.temperature
    kept = _kept_by_rank(scaled, params) if tracing() else _kept_by_sort(scaled, params)
    sampled = race_winner(scaled.masked_fill(~kept, float("-inf")).softmax(dim=-1), race)
    return torch.where(params.do_sample, sampled, greedy)


def _kept_by_sort(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The tokens top-k and top-p keep ([rows, vocab] bool), as transformers' filters find them.

    One ascending sort serves both filters: the k-th largest value is at vocab - k, and top-p's sort of
    the top-k-filtered logits is this sort with the values below it set to -inf (equal arrays, so the
    same softmax and cumulative sums; with a stable sort ties keep the same order)."""
    sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, stable=True)
    rows, vocab = scaled.shape[0], scaled.shape[-1]
    kth = sorted_logits.gather(-1, (vocab - params.top_k).view(1, 1).expand(rows, 1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    remove_sorted = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - params.top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    return (scaled >= kth) & ~remove_sorted.scatter(-1, sorted_idx, remove_sorted)


def _kept_by_rank(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`_kept_by_sort` without a sort, for compiled picks: each token's place in the stable ascending order
    is counted against every other token (vocab x vocab comparisons, which inductor makes reductions
    that never hold the square in memory; eagerly it would). A GPU's sort of a 2048-id vocabulary was
    the largest kernel of a Qwen3 frame (~26 µs, 15 a frame). The cumulative sums are the same terms
    added in another order: a token whose sum lies within rounding of 1 - top_p may fall the other way."""
    x_i, x_j = scaled.unsqueeze(-1), scaled.unsqueeze(-2)  # [rows, i, 1], [rows, 1, j]
    idx = torch.arange(scaled.shape[-1], device=scaled.device)
    i, j = idx.view(1, -1, 1), idx.view(1, 1, -1)
    above = (x_j > x_i) | ((x_j == x_i) & (j > i))  # j after i in the stable ascending order
    in_top_k = (x_j > x_i).sum(-1) < params.top_k  # fewer than k strictly larger: x_i >= the k-th value
    probs = scaled.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    cumulative = (probs.unsqueeze(-2) * ~above).sum(-1)  # over the tokens at or before i
    last = above.sum(-1) == 0  # the end of the order: always kept
    return in_top_k & ((cumulative > (1 - params.top_p)) | last)
