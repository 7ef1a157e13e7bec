"""The conversation's context kept between turns (runtime/context.py): each turn prefills only what the
thinker's cache lacks, encodes only its new clips and images, and still replies as transformers'
`generate` does on that turn's whole conversation (greedy, every text id and code, both tiny families).

A conversation of five turns: text; a clip; an image; text; then, under a context made too small for
all of it, a turn that drops the oldest exchanges (the kept prefix is then the system prompt alone).
The kept cache itself equals a fresh prefill's within float32 rounding (bound below).
"""

from __future__ import annotations

import pytest
import torch

from hf_reference import reference_generate
from test_media_input import ASSET, QWEN3, assert_qwen3_reference, picture, processor, tone

# |kept - fresh| of the cache's keys and values and of the prompt's hidden states, float32: the same math
# over other row counts (a suffix's matmuls against the whole prompt's), so rounding only. Measured on
# the tiny models on a CPU (2 cores): 7e-7 (Qwen2.5-Omni), 1.1e-6 (Qwen3-Omni).
CACHE_BOUND = 2e-5


@pytest.fixture(scope="module")
def qwen25():
    import omni_cli

    return omni_cli.load(ASSET, device="cpu")


@pytest.fixture(scope="module")
def qwen3():
    import omni_cli

    return omni_cli.load(QWEN3, device="cpu")


class Spy:
    """Counts the clips and images each encoder is given, and the prompt ids each turn's engine got."""

    def __init__(self, model, monkeypatch) -> None:
        from omni_cli.runtime import compat

        self.clips, self.images, self.ids = [], [], []
        thinker = model.loaded.model.thinker
        audio, vision, stream = compat.audio_encoder, thinker.get_image_features, model.engine.stream

        def heard(module, features, *args, **kwargs):
            self.clips.append(features.shape[0])
            return audio(module, features, *args, **kwargs)

        def seen(pixels, grid, *args, **kwargs):
            self.images.append(grid.shape[0])
            return vision(pixels, grid, *args, **kwargs)

        def spied(req):
            self.ids.append(list(req.input_ids))
            return stream(req)

        monkeypatch.setattr(compat, "audio_encoder", heard)
        monkeypatch.setattr(thinker, "get_image_features", seen)
        monkeypatch.setattr(model.engine, "stream", spied)


def processor_inputs(model, path: str, cls_name: str, history, text: str, clips: list, images: list) -> dict:
    """The processor's inputs for `history` (as the turn saw it) and the pending user turn."""
    from omni_cli.prompt import user_parts

    proc = processor(path, cls_name)
    proc.image_processor = model.family.image_processor(path)
    past_clips, past_images = history.media()
    messages = history.messages(user_parts(text, len(images), len(clips)) if clips or images else text)
    rendered = proc.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    all_clips, all_images = [c.at().pcm for c in past_clips + clips], past_images + images
    return dict(proc(text=rendered, images=all_images or None, audio=all_clips or None, return_tensors="pt",
                     padding=True))


# (text, clips: (seconds, rate, hz), images: (height, width)); the last turn drops the oldest exchanges.
TURNS = [
    ("Tell me about the sea.", [], []),
    ("What is this sound?", [(1.3, 22_050, 300.0)], []),
    ("And what is in this picture?", [], [(90, 120)]),
    ("Thank you, that is all.", [], []),
    ("One more question, please.", [], []),
]
# Qwen3-Omni's talker cannot place a prompt that holds both a clip and an image (its positions ask the
# talker's config for an audio encoder it lacks: transformers' own generate fails alike), so its clip
# comes in the last turn, after the drop has taken the image's exchange away.
TURNS_QWEN3 = [TURNS[0], TURNS[2], TURNS[3], ("Tell me more.", [], []), ("What is this sound?", [(1.3, 22_050, 300.0)], [])]


def run_conversation(model, monkeypatch, path: str, cls_name: str, check, steps: int, turns=TURNS) -> list:
    """The five `turns`, each compared by `check(inputs, ids, reply)`; returns the replies' stats."""
    from omni_cli.media import AudioClip

    spy = Spy(model, monkeypatch)
    chat = model.conversation()
    stats = []
    for i, (text, clips, images) in enumerate(turns):
        clips = [AudioClip(tone(s, r, hz, i), r) for s, r, hz in clips]
        images = [picture(h, w, i) for h, w in images]
        if i == len(turns) - 1:  # the last turn: a context with room for the system prompt and this turn only
            room = len(spy.ids[-1]) // 2
            monkeypatch.setattr(model, "max_context", room + 10)
        before = list(chat.history.turns)
        reply = chat.say(text, audio=clips or None, images=images or None, greedy=True, seed=0,
                         max_text_tokens=10, max_codes=steps)
        dropped = reply.stats.get("dropped_exchanges", 0)
        history = type(chat.history)(chat.history.system, before[2 * dropped:])
        check(processor_inputs(model, path, cls_name, history, text, clips, images), spy.ids[-1], reply)
        stats.append(dict(reply.stats, clips_encoded=sum(spy.clips), images_encoded=sum(spy.images),
                          images_left=len(history.media()[1])))
        spy.clips.clear(), spy.images.clear()
    return stats


def assert_kept_and_fresh(stats: list, clip: int, image: int) -> None:
    """Turn `clip` brought a clip, turn `image` an image; the last turn dropped the oldest exchanges."""
    assert stats[0]["prefill_tokens"] == stats[0]["prompt_tokens"]  # nothing kept yet
    for before, later in zip(stats, stats[1:-1]):  # the whole last prompt kept: the reply and the new turn fed
        assert later["prompt_tokens"] - later["prefill_tokens"] == before["prompt_tokens"]
    assert [s["clips_encoded"] for s in stats] == [int(i == clip) for i in range(len(stats))]  # never again
    assert [s["images_encoded"] for s in stats] == [int(i == image) for i in range(len(stats))]
    dropping = stats[-1]
    assert dropping.get("dropped_exchanges", 0) >= 1  # the kept prefix: the system prompt, the rest prefilled
    assert dropping["prefill_tokens"] < dropping["prompt_tokens"]
    # The talker kept its rows of the user turns (Qwen2.5-Omni: of every position) the thinker kept.
    assert stats[0]["talker_kept_rows"] == 0 and all(s["talker_kept_rows"] > 0 for s in stats[1:-1])


def test_a_kept_qwen25_conversation_equals_transformers_at_every_turn(qwen25, monkeypatch):
    def check(inputs, ids, reply):
        assert ids == inputs["input_ids"][0].tolist()
        if "pixel_values" in inputs:
            inputs["thinker_pixel_values"] = inputs.pop("pixel_values")  # as test_media_input's reference
        text_ids, codes = reference_generate(qwen25.loaded.model, [], n_text=10, n_codes=60,
                                             eos=qwen25.engine.eos_ids, inputs=inputs,
                                             repetition_penalty=qwen25.thinker_sampling.repetition_penalty)
        assert reply.text_ids == text_ids
        assert reply.codes == codes and len(codes) > 0

    assert_kept_and_fresh(run_conversation(qwen25, monkeypatch, ASSET, "Qwen2_5OmniProcessor", check, 60), 1, 2)


def test_a_kept_qwen3_conversation_equals_transformers_at_every_turn(qwen3, monkeypatch):
    def check(inputs, ids, reply):
        assert_qwen3_reference(qwen3, inputs, ids, reply)

    stats = run_conversation(qwen3, monkeypatch, QWEN3, "Qwen3OmniMoeProcessor", check, 30, TURNS_QWEN3)
    assert stats[-1]["images_left"] == 0  # the image's exchange was dropped before the clip came
    assert_kept_and_fresh(stats, 4, 1)


@pytest.mark.parametrize("family", ["qwen25", "qwen3"])
def test_the_kept_cache_equals_a_fresh_prefill(family, request):
    """Two prompts, the second extending the first with a clip: its cache over the kept prefix, and its
    per-position outputs, equal those of a fresh prefill of the whole second prompt (float32)."""
    worst = kept_against_fresh(request.getfixturevalue(family))
    assert max(worst.values()) <= CACHE_BOUND, worst


def kept_against_fresh(model) -> dict:
    """{"cache", "embeds", "hidden"}: the largest |kept - fresh| of the second prompt's cache over the
    kept positions and of its per-position outputs (the first prompt's positions kept, then a fresh
    prefill); asserts what must be exact (the kept length, the greedy picks). tests/test_gpu.py runs it
    on CUDA too."""
    from omni_cli.config import ReplyOptions
    from omni_cli.media import AudioClip
    from omni_cli.prompt import Conversation

    steps, opts = model.engine.steps, ReplyOptions(greedy=True, seed=0, max_text_tokens=4, max_codes=4)
    past = Conversation(model.default_system, [{"role": "user", "content": "Hello there."},
                                               {"role": "assistant", "content": "Hello! How can I help?"}])
    first, *_ = model._request("Hello there.", opts, None, Conversation(model.default_system))
    clip = AudioClip(tone(0.9, 16_000, 500.0, 7), 16_000)
    second, *_ = model._request("Listen to this.", opts, None, past, audio=[clip])

    def prefill(req):
        with torch.inference_mode():
            out = steps.prefill(torch.tensor([req.input_ids], device=steps.device), req.media)
        n = len(req.input_ids)
        cache = steps.thinker.cache
        return out, [t[:, :, :n].clone() for t in cache.keys + cache.values]

    prefill(first)
    kept_out, kept_cache = prefill(second)
    kept = steps.kept_context()["found"]
    assert kept == len(first.input_ids) and kept < len(second.input_ids) - 20  # the first prompt's positions
    steps.thinker.context.clear()
    fresh_out, fresh_cache = prefill(second)
    assert steps.kept_context()["found"] == 0
    assert torch.equal(kept_out.logits.argmax(-1), fresh_out.logits.argmax(-1))
    worst = {"cache": max((a - b).abs().max().item() for a, b in zip(kept_cache, fresh_cache))}
    for name in ("embeds", "hidden"):
        worst[name] = (getattr(kept_out, name) - getattr(fresh_out, name)).abs().max().item()
    return worst


@pytest.mark.parametrize("family", ["qwen25", "qwen3"])
def test_the_talkers_kept_rows_equal_a_fresh_prefill(family, request):
    """A second turn's talker keeps the rows of the first prompt's positions (runtime/context.py
    `TalkerRows`) and prefills the rest: its prompt rows in the cache, its text and its codes equal those of
    the same turn with nothing kept (float32)."""
    model = request.getfixturevalue(family)
    steps, opts = model.engine.steps, dict(greedy=True, seed=0, max_text_tokens=6, max_codes=6)
    chat = model.conversation()
    chat.say("Hello there.", **opts)
    past = type(chat.history)(chat.history.system, list(chat.history.turns))

    def turn(reply):
        n = len(steps.talker.rows.sources)  # the talker prompt's rows
        cache = steps.talker.cache
        return reply, [t[:, :, :n].clone() for t in cache.keys + cache.values]

    kept, kept_rows = turn(chat.say("Tell me more.", **opts))
    assert 0 < kept.stats["talker_kept_rows"] < len(steps.talker.rows.sources)
    steps.thinker.context.clear()
    fresh, fresh_rows = turn(model.say("Tell me more.", conversation=past, **opts))
    assert fresh.stats["talker_kept_rows"] == 0 and fresh.stats["prefill_tokens"] == kept.stats["prompt_tokens"]
    assert (kept.text_ids, kept.codes) == (fresh.text_ids, fresh.codes) and kept.codes
    worst = max((a - b).abs().max().item() for a, b in zip(kept_rows, fresh_rows))
    assert worst <= CACHE_BOUND, worst


def test_a_talker_after_a_text_only_turn_keeps_nothing(qwen25):
    """The talker's rows are kept only from the prompt just before: a text-only turn between (its
    prompt's positions kept by the thinker, the talker's cache still the turn before's) keeps none."""
    opts = dict(greedy=True, seed=0, max_text_tokens=6, max_codes=6)
    chat = qwen25.conversation()
    chat.say("Hello there.", **opts)
    assert chat.say("Go on.", text_only=True, **opts).stats.get("talker_kept_rows") is None
    third = chat.say("Tell me more.", **opts)
    assert third.stats["talker_kept_rows"] == 0 and third.stats["prefill_tokens"] < third.stats["prompt_tokens"]


def test_qwen3_talkers_captures_between_turns_leave_its_user_rows(qwen3):
    """Between turns the talker's prompt graphs are captured over the user rows it keeps (the cache cut
    back to them: the opener's rows and the reply's are made again), and the next turn keeps them all."""
    opts = dict(greedy=True, seed=0, max_text_tokens=6, max_codes=6)
    talker = qwen3.engine.steps.talker
    chat = qwen3.conversation()
    chat.say("Hello there.", **opts)
    users = len(talker._users)
    assert talker.cache.length > users + 9
    from omni_cli.runtime.graphs import capture_prompts

    capture_prompts(qwen3.engine.steps.thinker, talker)
    assert talker.cache.length == users
    assert chat.say("Tell me more.", **opts).stats["talker_kept_rows"] == users


@pytest.mark.parametrize("family, stack", [("qwen3", "thinker"), ("qwen3", "talker"), ("qwen25", "thinker"),
                                           ("qwen25", "talker")])
def test_the_suffix_graphs_forward_equals_the_eager_suffix_prefill(family, stack, request):
    """What the suffix graphs replay (`decoder.forward_suffix`: the kept length a device value, the rest
    padded to its bucket, the keys read over a fixed span behind a mask) gives the eager suffix prefill's
    rows and cache (float32, CPU: the same function the GPU captures), for each family's thinker and
    talker stacks."""
    from omni_cli.runtime.decoder import forward_layers_keeping, forward_suffix
    from omni_cli.runtime.graphs import suffix_span

    steps = request.getfixturevalue(family).engine.steps
    thinker, talker = steps.thinker, steps.talker
    model, cache = (thinker.model, thinker.cache) if stack == "thinker" else (talker.model, talker.cache)
    keep = getattr(thinker, "accept_layer", None) if stack == "thinker" else None  # Qwen3's talker reads one
    width = model.layers[0].self_attn.q_proj.in_features
    thinker.context.clear(), talker.rows.clear()  # this writes the caches: nothing in them is kept after it
    torch.manual_seed(0)
    prompt, rest = torch.randn(1, 40, width), torch.randn(1, 23, width)
    with torch.inference_mode():
        cache.reset()
        forward_layers_keeping(model, prompt, cache, keep)
        eager = forward_layers_keeping(model, rest, cache, keep)
        rows = [t[:, :, :63].clone() for t in cache.keys + cache.values]
        for t in cache.keys + cache.values:
            t[:, :, 40:].normal_()  # stale rows past the kept ones: what the mask must hide
        cache.keep_first(40)
        padded = torch.cat([rest, torch.zeros(1, 64 - 23, width)], dim=1)
        graphed = forward_suffix(model, padded, cache, keep, torch.tensor(40), suffix_span(40 + 64, cache.max_len))
    assert cache.length == 40  # the caller advances it
    assert (eager[1] is None) == (graphed[1] is None) == (keep is None)  # the kept layer's output, if asked
    worst = max((a - b[:, :23]).abs().max().item() for a, b in zip(eager, graphed) if a is not None)
    worst_cache = max((a - b[:, :, :63]).abs().max().item() for a, b in zip(rows, cache.keys + cache.values))
    assert worst <= CACHE_BOUND and worst_cache <= CACHE_BOUND, (worst, worst_cache)


def test_verbose_and_show_tell_the_kept_context(qwen25):
    from omni_cli.faces.timing import memory_rows

    reply = qwen25.conversation().say("Hello there.", greedy=True, seed=0, max_text_tokens=4, max_codes=4)
    context = qwen25.memory["context"]
    assert context["held"] == reply.stats["prompt_tokens"]
    cache = qwen25.engine.steps.thinker.cache
    per_position = sum(t[0, :, 0].numel() * t.element_size() for t in cache.keys + cache.values)
    assert context["bytes"] > context["held"] * per_position  # the cache's and the talker's rows beside it
    assert dict(memory_rows(qwen25.memory))["kept context"].startswith(f"{context['held']} tokens, ")


@pytest.mark.parametrize("family", ["qwen25", "qwen3"])
def test_the_audio_towers_indices_made_on_the_host_give_the_same_features(family, request):
    """`compat.audio_plan` (the tower's window indices made on the host, so that its layers split their
    windows without reading them back from the device) gives the features the tower makes alone: two
    clips of other lengths, bit for bit."""
    from omni_cli.faces.bench_turns import clip
    from omni_cli.runtime import compat

    import importlib

    model = request.getfixturevalue(family)
    thinker = model.loaded.model.thinker
    presets = importlib.import_module(f"omni_cli.models.{dict(qwen25='qwen2_5_omni', qwen3='qwen3_omni')[family]}.presets")
    media, _ = presets.spoken_inputs([clip(1.3, 1), clip(2.9, 2)])
    mask = media["feature_attention_mask"]
    plan = compat.audio_plan(compat.audio_tower(thinker), mask.sum(-1), "cpu")
    assert {"valid_indices", "cu_seqlens"} <= set(plan) and plan["cu_seqlens"].device.type == "cpu"
    with torch.inference_mode():
        alone = thinker.get_audio_features(media["input_features"], mask, return_dict=True).last_hidden_state
        planned = thinker.get_audio_features(media["input_features"], mask, return_dict=True, **plan).last_hidden_state
    assert torch.equal(alone, planned)


@pytest.mark.parametrize("family", ["qwen25", "qwen3"])
def test_a_placeholder_without_encoder_rows_is_an_error_before_the_scatter(family, request):
    """A prompt holding one audio placeholder more than its clip gives rows (what a marker in a reply's
    ids made of a conversation) is a clear error of the turn, checked on the host: on a GPU the scatter's
    own check is a device-side assert that ends the process. The count that matches still prefills."""
    from omni_cli.config import ReplyOptions
    from omni_cli.media import AudioClip
    from omni_cli.prompt import Conversation

    model = request.getfixturevalue(family)
    steps, opts = model.engine.steps, ReplyOptions(greedy=True, seed=0, max_text_tokens=4, max_codes=4)
    clip = AudioClip(tone(0.9, 16_000, 500.0, 7), 16_000)
    req, *_ = model._request("Listen to this.", opts, None, Conversation(model.default_system), audio=[clip])
    token = steps.thinker.audio_token
    extra = list(req.input_ids)
    extra.insert(extra.index(token), token)
    steps.thinker.context.clear()
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match=r"^the prompt has \d+ places for its encoder's outputs but the encoder gave \d+"):
            steps.prefill(torch.tensor([extra], device=steps.device), req.media)
        steps.thinker.context.clear()
        out = steps.prefill(torch.tensor([req.input_ids], device=steps.device), req.media)
    assert out.logits.shape[-1] > 0
