"""GPU-only checks (skipped without CUDA): the CUDA-graph decode path gives the same greedy tokens and
codes as the eager path and as transformers, on the tiny model and on a random true-size model over
200 talker steps; and the talker loop runs under `torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from omni_cli.config import RuntimeOptions, SamplingOptions
from omni_cli.models.qwen2_5_omni import DEFAULT_SYSTEM, TALKER_SAMPLING as TALKER_DEFAULTS
from omni_cli.models.qwen2_5_omni.steps import Qwen25Steps
from omni_cli.runtime.engine import Done, Engine, TurnRequest, configure_cuda

from hf_reference import reference_generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingOptions(do_sample=False)


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def run(engine: Engine, ids, n_text, n_codes, **kw):
    req = TurnRequest(ids, "Chelsie", GREEDY, TALKER_DEFAULTS.greedy(), n_text, n_codes, seed=0, **kw)
    for event in engine.stream(req):
        if isinstance(event, Done):
            return event.reply


def reference(model, ids, n_text, n_codes, eos, forced=False):
    return reference_generate(model, ids, n_text=n_text, n_codes=n_codes, eos=eos, forced=forced)


def engines(model, eos, max_codes):
    """(eager, graphed and compiled (omni-bench's), graphed uncompiled (omni-say's default)) engines."""
    eager = Engine(Qwen25Steps(model, model.speaker_map, RuntimeOptions(max_context=1024, max_codes=max_codes),
                               fast_decode=False),
                   _Tok(), eos_ids=eos)
    made = [Engine(Qwen25Steps(model, model.speaker_map, RuntimeOptions(max_context=1024, max_codes=max_codes, compile=compile),
                               fast_decode=True), _Tok(), eos_ids=eos) for compile in (True, False)]
    for engine in made:
        engine.warmup()
    return eager, *made


@pytest.fixture(autouse=True)
def cuda_settings():
    # No TF32 anywhere, for the reference too. An engine in bfloat16 (a test before this one) turns TF32
    # matmuls on for the whole process (configure_cuda), so they are turned off here first.
    torch.backends.cuda.matmul.allow_tf32 = False
    configure_cuda(float32_llm=True)


def test_tiny_graphed_equals_eager_equals_transformers():
    from omni_dev import tiny_qwen2_5 as tiny

    model = tiny.build_tiny_model(tiny.tiny_config(), seed=0).cuda().eval()
    eos = tiny.make_generation_config().eos_token_id
    tok = tiny.make_tokenizer()
    from omni_cli.prompt import Conversation, build_ids

    ids = build_ids(tok, Conversation(DEFAULT_SYSTEM).messages("Hello there, how are you today?"))
    ref_text, ref_codes = reference(model, ids, 16, 200, eos)
    eager, graphed, uncompiled = engines(model, eos, 256)
    a = run(eager, ids, 16, 200)
    b = run(graphed, ids, 16, 200)
    c = run(uncompiled, ids, 16, 200)
    for engine in (graphed, uncompiled):
        graphs = engine.steps.thinker.fused.graphs
        assert graphs.enabled and graphs.graphs  # really replayed graphs
    assert uncompiled.steps.compile is False and graphed.steps.compile is True
    assert a.text_ids == ref_text and a.codes == ref_codes
    assert b.text_ids == ref_text and b.codes == ref_codes
    assert c.text_ids == ref_text and c.codes == ref_codes
    # The vocoder: eager (ODE step by step), and its steps' graphs replayed: the same kernels, float32.
    diff = float(abs(c.audio - a.audio).max())
    print(f"tiny: audio max |eager - step graphs| {diff:.2e}")
    assert c.audio.shape == a.audio.shape and diff <= 1e-4


def test_tiny_lazy_graphs_across_span_buckets_equal_eager():
    """Uncompiled (omni-say's default): the warm-up captures the first span bucket and the first vocoder
    windows only; a long reply (700 codes: the talker's span crosses two bucket edges, the vocoder reaches
    its 96- and 192-code windows) captures the rest mid-reply, beside the other thread's GPU work. Codes
    and text equal the eager engine's, and the audio equals it to float32 rounding."""
    from omni_dev import tiny_qwen2_5 as tiny

    model = tiny.build_tiny_model(tiny.tiny_config(), seed=0).cuda().eval()
    eos = tiny.make_generation_config().eos_token_id
    ids = list(range(20, 80))
    eager = Engine(Qwen25Steps(model, model.speaker_map, RuntimeOptions(max_context=1024, max_codes=1024), fast_decode=False),
                   _Tok(), eos_ids=eos)
    lazy = Engine(Qwen25Steps(model, model.speaker_map, RuntimeOptions(max_context=1024, max_codes=1024, graphs=True, compile=False)),
                  _Tok(), eos_ids=eos)
    lazy.warmup()
    talker_graphs, vocoder_graphs = lazy.steps.talker.graphs, model.token2wav._omni_window_graphs
    before = (set(talker_graphs.graphs), set(vocoder_graphs.graphs))
    assert before[0] == {256}
    a = run(eager, ids, 24, 700, force_lengths=True)
    b = run(lazy, ids, 24, 700, force_lengths=True)
    print("lazy graphs: talker buckets", sorted(before[0]), "->", sorted(talker_graphs.graphs),
          "; vocoder graphs", len(before[1]), "->", len(vocoder_graphs.graphs))
    assert set(talker_graphs.graphs) >= {256, 512, 768}  # captured mid-reply
    assert len(vocoder_graphs.graphs) > len(before[1])
    assert b.text_ids == a.text_ids and b.codes == a.codes and len(a.codes) == 700
    diff = float(abs(b.audio - a.audio).max())
    print(f"lazy graphs: audio max |eager - graphs| {diff:.2e}")
    assert b.audio.shape == a.audio.shape and diff <= 1e-4
    # After the turn, the capture ahead: the thinker's and the talker's buckets up to CAPTURE_AHEAD past
    # where their caches stopped; the next reply (replaying them) equals the eager engine's again.
    from omni_cli.runtime.graphs import CAPTURE_AHEAD, bucket

    lazy.settle()
    thinker_graphs, steps = lazy.steps.thinker.fused.graphs, lazy.steps
    for graph_set, cache in ((thinker_graphs, steps.thinker.cache), (talker_graphs, steps.talker.cache)):
        top = bucket(cache.length + CAPTURE_AHEAD, graph_set.limit)
        assert top in graph_set.graphs, (cache.length, sorted(graph_set.graphs))
    c, d = run(eager, ids[:30], 12, 300, force_lengths=True), run(lazy, ids[:30], 12, 300, force_lengths=True)
    assert d.text_ids == c.text_ids and d.codes == c.codes


@pytest.fixture(scope="module")
def big_model():
    from omni_cli.faces.bench import build_model

    # float32 LLMs: in bf16 the fused step's matmuls (fused QKV, gate/up; other kernels) round
    # differently from the library's, and a random model's near-flat logits flip an argmax within a few
    # steps (measured on an H200: codes differ from step 4 on, before any vocoder window has run). In
    # float32 the eager/graphed talker logits differ by at most ~2e-5 over the 200 steps, against top-2
    # margins of 4e-3 and up (measured on an H200), and every code agrees.
    return build_model("qwen2.5-omni-7b", torch.device("cuda"), torch.float32)


def test_true_size_graphed_equals_eager_equals_transformers_over_200_steps(big_model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150000, (60,), generator=g).tolist()
    eos = [151645, 151643]
    # Random weights: text EOS is held off and codes kept in the audio range on both sides (forced), else
    # the reference's token2wav indexes out of range on a random talker's non-audio ids.
    ref_text, ref_codes = reference(big_model, ids, 32, 200, eos, forced=True)
    eager, graphed, uncompiled = engines(big_model, eos, 256)
    logits = {}
    a = run_recording(eager, ids, 32, 200, logits.setdefault("eager", []))
    b = run_recording(graphed, ids, 32, 200, logits.setdefault("graphed", []))
    c = run_recording(uncompiled, ids, 32, 200, [])
    print("uncompiled graphs: text eq", c.text_ids == a.text_ids, "codes eq", c.codes == a.codes)
    first_diff = next((i for i, (x, y) in enumerate(zip(a.codes, b.codes)) if x != y), None)
    print("codes: ref", len(ref_codes), "eager", len(a.codes), "graphed", len(b.codes), "first eager/graphed diff", first_diff)
    print("text eq", a.text_ids == ref_text, b.text_ids == a.text_ids, "codes eq", a.codes == ref_codes, b.codes == a.codes)
    # What tells a rounding flip from a logic error: the two paths' logits before and at the first
    # difference, against the eager top-2 margin there. (A logic error looked like this: while the
    # vocoder's graphs raced the talker's on one cuBLAS workspace, the difference jumped from 2e-5 to
    # 0.5 at step 25, when the first vocoder window ran, and codes differed from step 96 on.)
    for i, (x, y) in enumerate(zip(logits["eager"], logits["graphed"])):
        if first_diff is not None and i > first_diff:
            break
        top2 = x[0, :8192].topk(2).values
        if i % 25 == 0 or i == first_diff:
            print(f"talker step {i}: max |eager - graphed| logit {(x - y).abs().max().item():.2e}, "
                  f"eager top-2 margin {(top2[0] - top2[1]).item():.2e}")
    assert a.text_ids == ref_text and a.codes == ref_codes
    assert b.text_ids == a.text_ids
    assert b.codes == a.codes
    assert c.text_ids == a.text_ids and c.codes == a.codes
    assert len(a.codes) == 200


def run_recording(engine: Engine, ids, n_text, n_codes, into: list):
    """`run` with forced lengths, keeping a copy of the talker's logits at every step."""
    from omni_cli.models.qwen2_5_omni import steps as engine_mod  # where the talker's codes are picked

    original = engine_mod.select

    def spy(logits, opts, *args, **kwargs):
        if logits.shape[-1] == engine.steps.talker.codec_head.out_features:
            into.append(logits.detach().float().cpu())  # a host copy: fine outside the timed path
        return original(logits, opts, *args, **kwargs)

    engine_mod.select = spy
    try:
        return run(engine, ids, n_text, n_codes, force_lengths=True)
    finally:
        engine_mod.select = original


def test_talker_loop_runs_under_sync_debug_error(big_model, monkeypatch):
    from omni_cli.runtime import turn as turn_mod

    def no_vocoder(self):  # the vocoder thread copies audio to the host by design; leave it out here
        for _ in self.codes_ch:
            pass
        self._worker_done()

    monkeypatch.setattr(turn_mod.Turn, "_vocoder_main", no_vocoder)
    eng = Engine(Qwen25Steps(big_model, big_model.speaker_map, RuntimeOptions(max_context=1024, max_codes=256, compile=True)), _Tok(),
                 eos_ids=[151645])
    eng.warmup()
    ids = list(range(1000, 1060))
    reply = run(eng, ids, 16, 200, force_lengths=True, sync_debug=True)
    assert len(reply.codes) == 200


def test_tiny_on_cuda_through_the_api_equals_transformers(monkeypatch):
    """The built-in tiny Qwen2.5-Omni on CUDA (float32) through the real API, its weights read while
    transformers was imported (early_weights.py): greedy text and codes equal to transformers' generate on
    the model the files load."""
    from omni_cli import early_weights
    from omni_cli.assistant import Assistant
    from omni_cli.loader import TINY_MODEL_DIR
    from omni_cli.prompt import Conversation, build_ids

    taken = []
    real_take = early_weights.EarlyWeights.take
    monkeypatch.setattr(early_weights.EarlyWeights, "take", lambda self: taken.append(1) or real_take(self))
    assistant = Assistant.load(str(TINY_MODEL_DIR), device="cuda", dtype="float32")
    assert taken  # the early read was used
    prompt = "Hello there, how are you today?"
    reply = assistant.say(prompt, greedy=True, voice="Chelsie", max_text_tokens=16, max_codes=100)
    from transformers import Qwen2_5OmniForConditionalGeneration

    files = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(TINY_MODEL_DIR), dtype=torch.float32).cuda().eval()
    ids = build_ids(assistant.loaded.tokenizer, Conversation(system=assistant.default_system).messages(prompt))
    ref_text, ref_codes = reference_generate(files, ids, n_text=16, n_codes=100, eos=assistant.engine.eos_ids,
                                             repetition_penalty=assistant.thinker_sampling.repetition_penalty)
    assert reply.text_ids == ref_text and reply.codes == ref_codes


def test_qwen3_tiny_on_cuda_equals_transformers():
    """The built-in tiny Qwen3-Omni on CUDA (float32) through the real API: greedy text and every
    codebook of every frame equal to transformers' generate on the same device."""
    import qwen3_reference as ref

    from omni_cli.assistant import Assistant
    from omni_cli.prompt import Conversation, build_ids

    assistant = Assistant.load(str(ref.ASSET), device="cuda", dtype="float32")
    prompt = "Hello there! What is the weather like today?"
    reply = assistant.say(prompt, greedy=True, voice="Ethan", max_text_tokens=12, max_codes=40)
    ids = build_ids(assistant.loaded.tokenizer, Conversation(system=assistant.default_system).messages(prompt))
    assert (reply.text_ids, reply.codes) == _qwen3_generate(assistant.loaded.model, ids, assistant, 12, 40)
    assert len(reply.audio) == 1920 * len(reply.codes) - 555


def _qwen3_generate(model, ids, assistant, n_text: int, frames: int):
    """(text ids, frames) of transformers' greedy generate on CUDA, voice Ethan."""
    caught = {}
    hook = model.code2wav.register_forward_pre_hook(lambda _m, args: caught.setdefault("codes", args[0]))
    try:
        with torch.no_grad():
            sequences, _wav = model.generate(
                torch.tensor([ids], device="cuda"), speaker="ethan", thinker_max_new_tokens=n_text,
                thinker_eos_token_id=assistant.engine.eos_ids, thinker_do_sample=False,
                thinker_repetition_penalty=assistant.thinker_sampling.repetition_penalty,
                talker_do_sample=False, talker_max_new_tokens=frames + 1)
    finally:
        hook.remove()
    return sequences[0, len(ids):].tolist(), caught["codes"][0].T.tolist()


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_packed_tiny_on_cuda_equals_transformers_on_its_dequantized_weights(family, kind):
    """--quantize on CUDA (float32, graphs): the packed steps (the int4 / FP8 decode kernels, the prefill's
    tile products, the picked experts' kernels) give the greedy text and codes of transformers' generate
    on a model holding the dequantized weights."""
    import copy

    import qwen3_reference as ref

    from omni_cli.assistant import Assistant
    from omni_cli.loader import TINY_MODEL_DIR
    from omni_cli.prompt import Conversation, build_ids
    from omni_cli.quant.apply import dequantized, has_packed

    folder = str(ref.ASSET if family == "qwen3" else TINY_MODEL_DIR)
    runtime = RuntimeOptions(device="cuda", dtype="float32", quantize=kind, group_size=16 if kind == "int4" else None)
    if kind == "fp8":
        from omni_cli.quant import apply

        saved = apply.SPECS["fp8"]
        apply.SPECS["fp8"] = dict(kind="fp8", block=(16, 16))  # blocks that the tiny widths fill
    try:
        assistant = Assistant.load(folder, runtime=runtime)
    finally:
        if kind == "fp8":
            apply.SPECS["fp8"] = saved
    model = assistant.loaded.model
    assert has_packed(model)
    prompt = "Hello there! What is the weather like today?"
    voice = "Ethan" if family == "qwen3" else "Chelsie"
    n_codes = 40 if family == "qwen3" else 100
    reply = assistant.say(prompt, greedy=True, voice=voice, max_text_tokens=12, max_codes=n_codes)
    ids = build_ids(assistant.loaded.tokenizer, Conversation(system=assistant.default_system).messages(prompt))
    if family == "qwen3":
        from transformers import Qwen3OmniMoeForConditionalGeneration as cls
    else:
        from transformers import Qwen2_5OmniForConditionalGeneration as cls
    plain = cls.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for name, tensors in dequantized(model):
            for attr, value in tensors.items():
                getattr(plain.get_submodule(name), attr).copy_(value)
    if family == "qwen3":
        want = _qwen3_generate(plain, ids, assistant, 12, n_codes)
    else:
        if not hasattr(plain, "speaker_map"):
            plain.speaker_map = copy.copy(model.speaker_map)
        want = reference_generate(plain, ids, n_text=12, n_codes=n_codes, eos=assistant.engine.eos_ids,
                                  repetition_penalty=assistant.thinker_sampling.repetition_penalty)[:2]
        want = (list(want[0]), list(want[1]))
    assert (reply.text_ids, list(reply.codes)) == want


# -- Qwen3-Omni ------------------------------------------------------------------------------------------

def qwen3_engines(model, voices, tokenizer, eos, max_codes, compiles):
    """(eager: the library's layers, then per `compiles` entry the fused steps replayed as CUDA graphs,
    compiled (True: omni-bench's) or plain (False: the other commands' default), captured)."""
    from omni_cli.models.qwen3_omni.steps import Qwen3Steps
    from omni_cli.runtime import fused

    eager = Engine(Qwen3Steps(model, voices, RuntimeOptions(max_context=512, max_codes=max_codes), fast_decode=False),
                   tokenizer, eos_ids=eos)
    made = [Engine(Qwen3Steps(model, voices, RuntimeOptions(max_context=512, max_codes=max_codes, compile=compile)),
                   tokenizer, eos_ids=eos) for compile in compiles]
    for graphed, compile in zip(made, compiles):
        graphed.warmup()
        assert graphed.steps.compile is compile
        assert graphed.steps.talker.step_graphs.graphs and graphed.steps.talker.frame_graphs.graphs
        assert graphed.steps.thinker.fused.graphs.graphs
        # The one-launch attention (kernels.attend) in all three stacks, where the GPU has the kernels.
        wanted = fused.attend_wanted(torch.device("cuda"))
        talker = graphed.steps.talker
        assert graphed.steps.thinker.fused.fused.attend is talker.fused.attend is talker.predictor_fused.attend is wanted
    return eager, *made


def qwen3_run(engine, ids, n_text, frames, **kw):
    from omni_cli.models.qwen3_omni.talker import Talker

    req = TurnRequest(ids, "Ethan", GREEDY, Talker.default_sampling()[0].greedy(), n_text, frames, seed=0, **kw)
    for event in engine.stream(req):
        if isinstance(event, Done):
            return event.reply


def qwen3_reference(model, ids, n_text, frames, eos, forced=False):
    """transformers' greedy generate on the model's device: (text ids, codes as 16-id frames). `forced`:
    text EOS held off until `n_text` tokens and codec EOS suppressed (exactly `frames` frames)."""
    import warnings

    cfg = model.config.talker_config
    vocab = cfg.text_config.vocab_size
    kw = {}
    if forced:
        kw = dict(thinker_min_new_tokens=n_text, talker_suppress_tokens=list(range(vocab - 1024, vocab)))
    caught = {}
    hook = model.code2wav.register_forward_pre_hook(lambda _m, args: caught.setdefault("codes", args[0]))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Passing `repetition_penalty` with `inputs_embeds`")
            sequences, _wav = model.generate(
                torch.tensor([ids], device="cuda"), speaker="ethan", thinker_max_new_tokens=n_text,
                thinker_eos_token_id=eos, thinker_do_sample=False, talker_do_sample=False,
                talker_max_new_tokens=frames + 1, **kw)
    finally:
        hook.remove()
    return sequences[0, len(ids):].tolist(), caught["codes"][0].T.tolist()


@pytest.mark.parametrize("compile", [False, True], ids=["plain", "compiled"])
def test_qwen3_tiny_graphed_equals_eager_equals_transformers(compile):
    import qwen3_reference as ref

    model = ref.model("tiny").cuda()
    voices = {str(n).capitalize(): int(i) for n, i in model.config.talker_config.speaker_id.items()}
    ids = ref.prompt_ids([{"role": "user", "content": "Hello there! What is the weather like today?"}])
    eos = [ref.im_end()]
    ref_text, ref_codes = qwen3_reference(model, ids, 12, 40, eos)
    for engine in qwen3_engines(model, voices, ref.tokenizer(), eos, 64, compiles=(compile,)):
        reply = qwen3_run(engine, ids, 12, 40)
        assert reply.text_ids == ref_text and reply.codes == ref_codes


def qwen3_true_widths(dtype):
    """Qwen3-Omni-30B-A3B at true widths: the whole talker, code predictor and code2wav, and 4 of the
    thinker's 48 layers (in float32 all 48 would not fit in one H200: 141 GB)."""
    from omni_cli.models.qwen3_omni import presets

    config = presets.build_config("qwen3-omni-30b-a3b")
    config.thinker_config.text_config.num_hidden_layers = 4
    config.talker_config.accept_hidden_layer = 2  # within the 4 layers (the talker reads its state)
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with torch.device("cuda"):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=dtype)
    presets._init_talker_moe(model, "cuda")
    voices = {str(n).capitalize(): int(i) for n, i in config.talker_config.speaker_id.items()}
    return model.eval(), voices


@pytest.fixture(scope="module")
def qwen3_big():
    """In float32: bfloat16 rounding flips a random model's near-flat argmaxes within a few steps."""
    return qwen3_true_widths(torch.float32)


def test_qwen3_true_size_graphed_equals_eager_equals_transformers_over_200_frames(qwen3_big):
    model, voices = qwen3_big
    from omni_cli.models.qwen3_omni import presets

    ids = presets.prompt(model, 60)
    eos = [model.config.im_end_token_id]
    ref_text, ref_codes = qwen3_reference(model, ids, 32, 200, eos, forced=True)
    # Graphs as the commands run them (plain; the compiled ones passed this test when they were the default).
    eager, graphed = qwen3_engines(model, voices, _Tok(), eos, 256, compiles=(False,))
    a = qwen3_run(eager, ids, 32, 200, force_lengths=True)
    b = qwen3_run(graphed, ids, 32, 200, force_lengths=True)
    first = next((i for i, (x, y) in enumerate(zip(a.codes, b.codes)) if x != y), None)
    print("frames: ref", len(ref_codes), "eager", len(a.codes), "graphed", len(b.codes), "first difference", first)
    assert a.text_ids == ref_text and a.codes == ref_codes
    assert b.text_ids == a.text_ids and b.codes == a.codes
    assert len(a.codes) == 200


def test_qwen3_loop_runs_under_sync_debug_error(monkeypatch):
    """In bfloat16, the dtype a GPU runs: there the prompts are graphs too (in float32 the library's
    experts, which the talker's prompt runs through, copy from the host)."""
    from omni_cli.models.qwen3_omni import build_steps
    from omni_cli.runtime import turn as turn_mod

    def no_vocoder(self):  # the vocoder thread copies audio to the host by design; leave it out here
        for _ in self.codes_ch:
            pass
        self._worker_done()

    monkeypatch.setattr(turn_mod.Turn, "_vocoder_main", no_vocoder)
    model, voices = qwen3_true_widths(torch.bfloat16)
    from omni_cli.models.qwen3_omni import presets

    eng = Engine(build_steps(model, voices, RuntimeOptions(max_context=512, max_codes=256, graphs=True)), _Tok(),
                 eos_ids=[model.config.im_end_token_id])  # as the commands build them (not compiled)
    eng.warmup()
    reply = qwen3_run(eng, presets.prompt(model, 60), 16, 200, force_lengths=True, sync_debug=True)
    assert len(reply.codes) == 200


@pytest.mark.parametrize("rows", [60, 2500])
def test_routed_experts_are_the_librarys_in_bfloat16(rows):
    """runtime/prompt_ops.py at Qwen3-Omni's thinker widths (128 experts, 8 picked), bfloat16: the same
    grouped products as the library's grouped_mm path (the engine's models use it; a bare config's default
    is the eager loop, which sums the picks in bfloat16), the glue of ours; every output within one unit of
    bfloat16's last place of the library's (the k picks' float32 sum may be ordered otherwise), nearly all
    equal (an H100, the 2,500-token prefill through all 48 layers: equal)."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    from omni_cli.models.qwen3_omni import presets
    from omni_cli.runtime import prompt_ops

    config = presets.build_config("qwen3-omni-30b-a3b").thinker_config.text_config
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device("cuda"):
        block = m.Qwen3OmniMoeThinkerTextSparseMoeBlock(config).to(torch.bfloat16).eval()
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(rows, config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        _, weights, ids = block.gate(x)
        want = block.experts(x, ids, weights)  # outside the engine's forwards: the library's path
        got = prompt_ops.routed(block.experts.gate_up_proj, block.experts.down_proj, x, ids, weights)
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=2**-20)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got == want).float().mean().item() > 0.999


def test_the_rope_kernel_is_the_librarys_in_bfloat16():
    """runtime/rope_kernel.py at Qwen3-Omni's thinker widths (32 query heads, 4 key heads, 128 wide), a
    2,500-row prompt, bfloat16, q and k as the attention hands them over, against the library's: through
    Triton's interpreter the same values; compiled for an H100 not all of them (the first run of this test
    there failed on exact equality), so here each value is within one rounding of each of the two products
    and of the result (bfloat16's eps times |x cos| + |rotate_half(x) sin| + |result|), and the share
    equal is printed."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    from omni_cli.runtime.rope_kernel import rope

    library = getattr(m.apply_rotary_pos_emb, "_omni_library", m.apply_rotary_pos_emb)
    torch.manual_seed(0)
    with torch.device("cuda"):
        q = (torch.randn(1, 2500, 32, 128) * 3).to(torch.bfloat16).transpose(1, 2)
        k = (torch.randn(1, 2500, 4, 128) * 3).to(torch.bfloat16).transpose(1, 2)
        angle = torch.arange(2500).view(1, -1, 1) * torch.rand(1, 1, 64).repeat(1, 1, 2)
        cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    eps = torch.finfo(torch.bfloat16).eps
    for x, want in zip((q, k), library(q, k, cos, sin)):
        got = rope(x, cos, sin).float()
        c, s_ = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).float()
        bound = eps * ((x.float() * c).abs() + (rotated * s_).abs() + want.float().abs())
        worst = ((got - want.float()).abs() / bound.clamp(min=1e-30)).max().item()
        print(f"rope vs the library: {(got == want.float()).float().mean().item():.6f} equal, worst "
              f"{worst:.3f} of the bound")
        assert ((got - want.float()).abs() <= bound).all()
        assert not torch.equal(got, x.float())  # rotated


def _stream_code2wav(code2wav, fr, sizes, first=None, left_context=25):
    from omni_cli.models.qwen3_omni.code2wav import StreamingCode2Wav

    voc = StreamingCode2Wav(code2wav, max_frames=len(fr), first_chunk=first, left_context=left_context)
    blocks, i, k = [], 0, 0
    while i < len(fr):
        blocks += voc.push(fr[i : i + sizes[k % len(sizes)]].tolist())
        i, k = i + sizes[k % len(sizes)], k + 1
    return np.concatenate(blocks + voc.finish()), voc.chunk_log


@pytest.mark.parametrize("first", [2, 4])
@pytest.mark.parametrize("size", ["tiny", "true"])
def test_qwen3_chunk_graphs_equal_the_eager_stream(size, first, request):
    """code2wav's chunks as CUDA graphs (`ChunkGraphs`: each chunk of the schedule until the cache is full,
    then one for the steady chunks, the positions an input): the streamed audio equals the eager stream's
    (float32, no TF32) for utterances of every push pattern, twice over (a replay leaves nothing behind
    for the next utterance), and the stream with the graphs still equals the whole decode. Every chunk but
    an utterance's last replays a graph; one whose context differs in length from the graph's runs
    eagerly."""
    import qwen3_reference as ref

    from omni_cli.models.qwen3_omni.code2wav import ChunkGraphs

    # cuDNN's default TF32 convolutions round the whole decode itself by ~3e-3 (code2wav.py's docstring)
    torch.backends.cudnn.allow_tf32 = False
    code2wav = (ref.model("tiny").cuda() if size == "tiny" else request.getfixturevalue("qwen3_big")[0]).code2wav
    # The model may be one an earlier test's engine warmed up: its graphs, captured then (with cuDNN's TF32
    # on), would stand in for the eager stream this test compares with.
    code2wav._omni_chunk_graphs = None
    rng = np.random.default_rng(0)
    utterances = [rng.integers(0, 2048, size=(n, 16)) for n in (first, 60, 3, 170)]
    patterns = ([1], [4], [3, 1, 7, 2, 11], [10**6])
    eager = [_stream_code2wav(code2wav, fr, p, first)[0] for fr in utterances for p in patterns]
    graphs = ChunkGraphs.capture(code2wav, first, 25, 25)
    assert graphs is not None and all(g.graph is not None for g in graphs.graphs.values())
    try:
        for _round in range(2):
            graphed = [_stream_code2wav(code2wav, fr, p, first)[0] for fr in utterances for p in patterns]
            for a, b in zip(eager, graphed):
                assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5
        with torch.inference_mode():
            whole = code2wav(torch.from_numpy(utterances[3].T[None].copy()).cuda()).reshape(-1).cpu().numpy()
        assert np.abs(graphed[-1] - whole).max() <= 1e-4
        calls = []
        for g in graphs.graphs.values():
            g.graph.replay = lambda g=g: calls.append(g.start)
        _, log = _stream_code2wav(code2wav, utterances[3], [1], first)
        assert len(calls) == len(log) - 1 and calls[:3] == [0, first, 3 * first]
        calls.clear()
        _stream_code2wav(code2wav, utterances[1], [1], first, left_context=5)
        assert calls == [0, first]  # the third chunk's context is 5 frames, not the 2 * first it was made with
    finally:
        code2wav._omni_chunk_graphs = None
        torch.backends.cudnn.allow_tf32 = True


# -- the talker on its own stream ------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_talker_on_its_own_stream_gives_the_reply_of_one_stream(family):
    """The talker's steps on their own stream (the default: talker step k runs beside thinker step k+1)
    and on the thinker's: sampled, seeded replies with the same text, codes and audio. A missing wait
    between the two streams (the talker reading a text entry the thinker has not written yet, or memory
    reused under it) would change the codes."""
    sampled = SamplingOptions(do_sample=True, temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.05)
    if family == "qwen2.5":
        from omni_dev import tiny_qwen2_5 as tiny

        model = tiny.build_tiny_model(tiny.tiny_config(), seed=0).cuda().eval()
        engine = Engine(Qwen25Steps(model, model.speaker_map, RuntimeOptions(max_context=1024, max_codes=512, graphs=True)), _Tok(),
                        eos_ids=tiny.make_generation_config().eos_token_id)
        voice, talker, ids = "Chelsie", TALKER_DEFAULTS, list(range(20, 80))
    else:
        import qwen3_reference as ref
        from omni_cli.models.qwen3_omni.steps import Qwen3Steps
        from omni_cli.models.qwen3_omni.talker import Talker

        model = ref.model("tiny").cuda()
        voices = {str(n).capitalize(): int(i) for n, i in model.config.talker_config.speaker_id.items()}
        engine = Engine(Qwen3Steps(model, voices, RuntimeOptions(max_context=512, max_codes=256, graphs=True)), ref.tokenizer(),
                        eos_ids=[ref.im_end()])
        voice, talker = "Ethan", Talker.default_sampling()[0]
        ids = ref.prompt_ids([{"role": "user", "content": "Hello there! What is the weather like today?"}])
    engine.warmup()
    assert engine.talker_stream is not None and engine.overlap
    replies = {}
    for overlap in (True, False, True):
        engine.overlap = overlap
        for seed in (0, 1):
            req = TurnRequest(ids, voice, sampled, talker, 48, 200 if family == "qwen2.5" else 120, seed=seed,
                              force_lengths=True)
            reply = next(e.reply for e in engine.stream(req) if isinstance(e, Done))
            replies.setdefault(seed, []).append(reply)
    for seed, (a, b, c) in replies.items():
        assert len(a.codes) > 50
        for other in (b, c):
            assert other.text_ids == a.text_ids and other.codes == a.codes
            assert other.audio.shape == a.audio.shape and float(abs(other.audio - a.audio).max()) <= 1e-4
    assert replies[0][0].codes != replies[1][0].codes  # sampled: the seeds differ


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_compiled_steps_made_beside_the_plain_ones_take_over_with_the_same_replies(family):
    """omni-serve's default (runtime/beside.py): the compiled steps are built, compiled and captured on a
    thread of their own while replies run on the plain graphs, then take over between two replies. Every
    reply, during the compile and after the switch, has the plain steps' greedy text and codes; the audio is
    theirs during the compile and a model compiled from the start's after it."""
    import qwen3_reference as ref

    from omni_cli.assistant import Assistant
    from omni_cli.loader import TINY_MODEL_DIR

    path, voice = (str(TINY_MODEL_DIR), "Chelsie") if family == "qwen2.5" else (str(ref.ASSET), "Ethan")
    assistant = Assistant.load(path, device="cuda", dtype="float32")
    plain = assistant.engine.steps
    assert not plain.compile
    prompt, kw = "Hello there, how are you today?", dict(greedy=True, seed=0, voice=voice, max_text_tokens=12,
                                                     max_codes=40)  # the seed: the vocoder's noise
    before = assistant.say(prompt, **kw)
    ready, failed = [], []
    thread = assistant.compile_beside(on_ready=ready.append, on_failure=failed.append)
    assert thread is not None and assistant.compiling and not assistant.runtime.compile
    during = [assistant.say(prompt, **kw)]
    while thread.is_alive() and len(during) < 50:
        during.append(assistant.say(prompt, **kw))
    thread.join(900)
    assert ready and not failed, failed
    after = assistant.say(prompt, **kw)
    steps = assistant.engine.steps
    assert steps is not plain and steps.compile and assistant.runtime.compile is True
    assert not assistant.compiling
    for reply in during:  # the plain steps', while the compiler ran beside them
        assert reply.text_ids == before.text_ids and reply.codes == before.codes
        np.testing.assert_array_equal(reply.audio, before.audio)
    assert after.text_ids == before.text_ids and after.codes == before.codes
    # The audio is what a model compiled before its first reply gives (the compiled vocoder's sums are
    # ordered otherwise than the plain one's: near it, not equal).
    from omni_cli.config import RuntimeOptions

    compiled = Assistant.load(path, runtime=RuntimeOptions(device="cuda", dtype="float32", compile=True))
    assert compiled.engine.steps.compile
    np.testing.assert_allclose(after.audio, compiled.say(prompt, **kw).audio, rtol=0, atol=1e-6)
    print(f"{family}: {len(during)} replies while compiling, ready after {ready[0]:.1f} s; compiled audio "
          f"vs plain: max {np.abs(after.audio - before.audio).max():.2e}")


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_no_graphs_means_no_cuda_graph_anywhere_in_a_reply(family, monkeypatch):
    """RuntimeOptions(graphs=False) (`--no-graphs`) reaches every capture: loading (warm-up included) and a
    spoken reply capture no CUDA graph at all, the Qwen2.5-Omni vocoder's windows and Qwen3-Omni's code2wav
    included (the vocoder once asked for graphs itself and captured its windows during replies)."""
    import qwen3_reference as ref

    import omni_cli
    from omni_cli.loader import TINY_MODEL_DIR

    captures = []
    begin = torch.cuda.CUDAGraph.capture_begin

    def counted(self, *args, **kwargs):
        captures.append(self)
        return begin(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counted)
    path, voice = (str(TINY_MODEL_DIR), "Chelsie") if family == "qwen2.5" else (str(ref.ASSET), "Ethan")
    assistant = omni_cli.load(path, runtime=RuntimeOptions(device="cuda", graphs=False))
    assert assistant.runtime.graphs is False and assistant.runtime.device.startswith("cuda")
    for seed in (0, 1):  # the second reply: lazily captured windows would come in the first
        reply = assistant.say("Hello there, how are you today?", voice=voice, seed=seed, max_text_tokens=16,
                              max_codes=120)
        assert reply.codes and len(reply.audio) > 0
    assert captures == []
    # The control: with graphs, the same load captures.
    omni_cli.load(path, runtime=RuntimeOptions(device="cuda"))
    assert captures


# |kept - fresh| on CUDA, float32 without TF32: the same math over other row counts, whose kernels may
# split their sums differently than the CPU's (tests/test_context.py states the CPU's bound, 2e-5).
GPU_CACHE_BOUND = 1e-4


@pytest.mark.parametrize("asset", ["assets/tiny-qwen2.5-omni", "assets/tiny-qwen3-omni"])
def test_the_kept_cache_equals_a_fresh_prefill_on_cuda(asset):
    """The conversation issue's check of the kept context on the GPU: the second prompt's cache over the
    first prompt's kept positions, and its outputs, equal a fresh prefill's (graphs on, as replies run)."""
    import omni_cli
    from test_context import kept_against_fresh

    model = omni_cli.load(asset, device="cuda", dtype="float32")
    worst = kept_against_fresh(model)
    print(f"kept vs fresh on cuda, {asset}: {worst}")
    assert max(worst.values()) <= GPU_CACHE_BOUND, worst


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# bfloat16 (the prefill graphs' dtype): the graphed rest over padded rows and a masked span against the
# eager rest, the same math over other shapes. A wrong mask or slot gives errors of order 1.
SUFFIX_BOUND = 3e-2


def _prompt_graphed(asset: str, monkeypatch):
    """The tiny model on CUDA in bfloat16 with its prompt graphs (Qwen2.5-Omni's turned on: `PROMPT_GRAPHS`)."""
    import omni_cli
    from omni_cli.models import qwen2_5_omni

    monkeypatch.setattr(qwen2_5_omni, "PROMPT_GRAPHS", True)
    return omni_cli.load(asset, device="cuda", dtype="bfloat16")


@pytest.mark.parametrize("asset, stack", [("assets/tiny-qwen3-omni", "thinker"), ("assets/tiny-qwen3-omni", "talker"),
                                          ("assets/tiny-qwen2.5-omni", "thinker"), ("assets/tiny-qwen2.5-omni", "talker")])
def test_suffix_graph_replays_the_eager_rest_over_a_kept_context(asset, stack, monkeypatch):
    """A prompt's rest over the kept context, replayed from a graph captured between turns (padded to its
    bucket, the kept length a device value), equals the eager rest: rows, kept layer and cache; each
    family's thinker and talker stacks."""
    from omni_cli.runtime.decoder import forward_layers_keeping

    steps = _prompt_graphed(asset, monkeypatch).engine.steps
    part = steps.thinker if stack == "thinker" else steps.talker
    graphs, cache, keep = part.prefill_graphs, part.cache, getattr(part, "accept_layer", None)
    assert graphs is not None and graphs.buckets
    torch.manual_seed(0)
    width = part.model.layers[0].self_attn.q_proj.in_features
    prompt, rest = (torch.randn(1, n, width, device="cuda", dtype=torch.bfloat16) for n in (40, 23))
    with torch.inference_mode():
        cache.reset()
        forward_layers_keeping(part.model, prompt, cache, keep)
        eager = forward_layers_keeping(part.model, rest, cache, keep)
        rows = [t[:, :, :63].clone() for t in cache.keys + cache.values]
        cache.keep_first(40)
        graphs.wanted_rests = {32}
        assert graphs.capture_rests(kept=True) == 1 and cache.length == 40
        graphed = graphs.over_kept(rest)
    assert graphed is not None and cache.length == 63
    worst = max(_relative(b, a) for a, b in zip(eager, graphed) if a is not None)
    worst_cache = max(_relative(b[:, :, :63], a) for a, b in zip(rows, cache.keys + cache.values))
    print(f"{asset} {stack}: suffix graph vs eager: rows {worst:.2e}, cache {worst_cache:.2e}")
    assert worst <= SUFFIX_BOUND and worst_cache <= SUFFIX_BOUND, (worst, worst_cache)


@pytest.mark.parametrize("asset", ["assets/tiny-qwen3-omni", "assets/tiny-qwen2.5-omni"])
def test_conversation_replays_its_rests_from_graphs_captured_between_turns(asset, monkeypatch):
    """Through the API (bfloat16, graphs): the second turn's rest (under 32 rows) has no graph of its own
    bucket yet and replays the 64-row one captured ahead from the first turn on, padded, making its bucket
    wanted; the engine's capture ahead captures it, and the third turn's rest replays that; the talker's
    too."""
    model = _prompt_graphed(asset, monkeypatch)
    graphs, talker = model.engine.steps.thinker.prefill_graphs, model.engine.steps.talker.prefill_graphs
    sizes, talker_sizes = [], []
    replay, talker_replay = graphs._replay, talker._replay
    monkeypatch.setattr(graphs, "_replay", lambda entry, embeds, size: _noted(sizes, size, replay(entry, embeds, size)))
    monkeypatch.setattr(talker, "_replay",
                        lambda entry, embeds, size: _noted(talker_sizes, size, talker_replay(entry, embeds, size)))
    chat = model.conversation()
    kept = []
    for text in ("Hello there.", "Tell me more.", "And then?"):
        kept.append(chat.say(text, greedy=True, seed=0, max_text_tokens=6, max_codes=8).stats["talker_kept_rows"])
        model.engine.settle()
    # Turn 1 replays a prompt bucket from an empty cache (64: the template and the turn), turns 2 and 3 a
    # rest: 64 padded, then 32 once captured. The talker's rest (Qwen3: the new user turn and its 9 opener
    # rows; Qwen2.5: the thinker's rest and its 2 rows) comes after the rows it kept.
    assert sizes[1:] == [64, 32] and (32, 512) in graphs.rest_graphs, (sizes, list(graphs.rest_graphs))
    assert talker_sizes[1:] == [64, 32] and kept[0] == 0 and 0 < kept[1] < kept[2], (talker_sizes, kept)


@pytest.mark.parametrize("stack", ["thinker", "talker"])
def test_qwen25_prompt_graph_equals_the_eager_prompt(stack, monkeypatch):
    """Qwen2.5-Omni's prompt from an empty cache, replayed from the warm-up's graph of its bucket (padded
    to 64 rows), equals the eager prefill: rows and cache, to bfloat16's rounding of other row counts."""
    from omni_cli.runtime.decoder import forward_layers_keeping

    steps = _prompt_graphed("assets/tiny-qwen2.5-omni", monkeypatch).engine.steps
    part = steps.thinker if stack == "thinker" else steps.talker
    graphs, cache = part.prefill_graphs, part.cache
    assert graphs is not None and 64 in graphs.graphs  # captured in the warm-up
    torch.manual_seed(0)
    prompt = torch.randn(1, 40, part.model.layers[0].self_attn.q_proj.in_features, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        cache.reset()
        eager, _ = forward_layers_keeping(part.model, prompt, cache, None)
        rows = [t[:, :, :40].clone() for t in cache.keys + cache.values]
        graphed, _ = graphs(prompt)
    assert cache.length == 40
    worst = _relative(graphed, eager)
    worst_cache = max(_relative(b[:, :, :40], a) for a, b in zip(rows, cache.keys + cache.values))
    print(f"qwen2.5 {stack}: prompt graph vs eager: rows {worst:.2e}, cache {worst_cache:.2e}")
    assert worst <= SUFFIX_BOUND and worst_cache <= SUFFIX_BOUND, (worst, worst_cache)


def _noted(seen: list, what, out):
    seen.append(what)
    return out


def test_qwen3_long_prompt_replays_a_graph_captured_between_turns():
    """A prompt over the warm-up's buckets (512 rows) runs eagerly once and makes its length wanted; the
    capture between turns makes its graph (not over a thinker's kept context; over the talker's kept rows,
    which it puts back exactly), which the next such prompt replays: the same rows and cache as the eager
    prefill, within bfloat16's rounding of other row counts. The graph takes cuDNN's attention
    (prompt_ops.cudnn_attention), so the eager prefill it is held to does too; an eager prompt outside that
    block keeps flash's."""
    import omni_cli

    from omni_cli.runtime import prompt_ops

    model = omni_cli.load("assets/tiny-qwen3-omni", device="cuda", dtype="bfloat16")
    thinker = model.engine.steps.thinker
    graphs, cache = thinker.prefill_graphs, thinker.cache
    assert cache.max_len >= 2048, cache.max_len
    cudnn_calls = []
    real_cudnn = prompt_ops._cudnn_sdpa

    def cudnn_spy(*args):
        cudnn_calls.append(args[0].shape[2])
        return real_cudnn(*args)

    prompt_ops._cudnn_sdpa = cudnn_spy  # put back below
    torch.manual_seed(0)
    prompt = torch.randn(1, 700, thinker.embed_tokens.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    try:
        with torch.inference_mode():
            eager_flash = graphs(prompt)  # no graph of its length yet
            assert cudnn_calls == []  # an eager prompt keeps flash attention: cuDNN would build a plan
            with prompt_ops.cudnn_attention():  # the graph's attention kernel, to compare like with like
                eager = graphs(prompt)
            rows = [t[:, :, :700].clone() for t in cache.keys + cache.values]
            assert graphs.wanted_long == {1024} and 1024 not in graphs.graphs
            graphs.wanted_rests = set()
            graphs.capture_rests(kept=True)
            assert 1024 not in graphs.graphs  # a thinker's kept context is not copied aside for it
            assert graphs.capture_rests(kept=True, long_over_kept=True) == 1 and 1024 in graphs.graphs
            assert cache.length == 700 and all(torch.equal(a, b[:, :, :700]) for a, b in zip(rows, cache.keys + cache.values))
            graphed = graphs(prompt)
    finally:
        prompt_ops._cudnn_sdpa = real_cudnn
    layers = len(thinker.model.layers)
    # The eager forward in the block, then the capture's two warm-up forwards and its own: cuDNN's (where
    # this GPU has the kernel; elsewhere flash's throughout).
    has = prompt_ops._cudnn_attention_exists(torch.device("cuda", torch.cuda.current_device()))
    assert cudnn_calls == ([700] * layers + [1024] * (3 * layers) if has else []), cudnn_calls
    assert cache.length == 700
    worst = max(_relative(b, a) for a, b in zip(eager, graphed))
    worst_cache = max(_relative(b[:, :, :700], a) for a, b in zip(rows, cache.keys + cache.values))
    flash = max(_relative(b, a) for a, b in zip(eager_flash, eager))
    print(f"long prompt graph vs eager: rows {worst:.2e}, cache {worst_cache:.2e}; cuDNN vs flash {flash:.2e}")
    assert worst <= SUFFIX_BOUND and worst_cache <= SUFFIX_BOUND, (worst, worst_cache)


@pytest.mark.parametrize("rows", [64, 1024, 2560])
def test_cudnn_attention_on_cache_slices_is_flashs(rows):
    """`prompt_ops._cudnn_sdpa` on what a prompt's layers pass it (keys and values the first rows of the
    static cache: strided; 32 query heads over 4 key heads, 128 wide, bfloat16) against SDPA's flash
    kernel on the same tensors: bfloat16's rounding apart."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from omni_cli.runtime import prompt_ops

    if not prompt_ops._cudnn_attention_exists(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("this GPU or cuDNN has no fused attention (the prompts keep flash's)")
    g = torch.Generator(device="cuda").manual_seed(rows)
    q = torch.randn(1, 32, rows, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    buffer = torch.randn(2, 1, 4, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = buffer[0][:, :, :rows], buffer[1][:, :, :rows]
    assert not k.is_contiguous()
    got = prompt_ops._cudnn_sdpa(q, k, v, 128 ** -0.5)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=128 ** -0.5,
                                                                enable_gqa=True)
    worst = float((got.float() - want.float()).abs().max())
    print(f"cuDNN vs flash, {rows} rows: max abs {worst:.2e}")
    assert got.shape == want.shape and worst <= 2e-2


@pytest.mark.parametrize("asset", ["assets/tiny-qwen2.5-omni", "assets/tiny-qwen3-omni"])
def test_the_audio_encoder_runs_without_cudnn_attention(asset, monkeypatch):
    """cuDNN keeps its attention plans per host thread and each turn's engine thread is new: a turn's
    encoder call under cuDNN built them all again (60-180 ms a 5 s clip at true size, against 18-20)."""
    import omni_cli
    from omni_cli.media import AudioClip
    from test_media_input import tone

    from omni_cli.runtime import compat

    model = omni_cli.load(asset, device="cuda", dtype="bfloat16")
    prepare, seen = compat.audio_encoder, []

    def spied(*args, **kwargs):
        encode = prepare(*args, **kwargs)

        def encoding():
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return encode()

        return encoding

    monkeypatch.setattr(compat, "audio_encoder", spied)
    from omni_cli.runtime import audio_graphs

    monkeypatch.setattr(audio_graphs, "ENABLED", False)  # the library's call, not a graph a pause made
    before = torch.backends.cuda.cudnn_sdp_enabled()
    model.say("Listen.", audio=[AudioClip(tone(0.9, 16_000, 500.0, 7), 16_000)], greedy=True, max_text_tokens=2,
              max_codes=4)
    assert seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # only for the call: the process's setting is back


@pytest.mark.parametrize("asset", ["assets/tiny-qwen2.5-omni", "assets/tiny-qwen3-omni"])
def test_the_audio_encoder_reads_nothing_back_from_the_device(asset):
    """`compat.audio_encoder` (made and called) on two clips under sync debug "error": no host synchronisation (the
    library's call made three: the clips' boolean mask, the chunking by device lengths, and Qwen2.5-Omni's
    output-length check, after which the prefill waited for the encoder), and its features equal the
    library's."""
    import numpy as np

    import omni_cli
    from omni_cli.runtime import compat

    thinker = omni_cli.load(asset, device="cuda", dtype="bfloat16").loaded.model.thinker
    frames = [130, 357]
    features = torch.tensor(np.random.default_rng(0).standard_normal((2, 128, 357)), dtype=torch.bfloat16)
    mask = torch.zeros(2, 357, dtype=torch.long)
    for i, n in enumerate(frames):
        mask[i, :n] = 1
    features = features.cuda()
    with torch.inference_mode():
        library = thinker.get_audio_features(features, mask.cuda(), return_dict=True).last_hidden_state
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ours = compat.audio_encoder(thinker, features, mask, torch.device("cuda"))()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(ours, library)


def _audio_tower(family: str, size: str, dtype):
    """The audio tower alone: the tiny asset's or at the preset's true size (random weights)."""
    if family == "qwen3":
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

        from omni_cli.models.qwen3_omni import presets
        encoder, preset, asset = m.Qwen3OmniMoeAudioEncoder, "qwen3-omni-30b-a3b", "assets/tiny-qwen3-omni"
    else:
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m

        from omni_cli.models.qwen2_5_omni import presets
        encoder, preset, asset = m.Qwen2_5OmniAudioEncoder, "qwen2.5-omni-7b", "assets/tiny-qwen2.5-omni"
    if size == "true":
        config = presets.build_config(preset).thinker_config.audio_config
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(asset).thinker_config.audio_config
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        return encoder(config).to(dtype).eval()


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
@pytest.mark.parametrize("size", ["tiny", "true"])
def test_the_audio_tower_as_graphs_equals_the_librarys_call(family, size, monkeypatch):
    """runtime/audio_graphs.py: the tower replayed from its graph per chunk count gives the library's
    output for clips of many lengths (one and several clips, a partial last chunk, more than one attention
    window), twice over, without a host sync; a bucket with no graph says None and is captured between
    turns. float32 within 1e-5 of the values' scale; bfloat16 about as far from the float32 tower as the
    library's own bfloat16 call."""
    from omni_cli.runtime import audio_graphs, compat

    monkeypatch.setattr(audio_graphs, "ENABLED", True)
    dtype = torch.float32 if size == "tiny" else torch.bfloat16
    tower = _audio_tower(family, size, dtype)
    exact = copy.deepcopy(tower).float() if dtype != torch.float32 else None  # the bf16 calls' reference
    assert audio_graphs.TowerGraphs.of(tower) is None
    assert audio_graphs.TowerGraphs.made_for(tower).capture_ahead(most=6) == 6  # buckets 1..6
    assert sorted(audio_graphs.TowerGraphs.of(tower).by_chunks) == [1, 2, 3, 4, 5, 6]
    rng = np.random.default_rng(0)
    cases = [[57], [100], [130, 357, 41], [500], [1000, 20]]  # 1000 frames: past one 800-frame window
    worst = own = 0.0
    for frames in cases * 2:
        features = torch.tensor(rng.standard_normal((len(frames), 128, max(frames))), dtype=dtype).cuda()
        mask = torch.zeros(len(frames), max(frames), dtype=torch.long)
        for i, n in enumerate(frames):
            mask[i, :n] = 1
        chunks = sum(-(-n // (2 * tower.n_window)) for n in frames)
        with torch.inference_mode():
            library = compat.audio_encoder(_AsThinker(tower), features, mask, torch.device("cuda"))()
            call = audio_graphs.replay_call(tower, features, mask)
            if chunks not in audio_graphs.TowerGraphs.of(tower).by_chunks:
                assert call is None and chunks in audio_graphs.TowerGraphs.of(tower).wanted
                assert audio_graphs.TowerGraphs.of(tower).capture_ahead(most=1) == 1  # the wanted one first
                call = audio_graphs.replay_call(tower, features, mask)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                ours = call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert ours.shape == library.shape
        if exact is None:
            worst = max(worst, ((ours - library).abs().max() / library.abs().max()).item())
            continue
        with torch.inference_mode():  # bf16: each call against the float32 tower, not against each other
            ref = compat.audio_encoder(_AsThinker(exact), features.float(), mask, torch.device("cuda"))()
        scale = ref.abs().max()
        worst = max(worst, ((ours.float() - ref).abs().max() / scale).item())
        own = max(own, ((library.float() - ref).abs().max() / scale).item())
    print(f"audio tower graphs vs library ({family}, {size}): {worst:.2e} of the largest value"
          + (f" (bf16 against float32; the library's own bf16 call: {own:.2e})" if exact is not None else ""))
    # float32: the same sums in another order; bf16: no further from the float32 tower than the library's
    # own bf16 call is, give or take a quarter (H100: 1.34e-2 vs 1.38e-2 for Qwen2.5-Omni's, 1.72e-2 vs
    # 1.73e-2 for Qwen3-Omni's)
    assert worst <= (1e-5 if exact is None else 1.25 * own), (worst, own)


class _AsThinker(torch.nn.Module):
    """A thinker stand-in holding `tower` where `compat.audio_tower` looks for it."""

    def __init__(self, tower) -> None:
        super().__init__()
        self.audio_tower = tower

    def get_audio_features(self, *args, **kwargs):
        raise AssertionError("compat.audio_encoder should call the tower directly")


@pytest.mark.parametrize("asset", ["assets/tiny-qwen2.5-omni", "assets/tiny-qwen3-omni"])
def test_a_spoken_reply_with_the_audio_tower_graphs_is_the_one_without(asset, monkeypatch):
    """No tower graphs after the warm-up; the pause after a spoken turn makes some (its clip's bucket
    among them) and the same turn again replays one: greedy text and codes equal the first's, which took
    the library's call (float32)."""
    import omni_cli
    from omni_cli.media import AudioClip
    from omni_cli.runtime import audio_graphs
    from test_media_input import tone

    monkeypatch.setattr(audio_graphs, "ENABLED", True)
    model = omni_cli.load(asset, device="cuda", dtype="float32")
    tower = _compat_tower(model)
    assert audio_graphs.TowerGraphs.of(tower) is None
    replays = []
    monkeypatch.setattr(audio_graphs.TowerGraph, "__call__",
                        lambda self, layout, call=audio_graphs.TowerGraph.__call__: replays.append(1) or call(self, layout))
    clip = AudioClip(tone(3.3, 16_000, 500.0, 7), 16_000)
    replies = []
    for _ in range(2):
        r = model.say("Listen.", audio=[clip], greedy=True, max_text_tokens=6, max_codes=40)
        replies.append((r.text_ids, r.codes))
        model.engine.settle()  # the pause's capture ahead
        model.engine.steps.thinker.context.clear()  # else the same prompt again finds its clip's outputs kept
        assert len(audio_graphs.TowerGraphs.of(tower).by_chunks) >= audio_graphs.PER_PAUSE
    assert replays == [1] and replies[0] == replies[1]


def _compat_tower(model):
    from omni_cli.runtime import compat

    return compat.audio_tower(model.loaded.model.thinker)


@pytest.mark.parametrize("asset", ["assets/tiny-qwen2.5-omni", "assets/tiny-qwen3-omni"])
def test_the_vision_tower_waits_in_host_memory_until_the_first_image(asset, tmp_path):
    """runtime/vision_place.py on CUDA. However the model came (a float folder read onto the device, packed
    at load, an omni-quantize folder, a random preset), its vision tower is in host memory; the first image
    brings it, and that reply equals the one of the same checkpoint with the tower on the device from the
    start (greedy text and codes)."""
    import omni_cli
    from omni_cli.config import QuantizeOptions, RuntimeOptions
    from omni_cli.models.random_packed import build
    from omni_cli.quant.writing import quantize_folder
    from omni_cli.runtime import vision_place
    from test_media_input import picture

    def where(model) -> set:
        return {t.device.type for t in list(vision_place.tower(model).parameters())}

    ask = dict(images=[picture(90, 120)], greedy=True, seed=0, max_text_tokens=8, max_codes=30)
    lazy = omni_cli.load(asset, device="cuda", dtype="float32")
    assert where(lazy.loaded.model) == {"cpu"} and lazy.memory["host"] > 0
    first = lazy.say("What is in this picture?", **ask)
    assert where(lazy.loaded.model) == {"cuda"} and lazy.memory["host"] == 0
    eager = omni_cli.load(asset, device="cuda", dtype="float32")
    vision_place.tower(eager.loaded.model).cuda()
    second = eager.say("What is in this picture?", **ask)
    assert (first.text_ids, first.codes) == (second.text_ids, second.codes) and first.codes

    quantize_folder(asset, tmp_path / "int4", QuantizeOptions(group_size=16, device="cpu"))
    packed = [omni_cli.load(asset, runtime=RuntimeOptions(device="cuda", dtype="float32", quantize="int4",
                                                          group_size=16)),
              omni_cli.load(str(tmp_path / "int4"), device="cuda", dtype="float32")]
    for model in packed:
        assert where(model.loaded.model) == {"cpu"}
        assert model.say("What is in this picture?", **ask).codes
        assert where(model.loaded.model) == {"cuda"}
    # A capture ahead still running on another thread holds the default CUDA generator in capture mode, and
    # the preset's random initialisation draws from it: wait for them first (a process loads one model).
    for model in (lazy, eager, *packed):
        model.engine.settle()
    config = type(lazy.loaded.model.config).from_pretrained(asset)
    preset = build(lambda: type(lazy.loaded.model)._from_config(config, dtype=torch.float32), torch.device("cuda"),
                   torch.float32, "int4", 16, lambda message: None)
    assert where(preset) == {"cpu"}
    assert {p.device.type for p in preset.thinker.lm_head.parameters()} == {"cuda"}
