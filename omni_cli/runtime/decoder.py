"""One forward pass of a Qwen2-style decoder stack (the thinker's text model or the talker's model)
over a `StaticKVCache`.

The layers, norms and rotary embedding are transformers' own modules, called directly: the layer math is
the library's, so our loops match the reference token for token. What we replace is the plumbing around
them (cache, positions, masks), which in the library's `forward` branches on device values. Positions are
a host-side offset: for text and audio prompts the three M-RoPE components of Qwen-Omni are equal, so 1-D
positions are exact (image and video prompts would need `get_rope_index` and are not handled here).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from . import compat, prompt_ops
from .kv_cache import StaticKVCache


def forward_layers(model, embeds: torch.Tensor, cache: StaticKVCache, mrope: bool = True,
                   positions: torch.Tensor | None = None, shift: int = 0) -> torch.Tensor:
    """Run `embeds` [1, n, width] through `model.layers` and `model.norm`; append n positions to `cache`.

    With n > 1 this is a causal prefill (mask-free SDPA with is_causal, like the reference); with n == 1
    a decode step attending to the whole valid cache. `mrope`: the stack's rotary takes the three M-RoPE
    rows of positions ([3, 1, n]); False for a plain RoPE stack ([1, n]: Qwen3-Omni's code predictor).
    `positions`: the prompt's M-RoPE positions when they are not the cache's slots (an image's 3-D
    grid); `shift`: added to the slots' positions (the rope delta such a prompt leaves for what follows).
    """
    return forward_layers_keeping(model, embeds, cache, None, mrope, positions, shift)[0]


def forward_layers_keeping(model, embeds: torch.Tensor, cache: StaticKVCache, keep: int | None,
                           mrope: bool = True, positions: torch.Tensor | None = None,
                           shift: int = 0, after_layer=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forward_layers`, also returning what transformers records as `hidden_states[keep]`: the input
    embeddings for 0, the output of layer keep-1, the final-normed state when keep is the last layer
    (transformers replaces the last recorded state by the normed one); None when `keep` is None.
    `after_layer(i, hidden) -> hidden`: what the stack adds between layers (Qwen3-Omni's deepstack image
    features after its first layers); the kept state is the layer's own output, as transformers records it."""
    n = embeds.shape[1]
    start = cache.length
    if positions is None:
        positions = torch.arange(start + shift, start + shift + n, device=embeds.device).view(1, 1, n)
        positions = positions.expand(3, 1, n) if mrope else positions[0]
    mask = suffix_mask(start, n, embeds.dtype, embeds.device)
    out = _run_layers(model, embeds, cache, mask, positions, keep, after_layer)
    cache.advance(n)
    return out


def forward_suffix(model, embeds: torch.Tensor, cache: StaticKVCache, keep: int | None, start: torch.Tensor,
                   span: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forward_layers_keeping` of n positions after `start` cached ones where `start` is a device value (a
    0-d long tensor), so that one CUDA graph serves every kept context that fits `span` keys: the rows are
    written at slots start.. through `SlotWriter`, each query reads the cache's first `span` rows through a
    mask that hides the keys after its own. The hidden rows past the cache's valid part hold stale but
    finite values (masked to exactly zero weight). 1-D positions (M-RoPE rows equal: text and audio).
    The caller advances the cache (its length is the host's to know)."""
    n = embeds.shape[1]
    slots = start + torch.arange(n, device=embeds.device)
    keys = torch.arange(span, device=embeds.device)
    mask = torch.zeros(n, span, dtype=embeds.dtype, device=embeds.device)
    mask.masked_fill_(keys[None, :] > slots[:, None], torch.finfo(embeds.dtype).min)
    positions = slots.view(1, 1, n).expand(3, 1, n)
    return _run_layers(model, embeds, SlotWriter(cache, slots, span), mask.view(1, 1, n, span), positions, keep)


class SlotWriter:
    """A `StaticKVCache` as the layers of `forward_suffix` see it: the new keys and values go to the slots
    a device tensor names (index_copy_, no host offset in the captured kernels), and attention reads the
    first `span` rows whatever the cache's length."""

    def __init__(self, cache: StaticKVCache, slots: torch.Tensor, span: int) -> None:
        self.cache, self.slots, self.span = cache, slots, span

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        keys.index_copy_(2, self.slots, key)
        values.index_copy_(2, self.slots, value)
        return keys[:, :, :self.span], values[:, :, :self.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span


def _run_layers(model, embeds, cache, mask, positions, keep, after_layer=None):
    """The stack's layers and final norm over `embeds` (see `forward_layers_keeping` for `keep`)."""
    position_embeddings = model.rotary_emb(embeds, positions)
    layers = model.layers
    cache_kw = compat.layer_cache_kwargs(cache, layers[0])  # the same keyword for every layer of a stack
    hidden = embeds
    kept = embeds if keep == 0 else None
    # inside: the stack's installed modules take ours (prompt_ops.py: the routed experts, the fused RMSNorm)
    with no_cudnn_attention(embeds.shape[1] > 1 and embeds.device.type == "cuda"), prompt_ops.inside():
        for i, layer in enumerate(layers):
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings, use_cache=True,
                           **cache_kw)
            if keep is not None and i + 1 == keep:
                kept = hidden
            if after_layer is not None:
                hidden = after_layer(i, hidden)
    normed = model.norm(hidden)
    return normed, (normed if keep is not None and keep >= len(layers) else kept)


def suffix_mask(start: int, n: int, dtype, device) -> torch.Tensor | None:
    """The additive causal mask [1, 1, n, start + n] of n positions fed after `start` cached ones (a prompt's
    rest over a kept context); None where the layers' own causal rule is right: from an empty cache, and
    one position (it sees the whole cache). SDPA's `is_causal` aligns its triangle to the first key, so n
    queries after `start` keys would see only the first keys, not the cache and themselves."""
    if start == 0 or n == 1:
        return None
    mask = torch.full((n, start + n), torch.finfo(dtype).min, dtype=dtype, device=device)
    return mask.triu(start + 1).view(1, 1, n, start + n)  # 0 where key j <= start + i


def no_cudnn_attention(enabled: bool):
    """On CUDA, attention over inputs of changing length (a prefill, a streaming codec's chunks) leaves
    cuDNN's kernel out of SDPA's choices.

    cuDNN builds an execution plan for each new input shape and keeps it per host thread: every prompt
    of a new length paid that build, twice a turn (thinker and talker). Measured on an H200, 7B thinker,
    60-90 token prompts: 103-127 ms per prefill of a new length with cuDNN, 62-69 ms without it (same
    length again: 43-50 ms). Flash / memory-efficient attention need no plan. The decode steps keep the
    default choice: their shapes are fixed and captured once. float32 (the GPU parity tests) never picks
    cuDNN, so the reference's choice is the same there.

    The switch is process-wide, and threads use it at once (the engine's prefill, Qwen3-Omni's codec on the
    vocoder's thread, a capture ahead), so it is counted (`_CudnnLeftOut`): off from the first entry to the
    last exit, then as it was. torch's `sdpa_kernel` restores what it found on entry instead, so two
    threads' overlapping uses could leave cuDNN off for good.
    """
    return _LEFT_OUT if enabled else contextlib.nullcontext()


class _CudnnLeftOut:
    """cuDNN's attention off while any thread is inside (re-entrant, thread-safe): the flag is set by the
    first to enter and restored by the last to leave."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._was = True

    def __enter__(self) -> None:
        with self._lock:
            if self._inside == 0:
                self._was = torch.backends.cuda.cudnn_sdp_enabled()
                torch.backends.cuda.enable_cudnn_sdp(False)
            self._inside += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                torch.backends.cuda.enable_cudnn_sdp(self._was)


_LEFT_OUT = _CudnnLeftOut()


def mrope_positions(module, ids: list[int], media: dict, device) -> tuple[torch.Tensor, int]:
    """(the prompt's M-RoPE positions [3, 1, L] on `device`, the delta the steps after it add): the
    reference's `get_rope_index` of `module` (thinker or talker) on the host, so no step waits for it."""
    mask = media.get("feature_attention_mask")
    positions, delta = module.get_rope_index(
        torch.tensor([ids]), media.get("image_grid_thw"), None, torch.ones(1, len(ids), dtype=torch.long), False,
        None if mask is None else mask.sum(-1), None)
    return positions.to(device), int(delta.reshape(-1)[0])
