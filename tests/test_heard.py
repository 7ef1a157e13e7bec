"""omni_cli/heard.py: a cut reply's text cut to the audio played (the rule talk mode and the realtime server share)."""

from __future__ import annotations

import subprocess
import sys

from omni_cli.heard import heard_text

PIECES = ["Hello", " there", ",", " my", " fri", "end", ".", " How", " are", " you", "?"]


def test_all_played_keeps_everything():
    assert heard_text(PIECES, played=2.0, made=2.0) == "".join(PIECES)
    assert heard_text(PIECES, played=3.0, made=2.0) == "".join(PIECES)  # played past made: all of it


def test_nothing_played_keeps_nothing():
    assert heard_text(PIECES, played=0.0, made=2.0) == ""
    assert heard_text(PIECES, played=1.0, made=0.0) == ""
    assert heard_text([], played=1.0, made=1.0) == ""


def test_the_played_share_of_pieces_is_kept_up_to_a_whole_word():
    # 11 pieces, half played: floor(5.5) = 5 pieces "Hello there, my fri" -> "fri" is half a word, dropped.
    assert heard_text(PIECES, played=1.0, made=2.0) == "Hello there, my"
    # 6 pieces end with "end": the next piece "." does not start a word, so "friend" is cut too...
    assert heard_text(PIECES, played=6 / 11 * 2.0 + 1e-9, made=2.0) == "Hello there, my"
    # ...and 7 pieces end before " How", which starts one: "friend." is whole.
    assert heard_text(PIECES, played=7 / 11 * 2.0 + 1e-9, made=2.0) == "Hello there, my friend."


def test_never_more_pieces_than_talker_steps_played():
    # All the audio made was played, but only 0.07 s of it at 50 steps/s: 3 steps carry at most 3 tokens.
    assert heard_text(PIECES, played=0.07, made=0.07, steps_per_second=50) == "Hello there,"
    assert heard_text(PIECES, played=0.07, made=0.07) == "".join(PIECES)  # without the cap: all


def test_one_long_word_half_played_is_nothing():
    assert heard_text(["Super", "cal", "ifrag", "ilistic"], played=1.0, made=2.0) == ""


def test_newlines_end_words_and_no_trailing_space_is_kept():
    pieces = ["One", " two", "\n", "three", " four"]
    assert heard_text(pieces, played=3 / 5 + 1e-9, made=1.0) == "One two"
    assert heard_text(pieces, played=4 / 5 + 1e-9, made=1.0) == "One two\nthree"


def test_the_module_imports_no_torch():
    code = "import sys, omni_cli.heard; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
