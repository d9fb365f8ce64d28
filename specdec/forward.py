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
    argmax_head=None,
) -> torch.Tensor:
    """Run ``model`` on Q new tokens after the cached ones; returns float32 logits.

    input_ids: Q token ids; position_ids: [Q] int64; mask: [1, 1, Q, S + Q] additive in the
    model's dtype, or None for plain causal attention; logits_rows: keep only the last that many
    rows (None = all). Returns [logits_rows or Q, V] float32. The cache grows by Q slots.
    argmax_head: a ``specdec.argmax_head.ArgmaxHead`` of the model's LM head: then the kept rows'
    argmax ids [logits_rows or Q] int64 are returned instead of their logits (greedy rows; the
    model's own head is not run), for up to ``argmax_head.max_rows`` kept rows (more: logits, the
    full head being the faster there).
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
    if argmax_head is not None and min(logits_rows or len(input_ids), len(input_ids)) <= argmax_head.max_rows:
        hidden = _decoder_hidden(model, ids, kwargs)[0]  # (Q', H)
        return argmax_head.argmax(hidden)  # (Q',)
    out = model(ids, **kwargs)
    return out.logits[0].float()  # (Q', V)


def _decoder_hidden(model, ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The causal LM's decoder output (the LM head's input) for the rows ``kwargs["logits_to_keep"]``
    keeps (an int: the last that many, 0 = all; or a [K] index tensor): [B, K, H]. The same call
    the transformers model class makes before its head, so the cache and attention are unchanged."""
    keep = kwargs.pop("logits_to_keep")
    decoder = model.get_decoder()
    cache_key = _cache_kwarg(model)
    call = dict(kwargs)
    call[_cache_kwarg(decoder)] = call.pop(cache_key)
    hidden = decoder(ids, **call).last_hidden_state  # (B, Q, H)
    if isinstance(keep, int):
        return hidden[:, -keep:] if keep else hidden
    return hidden[:, keep]


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
    attention is not ``sdpa`` (eager, flash, flex: packing is built on sdpa) or whose class does not
    take a registered attention function (transformers then only warns and keeps sdpa).

    The switch is on ``model.config``: a model sharing that config object switches too (harmless:
    without a PackedRows plan the packed attention is sdpa)."""
    current = model.config._attn_implementation
    if current == PACKED_ATTENTION:
        return
    if current != "sdpa":
        raise ValueError(f"attn_implementation: packed forwards need 'sdpa', the model has {current!r}")
    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(PACKED_ATTENTION)
    if model.config._attn_implementation != PACKED_ATTENTION:
        raise ValueError(f"attn_implementation: {type(model).__name__} does not take a registered attention "
                         f"function (still {model.config._attn_implementation!r}): packed forwards need it")


def packed_layout(model, packed: bool | None) -> bool:
    """Whether a runtime's batched forwards pack rows (``model_forward_packed``): packed=True
    switches the model (``use_packed_attention``, ValueError where it cannot), False keeps the
    padded batch, None packs where the model can be switched and stays padded elsewhere."""
    if packed is False:
        return False
    try:
        use_packed_attention(model)
    except ValueError:
        if packed:
            raise
        return False
    return True


@torch.inference_mode()
def model_forward_packed(
    model,
    caches: Sequence,
    input_ids: Sequence[Sequence[int]],
    position_ids: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    logits_rows: Sequence[int | None] | None = None,
    argmax_head=None,
    argmax_rows: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """Run ``model`` once on the new rows of B sessions, packed into one sequence (no padding).

    caches: B dynamic caches (L_b slots each; each grows by its n_b rows); input_ids: B lists of n_b
    >= 1 ids; position_ids: B [n_b] int64; masks: B [1, 1, n_b, L_b + n_b] additive; logits_rows:
    per session, keep only its last that many rows' logits (None = all; the LM head runs only
    over the rows kept, e.g. 1 for a prefill chunk). The linear layers run over T = sum n_b rows (a
    padded batch would run B * max n_b), attention runs per session against its own cache
    (``_packed_attention``; the model must have gone through ``use_packed_attention``). Returns B
    [k_b, V] float32 logits (k_b = logits_rows[b] or n_b). This is sequence packing without
    cross-contamination (Krell et al. 2021, "Efficient Sequence Packing without
    Cross-contamination", section 3: block-diagonal attention, per-sequence positions), with each
    sequence's own KV cache behind its block, as vLLM's varlen attention batches requests.

    argmax_head, argmax_rows: with an ``ArgmaxHead`` of the model's LM head, session b with
    argmax_rows[b] True gets its kept rows' argmax ids [k_b] int64 instead of logits (greedy
    sessions, while their rows number at most ``argmax_head.max_rows``); the model's own head runs
    only over the other sessions' rows.

    Numerics: each session's attention is its solo forward's; the GEMMs see T rows instead of n_b,
    so logits equal the solo forward's up to float32 round-off (same order as a batched forward).
    Not for dynamic / longrope RoPE, whose angles depend on the largest position in the forward
    (the padded batch has the same limit); the default pair's RoPE is static.
    Raises ValueError for mismatched lengths, an empty row, a mask of the wrong shape or a model
    without packed attention. On an error in the forward, some layers of some caches may already
    hold the new rows: truncate them.
    """
    if model.config._attn_implementation != PACKED_ATTENTION:
        raise ValueError("model: call use_packed_attention(model) before packed forwards")
    keep = list(logits_rows) if logits_rows is not None else [None] * len(input_ids)
    if not (len(caches) == len(input_ids) == len(position_ids) == len(masks) == len(keep)) or not caches:
        raise ValueError(f"caches / input_ids / position_ids / masks / logits_rows: lengths {len(caches)} / "
                         f"{len(input_ids)} / {len(position_ids)} / {len(masks)} / {len(keep)} must be equal and >= 1")
    device = model.device
    segments, kept, start = [], [], 0
    for b, (cache, ids, mask, k) in enumerate(zip(caches, input_ids, masks, keep)):
        n, cached = len(ids), cache.get_seq_length()
        if not n or tuple(mask.shape) != (1, 1, n, cached + n):
            raise ValueError(f"masks[{b}]: shape {tuple(mask.shape)}, expected (1, 1, {n}, {cached + n}) "
                             f"for {n} >= 1 rows after {cached} cached slots")
        segments.append(PackedSegment(start, n, cache, mask.to(device=device, dtype=model.dtype)))
        kept.append(range(start + n - min(k or n, n), start + n))
        start += n
    ids = torch.tensor([[t for row in input_ids for t in row]], dtype=torch.long, device=device)  # (1, T)
    positions = torch.cat([p.to(torch.long) for p in position_ids]).to(device)[None]  # (1, T)
    rows = torch.tensor([r for span in kept for r in span], dtype=torch.long, device=device)  # (K,)
    kwargs = {
        _cache_kwarg(model): None,
        "position_ids": positions,
        # any 4-D mask makes transformers skip building its own (the packed attention does not read it)
        "attention_mask": torch.zeros(1, 1, 1, 1, dtype=model.dtype, device=device),
        "use_cache": False,
        "packed_rows": PackedRows(tuple(segments)),
        "logits_to_keep": rows,
    }
    wants_argmax = [bool(flag) for flag in argmax_rows] if argmax_head is not None and argmax_rows is not None else []
    if wants_argmax and len(wants_argmax) != len(kept):
        raise ValueError(f"argmax_rows: {len(wants_argmax)} flags for {len(kept)} sessions")
    if sum(len(span) for span, flag in zip(kept, wants_argmax) if flag) > getattr(argmax_head, "max_rows", 0):
        wants_argmax = []  # more greedy rows than the screen pays for: the full head for all
    if not any(wants_argmax):
        logits = model(ids, **kwargs).logits[0].float()  # (K, V)
        out, at = [], 0
        for span in kept:
            out.append(logits[at : at + len(span)])
            at += len(span)
        return out
    hidden = _decoder_hidden(model, ids, kwargs)[0]  # (K, H)
    spans, at = [], 0
    for span in kept:
        spans.append(slice(at, at + len(span)))
        at += len(span)
    greedy = [i for i, flag in enumerate(wants_argmax) if flag]
    other = [i for i, flag in enumerate(wants_argmax) if not flag]
    out: list = [None] * len(kept)
    ids_out = argmax_head.argmax(torch.cat([hidden[spans[i]] for i in greedy]))  # (K_greedy,)
    at = 0
    for i in greedy:
        n = spans[i].stop - spans[i].start
        out[i] = ids_out[at : at + n]
        at += n
    if other:
        logits = model.get_output_embeddings()(torch.cat([hidden[spans[i]] for i in other])).float()  # (K_other, V)
        at = 0
        for i in other:
            n = spans[i].stop - spans[i].start
            out[i] = logits[at : at + n]
            at += n
    return out
