"""The runtime settings and the one graph/compile policy, on a CPU.

`RuntimeOptions` (config.py): the environment's switches read once (`from_env`), flags given winning; the
omni-serve flags that reproduce it (`to_argv`); the model info's JSON (`to_json` / `from_json`).
`graphs.Policy`: graphs only where asked for and possible, compile only with graphs. And the defect this
policy fixes: `--no-graphs` reaches everything that captures CUDA graphs, the Qwen2.5-Omni vocoder's windows
and Qwen3-Omni's code2wav included. A CPU cannot capture, so these tests tell the policy that the device
can (`graphs.graphs_possible`) and make every way of capturing raise: with graphs off nothing may try.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omni_cli.config import RuntimeOptions
from omni_cli.runtime import graphs
from omni_cli.runtime.graphs import Policy

QWEN3_ASSET = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "assets" / "tiny-qwen3-omni")


# -- RuntimeOptions -------------------------------------------------------------------------------------
def test_the_environment_turns_off_what_no_flag_set():
    env = {"OMNI_NO_GRAPHS": "1", "OMNI_NO_COMPILE": "1", "OMNI_NO_KERNELS": "1", "OMNI_NO_ATTEND": "1"}
    off = RuntimeOptions.from_env(environ=env, device="cuda", compile=None)
    assert (off.graphs, off.compile, off.kernels, off.attention_kernel, off.device) == (False, False, False, False,
                                                                                         "cuda")
    assert RuntimeOptions.from_env(environ={}) == RuntimeOptions()
    assert RuntimeOptions.from_env(environ={"OMNI_NO_GRAPHS": "0"}).graphs is True  # "0" and "" are off
    assert RuntimeOptions.from_env(environ=env, graphs=True, compile=True).graphs is True  # a flag given wins
    with pytest.raises(TypeError):
        RuntimeOptions.from_env(environ={}, grafs=False)


def test_runtime_options_are_frozen_and_go_through_json_unchanged():
    options = RuntimeOptions(device="cuda:0", dtype="bfloat16", graphs=False, compile=True, kernels=False,
                             max_context=2048, max_codes=1000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.graphs = True  # type: ignore[misc]
    assert RuntimeOptions.from_json(options.to_json()) == options
    assert RuntimeOptions.from_json({"device": "cpu", "newer": 1}) == RuntimeOptions(device="cpu")
    with pytest.raises(ValueError):
        RuntimeOptions.from_json(["cpu"])


def test_to_argv_gives_the_flags_that_rebuild_the_options():
    assert RuntimeOptions().to_argv() == ["--device", "auto", "--dtype", "auto", "--no-compile", "--max-context",
                                          "4096"]
    argv = RuntimeOptions(device="cuda", dtype="float32", graphs=False, compile=True, kernels=False,
                          attention_kernel=False, max_context=512, max_codes=300).to_argv()
    assert argv == ["--device", "cuda", "--dtype", "float32", "--no-graphs", "--compile", "--no-kernels",
                    "--no-attention-kernel", "--max-context", "512", "--codes-capacity", "300"]


# -- Policy ----------------------------------------------------------------------------------------------
def test_the_policy_has_graphs_where_asked_and_possible_and_compile_only_with_them(monkeypatch):
    assert not Policy.of(RuntimeOptions(compile=True), "cpu").graphs_on  # a CPU has no graphs
    assert not Policy.of(RuntimeOptions(compile=True), "cpu").compile_on
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert Policy.of(RuntimeOptions(), cuda).graphs_on and not Policy.of(RuntimeOptions(), cuda).compile_on
    assert Policy.of(RuntimeOptions(compile=True), cuda).compile_on
    off = Policy.of(RuntimeOptions(graphs=False, compile=True), cuda)
    assert not off.graphs_on and not off.compile_on and not off.compiling().compile_on
    assert Policy.of(RuntimeOptions(), cuda).compiling().compile_on
    built = Policy.of(RuntimeOptions(graphs=False), cuda).to_runtime(RuntimeOptions(device="auto"), "bfloat16")
    assert (built.device, built.dtype, built.graphs, built.compile) == ("cuda", "bfloat16", False, False)
    plain = lambda x: x  # noqa: E731
    assert Policy.of(RuntimeOptions(), cuda).compile(plain) is plain  # compile off: the function itself


def test_no_family_chooses_graphs_or_reads_the_environment():
    """The rule of the house, as the source says it: graphs and compile come from the policy the steps get."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent / "omni_cli"
    offenders = [str(path.relative_to(root)) for folder in ("models", "runtime") for path in (root / folder).rglob("*.py")
                 if re.search(r"graphs_wanted|compile_wanted|env_flag|os\.environ", path.read_text(encoding="utf-8"))
                 and path.name != "graphs.py"]  # graphs.py: inductor's cache folder only
    assert offenders == []


# -- --no-graphs reaches everything that captures ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny Qwen2.5-Omni, loaded (its token2wav and voices)."""
    from omni_cli.loader import TINY_MODEL_DIR, load_model

    return load_model(str(TINY_MODEL_DIR), device="cpu")


@pytest.fixture
def capturing_forbidden(monkeypatch):
    """The policy told that the device can capture graphs; every way of capturing one raises."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError("a CUDA graph capture was attempted")

    monkeypatch.setattr(graphs, "graphs_possible", lambda device: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", refuse)
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    monkeypatch.setattr(graphs, "capture_anywhere", refuse)
    monkeypatch.setattr(graphs, "capture_stream", refuse)
    return attempts


def test_the_qwen2_5_vocoder_captures_no_graph_without_graphs(tiny, capturing_forbidden):
    """The defect: `_WindowGraphs` asked for graphs itself (`graphs_wanted(True, device)`), so with
    `--no-graphs` a GPU still captured the vocoder's windows during replies. Now it has the steps' policy."""
    from omni_cli.models.qwen2_5_omni.vocoder import StreamingVocoder

    loaded = tiny
    spk = loaded.speakers["Chelsie"]
    codes = [100 + i for i in range(60)]
    eager = Policy.of(RuntimeOptions(graphs=False), "cpu")
    voc = StreamingVocoder(loaded.model.token2wav, spk["cond"], spk["ref_mel"], max_codes=80, generator=0,
                           compiled=False, policy=eager)
    assert not voc._graphs.enabled and not voc.pad_windows
    assert sum(len(b) for b in voc.push(codes) + voc.finish()) > 0
    assert capturing_forbidden == []
    # The control: the same vocoder under a policy with graphs does try (here: raises) at once.
    with pytest.raises(AssertionError, match="capture"):
        StreamingVocoder(loaded.model.token2wav, spk["cond"], spk["ref_mel"], max_codes=80, generator=0,
                         compiled=False, policy=Policy.of(RuntimeOptions(), "cpu"))


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_a_reply_without_graphs_captures_nothing_on_a_device_that_could(family, capturing_forbidden):
    """Both families' steps, vocoder and warm-up built under RuntimeOptions(graphs=False) on a device the
    policy believes can capture: a whole reply (speech included) tries no capture; the assistant says
    graphs are off. With graphs asked for, building the same steps tries at once (the control)."""
    import omni_cli
    from omni_cli.loader import TINY_MODEL_DIR

    path = str(TINY_MODEL_DIR) if family == "qwen2.5" else QWEN3_ASSET
    assistant = omni_cli.load(path, runtime=RuntimeOptions(device="cpu", graphs=False, max_codes=64))
    assert assistant.runtime.graphs is False and assistant.engine.steps.policy.graphs_on is False
    steps = assistant.engine.steps
    steps.warmup_vocoder()  # what a GPU's warm-up does (a CPU's skips it): captures nothing either
    reply = assistant.say("Hello", seed=0, max_text_tokens=4, max_codes=24)
    assert reply.codes and reply.audio is not None and len(reply.audio) > 0
    assert capturing_forbidden == []
    with pytest.raises(AssertionError, match="capture"):
        assistant.family.build_steps(assistant.loaded.model, assistant.loaded.speakers,
                                     runtime=RuntimeOptions(max_codes=64))


def test_capture_ahead_captures_only_the_lazy_buckets_not_yet_captured_up_to_the_span(monkeypatch):
    """Between turns (`Engine._capture_ahead`) a lazy StepGraphs captures the buckets up to a span that it
    lacks, the last being the limit where that is no multiple of the bucket; graphs captured at warm-up
    (not lazy) or switched off capture nothing."""
    made = []
    steps = graphs.StepGraphs(lambda span: None, torch.device("cpu"), limit=1000, enabled=False, lazy=True)
    steps.enabled = True  # as on CUDA; the capture itself is replaced
    monkeypatch.setattr(steps, "_capture", lambda size: made.append(size) or ("graph", size))
    steps.graphs[256] = ("warm-up's", 256)
    assert steps.capture_upto(300) == 1 and made == [512]
    assert steps.capture_upto(500) == 0  # 500 is in the 512 bucket: captured
    assert steps.capture_upto(5000) == 2 and made == [512, 768, 1000]
    steps.lazy = False
    assert steps.capture_upto(5000) == 0
    cache = type("Cache", (), {"length": 300})()
    assert graphs.capture_ahead((None, cache)) == 0


def test_an_engine_on_a_cpu_captures_nothing_ahead_and_settles_at_once():
    """A finished turn on a CPU leaves no capture ahead (no graphs there): `settle` returns at once."""
    from scripted import FakeSteps, make_engine, request, run_turn, text_script

    engine = make_engine(FakeSteps(text_script(5, eos_at=3)))
    run_turn(engine, request())
    engine.settle()
    assert engine._ahead is None


def test_a_rest_replays_the_smallest_captured_graph_that_holds_it():
    """A rest over kept rows whose own bucket has no graph yet takes a larger one captured for the same kept
    span (padded rows are past the prompt), never one too small or whose key span its end leaves."""
    sizes = [32, 64, 128, 256, 512, 1024]
    captured = {(64, 512): "64", (256, 512): "256", (256, 1024): "256 wide"}
    assert graphs.rest_graph(captured, sizes, 79, 4, 4096) == (256, "256")  # 128 not captured: 256 serves
    assert graphs.rest_graph(captured, sizes, 20, 100, 4096) == (64, "64")
    assert graphs.rest_graph(captured, sizes, 64, 100, 4096) == (64, "64")
    assert graphs.rest_graph(captured, sizes, 65, 300, 4096) == (256, "256 wide")  # ends past 512
    assert graphs.rest_graph(captured, sizes, 300, 4, 4096) is None  # nothing holds 300 rows
    assert graphs.rest_graph(captured, sizes, 20, 460, 4096) == (256, "256 wide")  # 460 + 64 > 512
    assert graphs.rest_graph(captured, sizes, 20, 900, 4096) is None  # 900 + 256 wants a 2,048 span
    assert graphs.rest_graph(captured, sizes, 65, 300, 520) is None  # the context ends before 300 + 256


def test_the_talker_captures_long_prompts_around_its_kept_rows_and_the_thinker_not():
    """`capture_prompts`: the talker keeping rows has its long prompts captured too (around a copy of the
    rows); a thinker with a kept context only its rests; with nothing kept, both their long prompts."""
    from types import SimpleNamespace

    from omni_cli.runtime.kv_cache import StaticKVCache

    class Recorder:
        def __init__(self):
            self.calls = []

        def capture_rests(self, kept, long_over_kept=False):
            self.calls.append((kept, long_over_kept))
            return 0

    def stacks(kept_ids, talker_rows):
        cache = StaticKVCache(1, 1, 4, 16, device="cpu", dtype=torch.float32)
        cache.length = 10
        rows = SimpleNamespace(shared=lambda: talker_rows, clear=lambda: None)
        thinker = SimpleNamespace(prefill_graphs=Recorder(), context=SimpleNamespace(ids=kept_ids))
        return thinker, SimpleNamespace(prefill_graphs=Recorder(), cache=cache, rows=rows)

    thinker, talker = stacks([1, 2, 3], 6)
    graphs.capture_prompts(thinker, talker)
    assert thinker.prefill_graphs.calls == [(True, False)] and talker.prefill_graphs.calls == [(True, True)]
    assert talker.cache.length == 6  # cut back to the rows it keeps
    thinker, talker = stacks([], 0)
    graphs.capture_prompts(thinker, talker)
    assert thinker.prefill_graphs.calls == [(False, False)] and talker.prefill_graphs.calls == [(False, False)]


def test_a_caches_first_rows_copied_aside_come_back_exactly():
    from omni_cli.runtime.kv_cache import StaticKVCache

    cache = StaticKVCache(2, 2, 4, 16, device="cpu", dtype=torch.float32)
    for t in cache.keys + cache.values:
        t.normal_()
    cache.length = 5
    before = [t.clone() for t in cache.keys + cache.values]
    saved = cache.copy_first(5)
    for t in cache.keys + cache.values:
        t.zero_()  # what a capture's warm-up forwards do to them
    cache.length = 0
    cache.restore_first(saved)
    assert cache.length == 5
    assert all(torch.equal(a[:, :, :5], b[:, :, :5]) for a, b in zip(before, cache.keys + cache.values))
