"""transformers 5.17 ... 5.24 (and later 5.x): the few inner-module paths and keywords our loops use.

Our generation loops call transformers' inner modules directly (decoder layers, norms, rotary embeddings,
heads), so they see changes that `generate` hides. Every lookup of such a module, and every keyword whose
name moved, goes through one small function here. Each function detects the layout or the keyword by
looking at the objects (attributes, `inspect.signature`), not at the version string.

What it absorbs (the release that changed it):
- 5.21: the thinkers of both families got a `*ThinkerModel` between them and their parts:
  `thinker.model` (the text decoder stack)  -> `thinker.model.language_model`  (`thinker_text_model`)
  `thinker.audio_tower` / `thinker.visual`  -> `thinker.model.audio_tower` / `.visual` (`audio_tower`, `visual`)
  `thinker.rope_deltas`                     -> `thinker.model.rope_deltas`  (`get_rope_deltas`, `set_rope_deltas`)
  `thinker.lm_head` and `thinker.get_input_embeddings()` stay where they were. Checkpoint keys keep the old
  names: transformers renames them on load and back on save, but `named_parameters()` / `state_dict()` use
  the new ones, so anything keyed or ordered by parameter name (the tiny checkpoints' seeded fill, tests that
  look up a weight) goes through `checkpoint_name`.
- 5.24: the cache keyword of decoder layers and model forwards, `past_key_values=` -> `cache=` (the old name
  still works with a FutureWarning until 5.40; on 5.17 the new name would fall into `**kwargs` and the cache
  would silently not be written). `cache_kwargs(cache, module)` gives the right one; model outputs carry
  the cache as `.cache` instead of `.past_key_values` (`output_cache`).
- 5.19: rotary embedding constructors lose `device` (5.17/5.18 warn when it is given). `rotary_embedding`
  builds one from the config alone and moves it.
- 5.20: `Cache.max_cache_len` / `max_batch_size` / `get_max_cache_shape` removed; `Cache.get_max_length()`
  and `Cache.batch_size` exist on 5.17 and 5.24 alike (`cache_capacity` also knows our StaticKVCache).

Unchanged 5.17 -> 5.24, so no function here: the Qwen2.5 talker (`talker.model`, `codec_head`,
`thinker_to_talker_proj`, `get_input_embeddings()`), token2wav (DiT `rotary_embed(x, positions)` call,
`transformer_blocks`, `attn(hidden_states=, position_embeddings=, attention_mask=)`, BigVGAN), the Qwen3
talker (`talker.model`, `text_projection`, `hidden_projection`, `codec_head`, `code_predictor.model` /
`.lm_head` / `.get_input_embeddings()`), `code2wav` (`pre_transformer`, `upsample`, `decoder`), the MoE
blocks, each stack's `.layers` / `.norm` / `.rotary_emb(x, positions)` call, and a layer's other keywords
(`attention_mask`, `position_embeddings`, `use_cache`). A duck-typed cache needs only `update(k, v,
layer_idx, *args, **kwargs)` (5.24 passes `kwargs=` to it) and `get_seq_length()`.

Family-specific changes live with the family or the tests: Qwen3-Omni's deepstack features, per image on
5.24, are joined in models/qwen3_omni/thinker.py (`deepstack_levels`); 5.18's `generate` dropping an
all-ones mask from Qwen2.5's talker is undone for reference runs by tests/hf_reference.py
(`qwen2_5_talker_keeps_its_mask`). This module knows no family.

Not absorbed (no call site of ours uses them): the 5.18 removal of the thinker's
`_expand_inputs_for_generation` (num_beams / num_return_sequences > 1 in `thinker.generate`), the 5.23
removal of the `*ThinkerCausalLMOutputWithPast` classes (5.24 returns `MultimodalCausalLMOutputWithPast`, no
`rope_deltas` field) and of `generate(return_audio=)` (use `generation_mode="text"` for text only).
transformers' own `generate` takes `cache=` on 5.24; our tests call it without either name.
"""

from __future__ import annotations

import functools
import inspect
import re

# -- thinker layout (5.21) ------------------------------------------------------------------------


def thinker_core(thinker):
    """The module that holds the thinker's encoders, `rope_deltas` and text model: `thinker.model` (a
    `*ThinkerModel`) from 5.21, the `*ThinkerForConditionalGeneration` itself before."""
    inner = getattr(thinker, "model", None)
    if inner is not None and getattr(inner, "language_model", None) is not None:  # 5.21+
        return inner
    return thinker


def thinker_text_model(thinker):
    """The thinker's text decoder stack (`embed_tokens`, `layers`, `norm`, `rotary_emb`), either family.

    5.17-5.20: `thinker.model`; 5.21+: `thinker.model.language_model`."""
    inner = thinker.model
    text = getattr(inner, "language_model", None)  # 5.21+
    return inner if text is None else text


def audio_tower(thinker):
    """The thinker's audio encoder. 5.21 moved it from `thinker.audio_tower` to `thinker.model.audio_tower`."""
    return thinker_core(thinker).audio_tower


def visual(thinker):
    """The thinker's vision encoder. 5.21 moved it from `thinker.visual` to `thinker.model.visual`."""
    return thinker_core(thinker).visual


def get_rope_deltas(thinker):
    """The thinker's M-RoPE delta state (None before a multimodal prompt). 5.21: `thinker.model.rope_deltas`."""
    return thinker_core(thinker).rope_deltas


def set_rope_deltas(thinker, value) -> None:
    """Set (or clear, with None) the thinker's M-RoPE delta state where the installed version keeps it."""
    thinker_core(thinker).rope_deltas = value


# 5.21+ parameter-name prefixes -> the checkpoint's (and 5.17's) names; never matches a 5.17 name.
_RENAMED = (
    (re.compile(r"^(thinker\.)?model\.language_model\."), r"\1model."),
    (re.compile(r"^(thinker\.)?model\.(audio_tower|visual)\."), r"\1\2."),
)


def checkpoint_name(name: str) -> str:
    """The checkpoint key (= the 5.17 parameter name) of parameter `name` of a whole model
    (`thinker.model.language_model.layers.0...` -> `thinker.model.layers.0...`) or of a bare thinker
    (`model.audio_tower...` -> `audio_tower...`). Names that 5.21 did not move come back unchanged."""
    for pattern, repl in _RENAMED:
        name, n = pattern.subn(repl, name, count=1)
        if n:
            break
    return name


# -- the cache keyword (5.24) ----------------------------------------------------------------------

_NEW, _OLD = "cache", "past_key_values"


@functools.lru_cache(maxsize=None)
def _cache_name_of(forward) -> str | None:
    try:
        params = inspect.signature(forward).parameters  # follows the decorators' __wrapped__
    except (TypeError, ValueError):
        return None
    if _NEW in params:
        return _NEW
    if _OLD in params:
        return _OLD
    return None


def _reference_forward():
    # Every decoder layer and model forward of the Qwen-Omni families switched in the same release (5.24).
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniDecoderLayer

    return Qwen2_5OmniDecoderLayer.forward


def cache_kwarg_name(module=None) -> str:
    """'cache' (5.24+) or 'past_key_values' (before): the keyword `module`'s forward takes its KV cache by.

    `module`: a decoder layer or a model (`*TextModel`, `pre_transformer`, ...), or None for the installed
    version's Qwen-Omni decoder layers. Raises TypeError for a forward that names neither: passing the cache
    into its `**kwargs` would run without writing it.
    """
    forward = _reference_forward() if module is None else type(module).forward
    name = _cache_name_of(forward)
    if name is None:
        raise TypeError(f"{type(module).__name__}.forward takes neither `cache` nor `past_key_values`")
    return name


def cache_kwargs(cache, module=None) -> dict:
    """`{name: cache}` to splat into a layer or model call: `layer(h, **cache_kwargs(cache, layer), ...)`."""
    return {cache_kwarg_name(module): cache}


def layer_cache_kwargs(cache, layer=None) -> dict:
    """The same as `cache_kwargs`, named for the decoder-layer loops (`runtime.decoder.forward_layers`)."""
    return cache_kwargs(cache, layer)


def output_cache(outputs):
    """The cache a model forward returned: `outputs.cache` from 5.24, `outputs.past_key_values` before."""
    for name in (_NEW, _OLD):
        value = getattr(outputs, name, None)
        if value is not None:
            return value
    return None


# -- construction and cache size (5.19, 5.20) -----------------------------------------------------------


def rotary_embedding(cls, config, device=None):
    """A rotary embedding module of class `cls` for `config`, on `device`.

    5.19 dropped the constructors' `device` argument (5.17/5.18 warn about it): build from the config only,
    then move. The inverse frequencies are computed on the CPU in float32 either way (5.17 also moved them
    afterwards), so the values are the same."""
    module = cls(config)
    return module if device is None else module.to(device)


def cache_capacity(cache) -> int:
    """How many positions a cache holds: our `StaticKVCache.max_len`, or a transformers cache's
    `get_max_length()` (`max_cache_len` / `get_max_cache_shape()` are gone from 5.20)."""
    max_len = getattr(cache, "max_len", None)
    if isinstance(max_len, int):
        return max_len
    return cache.get_max_length()


# -- the audio towers' precomputed index tensors (5.17 on) ----------------------------------------------


def audio_encoder(thinker, features, mask, device):
    """A call that gives `thinker.get_audio_features(features, mask).last_hidden_state` (`features` [clips,
    mel, frames] on `device`, `mask` [clips, frames] on the host) without a host synchronisation, its
    host's work done here (so that a timer around the call times the encoder): the clips' frames laid end
    to end by their lengths on the host, where the library takes them by a boolean mask (a read-back of
    its size), split into the tower's chunks by lengths on the host (`chunk_and_pad_features`, which reads
    them back from the device when given device lengths), and Qwen2.5-Omni's check of the output length
    left out (it reads the lengths back after the tower has run: the prefill waited for the encoder). With
    `audio_plan`'s indices the tower then reads nothing back. The same ops on the same values: the features
    are bit-identical (tests/test_compat.py). Where the module lacks these functions, the library's call."""
    import sys

    import torch

    tower = audio_tower(thinker)
    lib = sys.modules[type(tower).__module__]
    lengths = mask.sum(-1).to("cpu", torch.long)
    plan = audio_plan(tower, lengths, device)
    if not plan or not hasattr(lib, "chunk_and_pad_features"):
        return lambda: thinker.get_audio_features(features, mask.to(device), return_dict=True, **plan).last_hidden_state
    flat = clips_end_to_end(features, lengths)
    padded, chunks = lib.chunk_and_pad_features(flat, lengths, tower.n_window)  # chunks on the host
    inputs = dict(feature_lens=lengths, padded_feature=padded, chunk_lengths=_to_device(chunks, device), **plan)
    return lambda: tower(flat, return_dict=True, **inputs).last_hidden_state


def clips_end_to_end(features, lengths):
    """The clips' frames laid end to end, [mel, sum(lengths)], from `features` [clips, mel, frames] (on any
    device) by their frame counts `lengths` (a host tensor: nothing is read back)."""
    import torch

    return torch.cat([features[i, :, :n] for i, n in enumerate(lengths.tolist())], dim=1)


def _to_device(index, device):
    """A host index tensor on `device`, copied without waiting (from pinned memory on CUDA)."""
    import torch

    device = torch.device(device)
    return (index.pin_memory() if device.type == "cuda" else index).to(device, non_blocking=True)


def audio_plan(tower, lengths, device) -> dict:
    """The index tensors an audio tower accepts precomputed (`valid_indices`, `cu_seqlens` and, for
    Qwen2.5-Omni's, `pool_indices`: keywords its forward pops, 5.17 on), made on the host by its module's
    own functions from the clips' frame counts (`lengths`, a host tensor): keywords for
    `get_audio_features`, or {} where the module lacks those functions.

    Without them the tower computes them on the device, and its SDPA path splits every layer's windows
    by `cu_seqlens` read back to the host, three times a layer: about 100 synchronisations a call, each
    waiting for the GPU (H200, a 5 s clip at true size, both families). With `cu_seqlens` on the host
    those splits read host values. The index tensors go to `device` (from pinned memory on CUDA)."""
    import sys

    import torch

    lib = sys.modules[type(tower).__module__]
    if not all(hasattr(lib, name) for name in ("chunk_and_pad_features", "get_valid_indices", "get_audio_cu_seqlens")):
        return {}
    lengths = lengths.to("cpu", torch.long)
    # chunk_and_pad_features splits the features by the chunk lengths it computes: one row of zeros will do
    _, chunks = lib.chunk_and_pad_features(torch.zeros(1, int(lengths.sum())), lengths, tower.n_window)
    if hasattr(tower, "n_window_infer"):  # Qwen3-Omni's windows of chunks
        plan = {"valid_indices": lib.get_valid_indices(chunks, tower.n_window),
                "cu_seqlens": lib.get_audio_cu_seqlens(chunks, lengths, tower.n_window_infer, tower.n_window)}
    else:
        plan = {"valid_indices": lib.get_valid_indices(chunks), "cu_seqlens": lib.get_audio_cu_seqlens(chunks)}
        if hasattr(lib, "get_pool_indices"):
            plan["pool_indices"] = lib.get_pool_indices(lengths)
    for name in ("valid_indices", "pool_indices"):  # read on the device; cu_seqlens is read on the host
        if name in plan:
            plan[name] = _to_device(plan[name], device)
    return plan
