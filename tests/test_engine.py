"""The turn's threads: audio reaches the sink while the talker still runs, stops are noticed with a
bounded lag and what comes after an EOS is discarded, and a failure in any worker is raised by `say()`
with no thread left running."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from omni_cli.runtime import engine as engine_mod
from omni_cli.runtime import turn as turn_mod
from omni_cli.assistant import Assistant
from omni_cli.errors import UsageError
from fakes import RecordingSink
from omni_cli.models.qwen2_5_omni.talker import Talker

PROMPT = "Say something nice."


@pytest.fixture(scope="module")
def assistant():
    return Assistant.load(None, device="cpu")


def omni_threads():
    return [t for t in threading.enumerate() if t.name.startswith("omni-")]


def test_first_audio_reaches_the_sink_before_the_talkers_last_step(assistant):
    sink = RecordingSink()
    reply = assistant.say(PROMPT, greedy=True, max_text_tokens=12, max_codes=400, sink=sink)
    assert len(reply.codes) >= 300  # a long stretch, so "before the end" means something
    talker_last_step = reply.stats["started_at"] + reply.stats["talker_last_step"]  # perf_counter clock
    assert sink.first_block_time is not None
    assert sink.first_block_time < talker_last_step
    assert reply.stats["time_to_first_audio"] < reply.stats["talker_last_step"]
    np.testing.assert_array_equal(sink.audio, reply.audio)


def test_reply_shape_and_stats(assistant):
    reply = assistant.say(PROMPT, seed=3, max_text_tokens=8, max_codes=60)
    assert reply.sample_rate == 24_000
    assert reply.audio.dtype == np.float32
    assert len(reply.audio) == len([c for c in reply.codes if c < 8192]) * 480  # 50 codes = 1 s
    assert reply.text_ids and all(isinstance(i, int) for i in reply.text_ids)
    for key in ("time_to_first_text", "time_to_first_audio", "thinker_steps", "talker_steps",
                "thinker_ms_per_token", "talker_ms_per_step", "real_time_factor"):
        assert reply.stats[key] is not None, key
    again = assistant.say(PROMPT, seed=3, max_text_tokens=8, max_codes=60)
    assert again.codes == reply.codes and again.text_ids == reply.text_ids
    np.testing.assert_array_equal(again.audio, reply.audio)  # the seed covers the vocoder's noise too


def test_the_same_seed_gives_the_same_speech_however_late_the_host_learns_the_texts_end(assistant, monkeypatch):
    """The thinker runs on past its EOS until the host has read it (a timing-dependent number of steps).
    Those steps draw from the thinker's randomness only: with the host slowed down (more of them) the
    sampled speech is the same as with a fast host. When the talker shared the thinker's generator, the
    codes after the text's end differed from run to run under the same seed."""
    fast = assistant.say("Hello there", seed=7, max_text_tokens=40, max_codes=60)
    assert len(fast.text_ids) < 40  # the text ends with an EOS (seed 7: 35 ids), not at the limit
    handle = turn_mod.Turn._handle

    def slow_host(self, kind, index, value):
        if kind == "text":
            time.sleep(0.03)  # the engine steps on meanwhile, up to the boundary's lag
        return handle(self, kind, index, value)

    monkeypatch.setattr(turn_mod.Turn, "_handle", slow_host)
    slow = assistant.say("Hello there", seed=7, max_text_tokens=40, max_codes=60)
    assert slow.stats["thinker_steps"] > fast.stats["thinker_steps"]  # it did step on past the EOS
    assert slow.text_ids == fast.text_ids and slow.codes == fast.codes


def test_codec_eos_stops_the_turn_and_overshoot_is_discarded(assistant, monkeypatch):
    eos_at = 30
    original = Talker.decode_one
    steps = {"n": 0}

    def decode_one(self, code, reply):
        logits = original(self, code, reply)
        steps["n"] += 1
        if steps["n"] >= eos_at:  # from step `eos_at` on, the talker "wants" to stop
            logits = logits.clone()
            logits[:, self.codec_eos] = 1e4
        return logits

    monkeypatch.setattr(Talker, "decode_one", decode_one)
    reply = assistant.say(PROMPT, greedy=True, max_text_tokens=8, max_codes=200)
    assert len(reply.codes) == eos_at  # codes 0..eos_at-1; the EOS and any overshoot are dropped
    assert len(reply.audio) == eos_at * 480
    assert reply.stats["talker_steps"] <= eos_at + 1 + assistant.engine.max_lag


def test_an_empty_reply_ends_cleanly_with_no_audio(assistant, monkeypatch):
    # The thinker's first token is EOS: nothing to say, no code reaches the vocoder.
    from omni_cli.models.qwen2_5_omni.thinker import Thinker

    eos = assistant.engine.eos_ids[0]
    original = Thinker.prefill

    def prefill(self, input_ids, media=None):
        out = original(self, input_ids, media)
        out.logits[:, eos] = 1e4
        return out

    monkeypatch.setattr(Thinker, "prefill", prefill)
    reply = assistant.say(PROMPT, greedy=True, max_text_tokens=8, max_codes=60)
    assert reply.text_ids == [eos] and reply.codes == [] and len(reply.audio) == 0
    assert reply.stats["audio_seconds"] == 0 and "vocoder_chunks" not in reply.stats


def test_vocoder_stats_account_for_every_second_of_audio(assistant):
    reply = assistant.say(PROMPT, greedy=True, max_text_tokens=8, max_codes=150)
    s = reply.stats
    assert len(reply.codes) == 150 and s["vocoder_chunks"] == 4  # 12, 24, 48 codes and a 66-code tail
    assert s["vocoder_steady_chunk_codes"] == 48 and s["vocoder_s_per_audio_s"] > 0  # largest before the last
    assert s["time_to_first_token"] <= s["time_to_first_text"] and "thinker_prefill_step_ms" not in s  # no step clock asked for


def test_text_only_skips_the_talker(assistant):
    sink = RecordingSink()
    reply = assistant.say(PROMPT, greedy=True, max_text_tokens=8, text_only=True, sink=sink)
    assert reply.codes == [] and len(reply.audio) == 0 and reply.text_ids
    assert sink.first_block_time is None


@pytest.mark.parametrize("where", ["vocoder", "producer", "engine"])
def test_a_worker_failure_is_raised_by_say_and_no_thread_survives(assistant, monkeypatch, where):
    class Boom(RuntimeError):
        pass

    def boom(*args, **kwargs):
        raise Boom(where)

    if where == "vocoder":
        from omni_cli.models.qwen2_5_omni import vocoder

        monkeypatch.setattr(vocoder.StreamingVocoder, "push", boom)
    elif where == "producer":
        original = turn_mod.Turn._handle

        def handle(self, kind, index, value):
            if kind == "code" and index == 5:
                boom()
            return original(self, kind, index, value)

        monkeypatch.setattr(turn_mod.Turn, "_handle", handle)
    else:
        monkeypatch.setattr(Talker, "decode_one", boom)
    sink = RecordingSink()
    with pytest.raises(Boom, match=where):
        assistant.say(PROMPT, greedy=True, max_text_tokens=8, max_codes=100, sink=sink)
    assert sink.aborted
    for t in omni_threads():
        t.join(timeout=5)
    assert omni_threads() == []
    # the model is usable again afterwards
    monkeypatch.undo()
    assert assistant.say(PROMPT, greedy=True, max_text_tokens=4, max_codes=10).codes


def test_closing_the_stream_early_stops_every_thread(assistant):
    events = assistant.stream(PROMPT, greedy=True, max_text_tokens=8, max_codes=300)
    for event in events:
        if isinstance(event, engine_mod.AudioBlock):
            break  # mid-reply: the talker and the vocoder are both busy
    t = time.perf_counter()
    events.close()
    assert time.perf_counter() - t < 0.2  # an interrupt returns control at once
    for t in omni_threads():
        t.join(timeout=5)
    assert omni_threads() == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt="   "), "empty prompt"),
    (dict(prompt="hi", voice="Nobody"), "Chelsie"),
    (dict(prompt="hi", max_codes=0), "max_codes"),
    (dict(prompt="word " * 5000), "context"),
])
def test_bad_requests_are_usage_errors(assistant, kwargs, message):
    with pytest.raises(UsageError, match=message):
        assistant.say(**kwargs)


def test_kv_cache_is_reused_not_reallocated(assistant):
    keys = assistant.engine.steps.thinker.cache.keys[0]
    assistant.say(PROMPT, greedy=True, max_text_tokens=4, max_codes=10)
    assert assistant.engine.steps.thinker.cache.keys[0] is keys
    assert isinstance(keys, torch.Tensor) and keys.shape[2] == assistant.max_context


def test_streamed_reply_audio_matches_whole_utterance_decoding(assistant):
    """The reply's audio (decoded chunk by chunk while the talker ran) against token2wav on all of its
    codes at once, with the same starting noise: same length, within the stated bound."""
    from omni_cli.models.qwen2_5_omni.vocoder import StreamingVocoder

    reply = assistant.say(PROMPT, seed=5, max_text_tokens=8, max_codes=150)
    spk = assistant.loaded.speakers["Chelsie"]
    whole = StreamingVocoder(assistant.loaded.model.token2wav, spk["cond"], spk["ref_mel"], max_codes=150,
                             generator=5).decode_whole(reply.codes)
    assert len(reply.audio) == len(whole) == len(reply.codes) * 480
    err = reply.audio - whole
    snr = 10 * np.log10(np.sum(whole.astype(np.float64) ** 2) / max(np.sum(err.astype(np.float64) ** 2), 1e-30))
    assert np.abs(err).max() <= 1e-3 and snr >= 70, (np.abs(err).max(), snr)


def test_on_a_cpu_the_engine_waits_for_the_first_chunk_instead_of_competing_with_it(assistant, monkeypatch):
    """The engine and vocoder threads share the CPU: once the talker has made the codes the first chunk
    needs, it waits for the first audio rather than running ahead and slowing that chunk down."""
    from omni_cli.models.qwen2_5_omni import vocoder as vocoder_mod

    steps: list[float] = []
    real_decode = Talker.decode_one
    real_push = vocoder_mod.StreamingVocoder.push

    def decode_one(self, *args, **kwargs):
        steps.append(time.perf_counter())
        return real_decode(self, *args, **kwargs)

    def slow_push(self, codes):
        blocks = real_push(self, codes)
        if blocks and not getattr(self, "_slowed", False):
            self._slowed = True
            time.sleep(0.3)  # a slow first chunk: an engine that did not wait would run far ahead
        return blocks

    monkeypatch.setattr(Talker, "decode_one", decode_one)
    monkeypatch.setattr(vocoder_mod.StreamingVocoder, "push", slow_push)
    sink = RecordingSink()
    reply = assistant.say(PROMPT, greedy=True, max_text_tokens=8, max_codes=120, sink=sink)
    # When the first block existed (what releases the engine), not when the sink's own thread got it: on a
    # loaded machine that thread may run a few talker steps later, which is no fault of the engine.
    first_audio = reply.stats["started_at"] + reply.stats["time_to_first_audio"]
    assert first_audio <= sink.first_block_time
    need = (24 + 24) // 2  # the tiny DiT: a first chunk of one block (24 frames) + one block look-ahead
    made_before = sum(t < first_audio for t in steps) + 1  # + the talker prefill (step 0)
    assert need <= made_before <= need + 1
    assert len(reply.codes) == 120  # and then it goes on to the end



def test_warm_up_in_the_background_leaves_no_trace_in_the_next_reply(assistant, monkeypatch):
    """`warm_up(background=True)` (omni-chat's, while the person types): short, sampled as replies are,
    with a second of audio said (the audio encoder's first run is the warm-up's), heard by nobody, on its
    own thread; the next reply waits for it to end and is the reply it would have been without it."""
    before = assistant.say("Tell me about the sea.", seed=3, max_codes=60)
    calls = []
    real_say = Assistant.say

    def spy_say(self, prompt, options=None, **kw):
        calls.append((prompt, kw, threading.current_thread().name))
        if threading.current_thread().name == "omni-warm-up":
            time.sleep(0.3)  # not started yet when the next reply is asked for
        reply = real_say(self, prompt, options, **kw)
        calls.append(("done", prompt))
        return reply

    monkeypatch.setattr(Assistant, "say", spy_say)
    assistant.warm_up(background=True)
    after = assistant.say("Tell me about the sea.", seed=3, max_codes=60)
    prompt, kw, thread = next(call for call in calls if call[0] == "Hello.")  # the warm-up's
    assert thread == "omni-warm-up" and not kw.get("greedy") and kw["max_text_tokens"] <= 8 and kw["max_codes"] == 75
    assert "sink" not in kw
    assert [clip.seconds for clip in kw["audio"]] == [1.0]
    assert calls.index(("done", "Hello.")) < calls.index(("done", "Tell me about the sea."))
    assert after.text_ids == before.text_ids and after.codes == before.codes
    assert np.array_equal(after.audio, before.audio)


def test_without_graphs_nothing_is_compiled():
    """--no-graphs turns compiling off too (compiled steps exist to be captured), as the docs say; on a
    GPU device --compile with graphs compiles both stacks."""
    from omni_cli.config import RuntimeOptions
    from omni_cli.runtime.engine import enable_fast_steps
    from omni_cli.runtime.graphs import Policy

    tf32 = torch.backends.cuda.matmul.allow_tf32  # configure_cuda sets it for a bfloat16 "GPU"
    class Stack:
        def enable_fast_decode(self, policy):
            self.args = (policy.graphs_on, policy.compile_on)

    class Steps:
        device = torch.device("cuda")  # a device object only: nothing runs on it
        has_talker = True

    try:
        for graphs, compile, compiled in ((True, True, True), (False, True, False), (True, False, False)):
            steps = Steps()
            steps.thinker, steps.talker = Stack(), Stack()
            policy = Policy.of(RuntimeOptions(graphs=graphs, compile=compile), steps.device)
            enable_fast_steps(steps, torch.bfloat16, policy, None)
            assert steps.compile is compiled
            assert steps.thinker.args == steps.talker.args == (graphs, compiled)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _second_steps(assistant):
    """Another set of steps over the assistant's model, built as `compile_beside` builds them (uncompiled
    here: a CPU)."""
    return assistant.family.build_steps(assistant.loaded.model, assistant.loaded.speakers, runtime=assistant.asked)


def test_other_steps_take_over_between_turns_never_inside_one(assistant):
    """`Engine.adopt` (the compiled steps made beside the plain ones: runtime/beside.py): handed over while a
    turn runs, the new steps take over at the next turn; between turns, at once. Built over the same weights
    they share the fused matrices (no copy), and the reply is the one the old steps gave."""
    from omni_cli.runtime.events import Done

    engine, old = assistant.engine, assistant.engine.steps
    before = assistant.say(PROMPT, seed=5, max_text_tokens=6, max_codes=40)
    new = _second_steps(assistant)
    shared = [(a.qkv_w, b.qkv_w) for a, b in zip(old.thinker.fused.fused.layers, new.thinker.fused.fused.layers)]
    assert all(a.data_ptr() == b.data_ptr() and a.shape == b.shape for a, b in shared)
    assert new.thinker.cache.keys[0].data_ptr() != old.thinker.cache.keys[0].data_ptr()  # caches of their own
    events = assistant.stream(PROMPT, seed=5, max_text_tokens=6, max_codes=40)
    try:
        next(events)  # the turn is running
        assert engine.adopt(new) is False and engine.steps is old
        during = next(e for e in events if isinstance(e, Done)).reply
        events.close()  # the turn's end
        assert engine.steps is old  # until the next turn starts
        after = assistant.say(PROMPT, seed=5, max_text_tokens=6, max_codes=40)
        assert engine.steps is new
        for reply in (during, after):
            assert reply.text_ids == before.text_ids and reply.codes == before.codes
            np.testing.assert_array_equal(reply.audio, before.audio)
    finally:
        events.close()
    assert engine.adopt(old) is True and engine.steps is old  # idle: at once


def test_compile_beside_hands_the_engine_its_steps_or_leaves_them_on_a_failure(assistant):
    """runtime/beside.py's thread: the steps it builds are warmed up and adopted, the caller told how long it
    took; a build that fails leaves the engine's steps serving and says why; the switch interval is put back
    either way. On a CPU the assistant compiles nothing (`compile_beside` gives None)."""
    import sys

    from omni_cli.runtime.beside import compile_beside

    engine, old = assistant.engine, assistant.engine.steps
    assert assistant.compile_beside() is None and not assistant.compiling
    interval = sys.getswitchinterval()
    new, warmed, ready = _second_steps(assistant), [], []
    new.warmup = lambda: warmed.append(sys.getswitchinterval())
    try:
        compile_beside(engine, lambda: new, on_ready=ready.append).join(30)
        assert engine.steps is new and len(ready) == 1 and ready[0] >= 0
        assert warmed and warmed[0] < interval and sys.getswitchinterval() == interval

        failures = []

        def broken():
            raise RuntimeError("no compiler here")

        compile_beside(engine, broken, on_ready=ready.append, on_failure=failures.append).join(30)
        assert engine.steps is new and len(ready) == 1
        assert [str(e) for e in failures] == ["no compiler here"] and sys.getswitchinterval() == interval
    finally:
        engine.adopt(old)


def test_tracing_is_true_only_inside_dynamos_trace():
    """`graphs.tracing()` chooses the compiled paths of fused.py and sampling.py: True where dynamo traces
    the call, False when it runs eagerly (torch's `is_compiling()` is also True in every other thread while
    one compiles, which sent plain steps serving beside a compile down the compiled paths)."""
    from omni_cli.runtime.graphs import tracing

    def which(x):
        return x + 1 if tracing() else x - 1

    x = torch.zeros(2)
    assert which(x).tolist() == [-1, -1]
    assert torch.compile(which, backend="eager", fullgraph=True)(x).tolist() == [1, 1]


def test_a_turn_asked_for_during_an_adoption_waits_for_it_and_runs_on_the_new_steps(assistant, monkeypatch):
    """`adopt` holds the turns' lock a moment when no turn runs (it frees the old steps' memory then): a
    reply asked for meanwhile (omni-serve's next request) waits for it, instead of failing as if another
    turn were running, and is answered by the new steps."""
    engine, old = assistant.engine, assistant.engine.steps
    new = _second_steps(assistant)
    inside = threading.Event()

    def slow_collect():
        inside.set()
        time.sleep(0.3)

    monkeypatch.setattr(engine_mod.gc, "collect", slow_collect)
    adopting = threading.Thread(target=engine.adopt, args=(new,))
    adopting.start()
    try:
        assert inside.wait(10)
        reply = assistant.say(PROMPT, seed=5, max_text_tokens=4, max_codes=20)
        assert reply.text_ids and engine.steps is new
    finally:
        adopting.join(10)
        monkeypatch.undo()
        engine.adopt(old)
