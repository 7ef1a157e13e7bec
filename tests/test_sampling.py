"""The sampled path against transformers: omni_cli.runtime.sampling's filtered distribution is the one
transformers' own logits processors and warpers give on the same logits, and the exponential-race draw
samples from it.

The reference processors are not assembled by hand: transformers' `GenerationMixin._get_logits_processor`
builds them from a `GenerationConfig` (which ones run, in which order, which values switch one off), so
a setting the library treats differently from us shows up here. The draw is checked statistically with
fixed generators (deterministic, so it cannot pass or fail by chance from run to run): the frequencies
of many draws fit the probabilities by a chi-square test, and the same counts are shown to *fail* it
against slightly wrong distributions, so the bound has the power to catch a wrong sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MethodType, SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from omni_cli.config import SamplingOptions
from omni_cli.models.qwen2_5_omni import TALKER_SAMPLING as TALKER_DEFAULTS
from omni_cli.runtime.sampling import SamplingParams, distribution, draw, pick, race_winner, select

THINKER_LIKE = SamplingOptions(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)


def hf_processors(opts: SamplingOptions, suppress_ids: list[int], prompt_len: int):
    """The processor list transformers' generate would build for these settings."""
    config = GenerationConfig(
        do_sample=opts.do_sample, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p,
        repetition_penalty=opts.repetition_penalty, suppress_tokens=suppress_ids or None,
    )
    # `_get_logits_processor` reads only `config.is_encoder_decoder` and one helper from the model.
    model = SimpleNamespace(config=SimpleNamespace(is_encoder_decoder=False))
    model._merge_criteria_processor_list = MethodType(GenerationMixin._merge_criteria_processor_list, model)
    return GenerationMixin._get_logits_processor(model, config, input_ids_seq_length=prompt_len, device="cpu")


def masks(vocab: int, seen_ids: list[int], suppress_ids: list[int]):
    seen = torch.zeros(1, vocab, dtype=torch.bool)
    seen[0, seen_ids] = True
    suppress = torch.zeros(1, vocab, dtype=torch.bool)
    suppress[0, suppress_ids] = True
    return (seen if seen_ids else None), (suppress if suppress_ids else None)


def reference(logits, opts, seen_ids, suppress_ids):
    """(processor class names, transformers' probabilities) for `logits` [1, vocab]."""
    processors = hf_processors(opts, suppress_ids, len(seen_ids))
    input_ids = torch.tensor([seen_ids], dtype=torch.long).reshape(1, len(seen_ids))
    scores = processors(input_ids, logits.clone())
    return [type(p).__name__ for p in processors], scores.softmax(dim=-1)


@dataclass
class Case:
    opts: SamplingOptions
    logits: torch.Tensor
    seen_ids: list[int] = field(default_factory=list)  # the sequence so far (repeats allowed, as in input_ids)
    suppress_ids: list[int] = field(default_factory=list)
    processors: list[str] = field(default_factory=list)  # what transformers must run for the case to mean anything
    kept: int | None = None  # how many tokens must survive (None: not fixed by construction)


def _randn(vocab, seed, scale=3.0):
    return torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _ties_at_k():
    # 10 distinct high values, then 6 equal values that hold ranks 11 to 16, then low values: with
    # k=12 the k-th value is one of the tied six, and top-k keeps all of them (16 tokens, not 12).
    logits = torch.full((1, 64), -4.0)
    logits[0, :10] = torch.linspace(6.0, 3.0, 10)
    logits[0, 20:26] = 1.5
    return logits


ALL = ["RepetitionPenaltyLogitsProcessor", "SuppressTokensLogitsProcessor", "TemperatureLogitsWarper",
       "TopKLogitsWarper", "TopPLogitsWarper"]

CASES = {
    # The talker's settings on a codec-sized vocabulary: codes seen so far penalised, codec BOS suppressed.
    "talker-defaults": Case(TALKER_DEFAULTS, _randn(8448, 0), seen_ids=[5, 17, 17, 8292, 40, 5, 311],
                            suppress_ids=[8293], processors=ALL),
    # The thinker-like settings omni-bench uses, on a larger vocabulary, with a suppressed block.
    "thinker-like": Case(THINKER_LIKE, _randn(20000, 1, scale=4.0), seen_ids=list(range(0, 300, 7)),
                         suppress_ids=[19998, 19999], processors=ALL),
    # Everything off: plain softmax of the logits (transformers runs no processor at all).
    "all-off": Case(SamplingOptions(), _randn(500, 2), processors=[], kept=500),
    "ties-at-k": Case(SamplingOptions(top_k=12), _ties_at_k(), processors=["TopKLogitsWarper"], kept=16),
    "top-p-1.0": Case(SamplingOptions(temperature=1.3, top_k=10, top_p=1.0), _randn(300, 3),
                      processors=["TemperatureLogitsWarper", "TopKLogitsWarper"], kept=10),
    "top-k-beyond-vocab": Case(SamplingOptions(top_k=1000, top_p=0.95), _randn(64, 4),
                               processors=["TopKLogitsWarper", "TopPLogitsWarper"]),
    # 1 - 1e-9 is 1.0 in float32, so every cumulative sum is "<= 1 - top_p": only the rule that always
    # keeps the most likely token leaves one.
    "top-p-tiny": Case(SamplingOptions(top_p=1e-9), _randn(300, 5), processors=["TopPLogitsWarper"], kept=1),
    # Eight equal logits: the cumulative sums are exact multiples of 1/8 and four of them equal
    # 1 - top_p = 0.5 or less; a token exactly at the boundary is cut (transformers' `<=`).
    "top-p-exact-boundary": Case(SamplingOptions(top_p=0.5), torch.zeros(1, 8), processors=["TopPLogitsWarper"],
                                 kept=4),
    # A strong penalty over seen tokens with negative and positive logits, the best token suppressed.
    "seen-mask": Case(SamplingOptions(temperature=0.8, top_k=50, repetition_penalty=1.5), _randn(200, 6),
                      seen_ids=list(range(0, 200, 3)), suppress_ids=[int(_randn(200, 6).argmax())],
                      processors=["RepetitionPenaltyLogitsProcessor", "SuppressTokensLogitsProcessor",
                                  "TemperatureLogitsWarper", "TopKLogitsWarper"], kept=50),
}


@pytest.mark.parametrize("name", list(CASES))
def test_distribution_is_transformers(name):
    case = CASES[name]
    vocab = case.logits.shape[-1]
    seen, suppress = masks(vocab, case.seen_ids, case.suppress_ids)
    ran, ref = reference(case.logits, case.opts, case.seen_ids, case.suppress_ids)
    ours = distribution(case.logits, case.opts, seen, suppress)
    assert ran == case.processors  # the case exercises the processors it is named for
    assert torch.equal(ours > 0, ref > 0)  # the same kept set
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-9)
    kept = int((ours > 0).sum())
    assert kept >= 1 and abs(float(ours.sum()) - 1) < 1e-5
    if case.kept is not None:
        assert kept == case.kept
    else:  # top-p cut something, but not down to one token
        assert 1 < kept < vocab
    if case.suppress_ids:
        assert (ours[0, case.suppress_ids] == 0).all()


@pytest.mark.parametrize("name", list(CASES))
def test_pick_with_device_settings_is_select(name):
    """`pick` (settings as device tensors, for graphs) picks what `select` picks: greedy, and sampled with
    the same Exp(1) draws, over 200 draws; one SamplingParams refilled from case to case."""
    case = CASES[name]
    vocab = case.logits.shape[-1]
    seen, suppress = masks(vocab, case.seen_ids, case.suppress_ids)
    params = SamplingParams(vocab, "cpu")
    params.set(SamplingOptions(do_sample=False, top_k=3, temperature=0.5))  # stale values must not leak
    params.set(case.opts.greedy())
    assert torch.equal(pick(case.logits, params, seen, suppress, torch.ones(1, vocab)),
                       select(case.logits, case.opts.greedy(), seen, suppress))
    params.set(case.opts)
    race = torch.empty(200, vocab).exponential_(1, generator=torch.Generator().manual_seed(0))
    logits = case.logits.expand(200, -1)
    rows = [None if m is None else m.expand(200, -1) for m in (seen, suppress)]
    ours = pick(logits, params, *rows, race)
    theirs = race_winner(distribution(case.logits, case.opts, seen, suppress), race)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].logits.shape[-1] <= 2048])
def test_the_compiled_picks_filters_keep_what_the_sorted_ones_keep(name):
    """`pick` compiled keeps tokens by counting each one's place against every other (no sort); run
    eagerly here (the vocab x vocab comparisons fit for these vocabularies), it keeps exactly the tokens
    the sort-based filters keep, ties at the k-th value and the top-p boundary included."""
    from omni_cli.runtime.sampling import _kept_by_rank, _kept_by_sort

    case = CASES[name]
    params = SamplingParams(case.logits.shape[-1], "cpu")
    params.set(case.opts)
    scaled = case.logits / params.temperature
    by_sort = _kept_by_sort(scaled, params)
    assert torch.equal(_kept_by_rank(scaled, params), by_sort)
    assert 0 < int(by_sort.sum()) < scaled.shape[-1] or case.kept == scaled.shape[-1]


def test_seen_mask_changes_the_distribution():
    """The penalty really acted in the cases above (the comparison would hold trivially otherwise)."""
    case = CASES["seen-mask"]
    seen, suppress = masks(200, case.seen_ids, case.suppress_ids)
    assert not torch.allclose(distribution(case.logits, case.opts, seen, suppress),
                              distribution(case.logits, case.opts, None, suppress))


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_pick_is_transformers(name):
    """do_sample=False: the argmax after penalty and suppression only, as transformers' greedy search."""
    case = CASES[name]
    opts = case.opts.greedy()
    seen, suppress = masks(case.logits.shape[-1], case.seen_ids, case.suppress_ids)
    _, ref = reference(case.logits, opts, case.seen_ids, case.suppress_ids)
    assert select(case.logits, opts, seen, suppress).tolist() == ref.argmax(dim=-1).tolist()


# -- the draw -------------------------------------------------------------------------------------------


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of `counts` (over the tokens where probs > 0) under `probs`, by Pearson's chi-square."""
    keep = probs > 0
    n = counts.sum().double()
    expected = n * probs[keep].double()
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    # The chi-square survival function is the regularised upper incomplete gamma Q(df/2, x/2).
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


N_DRAWS = 100_000


@pytest.fixture(scope="module")
def drawn():
    """N_DRAWS picks by `select` (the whole sampled path) with the talker's settings, with seen and
    suppressed tokens, on one set of logits, and the probabilities they should follow."""
    vocab = 128
    logits = _randn(vocab, 7, scale=1.5)
    seen, suppress = masks(vocab, [0, 1, 2, 3, int(logits.argmax())], [int(logits.argsort()[0, -2])])
    probs = distribution(logits, TALKER_DEFAULTS, seen, suppress)[0]
    generator = torch.Generator().manual_seed(1234)
    picks = select(logits.expand(N_DRAWS, vocab), TALKER_DEFAULTS, seen, suppress, generator)
    return probs, torch.bincount(picks, minlength=vocab)


def test_draws_follow_the_distribution(drawn):
    probs, counts = drawn
    assert int((probs > 0).sum()) >= 8  # enough tokens for the test to mean something (22 here)
    assert int(counts.sum()) == N_DRAWS
    # A correct sampler falls below 1e-3 one time in a thousand seeds; this seed is fixed.
    assert chi_square_p(counts, probs) > 1e-3


def test_the_chi_square_bound_rejects_wrong_distributions(drawn):
    """The same counts against distributions a buggy sampler might follow: each is rejected far beyond
    chance, so the check above is not one a wrong draw could pass."""
    probs, counts = drawn
    keep = probs > 0
    as_if_temperature_1 = torch.where(keep, probs ** 0.9, 0.0)  # exp(l / 0.9) ** 0.9 = exp(l): T=1 on the kept set
    uniform = keep.double()
    first, second = probs.argsort(descending=True)[:2].tolist()
    shifted = probs.clone()  # 5 % of the top token's mass (under 1 % of all) moved to the runner-up
    shifted[first] -= 0.05 * probs[first]
    shifted[second] += 0.05 * probs[first]
    for wrong in (as_if_temperature_1, uniform, shifted):
        assert chi_square_p(counts, wrong / wrong.sum()) < 1e-6


def test_draws_never_pick_a_token_of_probability_zero(drawn):
    probs, counts = drawn
    assert (probs == 0).sum() > 100  # top-k, top-p and suppression cut most of the vocabulary
    assert int(counts[probs == 0].sum()) == 0
    assert (counts[probs > 0] > 0).all()  # and every kept token was drawn at some point


def test_race_with_a_zero_exponential_never_picks_probability_zero():
    """An exponential sample of exactly 0 at a banned token would make its score 0/0 = NaN, which argmax
    picks; the race scores banned tokens below every kept one instead."""
    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3]])
    assert race_winner(probs, torch.tensor([[0.0, 1.0, 0.0, 2.0]])).tolist() == [1]
    # A zero at a kept token makes it win (it arrived first), which is still a token of the distribution.
    assert race_winner(probs, torch.tensor([[1.0, 1.0, 1.0, 0.0]])).tolist() == [3]
    # And in the ordinary case the race is the argmax of p / race.
    assert race_winner(probs, torch.tensor([[0.5, 3.0, 0.1, 0.5]])).tolist() == [3]


def test_draw_is_reproducible_with_a_seeded_generator():
    probs = distribution(_randn(300, 8), TALKER_DEFAULTS)
    def picks(seed):
        g = torch.Generator().manual_seed(seed)
        return [int(draw(probs, g)) for _ in range(50)]
    assert picks(3) == picks(3)
    assert picks(3) != picks(4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sync debug mode)")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_select_does_not_sync_with_the_host():
    """Sampled and greedy picks raise no host sync on CUDA (torch's sync debug mode turns one into an error)."""
    device = torch.device("cuda")
    logits = _randn(8448, 9).to(device)
    seen, suppress = (m.to(device) for m in masks(8448, [1, 2, 3], [8293]))
    generator = torch.Generator(device=device).manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        select(logits, TALKER_DEFAULTS, seen, suppress, generator)
        select(logits, TALKER_DEFAULTS.greedy(), seen, suppress, generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")
