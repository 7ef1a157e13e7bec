"""Qwen3-Omni steps (models/qwen3_omni/thinker.py, talker.py, steps.py) checked where the reply alone cannot
show it: the float inputs of the talker's and the code predictor's first layer bit-identical to what
transformers' `generate` feeds them (equal picks may hide a rounding difference behind a wide margin),
the thinker prefill's `accepted` state, seeded sampling and its defaults, voices that change the speech.

The steps run through the runtime (`Engine(Qwen3Steps(...))` + `TurnRequest`), never a schedule of the
test's own. Greedy text / 16-codebook parity with `generate` through the `Assistant` (every voice, three
models, EOS and length endings, a second turn, the streamed audio) is test_qwen3_parity.py's.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qwen3_reference as ref  # noqa: E402  (tests/ is on sys.path: pytest inserts a test file's folder)

from omni_cli.config import RuntimeOptions, SamplingOptions  # noqa: E402
from omni_cli.runtime.kv_cache import StaticKVCache  # noqa: E402

GREEDY = SamplingOptions(do_sample=False)
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


def engine_for(model, max_codes: int = 32, fast_decode: bool = True):
    """The runtime's engine over our steps for `model` (the tiny tokenizer; <|im_end|> ends the text).
    `fast_decode=False`: every step through the library's layers (the fused steps bypass them)."""
    from omni_cli.models.qwen3_omni.steps import Qwen3Steps
    from omni_cli.runtime.engine import Engine

    voices = {str(n).capitalize(): int(i) for n, i in model.config.talker_config.speaker_id.items()}
    steps = Qwen3Steps(model, voices, RuntimeOptions(max_context=256, max_codes=max_codes), fast_decode=fast_decode)
    return Engine(steps, ref.tokenizer(), eos_ids=[ref.im_end()])


def run(engine, ids: list[int], *, voice: str, frames: int, text_tokens: int, talker: SamplingOptions | None = None,
        seed: int = 0, thinker: SamplingOptions = GREEDY):
    """One turn through the runtime: the Reply (text_ids, codes as 16-id frames, audio, stats)."""
    from omni_cli.models.qwen3_omni.talker import Talker
    from omni_cli.runtime.events import Done, TurnRequest

    talker = talker or Talker.default_sampling()[0].greedy()
    req = TurnRequest(input_ids=list(ids), voice=voice, thinker=thinker, talker=talker, max_text_tokens=text_tokens,
                      max_codes=frames, seed=seed)
    done = [e for e in engine.stream(req) if isinstance(e, Done)]
    return done[0].reply


class _Inputs:
    """Every input of the talker's and the code predictor's first layer, in call order (prompt, steps)."""

    def __init__(self, model):
        self.talker, self.predictor = [], []
        layers = ((model.talker.model.layers[0], self.talker),
                  (model.talker.code_predictor.model.layers[0], self.predictor))
        self.hooks = [layer.register_forward_pre_hook(lambda _m, args, seen=seen: seen.append(args[0].clone()))
                      for layer, seen in layers]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()


def _same_inputs(ours: list, theirs: list, missing: int) -> None:
    """Every input both made is bit-identical, and ours cover all of the reference's but `missing`.

    The reference runs one talker forward more than we do when the speech stops by length (the codebook 0
    of a frame it never completes). We may run more: the code predictor on a stop frame (the reference
    stops first), and steps the runtime issued before the host saw the stop (their frames are discarded)."""
    n = min(len(ours), len(theirs))
    assert n >= len(theirs) - missing, (len(ours), len(theirs))
    for i in range(n):
        assert torch.equal(ours[i], theirs[i]), f"input {i} differs (shape {tuple(ours[i].shape)})"


@pytest.mark.parametrize(
    "name, messages, voice, text_tokens, frames",
    [
        # The system turn is in the thinker's prompt only; 8 tokens by length: R[0..6], text-EOS, then pad.
        ("tiny", HELLO, "Chelsie", 8, 12),
        ("tiny", [{"role": "user", "content": "Please play some quiet music."}], "Ethan", 24, 12),  # codec EOS
        ("wide", [{"role": "user", "content": "Thanks"}], "Aiden", 20, 16),  # text EOS
        ("deep", [{"role": "user", "content": "Hi"}], "Aiden", 7, 10),
    ],
    ids=["tiny-length", "tiny-stop-code", "wide-eos", "deep-length"],
)
def test_talker_and_code_predictor_inputs_are_the_references(name, messages, voice, text_tokens, frames):
    model = ref.model(name)
    ids = ref.prompt_ids(messages)
    engine = engine_for(model, fast_decode=False)  # the layers' inputs: the library's path
    with _Inputs(model) as theirs:
        ref.reference_generate(model, ids, voice=voice, frames=frames, text_tokens=text_tokens)
    with _Inputs(model) as ours:
        reply = run(engine, ids, voice=voice, frames=frames, text_tokens=text_tokens)
    assert len(reply.codes) >= 1
    # The prompt (user turns + 9 positions) at once, then one position a frame.
    assert ours.talker[0].shape[1] > 9 and all(x.shape[1] == 1 for x in ours.talker[1:])
    _same_inputs(ours.talker, theirs.talker, missing=1)
    _same_inputs(ours.predictor, theirs.predictor, missing=0)  # 15 calls a frame: 2 prefill rows, then 14 of one


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_steps_sample_what_the_library_layers_sample(seed):
    """The fused steps (fast decode: what CUDA graphs replay) and the library's layers draw the same
    seeded picks, thinker and all 16 codebooks, with the reference's sampling settings: both paths read
    one buffer of randomness per frame, and their logits differ only in the last bits."""
    from omni_cli.models.qwen3_omni.talker import Talker

    model = ref.model("tiny")
    ids = ref.prompt_ids(HELLO)
    sampled = SamplingOptions(do_sample=True, temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.05)
    replies = []
    for fast in (True, False):
        engine = engine_for(model, fast_decode=fast)
        req_talker = Talker.default_sampling()[0]
        replies.append(run(engine, ids, voice="Ethan", frames=12, text_tokens=8, talker=req_talker, seed=seed,
                           thinker=sampled))
    assert replies[0].text_ids == replies[1].text_ids
    assert replies[0].codes == replies[1].codes and len(replies[0].codes) >= 4


def test_talker_step_k_follows_thinker_step_k():
    """R[k] is the projected embedding of token k: talker step k runs as soon as token k is sampled (the
    talker prompt right after the thinker's prefill), not after the thinker step that feeds token k. The
    first audio's 4 frames then wait for 3 thinker steps, not 4."""
    engine = engine_for(ref.model("tiny"))
    steps, order = engine.steps, []
    decode_one, talker_turn = steps.decode_one, steps.talker_turn

    def logged_turn(*args, **kwargs):
        turn = talker_turn(*args, **kwargs)
        prefill, step = turn.prefill, turn.step
        turn.prefill = lambda *a: (order.append("talker"), prefill(*a))[1]
        turn.step = lambda *a: (order.append("talker"), step(*a))[1]
        return turn

    steps.decode_one = lambda token: (order.append("thinker"), decode_one(token))[1]
    steps.talker_turn = logged_turn
    reply = run(engine, ref.prompt_ids(HELLO), voice="Ethan", frames=6, text_tokens=8)
    assert len(reply.codes) >= 4
    assert order[:6] == ["talker", "thinker"] * 3


def test_voices_differ():
    engine = engine_for(ref.model("tiny"))
    ids = ref.prompt_ids(HELLO)
    codes = [run(engine, ids, voice=v, frames=4, text_tokens=4).codes for v in ("Chelsie", "Ethan", "Aiden")]
    assert codes[0] != codes[1] and codes[1] != codes[2] and codes[0] != codes[2]


@pytest.mark.parametrize("name", ["tiny", "deep"])
def test_thinker_keeps_the_accepted_hidden_state(name):
    """`accepted` is the reference's hidden_states[accept_hidden_layer] (what hidden_projection reads)."""
    from omni_cli.models.qwen3_omni.thinker import Thinker

    model = ref.model(name)
    ids = torch.tensor([ref.prompt_ids(HELLO)])
    layer = model.config.talker_config.accept_hidden_layer
    cache = StaticKVCache.for_config(model.config.thinker_config.text_config, ids.shape[1], device=torch.device("cpu"),
                                     dtype=torch.float32)
    with torch.inference_mode():
        out = Thinker(model.thinker, cache, accept_hidden_layer=layer).prefill(ids)
        want = model.thinker(input_ids=ids, output_hidden_states=True, use_cache=False)
    assert torch.equal(out.accepted, want.hidden_states[layer])
    assert torch.equal(out.hidden, want.hidden_states[-1]) and torch.equal(out.embeds, want.hidden_states[0])
    assert torch.equal(out.logits, want.logits[:, -1].float())


def test_sampled_frames_are_seeded_and_in_range():
    from omni_cli.models.qwen3_omni.talker import Talker

    engine = engine_for(ref.model("tiny"))
    ids = ref.prompt_ids(HELLO)
    talker_opts, predictor_opts = Talker.default_sampling()

    def sampled(seed: int):
        return run(engine, ids, voice="Ethan", frames=10, text_tokens=6, talker=talker_opts, seed=seed).codes

    first, again, other = sampled(3), sampled(3), sampled(4)
    assert first == again
    assert first != other
    assert first != run(engine, ids, voice="Ethan", frames=10, text_tokens=6).codes  # greedy
    for codes in (first, other):
        assert codes and all(len(f) == 16 and all(0 <= c < Talker.audio_limit for c in f) for f in codes)
    assert (talker_opts.temperature, talker_opts.top_k, talker_opts.top_p, talker_opts.repetition_penalty) == (
        0.9, 50, 1.0, 1.05)
    assert (predictor_opts.temperature, predictor_opts.top_k, predictor_opts.top_p) == (1.0, 50, 0.8)
