"""omni_cli.runtime.compat against the installed transformers (5.17 ... 5.24): each accessor returns the
module the library itself uses, and a layer called with `cache_kwargs` writes our static cache.

Run under every transformers the project supports; the assertions are the same on each, only the
layout underneath differs (5.21: thinker parts under `thinker.model`; 5.24: `cache=`)."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from omni_cli.runtime import compat  # noqa: E402
from hf_reference import qwen2_5_talker_keeps_its_mask, tiny_model  # noqa: E402  (tests/ is on sys.path)
from omni_cli.runtime.kv_cache import StaticKVCache  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "assets"


@pytest.fixture(scope="module", params=["qwen2.5", "qwen3"])
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3")


def _path_of(root, module) -> str:
    """The dotted name under which `root` holds `module` (what checkpoint keys are built from)."""
    names = [name for name, m in root.named_modules() if m is module]
    assert names, f"{type(module).__name__} is not a submodule"
    return names[0]


@pytest.fixture
def no_future_warnings():
    """The old keyword only warns on 5.24; with the right one, nothing may warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        yield


# -- the thinker's layout (5.21) ------------------------------------------------------------------


def test_text_model_is_the_thinkers_decoder_stack(model):
    thinker = model.thinker
    text = compat.thinker_text_model(thinker)
    assert type(text).__name__.endswith("ThinkerTextModel")
    assert text.embed_tokens is thinker.get_input_embeddings()  # the embedding the thinker's forward uses
    assert text.embed_tokens.weight.shape[1] == thinker.lm_head.in_features
    assert len(text.layers) == model.config.thinker_config.text_config.num_hidden_layers
    assert hasattr(text, "norm") and hasattr(text, "rotary_emb")
    layout = "thinker.model.language_model" if hasattr(thinker.model, "language_model") else "thinker.model"
    assert _path_of(model, text) == layout


def test_encoders_and_core(model):
    thinker = model.thinker
    assert type(compat.audio_tower(thinker)).__name__.endswith("AudioEncoder")
    assert type(compat.visual(thinker)).__name__.endswith("VisionEncoder")
    core = compat.thinker_core(thinker)
    prefix = "thinker" if core is thinker else "thinker.model"
    assert _path_of(model, compat.audio_tower(thinker)) == prefix + ".audio_tower"
    assert _path_of(model, compat.visual(thinker)) == prefix + ".visual"
    assert compat.thinker_text_model(thinker) in set(core.modules())


def test_rope_deltas_live_where_the_library_writes_them(model):
    thinker = model.thinker
    compat.set_rope_deltas(thinker, None)
    assert compat.get_rope_deltas(thinker) is None
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        thinker(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    deltas = compat.get_rope_deltas(thinker)  # text only: zeros, one per row
    assert isinstance(deltas, torch.Tensor) and deltas.shape[0] == 1 and torch.all(deltas == 0)
    compat.set_rope_deltas(thinker, None)
    assert compat.get_rope_deltas(thinker) is None


def test_checkpoint_names_are_the_files_keys(model):
    """Parameter names mapped by `checkpoint_name` are the checkpoint's keys, holding the same tensors."""
    from safetensors import safe_open

    folder = "tiny-qwen2.5-omni" if hasattr(model, "token2wav") else "tiny-qwen3-omni"
    moved = hasattr(model.thinker.model, "language_model")
    with safe_open(str(ASSETS / folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        renamed = 0
        for name, param in model.named_parameters():
            key = compat.checkpoint_name(name)
            renamed += key != name
            if key not in keys:
                assert ".experts." in key, key  # only the MoE experts are fused on load
                continue
            assert torch.equal(param, f.get_tensor(key)), name
    assert (renamed > 0) == moved
    assert compat.checkpoint_name("talker.model.layers.0.mlp.gate.weight") == "talker.model.layers.0.mlp.gate.weight"
    assert compat.checkpoint_name("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert compat.checkpoint_name("model.language_model.norm.weight") == "model.norm.weight"


# -- the cache keyword (5.24) -----------------------------------------------------------------------


def _stacks(model) -> dict:
    """Every decoder stack our loops drive, by role."""
    stacks = {"thinker": compat.thinker_text_model(model.thinker), "talker": model.talker.model}
    if hasattr(model.talker, "code_predictor"):
        stacks["code_predictor"] = model.talker.code_predictor.model
    return stacks


def test_cache_keyword_is_one_name_for_every_layer(model):
    names = {compat.cache_kwarg_name(layer) for stack in _stacks(model).values() for layer in stack.layers}
    assert names == {compat.cache_kwarg_name()}  # the default (no module) agrees with every layer
    assert names <= {"cache", "past_key_values"}


def _rope(stack, x, start: int):
    """The stack's own rotary call: [3, 1, n] M-RoPE positions, or [1, n] for plain RoPE (code predictor)."""
    n = x.shape[1]
    pos = torch.arange(start, start + n)
    if hasattr(stack.rotary_emb, "mrope_section"):
        return stack.rotary_emb(x, pos.view(1, 1, n).expand(3, 1, n))
    return stack.rotary_emb(x, pos.view(1, n))


def _run(stack, embeds, cache: StaticKVCache):
    """Our loops' pattern (runtime/decoder.py): the library's layers over a StaticKVCache, via compat."""
    rope = _rope(stack, embeds, cache.length)
    hidden = embeds
    for layer in stack.layers:
        hidden = layer(hidden, attention_mask=None, position_embeddings=rope, use_cache=True,
                       **compat.layer_cache_kwargs(cache, layer))
    cache.advance(embeds.shape[1])
    return stack.norm(hidden)


@pytest.mark.parametrize("role", ["thinker", "talker", "code_predictor"])
def test_layers_write_our_cache_and_match_the_library(model, role, no_future_warnings):
    """Prefill 5 + decode 1 through our cache equals the library's stack forward over all 6 positions."""
    stacks = _stacks(model)
    if role not in stacks:
        pytest.skip(f"no {role} in this family")
    stack = stacks[role]
    cache = StaticKVCache.for_config(stack.config, 8, device=torch.device("cpu"), dtype=torch.float32)
    torch.manual_seed(0)
    embeds = torch.randn(1, 6, stack.config.hidden_size)
    with torch.no_grad():
        _run(stack, embeds[:, :5], cache)
        assert all(k[:, :, :5].abs().sum() > 0 for k in cache.keys)  # every layer wrote its rows
        assert all(k[:, :, 5:].abs().sum() == 0 for k in cache.keys)
        last = _run(stack, embeds[:, 5:], cache)
        assert all(k[:, :, 5].abs().sum() > 0 for k in cache.keys)
        ref = stack(inputs_embeds=embeds, use_cache=False).last_hidden_state
    torch.testing.assert_close(last[:, -1], ref[:, -1], rtol=1e-5, atol=1e-5)


def test_the_other_keyword_warns_or_misses_the_cache(model):
    """Why the compat function exists: on 5.17 `cache=` falls into `**kwargs` (nothing written); on
    5.24 `past_key_values=` still writes but warns (and goes away in 5.40)."""
    stack = compat.thinker_text_model(model.thinker)
    other = {"cache": "past_key_values", "past_key_values": "cache"}[compat.cache_kwarg_name()]
    cache = StaticKVCache.for_config(stack.config, 4, device=torch.device("cpu"), dtype=torch.float32)
    x = torch.randn(1, 2, stack.config.hidden_size)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            stack.layers[0](x, attention_mask=None, position_embeddings=_rope(stack, x, 0), use_cache=True,
                            **{other: cache})
        except TypeError:
            return  # a future version that rejects the name outright: also not silent
    written = cache.keys[0].abs().sum() > 0
    warned = any(issubclass(w.category, FutureWarning) for w in caught)
    assert warned or not written


def test_model_forward_takes_the_cache_by_name(qwen3, no_future_warnings):
    """Model forwards (here code2wav's pre-transformer, which code2wav.py drives) switched too; the
    returned cache is read with `output_cache`."""
    from transformers.cache_utils import DynamicCache

    pre = qwen3.code2wav.pre_transformer
    cache = DynamicCache(config=pre.config)
    x = torch.randn(1, 3, pre.config.hidden_size)
    with torch.no_grad():
        out = pre(inputs_embeds=x, use_cache=True, **compat.cache_kwargs(cache, pre))
    assert compat.output_cache(out) is cache
    assert cache.get_seq_length() == 3


def test_cache_kwarg_name_refuses_a_forward_without_a_cache():
    with pytest.raises(TypeError):
        compat.cache_kwarg_name(torch.nn.Linear(2, 2))


# -- construction and sizes (5.19, 5.20) ---------------------------------------------------------------


def test_rotary_embedding_equals_the_models_own(model, no_future_warnings):
    stack = compat.thinker_text_model(model.thinker)
    rope = compat.rotary_embedding(type(stack.rotary_emb), stack.config, device=torch.device("cpu"))
    x = torch.zeros(1, 5, 1)
    pos = torch.arange(5).view(1, 1, 5).expand(3, 1, 5)
    for ours, theirs in zip(rope(x, pos), stack.rotary_emb(x, pos)):
        assert torch.equal(ours, theirs)


def test_dit_rotary_embedding_equals_the_models_own(no_future_warnings):
    """token2wav's DiT RoPE (5.19 changed its constructor): built anew it gives the model's values."""
    m = tiny_model("qwen2.5")
    dit = m.token2wav.code2wav_dit_model
    rope = compat.rotary_embedding(type(dit.rotary_embed), dit.config)
    x = torch.zeros(2, 7, 1)
    pos = torch.arange(7)[None, :].repeat(2, 1)
    for ours, theirs in zip(rope(x, pos), dit.rotary_embed(x, pos)):
        assert torch.equal(ours, theirs)


def test_cache_capacity():
    from transformers import Qwen2_5OmniConfig
    from transformers.cache_utils import StaticCache

    ours = StaticKVCache(2, 1, 4, 7, device=torch.device("cpu"), dtype=torch.float32)
    assert compat.cache_capacity(ours) == 7
    text = Qwen2_5OmniConfig.from_pretrained(str(ASSETS / "tiny-qwen2.5-omni")).thinker_config.text_config
    assert compat.cache_capacity(StaticCache(config=text, max_cache_len=12)) == 12


# -- what compat leaves alone: the parts our loops read directly are where they were ------------------


def test_unchanged_parts(model):
    talker = model.talker
    assert isinstance(talker.codec_head, torch.nn.Linear)
    if hasattr(talker, "thinker_to_talker_proj"):  # Qwen2.5
        assert talker.get_input_embeddings() is talker.model.embed_tokens
        assert isinstance(talker.thinker_to_talker_proj, torch.nn.Linear)
        dit = model.token2wav.code2wav_dit_model
        assert hasattr(dit, "rotary_embed") and len(dit.transformer_blocks) > 0
    else:  # Qwen3
        assert talker.get_input_embeddings() is talker.model.codec_embedding
        predictor = talker.code_predictor
        groups = model.config.talker_config.num_code_groups
        assert len(predictor.lm_head) == len(predictor.get_input_embeddings()) == groups - 1
        assert {"text_projection", "hidden_projection"} <= {n for n, _ in talker.named_children()}
        assert all(hasattr(model.code2wav, n) for n in ("pre_transformer", "upsample", "decoder"))


# -- transformers' Qwen2.5 generate as the parity reference (5.18) ------------------------------------------


def _talker_prompt_last_rows(model, keep_mask: bool):
    """The talker's first layer input rows for the voice-BOS and first-reply positions in HF's generate."""
    seen = []
    hook = model.talker.model.layers[0].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).clone()), with_kwargs=True)
    model.talker.rope_deltas = None  # set by the talker's forward only when it gets a mask
    ctx = qwen2_5_talker_keeps_its_mask(model) if keep_mask else contextlib.nullcontext()
    try:
        with torch.no_grad(), ctx:
            model.generate(torch.tensor([[1, 2, 3, 4, 5]]), speaker="Chelsie", thinker_max_new_tokens=2,
                           thinker_do_sample=False, talker_max_new_tokens=2, talker_do_sample=False)
    finally:
        hook.remove()
    return seen[0][0, -2:]


def test_reference_talker_prompt_has_the_codec_embeddings():
    """With the shim, transformers' generate feeds the talker pad/BOS-embedded prompt rows: the same as
    projecting (what the reference builds) + codec embeddings, as 5.17 did, on every version."""
    m = tiny_model("qwen2.5")
    talker = m.talker
    without = _talker_prompt_last_rows(m, keep_mask=False)
    with_mask = _talker_prompt_last_rows(m, keep_mask=True)
    assert talker.rope_deltas is not None  # the talker took its masked (5.17) branch
    codec = talker.get_input_embeddings()(torch.tensor([talker.codec_pad_token, talker.codec_bos_token]))
    added = talker.thinker_to_talker_proj.weight @ codec.T  # the projection is linear: the rows differ by this
    if not torch.allclose(with_mask - without, added.T, atol=1e-5):
        # 5.17: generate keeps the mask itself, so both runs already include the codec embeddings
        torch.testing.assert_close(with_mask, without)
    assert "forward" not in talker.__dict__  # the class's forward is back


def test_audio_features_without_a_read_back_equal_the_librarys(model):
    """`compat.audio_encoder` (the clips laid end to end and chunked by lengths on the host, the tower's
    indices made there) gives `get_audio_features`' output bit for bit: three clips of other lengths, one
    of them padded in the batch, another longer than the tower's chunk of frames."""
    import numpy as np

    thinker = model.thinker
    rng = np.random.default_rng(0)
    frames = [130, 357, 41]
    features = torch.tensor(rng.standard_normal((3, 128, max(frames))), dtype=torch.float32)
    mask = torch.zeros(3, max(frames), dtype=torch.long)
    for i, n in enumerate(frames):
        mask[i, :n] = 1
        features[i, :, n:] = -0.8  # the batch's padding: read by neither
    with torch.inference_mode():
        library = thinker.get_audio_features(features, mask, return_dict=True).last_hidden_state
        ours = compat.audio_encoder(thinker, features, mask, "cpu")()
    assert ours.shape == library.shape and torch.equal(ours, library)


def test_cudnn_attention_left_out_by_two_threads_at_once_comes_back():
    """Two threads' overlapping uses of `no_cudnn_attention` (A enters, B enters, A leaves, B leaves: the
    engine's prefill beside Qwen3-Omni's codec on the vocoder's thread) keep cuDNN's attention off while
    either is inside and leave it as it was. torch's `sdpa_kernel`, used before, restored what each thread
    found on entry: A turned it back on under B, and B then left it off for good."""
    import threading

    from omni_cli.runtime.decoder import no_cudnn_attention

    assert torch.backends.cuda.cudnn_sdp_enabled()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with no_cudnn_attention(True):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with no_cudnn_attention(True):
            b_in.set()
            a_out.wait(5)
            seen["inside B, after A left"] = torch.backends.cuda.cudnn_sdp_enabled()

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"inside B, after A left": False}
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with no_cudnn_attention(True), no_cudnn_attention(True):  # re-entrant on one thread
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
