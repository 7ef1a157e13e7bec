"""Static KV cache: one preallocated key/value buffer per layer, written in place, reset between turns.

It plugs into transformers' own decoder layers through the one method they call, `update(k, v,
layer_idx)`, so the layer math stays the library's (that is what keeps greedy parity exact). The
write position is a host-side integer the engine advances after each forward: positions are known on
the host without looking at any device value, so this costs no sync.

`update` returns the *valid* prefix of the buffer (a view, no copy): attention reads only the part
of the cache that has been written, with the same shapes the reference's growing cache has. What it
does not know: which model it serves, sampling, or how positions map to RoPE (the caller passes those).
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (1, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0  # tokens already in the cache (host-side: advanced by the engine)

    @classmethod
    def for_config(cls, config, max_len: int, *, device, dtype) -> "StaticKVCache":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, max_len, device=device, dtype=dtype)

    def reset(self) -> None:
        # Nothing to clear: stale entries past `length` are never read.
        self.length = 0

    def keep_first(self, n: int) -> None:
        """Keep the first `n` positions (a kept context's prefix); what follows is written over."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot keep {n} of {self.length} cached positions")
        self.length = n

    def copy_first(self, n: int) -> list[torch.Tensor]:
        """A copy of the first `n` positions of every layer's keys and values (for `restore_first`)."""
        return [t[:, :, :n].clone() for t in self.keys + self.values]

    def restore_first(self, saved: list[torch.Tensor]) -> None:
        """Put back what `copy_first` copied: those positions, and the length, are the cache's again."""
        n = saved[0].shape[2]
        for t, s in zip(self.keys + self.values, saved):
            t[:, :, :n].copy_(s)
        self.length = n

    def room(self) -> int:
        return self.max_len - self.length

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write `key`/`value` ([1, kv_heads, n, head_dim]) at the current position; return the valid prefix."""
        end = self.length + key.shape[2]
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} > {self.max_len} positions")
        self.keys[layer_idx][:, :, self.length : end].copy_(key)
        self.values[layer_idx][:, :, self.length : end].copy_(value)
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    # transformers' layers may ask these of a cache object.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length
