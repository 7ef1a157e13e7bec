"""The real `Engine` (threads, channels, the async output boundary, the schedule) on scripted steps
(tests/scripted.py): every turn takes milliseconds and its text, codes and audio are known exactly, so
the ends of the text and of the speech, the lag the host learns them with, interrupts after every event
and a failure in every worker are each tried, not sampled."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from fakes import RecordingSink
from scripted import (
    AUDIO_LIMIT,
    EOS_IDS,
    EOS_KIND,
    NON_AUDIO,
    OVERSHOOT_CODE,
    OVERSHOOT_TEXT,
    PAD_KIND,
    PROMPT,
    REPLY_KIND,
    SAMPLE_RATE,
    STOP_CODES,
    FakeSteps,
    LaggingOutput,
    SamplingOptions,
    code_script,
    expected_audio,
    expected_text,
    frame,
    make_engine,
    request,
    run_turn,
    text_script,
)

from omni_cli.runtime import turn as turn_mod
from omni_cli.runtime.events import Done, TurnInterrupted

LAGS = [1, 2, 5]


@pytest.fixture(autouse=True)
def no_thread_survives():
    """Every test: no thread it started is left running at its end (the engine's lingering vocoder included)."""
    before = set(threading.enumerate())
    yield
    new = [t for t in threading.enumerate() if t not in before]
    for t in new:
        t.join(timeout=5)
    assert [t.name for t in new if t.is_alive()] == []


@pytest.fixture(params=["fast", "late"])
def host(request, monkeypatch):
    """The host side of the boundary as fast as it goes, or as late as the lag allows (`LaggingOutput`)."""
    if request.param == "late":
        monkeypatch.setattr(turn_mod, "AsyncOutput", LaggingOutput)
    return request.param


def turn_threads():
    return [t for t in threading.enumerate() if t.name in ("omni-engine", "omni-producer", "omni-vocoder", "omni-sink")]


# -- what a turn must give, computed from the script ------------------------------------------------

def expected_ids(steps: FakeSteps, n_max: int) -> list[int]:
    """The reply's text ids: the script up to its first EOS (included), or n_max ids."""
    out = []
    for j in range(n_max):
        tok = steps.text[j] if j < len(steps.text) else OVERSHOOT_TEXT + j
        out.append(tok)
        if tok in EOS_IDS:
            break
    return out


def expected_codes(steps: FakeSteps, text_ids: list[int], max_codes: int) -> list[int]:
    """The reply's codebook-0 ids: the script up to (not including) its first stop code, or max_codes;
    none for an empty reply (the text is only an EOS)."""
    if text_ids == [text_ids[0]] and text_ids[0] in EOS_IDS:
        return []
    out = []
    for k in range(max_codes):
        code = steps.codes[k] if k < len(steps.codes) else OVERSHOOT_CODE + k
        if code in STOP_CODES:
            break
        out.append(code)
    return out


def expected_entry(k: int, text_ids: list[int]) -> tuple[int, int]:
    """Talker step k's text entry (models/base.py): R[k], text-EOS at the text's end index, then text-pad."""
    end = len(text_ids) - 1  # the EOS's index, or the last token's when the text stopped by length
    if k < end:
        return (REPLY_KIND, text_ids[k])
    return (EOS_KIND, -1) if k == end else (PAD_KIND, -1)


def checked_turn(steps: FakeSteps, *, lag: int = 4, max_text_tokens: int = 64, max_codes: int = 64,
                 text_only: bool = False, host: str = "fast", engine=None, **req):
    """Run one turn on a fresh engine (or `engine`) and check everything the script decides."""
    engine = engine or make_engine(steps, max_lag=lag)
    lag = engine.max_lag
    steps.reset()
    sink = RecordingSink()
    got = run_turn(engine, request(max_text_tokens, max_codes, sink=sink, text_only=text_only, **req))
    r = got.reply
    audio = steps.has_talker and not text_only
    n_max = max(2, max_text_tokens) if audio else max_text_tokens

    # Text: the scripted ids up to the end, their text, streamed as deltas; what came after was discarded.
    ids = expected_ids(steps, n_max)
    assert r.text_ids == ids
    assert r.text == expected_text(ids) == "".join(got.deltas)
    # The thinker: prefilled the prompt, then each step fed the token sampled just before.
    assert steps.prefill_ids == [[PROMPT]]
    assert steps.thinker_fed == steps.thinker_emitted[:-1]
    thinker_steps = len(steps.thinker_emitted)
    assert len(ids) <= thinker_steps <= min(len(ids) + lag, n_max)  # the host learns the end within the lag
    st = r.stats
    assert st["thinker_steps"] == thinker_steps and st["text_tokens"] == len(ids)
    assert st["time_to_first_token"] <= st["total_time"] and st["prompt_tokens"] == len(PROMPT)

    if not audio:
        assert steps.calls.get("talker_turn", 0) == 0 and steps.talker_entries == [] and steps.vocoders == []
        assert r.codes == [] and len(r.audio) == 0 and got.blocks == []
        assert st["talker_steps"] == 0 and st["codes"] == 0 and st["time_to_first_audio"] is None
        assert not sink.started and not sink.closed and not sink.aborted  # no audio: the sink is not used
        return got, st

    # Codes: the scripted ones up to the stop, or max_codes; overshoot past the stop discarded.
    codes = expected_codes(steps, ids, max_codes)
    assert r.codes == [frame(c, steps.frame_width) for c in codes]
    talker_steps = len(steps.talker_entries)
    end = len(codes) + (1 if len(codes) < max_codes else 0)  # talker steps up to the one the host stops at
    if not codes and ids[0] in EOS_IDS:
        end = 1  # an empty reply: the host drops the first code and stops there
    assert end <= talker_steps <= min(end + lag, max_codes)
    assert st["talker_steps"] == talker_steps and st["codes"] == len(codes)
    assert st["non_audio_codes"] == sum(c >= AUDIO_LIMIT for c in codes)
    # The talker: one turn, for this prompt and sampling; prefilled with the thinker's prompt output;
    # each step fed back the ids of the one before, and the text entries of the schedule.
    (talker,) = steps.talker_turns
    assert talker.args["prompt_ids"] == PROMPT and talker.args["voice"] == "Chelsie"
    assert talker.args["force_audio"] is False and talker.prompt is steps.first_out
    assert steps.talker_fed_ids == steps.talker_emitted[:-1]
    entries = list(steps.talker_entries)
    assert entries == [expected_entry(k, ids) for k in range(talker_steps)]
    source = 1 if steps.vector_from_token else 0
    assert all(s == source for (kind, _), s in zip(steps.talker_entries, steps.talker_sources) if kind == REPLY_KIND)
    # Audio: exactly the scripted codes' blocks, in the reply, the events and the sink alike.
    want = expected_audio(r.codes)
    np.testing.assert_array_equal(r.audio, want)
    streamed = np.concatenate([b.pcm for b in got.blocks]) if got.blocks else np.zeros(0, np.float32)
    np.testing.assert_array_equal(streamed, want)
    assert all(b.sample_rate == SAMPLE_RATE for b in got.blocks) and r.sample_rate == SAMPLE_RATE
    assert sink.closed and not sink.aborted and sink.sample_rate == SAMPLE_RATE
    np.testing.assert_array_equal(sink.audio, want)
    (voc,) = steps.vocoders
    assert steps.vocoder_args == [("Chelsie", 7, max_codes)]
    assert steps.vocoder_pushes == [[frame(c, steps.frame_width)] for c in codes if c < AUDIO_LIMIT]
    assert steps.vocoder_finished == 1
    assert st["audio_seconds"] == len(want) / SAMPLE_RATE
    if len(want):
        assert st["time_to_first_token"] <= st["time_to_first_audio"] <= st["total_time"]
        assert st["vocoder_chunks"] == len([c for c in voc.chunk_log if c[0] > 0])
    else:
        assert st["time_to_first_audio"] is None and "vocoder_chunks" not in st
    return got, st


# -- the text's end at every index, the speech's end at every index, whatever the lag --------------

N = 6


@pytest.mark.parametrize("early", [False, True], ids=["reply_vector", "token_vector"])
@pytest.mark.parametrize("lag", LAGS)
@pytest.mark.parametrize("eos_at, max_text", [(i, N) for i in range(N)] + [(None, n) for n in (1, 2, 3, N)])
def test_the_text_ends_at_its_eos_or_its_length_and_the_talker_is_fed_accordingly(host, lag, early, eos_at, max_text):
    steps = FakeSteps(text_script(N + 3, eos_at), code_script(12, 9), vector_from_token=early)
    _got, _st = checked_turn(steps, lag=lag, max_text_tokens=max_text, host=host)
    if host == "late" and lag >= 2 and eos_at is not None and eos_at + 1 < max(2, max_text):
        assert len(steps.thinker_emitted) > eos_at + 1  # the engine did run on past the EOS: the discarding was tested


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("lag", LAGS)
@pytest.mark.parametrize("stop_at, max_codes", [(i, 8) for i in range(8)] + [(None, n) for n in (1, 3, 8)])
def test_the_speech_ends_at_its_stop_code_or_max_codes_and_overshoot_is_discarded(host, lag, width, stop_at, max_codes):
    steps = FakeSteps(text_script(4, 3), code_script(8 + 4, stop_at), frame_width=width)
    checked_turn(steps, lag=lag, max_codes=max_codes, host=host)
    if host == "late" and lag >= 2 and stop_at is not None and stop_at + 1 < max_codes:
        assert len(steps.talker_entries) > stop_at + 1  # it stepped on past the stop code


@pytest.mark.parametrize("lag", [1, 3])
@pytest.mark.parametrize("eos_at", [0, 1, 4, None])
@pytest.mark.parametrize("stop_at", [0, 1, 3, 7, None])
def test_the_text_and_the_speech_end_in_either_order(host, lag, eos_at, stop_at):
    """The speech may end long before the text (the thinker goes on alone) or long after it (the talker goes
    on with text-pad entries)."""
    steps = FakeSteps(text_script(8, eos_at, eos=EOS_IDS[1]), code_script(10, stop_at), vector_from_token=lag == 3)
    checked_turn(steps, lag=lag, max_text_tokens=6, max_codes=9, host=host)


def test_an_empty_reply_says_nothing():
    steps = FakeSteps(text_script(4, 0), code_script(6, None))
    got, _st = checked_turn(steps)
    assert got.reply.text_ids == [EOS_IDS[0]] and got.reply.text == "" and got.deltas == []
    assert got.reply.codes == [] and got.blocks == [] and steps.vocoder_pushes == []


def test_non_audio_codes_are_kept_in_the_reply_but_not_voiced(host):
    codes = code_script(8, 6)
    codes[1] = codes[4] = NON_AUDIO
    steps = FakeSteps(text_script(4, 3), codes)
    got, st = checked_turn(steps, host=host)
    assert got.reply.codes == [10, NON_AUDIO, 12, 13, NON_AUDIO, 15] and st["non_audio_codes"] == 2
    assert len(got.reply.audio) == 4 * len(expected_audio([10]))


@pytest.mark.parametrize("chunk", [1, 3, 50])
def test_the_vocoders_chunks_give_the_same_audio(host, chunk):
    steps = FakeSteps(text_script(4, 3), code_script(12, 10), chunk=chunk)
    got, _st = checked_turn(steps, host=host)
    assert len(got.blocks) == -(-10 // chunk)  # one block per chunk, the rest at finish()


# -- text-only turns ---------------------------------------------------------------------------------

@pytest.mark.parametrize("max_text", [1, 3, 8])
@pytest.mark.parametrize("how", ["text_only", "no talker"])
def test_a_text_only_turn_never_touches_the_talker(host, how, max_text):
    steps = FakeSteps(text_script(10, 5), code_script(6, None), has_talker=how == "text_only")
    got, _st = checked_turn(steps, max_text_tokens=max_text, text_only=how == "text_only", host=host)
    assert len(got.reply.text_ids) == min(max_text, 6)
    assert not any(t.name == "omni-vocoder" for t in threading.enumerate())


def test_with_audio_a_reply_has_at_least_two_text_tokens():
    """`Turn.n_max`: with a talker the text limit is at least 2 (one token would leave the talker no entry
    before its text-EOS); text-only, 1 means 1."""
    steps = FakeSteps(text_script(6, None), code_script(6, 4))
    got, _ = checked_turn(steps, max_text_tokens=1)
    assert got.reply.text_ids == [1, 2]
    got, _ = checked_turn(steps, max_text_tokens=1, text_only=True)
    assert got.reply.text_ids == [1]


# -- sampling randomness and forced lengths ------------------------------------------------------------

def test_the_talkers_randomness_is_its_own_however_late_the_host_learns_the_texts_end(monkeypatch):
    """The thinker samples (from the turn's seed) and runs on past its EOS by a timing-dependent number of
    steps; the talker draws from a generator of its own, seeded seed + 1, so its draws are the same with a
    fast host and with the latest one."""
    sampled = SamplingOptions(do_sample=True)
    steps = FakeSteps(text_script(8, 3), code_script(10, 8))
    checked_turn(steps, lag=1, thinker=sampled)  # the host in step: at most one thinker step past the EOS
    fast = (list(steps.talker_draws), len(steps.thinker_emitted))
    monkeypatch.setattr(turn_mod, "AsyncOutput", LaggingOutput)
    checked_turn(steps, lag=5, thinker=sampled)
    late = (list(steps.talker_draws), len(steps.thinker_emitted))
    assert fast[1] <= 4 + 1 < late[1]  # the late host let the thinker run on past its EOS (index 3)
    used = 8 + 1  # the draws of the steps up to the stop code (index 8); later ones are overshoot
    assert len(fast[0]) >= used and late[0][:used] == fast[0][:used]
    gen = torch.Generator().manual_seed(7 + 1)
    assert fast[0] == [float(torch.rand((), generator=gen)) for _ in fast[0]]
    assert steps.talker_turns[0].args["generator"].initial_seed() == 8


def test_forced_lengths_ignore_the_text_eos():
    steps = FakeSteps(text_script(8, 2), code_script(10, None))
    engine = make_engine(steps)
    got = run_turn(engine, request(5, 6, force_lengths=True))
    ids = got.reply.text_ids
    assert len(ids) == 5 and not set(ids) & set(EOS_IDS) and ids[:2] == [1, 2] and ids[3:] == [4, 5]
    assert len(got.reply.codes) == 6 and steps.talker_turns[0].args["force_audio"] is True


# -- streaming: audio before the end, and the CPU's hold for the first chunk ------------------------------

def test_audio_reaches_the_sink_while_the_talker_still_runs():
    """Talker step 20 waits (bounded) for the sink to have a block: with audio held back until the end it
    would wait in vain."""
    steps = FakeSteps(text_script(4, 3), code_script(40, 30))
    engine = make_engine(steps)
    sink = RecordingSink()
    seen = []

    def wait_for_sink(i):
        if i == 20:
            deadline = time.perf_counter() + 5
            while not sink.blocks and time.perf_counter() < deadline:
                time.sleep(0.001)
            seen.append(bool(sink.blocks))

    steps.hooks["talker.step"] = wait_for_sink
    got = run_turn(engine, request(sink=sink))
    assert seen == [True] and len(got.reply.codes) == 30
    st = got.reply.stats
    assert st["time_to_first_audio"] < st["talker_last_step"] <= st["total_time"]


def test_on_a_cpu_the_engine_holds_for_the_first_chunk_instead_of_running_ahead():
    """The vocoder's first chunk needs 4 codes and is slow; the engine waits for it after the 4th talker
    step rather than competing with it, then goes on to the end."""
    steps = FakeSteps(text_script(4, 3), code_script(30, 25), chunk=4, codes_for_first_audio=4)
    steps.hooks["vocoder.push"] = lambda i: time.sleep(0.15) if i == 3 else None
    # The vocoder thread tells the engine where to hold once it has made its vocoder (`hold_at`); a fake
    # talker outruns that (27 steps before it, seen), so its prefill waits for the vocoder to exist.
    steps.hooks["talker.prefill"] = lambda i: _wait_until(lambda: steps.vocoders)
    stamps = []
    steps.hooks["talker.step"] = lambda i: stamps.append(time.perf_counter())
    got = run_turn(make_engine(steps), request())
    first_audio = got.reply.stats["started_at"] + got.reply.stats["time_to_first_audio"]
    made_before = 1 + sum(t < first_audio for t in stamps)  # + the prefill
    assert 4 <= made_before <= 5
    assert len(got.reply.codes) == 25


def _wait_until(cond, timeout=5.0):
    deadline = time.perf_counter() + timeout
    while not cond() and time.perf_counter() < deadline:
        time.sleep(0.0005)
    assert cond()


def test_the_talker_gets_one_text_eos_when_the_host_learns_the_texts_end_late(monkeypatch):
    """The text ends by an EOS at index n_max - 2 (5 tokens, limit 6); the host reads that EOS only after
    talker step n_max - 1 was issued (its text entry then chosen on the device, `_reply_vector`): step
    n_max - 2 gets text-EOS, step n_max - 1 must get text-pad (models/base.py), not a second text-EOS."""
    n_max = 6
    steps = FakeSteps(text_script(8, n_max - 2), code_script(12, 10))
    issued = threading.Event()
    steps.hooks["talker.step"] = lambda i: issued.set() if i == n_max - 2 else None  # step i + 1
    handle = turn_mod.Turn._handle

    def late_eos(self, kind, index, value):
        if kind == "text" and index == n_max - 2:
            issued.wait(5)
        return handle(self, kind, index, value)

    monkeypatch.setattr(turn_mod.Turn, "_handle", late_eos)
    got = run_turn(make_engine(steps, max_lag=8), request(n_max, 12))
    assert issued.is_set() and got.reply.text_ids == [1, 2, 3, 4, EOS_IDS[0]]
    assert steps.talker_entries[n_max - 2] == (EOS_KIND, -1)
    assert steps.talker_entries[n_max - 1:] == [(PAD_KIND, -1)] * (len(steps.talker_entries) - n_max + 1)


# -- interrupts after every event ---------------------------------------------------------------------

def _events_of_a_whole_turn(steps):
    return len(run_turn(make_engine(steps), request()).deltas) + len(steps.vocoder_pushes)


SCRIPT = {"text": text_script(5, 4), "codes": code_script(8, 6)}
EVENTS = 4 + 6  # 4 text deltas (the EOS has none) and 6 audio blocks, before Done


def test_the_script_has_the_events_the_interrupt_tests_count():
    assert _events_of_a_whole_turn(FakeSteps(**SCRIPT)) == EVENTS


@pytest.mark.parametrize("how", ["close", "interrupt"])
@pytest.mark.parametrize("k", range(1, EVENTS + 1))
def test_stopping_after_any_event_stops_every_thread_aborts_the_sink_and_the_next_turn_is_whole(host, how, k):
    steps = FakeSteps(**SCRIPT)
    engine = make_engine(steps, max_lag=2)
    sink = RecordingSink()
    events = engine.stream(request(sink=sink))
    seen = [next(events) for _ in range(k)]
    assert not any(isinstance(e, Done) for e in seen)
    t = time.perf_counter()
    if how == "close":
        events.close()
    else:
        engine.interrupt()
        with pytest.raises(TurnInterrupted):
            next(events)
    assert time.perf_counter() - t < 1.0
    assert sink.aborted and not sink.closed
    # The engine and producer threads were joined before control came back; the vocoder may linger a
    # moment (the engine joins it before its next turn).
    assert not any(t.name in ("omni-engine", "omni-producer") for t in threading.enumerate())
    for t in turn_threads():
        t.join(timeout=5)
    assert turn_threads() == []
    assert engine._turn is None
    checked_turn(steps, engine=engine, host=host)


@pytest.mark.parametrize("how", ["close", "interrupt from another thread"])
def test_stopping_while_the_vocoder_is_inside_a_chunk_returns_at_once_and_the_next_turn_waits_for_it(how):
    steps = FakeSteps(**SCRIPT)
    engine = make_engine(steps)
    inside, release = threading.Event(), threading.Event()

    def slow_chunk(i):
        if i == 2:
            inside.set()
            release.wait(5)

    steps.hooks["vocoder.push"] = slow_chunk
    sink = RecordingSink()
    events = engine.stream(request(sink=sink))
    try:
        if how == "close":
            next(events)  # the turn runs (its channels are unbounded: it goes on without the caller)
            assert inside.wait(5)
            t = time.perf_counter()
            events.close()
        else:
            threading.Thread(target=lambda: (inside.wait(5), engine.interrupt()), name="test-interrupter").start()
            t = time.perf_counter()
            with pytest.raises(TurnInterrupted):
                for _ev in events:
                    pass
        assert time.perf_counter() - t < 1.0 and sink.aborted and not sink.closed
        (vocoder,) = engine.lingering
        assert vocoder.name == "omni-vocoder" and vocoder.is_alive()
    finally:
        release.set()
    del steps.hooks["vocoder.push"]
    checked_turn(steps, engine=engine)
    assert engine.lingering == [] and not vocoder.is_alive()


def test_a_second_turn_while_one_runs_is_refused():
    steps = FakeSteps(**SCRIPT)
    engine = make_engine(steps)
    events = engine.stream(request())
    next(events)
    with pytest.raises(RuntimeError, match="already running"):
        next(engine.stream(request()))
    events.close()
    checked_turn(steps, engine=engine)


# -- a failure in every worker reaches the caller -----------------------------------------------------

class Boom(RuntimeError):
    pass


class Fatal(BaseException):
    """Not an Exception (like KeyboardInterrupt): still carried to the caller."""


class FailingSink(RecordingSink):
    def __init__(self, where: str, at: int, exc: BaseException) -> None:
        super().__init__()
        self.where, self.at, self.exc, self.writes = where, at, exc, 0

    def start(self, rate):
        if self.where == "sink.start":
            raise self.exc
        super().start(rate)

    def write(self, block):
        if self.where == "sink.write" and self.writes == self.at:
            raise self.exc
        self.writes += 1
        super().write(block)

    def close(self):
        if self.where == "sink.close":
            raise self.exc
        super().close()


FAILURES = [("thinker.prefill", 0), ("thinker.decode_one", 0), ("thinker.decode_one", 3), ("reply_vector", 1),
            ("token_vector", 2), ("talker_turn", 0), ("talker.prefill", 0), ("talker.step", 0), ("talker.step", 4),
            ("vocoder", 0), ("vocoder.push", 0), ("vocoder.push", 4), ("vocoder.finish", 0),
            ("tokenizer.decode", 0), ("tokenizer.decode", 2),
            ("sink.start", 0), ("sink.write", 0), ("sink.write", 4), ("sink.close", 0)]


@pytest.mark.parametrize("kind", [Boom, Fatal])
@pytest.mark.parametrize("where, at", FAILURES)
def test_a_failure_anywhere_is_raised_to_the_caller_no_thread_survives_and_the_next_turn_is_whole(host, where, at, kind):
    steps = FakeSteps(**SCRIPT, vector_from_token=where == "token_vector")
    engine = make_engine(steps, max_lag=2)
    exc = kind(f"{where} #{at}")

    def fail(i):
        if i == at:
            raise exc

    if not where.startswith("sink."):
        steps.hooks[where] = fail
    sink = FailingSink(where, at, exc)
    with pytest.raises(kind) as raised:
        run_turn(engine, request(sink=sink))
    assert raised.value is exc and str(raised.value) == f"{where} #{at}"
    assert steps.calls.get(where, 1) > at or where.startswith("sink.")  # it did fail where asked
    assert not sink.closed
    assert sink.aborted or where == "sink.start"  # a sink that never started has nothing to abort
    assert not any(t.name in ("omni-engine", "omni-producer") for t in threading.enumerate())
    for t in turn_threads():
        t.join(timeout=5)
    assert turn_threads() == []
    steps.hooks.clear()
    checked_turn(steps, engine=engine, host=host)


# -- other steps taking over (Engine.adopt) -------------------------------------------------------------

def test_other_steps_take_over_between_turns_never_inside_one():
    old, new = FakeSteps(**SCRIPT), FakeSteps(text_script(4, 2), code_script(5, 3))
    engine = make_engine(old)
    events = engine.stream(request())
    next(events)
    assert engine.adopt(new) is False and engine.steps is old  # a turn runs: from the next one on
    *_, last = events  # to the end (the generator's end releases the turns' lock)
    assert isinstance(last, Done)
    reply = last.reply
    assert reply.text_ids == [1, 2, 3, 4, EOS_IDS[0]] and new.calls == {}  # the running turn kept its steps
    got, _ = checked_turn(new, engine=engine)
    assert engine.steps is new and got.reply.text_ids == [1, 2, EOS_IDS[0]]
    assert engine.adopt(old) is True and engine.steps is old  # idle: at once
    checked_turn(old, engine=engine)
