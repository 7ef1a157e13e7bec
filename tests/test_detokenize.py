"""runtime/detokenize.py: the reply's text deltas add up to the reply's text, and a fast tokenizer's reply
is not decoded again at every token (tokenizers' DecodeStream: constant work a token)."""

from __future__ import annotations

import random

import pytest

from conftest import REPO_ROOT
from omni_cli.runtime.detokenize import Detokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO_ROOT / "assets" / "tiny-qwen2.5-omni")


class Counting:
    """A tokenizer whose whole-reply decodes are counted."""

    def __init__(self, tokenizer, fast: bool = True):
        self.inner, self.decodes = tokenizer, 0
        if fast:
            self.backend_tokenizer = tokenizer.backend_tokenizer

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def streamed(tok, ids):
    detok = Detokenizer(tok)
    pieces = [detok.delta(ids[: i + 1], final=i == len(ids) - 1) for i in range(len(ids))]
    return pieces, detok.text(ids)


SAMPLES = ["Hello, world! Привет мир. 你好，世界！ 🎉🎉 naïve café", "  spaces   and\nnewlines\t tabs", "日本語です。"]


@pytest.mark.parametrize("fast", [True, False])
def test_the_deltas_add_up_to_the_replys_text(tokenizer, fast):
    rng = random.Random(0)
    cases = [tokenizer.encode(t) for t in SAMPLES]
    cases += [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))] for _ in range(100)]
    for ids in cases:
        pieces, text = streamed(Counting(tokenizer, fast), ids)
        assert "".join(pieces) == text, ids
        assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in tokenizer.decode(ids[:-1])


def test_a_fast_tokenizer_decodes_the_reply_whole_once_not_at_every_token(tokenizer):
    ids = tokenizer.encode(" ".join(SAMPLES) * 20)
    fast, slow = Counting(tokenizer, fast=True), Counting(tokenizer, fast=False)
    assert streamed(fast, ids)[0] == streamed(slow, ids)[0]  # the same deltas, token by token
    assert fast.decodes == 2  # at the end (the check of the rest) and for the reply's text
    assert slow.decodes == len(ids) + 1
