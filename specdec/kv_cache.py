"""KV cache rollback and compaction on a transformers ``DynamicCache`` (docs/design.md "KV rollback").

Dims: B batch (1 per session), H kv heads, S cached slots, D head dim; each layer holds (B, H, S, D).
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


def _check_dynamic(cache: DynamicCache) -> None:
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(f"KV rollback and batching support DynamicLayer only, got {type(layer).__name__}")


@torch.inference_mode()
def compact_kv(cache: DynamicCache, keep_len: int, src_slots: list[int]) -> None:
    """Keep slots [0, keep_len), then ``src_slots`` [K] (ascending, >= keep_len) moved after them; drop the
    rest, in place. Raises TypeError for layers that are not plain DynamicLayer."""
    _check_dynamic(cache)
    k, src = len(src_slots), None
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if k:
            if src is None or src.device != layer.keys.device:  # one index copy per cache, not per layer
                src = torch.tensor(src_slots, dtype=torch.long, device=layer.keys.device)
            # Gather first (a copy), then write: sources may overlap the destination range.
            layer.keys[:, :, keep_len : keep_len + k] = layer.keys[:, :, src]
            layer.values[:, :, keep_len : keep_len + k] = layer.values[:, :, src]
        layer.keys = layer.keys[:, :, : keep_len + k]  # (B, H, keep_len + K, D)
        layer.values = layer.values[:, :, : keep_len + k]


def truncate_kv(cache: DynamicCache, length: int) -> None:
    """Roll the cache back to its first ``length`` slots."""
    compact_kv(cache, length, [])


@torch.inference_mode()
def stack_kv(caches: list[DynamicCache], lengths: list[int], config) -> DynamicCache:
    """Stack the first ``lengths[b]`` slots of B single-row caches into one B-row cache.
    caches: B caches, (1, H, >= lengths[b], D) per layer; lengths: [B]. Returns a new DynamicCache of
    (B, H, S, D) layers, S = max(lengths), right-padded with zeros (a mask must hide the padding); a copy,
    so the batch's KV is held twice while it lives. Raises TypeError for layers that are not plain
    DynamicLayer, ValueError when a cache holds fewer slots than asked."""
    if len(caches) != len(lengths):
        raise ValueError(f"lengths: {len(lengths)} entries for {len(caches)} caches")
    for cache, length in zip(caches, lengths):
        _check_dynamic(cache)
        if cache_length(cache) < length:
            raise ValueError(f"lengths: asked for {length} slots of a cache holding {cache_length(cache)}")
    stacked = DynamicCache(config=config)
    _check_dynamic(stacked)
    width = max(lengths, default=0)
    if width == 0:
        return stacked
    for index, layer in enumerate(stacked.layers):
        sources = [(row, cache.layers[index]) for row, cache in enumerate(caches) if lengths[row] > 0]
        ref = sources[0][1]  # a layer with data gives H, D, dtype and device
        _, heads, _, dim = ref.keys.shape
        keys = ref.keys.new_zeros(len(caches), heads, width, dim)  # (B, H, S, D)
        values = ref.values.new_zeros(len(caches), heads, width, ref.values.shape[-1])
        for row, src in sources:
            keys[row, :, : lengths[row]] = src.keys[0, :, : lengths[row]]
            values[row, :, : lengths[row]] = src.values[0, :, : lengths[row]]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return stacked


@torch.inference_mode()
def append_kv_row(cache: DynamicCache, stacked: DynamicCache, row: int, start: int, count: int) -> None:
    """Append slots [start, start + count) of row ``row`` of a B-row ``stacked`` cache to ``cache``.
    cache: (1, H, S, D) per layer, grows to S + count slots; stacked: (B, H, >= start + count, D) per
    layer. Raises TypeError for non-DynamicLayer layers."""
    _check_dynamic(cache)
    for layer, src in zip(cache.layers, stacked.layers):
        keys = src.keys[row : row + 1, :, start : start + count]  # (1, H, count, D)
        values = src.values[row : row + 1, :, start : start + count]
        layer.update(keys, values)


def tail_kv(cache: DynamicCache, start: int) -> list:
    """A copy of every layer's slots from ``start`` on: [(keys, values)] (None for an empty layer)."""
    _check_dynamic(cache)
    return [(layer.keys[:, :, start:].clone(), layer.values[:, :, start:].clone()) if layer.is_initialized else None
            for layer in cache.layers]


def restore_tail_kv(cache: DynamicCache, start: int, tail: list) -> None:
    """Roll the cache back to ``start`` slots, then append a ``tail_kv(cache, start)`` copy (the cache as it was)."""
    truncate_kv(cache, start)
    for layer, kv in zip(cache.layers, tail):
        if kv is not None:
            layer.keys, layer.values = torch.cat([layer.keys, kv[0]], 2), torch.cat([layer.values, kv[1]], 2)  # copies
