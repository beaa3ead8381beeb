"""A KV cache allocated once per batch: the decode engine's (`stages.inference.engine`).

transformers' `DynamicCache` grows each layer's keys and values with `torch.cat`, a copy of the
whole cache per layer per token; `StaticCache` preallocates but hands attention the full
`max_cache_len` keys (the unwritten ones masked), which changes the floating-point sums of
attention against `generate`. `PreallocatedCache` does neither: each layer writes its new keys
and values into a buffer of `capacity` positions allocated on its first update, and returns the
written part as a view, (B, kv_heads, length, head_dim), the very tensor `DynamicCache` would have
returned. Greedy outputs therefore equal `generate`'s token for token, without the copies.

`cache_fits(config, capacity)` says whether a model's layers can use it: full attention, or a
sliding window no shorter than the capacity (then the window never slides).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs


def cache_fits(config, capacity: int) -> str | None:
    """None when every attention layer of `config` can hold `capacity` positions in a
    PreallocatedCache, else the reason it cannot (a window that would slide, a layer type that
    stores something else)."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        window = kwargs.get("sliding_window")
        if kind == "sliding_attention" and window is not None and window < capacity:
            return f"layer {i} has a sliding window of {window} < {capacity} positions"
        if kind not in ("full_attention", "sliding_attention"):
            return f"layer {i} is a {kind!r} layer"
    return None


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers of `capacity` positions; `keys` / `values` are the
    written part, (B, kv_heads, length, head_dim) views, as DynamicLayer's tensors are."""

    def __init__(self, capacity: int, spare: int = 0):
        super().__init__()
        self.capacity = capacity
        self.spare = spare  # positions allocated beyond capacity, never written
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, size = *key_states.shape[:2], self.capacity + self.spare
        self._keys = key_states.new_empty((batch, heads, size, key_states.shape[-1]))  # (B, H, L, Dk)
        self._values = value_states.new_empty((batch, heads, size, value_states.shape[-1]))  # (B, H, L, Dv)
        self.keys, self.values = self._keys[:, :, :0], self._values[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, H, n, D) new keys and values after the written ones; return all written, (B, H, length, D)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {end} asked (prompt + new tokens)")
        self._keys[:, :, self.length:end].copy_(key_states)
        self._values[:, :, self.length:end].copy_(value_states)
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        """Forget what was written; the buffers stay for the next batch of the same shape."""
        self.length = 0
        if self.is_initialized:
            self.keys, self.values = self._keys[:, :, :0], self._values[:, :, :0]

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -`tokens_to_remove` positions (a number <= 0, as transformers 5's
        DynamicLayer.crop takes it): speculative decoding drops a rejected draft's keys and values."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass minus the number of positions to forget")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self.keys, self.values = self._keys[:, :, :self.length], self._values[:, :, :self.length]


class PreallocatedCache(Cache):
    """`num_layers` PreallocatedLayers of `capacity` positions each (see the module docstring).
    `spare`: positions allocated beyond `capacity` and never written, so that the written part is
    never the whole buffer; a step compiled with dynamic shapes then never meets the one length
    at which that view is contiguous (torch.compile would specialize on it and compile again)."""

    def __init__(self, num_layers: int, capacity: int, spare: int = 0):
        super().__init__(layers=[PreallocatedLayer(capacity, spare) for _ in range(num_layers)])
        self.capacity = capacity

    def fits(self, batch: int, capacity: int) -> bool:
        """Whether a batch of `batch` rows and up to `capacity` positions can reuse these buffers."""
        layer = self.layers[0]
        return capacity <= self.capacity and (not layer.is_initialized or layer._keys.shape[0] == batch)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
