"""One model forward over new tokens with explicit position ids and a 4-D additive mask.

Both services call this; it uses the transformers model class unchanged (no vendored modelling
code): transformers takes a ready 4-D mask as is, and appends the new KV to the dynamic cache.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def _cache_kwarg(model) -> str:
    # transformers renamed `past_key_values` to `cache` in 5.x; take whichever this version has.
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def model_forward(
    model,
    cache,
    input_ids: list[int],
    position_ids: torch.Tensor,
    mask: torch.Tensor | None,
    logits_rows: int | None = None,
) -> torch.Tensor:
    """Run ``model`` on Q new tokens after the cached ones; returns float32 logits.

    input_ids: Q token ids; position_ids: [Q] int64; mask: [1, 1, Q, S + Q] additive in the
    model's dtype, or None for plain causal attention; logits_rows: keep only the last that many
    rows (None = all). Returns [logits_rows or Q, V] float32. The cache grows by Q slots.
    """
    device = model.device
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)  # (1, Q)
    kwargs = {
        _cache_kwarg(model): cache,
        "position_ids": position_ids.to(device)[None],  # (1, Q)
        "use_cache": True,
        "logits_to_keep": logits_rows or 0,
    }
    if mask is not None:
        kwargs["attention_mask"] = mask.to(device=device, dtype=model.dtype)
    out = model(ids, **kwargs)
    return out.logits[0].float()  # (Q', V)


@torch.inference_mode()
def model_forward_batch(
    model,
    cache,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Run ``model`` on B rows of Q new tokens each after a batched cache; returns float32 logits.

    The batched form of ``model_forward`` (which stays the batch-of-one path): every row has its own
    position ids and its own mask rows, so rows may hold different sessions with different cached
    lengths (padded to a common S) and different numbers of real new tokens (padded to Q).

    cache: a DynamicCache with B rows of S slots (may be empty, S = 0); input_ids: [B, Q] int64;
    position_ids: [B, Q] int64; mask: [B, 1, Q, S + Q] additive (0 = visible, dtype min = hidden),
    converted to the model's dtype. Every mask row must see at least one slot (a fully hidden row
    is a softmax over nothing). Returns [B, Q, V] float32 for every row, padded ones included. The
    cache grows by Q slots per row.
    """
    device = model.device
    if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} / position_ids {tuple(position_ids.shape)}: need [B, Q] both"
        )
    b, q = input_ids.shape
    if mask.dim() != 4 or mask.shape[0] != b or mask.shape[2] != q:
        raise ValueError(f"mask: shape {tuple(mask.shape)} is not [{b}, 1, {q}, S + {q}]")
    kwargs = {
        _cache_kwarg(model): cache,
        "position_ids": position_ids.to(device),  # (B, Q)
        "attention_mask": mask.to(device=device, dtype=model.dtype),  # (B, 1, Q, S + Q)
        "use_cache": True,
        "logits_to_keep": 0,
    }
    out = model(input_ids.to(device), **kwargs)
    return out.logits.float()  # (B, Q, V)


# --- packed rows: several sessions in one forward, each row against its own cache -------------------------

PACKED_ATTENTION = "specdec_packed"


@dataclass(frozen=True)
class PackedSegment:
    """One session's rows inside a packed forward: query rows [start, start + rows) of the packed
    sequence, attending to ``cache`` (its L cached slots; the rows' new KV is appended to it) plus
    its own new rows, through ``mask`` [1, 1, rows, L + rows] additive (0 = visible)."""

    start: int
    rows: int
    cache: object
    mask: torch.Tensor


@dataclass(frozen=True)
class PackedRows:
    """The attention plan of a packed forward (a keyword argument of the model call, which
    transformers hands down to every attention call; the model's own causal mask is ignored)."""

    segments: tuple[PackedSegment, ...]


def _packed_attention(module, query, key, value, attention_mask, packed_rows: PackedRows | None = None, **kwargs):
    """``sdpa`` attention, or segment by segment when the forward was given a PackedRows plan.

    query: [1, H, T, D], key / value: [1, H_kv, T, D] for the T packed new rows. Each segment's keys
    are its own cache's slots followed by its own new rows (its cache grows by them, as
    ``DynamicCache.update`` does in a solo forward), so a row never attends to another session and
    costs what it costs alone. Returns ([1, T, H, D], None), the layout ``sdpa`` returns.
    """
    if packed_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # (1, T, H, D)
    for seg in packed_rows.segments:
        rows = slice(seg.start, seg.start + seg.rows)
        keys, values = seg.cache.update(key[:, :, rows], value[:, :, rows], module.layer_idx)  # (1, H_kv, L + n, D)
        out[:, rows], _ = sdpa_attention_forward(module, query[:, :, rows], keys, values, seg.mask, **kwargs)
    return out, None


def use_packed_attention(model) -> None:
    """Route ``model``'s attention through ``_packed_attention`` (plain ``sdpa`` for every forward
    that is not packed, so other forwards are unchanged). Raises ValueError for a model whose
    attention is not ``sdpa`` (eager, flash, flex: packing is built on sdpa)."""
    current = model.config._attn_implementation
    if current == PACKED_ATTENTION:
        return
    if current != "sdpa":
        raise ValueError(f"attn_implementation: packed forwards need 'sdpa', the model has {current!r}")
    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(PACKED_ATTENTION)


@torch.inference_mode()
def model_forward_packed(
    model,
    caches: Sequence,
    input_ids: Sequence[Sequence[int]],
    position_ids: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """Run ``model`` once on the new rows of B sessions, packed into one sequence (no padding).

    caches: B dynamic caches (L_b slots each; each grows by its n_b rows); input_ids: B lists of n_b
    >= 1 ids; position_ids: B [n_b] int64; masks: B [1, 1, n_b, L_b + n_b] additive. The linear
    layers run over T = sum n_b rows (a padded batch would run B * max n_b), attention runs per
    session against its own cache (``_packed_attention``; the model must have gone through
    ``use_packed_attention``). Returns B [n_b, V] float32 logits.

    Numerics: each session's attention is its solo forward's; the GEMMs see T rows instead of n_b,
    so logits equal the solo forward's up to float32 round-off (same order as a batched forward).
    Raises ValueError for mismatched lengths or a model without packed attention. On an error in
    the forward, some layers of some caches may already hold the new rows: truncate them.
    """
    if model.config._attn_implementation != PACKED_ATTENTION:
        raise ValueError("model: call use_packed_attention(model) before packed forwards")
    if not (len(caches) == len(input_ids) == len(position_ids) == len(masks)) or not caches:
        raise ValueError(f"caches / input_ids / position_ids / masks: lengths {len(caches)} / {len(input_ids)} / "
                         f"{len(position_ids)} / {len(masks)} must be equal and >= 1")
    device = model.device
    segments, start = [], 0
    for cache, ids, mask in zip(caches, input_ids, masks):
        segments.append(PackedSegment(start, len(ids), cache, mask.to(device=device, dtype=model.dtype)))
        start += len(ids)
    plan = PackedRows(tuple(segments))
    ids = torch.tensor([[t for row in input_ids for t in row]], dtype=torch.long, device=device)  # (1, T)
    positions = torch.cat([p.to(torch.long) for p in position_ids]).to(device)[None]  # (1, T)
    kwargs = {
        _cache_kwarg(model): None,
        "position_ids": positions,
        "use_cache": False,
        "packed_rows": plan,
        "logits_to_keep": 0,
    }
    logits = model(ids, **kwargs).logits[0].float()  # (T, V)
    return [logits[seg.start : seg.start + seg.rows] for seg in segments]
