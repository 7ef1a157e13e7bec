"""Our Qwen3-Omni steps (models/qwen3_omni/thinker.py, talker.py) against transformers' own `generate`:
greedy text ids and all 16 codebooks of every frame identical, on the committed tiny model and two more
configs, every voice, a second turn, replies ending by EOS and by length; and the sampled path is
seeded and in range.

The driver follows the runtime's schedule: thinker prefill -> token 0; thinker step j feeds token j-1
(its text entry R[j-1]) and samples token j; talker step k is fed R[k], the text-EOS entry at the index
of the text's last token (its EOS, or the last one when it stops by length: never fed, never spoken),
then text-pad. The speech ends at a stop code (that frame dropped) or after `frames` frames.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qwen3_reference as ref  # noqa: E402  (tests/ is on sys.path: pytest inserts a test file's folder)

from omni_cli.config import SamplingOptions  # noqa: E402
from omni_cli.runtime.kv_cache import StaticKVCache  # noqa: E402
from omni_cli.runtime.sampling import select  # noqa: E402

GREEDY = SamplingOptions(do_sample=False)
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


def run_steps(model, ids: list[int], *, voice: str, frames: int, text_tokens: int, sample: bool = False,
              generator: torch.Generator | None = None):
    """Our steps on the runtime's schedule: (reply ids, frames [F, 16])."""
    from omni_cli.models.qwen3_omni.talker import Talker
    from omni_cli.models.qwen3_omni.thinker import Thinker

    cfg = model.config
    cpu, f32 = torch.device("cpu"), torch.float32
    thinker = Thinker(
        model.thinker,
        StaticKVCache.for_config(cfg.thinker_config.text_config, len(ids) + text_tokens, device=cpu, dtype=f32),
        accept_hidden_layer=cfg.talker_config.accept_hidden_layer,
    )
    users = len(ids)  # the talker prompt holds at most every prompt position (user turns) + 9
    talker = Talker(
        model,
        StaticKVCache.for_config(cfg.talker_config.text_config, users + 9 + frames, device=cpu, dtype=f32),
        StaticKVCache.for_config(cfg.talker_config.code_predictor_config, 16, device=cpu, dtype=f32),
    )
    talker_opts, predictor_opts = Talker.default_sampling()
    if not sample:
        talker_opts, predictor_opts = talker_opts.greedy(), predictor_opts.greedy()
    eos = ref.im_end()
    with torch.inference_mode():
        prompt = thinker.prefill(torch.tensor([ids]))
        toks = [select(prompt.logits, GREEDY)]
        replies = []  # R[k]
        while toks[-1].item() != eos and len(toks) < text_tokens:
            out = thinker.decode_one(toks[-1])
            replies.append(talker.reply_vector(out))
            toks.append(select(out.logits, GREEDY))
        end = len(toks) - 1  # index of the EOS, or of the last token when stopped by length

        def entry(k: int) -> torch.Tensor:
            return replies[k] if k < end else talker.text_eos_vec if k == end else talker.text_pad_vec

        talker.begin(ids, voice, talker_opts, predictor_opts, generator)
        codes = []
        frame = talker.prefill(prompt, replies[0] if end > 0 else talker.text_eos_vec)
        while int(frame[0]) not in talker.stop_codes:
            codes.append(frame)
            if len(codes) == frames:
                break
            frame = talker.step(frame, entry(len(codes)))
    stacked = torch.stack(codes) if codes else torch.zeros(0, 16, dtype=torch.long)
    return [int(t) for t in toks], stacked


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


def _same_inputs(ours: list, theirs: list) -> None:
    # The reference runs one talker forward more than we do (it samples the codebook 0 of a frame it never
    # completes); where we stop at a stop code, we run one code predictor more (that frame is dropped).
    n = min(len(ours), len(theirs))
    assert n >= len(ours) - 15 and n >= len(theirs) - 1
    for i in range(n):
        assert torch.equal(ours[i], theirs[i]), f"input {i} differs (shape {tuple(ours[i].shape)})"


def assert_same(model, ids, *, voice="Ethan", frames=12, text_tokens=8):
    """Text, frames, and every talker / code predictor layer input bit-identical to the reference's."""
    with _Inputs(model) as theirs:
        want_text, want_codes = ref.reference_generate(model, ids, voice=voice, frames=frames, text_tokens=text_tokens)
    with _Inputs(model) as ours:
        got_text, got_codes = run_steps(model, ids, voice=voice, frames=frames, text_tokens=text_tokens)
    assert got_text == want_text
    assert got_codes.shape == want_codes.shape, (got_codes.shape, want_codes.shape)
    mismatches = int((got_codes != want_codes).sum())
    assert mismatches == 0, f"{mismatches} of {want_codes.numel()} codes differ"
    # Stronger than equal picks (tiny margins may hide a rounding difference): equal float inputs.
    _same_inputs(ours.talker, theirs.talker)
    _same_inputs(ours.predictor, theirs.predictor)
    return want_text, want_codes


def _user(text: str) -> list[int]:
    return ref.prompt_ids([{"role": "user", "content": text}])


@pytest.mark.parametrize("voice", ["chelsie", "ethan", "aiden"])
def test_tiny_every_voice(voice):
    # The system turn is in the thinker's prompt but not the talker's. 8 text tokens, 12 frames: the text
    # stops by length, so the talker is fed R[0..6], text-EOS at 7 (token 7 is never spoken), then pad.
    text, codes = assert_same(ref.model("tiny"), ref.prompt_ids(HELLO), voice=voice, frames=12, text_tokens=8)
    assert len(text) == 8 and text[-1] != ref.im_end() and codes.shape == (12, 16)


def test_tiny_voices_differ():
    ids = ref.prompt_ids(HELLO)
    frames = [run_steps(ref.model("tiny"), ids, voice=v, frames=4, text_tokens=4)[1]
              for v in ("Chelsie", "Ethan", "Aiden")]
    assert not torch.equal(frames[0], frames[1]) and not torch.equal(frames[1], frames[2])


def test_tiny_reply_ends_by_eos():
    text, codes = assert_same(ref.model("tiny"), _user("Ok"), frames=12, text_tokens=20)
    assert text[-1] == ref.im_end() and len(text) < 12 and codes.shape == (12, 16)  # speech runs past the text


def test_tiny_second_turn():
    """An earlier user + assistant exchange: the talker prompt keeps both user turns, drops the rest."""
    messages = HELLO + [
        {"role": "assistant", "content": "Hi! What would you like to hear?"},
        {"role": "user", "content": "Ok"},
    ]
    assert_same(ref.model("tiny"), ref.prompt_ids(messages), voice="chelsie", frames=12, text_tokens=10)


def test_tiny_speech_ends_by_stop_code():
    _, codes = assert_same(ref.model("tiny"), _user("Please play some quiet music."), frames=12, text_tokens=24)
    assert 1 <= codes.shape[0] < 12


@pytest.mark.parametrize(
    "name, prompt, text_tokens, frames, by_eos",
    [
        ("wide", "Thanks", 20, 16, True),
        ("wide", "What time is it?", 6, 10, False),
        ("deep", "Thanks", 20, 8, True),
        ("deep", "Hi", 7, 10, False),
    ],
)
def test_other_configs(name, prompt, text_tokens, frames, by_eos):
    """Other widths, depths and expert counts (shared expert in every talker layer), other seeds."""
    text, codes = assert_same(ref.model(name), _user(prompt), voice="aiden", frames=frames, text_tokens=text_tokens)
    assert (text[-1] == ref.im_end()) == by_eos
    assert len(text) < codes.shape[0]  # the talker was fed text-EOS and text-pad too


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

    model = ref.model("tiny")
    ids = ref.prompt_ids(HELLO)

    def sampled(seed: int):
        gen = torch.Generator().manual_seed(seed)
        return run_steps(model, ids, voice="ethan", frames=10, text_tokens=6, sample=True, generator=gen)[1]

    first, again, other = sampled(3), sampled(3), sampled(4)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    greedy = run_steps(model, ids, voice="ethan", frames=10, text_tokens=6)[1]
    assert not torch.equal(first, greedy)
    for codes in (first, other):
        assert codes.shape[1] == 16 and codes.dtype == torch.long
        assert torch.all((codes >= 0) & (codes < Talker.audio_limit))  # stop frames are dropped by the driver
    talker_opts, predictor_opts = Talker.default_sampling()
    assert (talker_opts.temperature, talker_opts.top_k, talker_opts.top_p, talker_opts.repetition_penalty) == (
        0.9, 50, 1.0, 1.05)
    assert (predictor_opts.temperature, predictor_opts.top_k, predictor_opts.top_p) == (1.0, 50, 0.8)
