"""Pure next-token selection without host sync: repetition penalty, suppression, temperature, top-k,
top-p, and either greedy argmax or a draw.

The order and the float operations follow transformers' logits processors (repetition penalty, token
suppression, temperature, top-k, top-p), so greedy picks are bit-identical to the reference. A draw
uses the exponential-race trick (argmax of p / Exp(1)), which is an exact categorical sample that,
unlike `torch.multinomial`, never waits for the device. Everything stays a device tensor: no
`.item()`, no Python branch on a tensor value. The penalty needs the set of tokens seen so far; the
caller keeps it as a boolean mask (`seen`) and updates it with `mark_seen`.
"""

from __future__ import annotations

import torch

from .config import SamplingOptions


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Divide positive / multiply negative logits of already-seen tokens (transformers' rule)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def select(
    logits: torch.Tensor,
    opts: SamplingOptions,
    seen: torch.Tensor | None = None,
    suppress: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token from `logits` [1, vocab] (float32). Returns a [1] long tensor on the same device.

    `seen`: bool [1, vocab] mask for the repetition penalty; `suppress`: bool [1, vocab] of banned ids.
    """
    if seen is not None:
        logits = repetition_penalty(logits, seen, opts.repetition_penalty)
    if suppress is not None:
        logits = logits.masked_fill(suppress, float("-inf"))
    if not opts.do_sample:
        return logits.argmax(dim=-1)
    if opts.temperature != 1.0:
        logits = logits / opts.temperature
    if opts.top_k:
        logits = top_k_filter(logits, opts.top_k)
    if opts.top_p < 1.0:
        logits = top_p_filter(logits, opts.top_p)
    probs = logits.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(dim=-1)


def mark_seen(seen: torch.Tensor, token: torch.Tensor) -> None:
    """Add `token` ([1] long) to the `seen` mask in place (device-side)."""
    seen.scatter_(1, token.view(1, 1), True)
