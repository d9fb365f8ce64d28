"""KV cache rollback and compaction on a transformers ``DynamicCache`` (both services use it).

Dims: B batch (1 per session), H kv heads, S cached slots, D head dim; each layer holds
keys/values of shape (B, H, S, D).

Worked example: 7 cached prefix slots, then R at slot 7 and tree nodes 0..11 at slots 8..19.
Accepting nodes [0, 6] keeps slots 0..7, moves slot 8 -> 8 and slot 14 -> 9, crops to 10.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache(config) -> DynamicCache:
    """An empty dynamic cache for a model config."""
    return DynamicCache(config=config)


def cache_length(cache: DynamicCache) -> int:
    """Slots S currently held (0 when empty)."""
    return cache.get_seq_length()


@torch.inference_mode()
def compact_kv(cache: DynamicCache, keep_len: int, src_slots: list[int]) -> None:
    """Keep slots [0, keep_len), then ``src_slots`` moved to keep_len, keep_len + 1, ...; drop the rest.

    src_slots: [K] ascending slot indices, each >= keep_len. In place; raises TypeError for cache
    layers that are not plain DynamicLayer (sliding-window or quantized caches are not supported).
    """
    k = len(src_slots)
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(f"compact_kv supports DynamicLayer only, got {type(layer).__name__}")
        if not layer.is_initialized:
            continue
        if k:
            src = torch.tensor(src_slots, dtype=torch.long, device=layer.keys.device)
            # Gather first (a copy), then write: sources may overlap the destination range.
            layer.keys[:, :, keep_len : keep_len + k] = layer.keys[:, :, src]
            layer.values[:, :, keep_len : keep_len + k] = layer.values[:, :, src]
        layer.keys = layer.keys[:, :, : keep_len + k]  # (B, H, keep_len + K, D)
        layer.values = layer.values[:, :, : keep_len + k]


def truncate_kv(cache: DynamicCache, length: int) -> None:
    """Roll the cache back to its first ``length`` slots."""
    compact_kv(cache, length, [])
