"""One model forward over new tokens with explicit position ids and a 4-D additive mask.

Both services call this; it uses the transformers model class unchanged (no vendored modelling
code): transformers takes a ready 4-D mask as is, and appends the new KV to the dynamic cache.
"""

from __future__ import annotations

import inspect

import torch


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
