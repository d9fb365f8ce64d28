"""One model forward over new tokens with explicit position ids and a 4-D additive mask.

Uses the transformers model class unchanged (no vendored modelling code). Speed paths, bit for bit the
transformers forward's logits and KV (tests/test_forward_paths.py; docs/design.md "Speed paths"):
multi-row attention through SDPA's ``enable_gqa`` instead of ``repeat_kv`` copies, and ``DirectDecoder``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec.cpu_linear import PackedLinear
from specdec.interfaces import UnknownSessionError
from specdec.kv_budget import kv_bytes_per_token
from specdec.kv_cache import append_kv_row, stack_kv
from specdec.tree import additive_mask


def _cache_kwarg(model) -> str:
    """``cache`` (transformers 5.x) or ``past_key_values``, whichever this version's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def model_forward(model, cache, input_ids: list[int], position_ids: torch.Tensor, mask: torch.Tensor | None,
                  logits_rows: int | None = None, argmax_head=None) -> torch.Tensor:
    """Run ``model`` on Q new tokens after the cached ones; the cache grows by Q slots.
    input_ids: Q token ids; position_ids: [Q] int64; mask: [1, 1, Q, S + Q] additive in the model's
    dtype, or None for causal; logits_rows: keep only the last that many rows (None = all). Returns
    [logits_rows or Q, V] float32; with ``argmax_head`` (and at most its ``max_rows`` kept rows) the
    argmax ids [logits_rows or Q] int64 instead, without running the model's own head."""
    ids = torch.tensor([input_ids], dtype=torch.long, device=model.device)  # (1, Q)
    kwargs = _forward_kwargs(model, cache, position_ids[None], mask, logits_rows or 0)  # positions (1, Q)
    if argmax_head is not None and min(logits_rows or len(input_ids), len(input_ids)) <= argmax_head.max_rows:
        hidden = _decoder_hidden(model, ids, kwargs)[0]  # (Q', H)
        return argmax_head.argmax(hidden)  # (Q',)
    out = model(ids, **kwargs)
    return out.logits[0].float()  # (Q', V)


DIRECT_MODEL_TYPES = ("qwen2", "llama")  # decoder layouts ``DirectDecoder`` knows (the default pair is qwen2)


def _direct_linear(module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The op a linear layer's forward runs, bound to its weights (int8 dynamic: ``quantized::linear_dynamic``
    minus per-call checks; ``PackedLinear``: its oneDNN op); any other linear is called as is."""
    packed = getattr(module, "_packed_params", None)
    if packed is not None and getattr(packed, "dtype", None) == torch.qint8:
        weights, reduce_range = packed._packed_params, not (module.version is None or module.version < 4)
        op = torch.ops.quantized.linear_dynamic.default
        return lambda x: op(x, weights, reduce_range)
    if type(module) is PackedLinear:  # a float32 linear pre-packed for oneDNN (the CPU target's)
        return module.direct()
    return module


def _direct_norm(module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Qwen2 / Llama RMSNorm's forward as its ops (float32 activations: its dtype casts are no-ops),
    bound to its weight; any other norm module, or one whose forward was replaced, is called as is."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if (not type(module).__name__.endswith("RMSNorm") or weight is None or eps is None or weight.dtype != torch.float32
            or not _own_forward(module)):
        return module

    def norm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return module(x)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    return norm


def _direct_activation(module) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' SiLU activation module as ``F.silu`` (its forward); any other is called as is."""
    known = (type(module).__name__ == "SiLUActivation" and _own_forward(module)) or type(module) is torch.nn.SiLU
    return F.silu if known else module


def _own_forward(module) -> bool:
    """Whether ``module`` runs its class's own forward from transformers' modelling code (not one a
    hub kernel or a patch put in its place, on the instance or the class)."""
    cls = type(module)
    return ("forward" not in vars(module) and cls.forward.__module__ == cls.__module__
            and cls.__module__.startswith("transformers."))


class DirectDecoder:
    """A causal LM's one-session forward over the model's own modules and functions, layer by layer,
    skipping the model forward's per-call plumbing (decorators, mask building, output records); logits
    and KV are bit for bit the model forward's. Build with ``DirectDecoder.of(model)`` (None for models
    outside ``DIRECT_MODEL_TYPES`` with full attention)."""

    def __init__(self, model):
        decoder = model.get_decoder()
        self.model = model
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm = _direct_norm(decoder.norm)
        self.head = _direct_linear(model.get_output_embeddings())
        self.apply_rope = sys.modules[type(decoder.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((_direct_norm(layer.input_layernorm), _direct_linear(attn.q_proj),
                                _direct_linear(attn.k_proj), _direct_linear(attn.v_proj), _direct_linear(attn.o_proj),
                                attn, _direct_norm(layer.post_attention_layernorm), _direct_linear(mlp.gate_proj),
                                _direct_linear(mlp.up_proj), _direct_linear(mlp.down_proj),
                                _direct_activation(mlp.act_fn)))

    @classmethod
    def of(cls, model) -> "DirectDecoder | None":
        """A DirectDecoder of ``model``, or None where its layout is unknown (other model type or attention,
        sliding window, training mode, forward hooks, ...). Hooks added later are not seen and weights are
        read here: build it after adding hooks, quantizing or switching the attention."""
        config = model.config
        if (config.model_type not in DIRECT_MODEL_TYPES or model.training or getattr(config, "is_causal", True) is False
                or model.get_output_embeddings() is None or _hooked(model)
                or config._attn_implementation not in ("sdpa", PACKED_ATTENTION)
                or any(t != "full_attention" for t in getattr(config, "layer_types", None) or ())):
            return None
        try:
            decoder = model.get_decoder()
            for layer in decoder.layers:
                attn, mlp = layer.self_attn, layer.mlp
                names = {name for name, _ in layer.named_children()} | {name for name, _ in attn.named_children()}
                if names != {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp",
                             "q_proj", "k_proj", "v_proj", "o_proj"}:
                    return None
                if {name for name, _ in mlp.named_children()} - {"act_fn"} != {"gate_proj", "up_proj", "down_proj"}:
                    return None
            return cls(model)
        except AttributeError:
            return None

    @torch.inference_mode()
    def __call__(self, cache, input_ids: list[int], position_ids: torch.Tensor, mask: torch.Tensor | None,
                 logits_rows: int | None = None, argmax_head=None) -> torch.Tensor:
        """As ``model_forward(model, cache, ...)``. On an error mid-forward some layers may already hold
        the rows: truncate them."""
        model = self.model
        device, dtype = model.device, model.dtype
        q_len = len(input_ids)
        ids = torch.tensor([input_ids], dtype=torch.long, device=device)  # (1, Q)
        positions = position_ids.to(device)[None]  # (1, Q)
        if mask is not None:
            mask = mask.to(device=device, dtype=dtype)
        elif q_len > 1 and (cached := cache.get_seq_length()) > 0:
            visible = torch.ones(q_len, cached + q_len, dtype=torch.bool, device=device)
            visible[:, cached:] = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
            mask = visible[None, None]  # (1, 1, Q, S + Q): the boolean causal mask transformers builds
        hidden = self.embed(ids)  # (1, Q, H)
        cos, sin = self.rotary(hidden, positions)
        for i, (norm1, q_proj, k_proj, v_proj, o_proj, attn, norm2, gate, up, down, act) in enumerate(self.layers):
            x = norm1(hidden)
            shape = (1, q_len, -1, attn.head_dim)
            q = q_proj(x).view(shape).transpose(1, 2)  # (1, H, Q, D)
            k = k_proj(x).view(shape).transpose(1, 2)  # (1, H_kv, Q, D)
            v = v_proj(x).view(shape).transpose(1, 2)
            q, k = self.apply_rope(q, k, cos, sin)
            k, v = cache.update(k, v, i)  # (1, H_kv, S + Q, D)
            out, _ = _sdpa_attention(attn, q, k, v, mask, native_gqa=True, dropout=0.0, scaling=attn.scaling)
            hidden = hidden + o_proj(out.reshape(1, q_len, -1))
            x = norm2(hidden)
            hidden = hidden + down(act(gate(x)) * up(x))
        hidden = self.norm(hidden[:, -logits_rows:] if logits_rows else hidden)  # (1, Q', H)
        if argmax_head is not None and hidden.shape[1] <= argmax_head.max_rows:
            return argmax_head.argmax(hidden[0])  # (Q',)
        return self.head(hidden)[0].float()  # (Q', V)


_OUTPUT_CAPTURING = "transformers.utils.output_capturing"  # hooks that record outputs only inside a capture


def _hooked(model) -> bool:
    """Whether the model forward would run a hook (module, global or accelerate ``_hf_hook``); transformers'
    output-capturing hooks, inert outside a capture, do not count."""

    def live(hooks) -> bool:
        return any(getattr(hook, "__module__", None) != _OUTPUT_CAPTURING for hook in hooks.values())

    if live(nn_module._global_forward_hooks) or live(nn_module._global_forward_pre_hooks):
        return True
    return any(live(m._forward_hooks) or live(m._forward_pre_hooks) or hasattr(m, "_hf_hook") for m in model.modules())


def _decoder_hidden(model, ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The decoder output (LM head input) [B, K, H] for the rows ``kwargs["logits_to_keep"]`` keeps
    (last int rows, 0 = all, or a [K] index tensor), called as the model class calls it."""
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
def model_forward_batch(model, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """Run ``model`` on B padded rows of Q new tokens each after a batched cache (S slots per row).
    input_ids, position_ids: [B, Q] int64; mask: [B, 1, Q, S + Q] additive, every row seeing at least
    one slot. Returns [B, Q, V] float32, padded rows included; the cache grows by Q slots per row."""
    if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} / position_ids {tuple(position_ids.shape)}: need [B, Q] both"
        )
    b, q = input_ids.shape
    if mask.dim() != 4 or mask.shape[0] != b or mask.shape[2] != q:
        raise ValueError(f"mask: shape {tuple(mask.shape)} is not [{b}, 1, {q}, S + {q}]")
    out = model(input_ids.to(model.device), **_forward_kwargs(model, cache, position_ids, mask, 0))
    return out.logits.float()  # (B, Q, V)


def padded_batch_inputs(ids: Sequence[Sequence[int]], positions: Sequence[torch.Tensor],
                        visible: Sequence[torch.Tensor], cache_lens: Sequence[int], dtype: torch.dtype = torch.float32):
    """Inputs of ``model_forward_batch`` over B sessions' new rows after a right-padded stacked cache.
    ids: B lists of n_b token ids; positions: B (n_b,) position ids; visible: B (n_b, C_b + n_b) bool, which of
    the session's C_b cached slots and n_b new rows each row sees; cache_lens: [B] C_b. With S = max C_b and
    Q = max n_b, row b holds its n_b rows then padding, its keys cache slots 0..S-1 then the Q new slots.
    Returns (input_ids [B, Q] int64, position_ids [B, Q] int64, mask [B, 1, Q, S + Q] additive in ``dtype``):
    pad rows see only their own slot (so none is fully masked) and no real row sees a pad."""
    width = max(cache_lens, default=0)
    q = max((len(row) for row in ids), default=1)
    input_ids = torch.zeros(len(ids), q, dtype=torch.long)
    position_ids = torch.zeros(len(ids), q, dtype=torch.long)
    seen = torch.zeros(len(ids), q, width + q, dtype=torch.bool)
    own = torch.arange(q)
    for b, (row_ids, row_positions, row_visible, length) in enumerate(zip(ids, positions, visible, cache_lens)):
        n = len(row_ids)
        input_ids[b, :n] = torch.tensor(row_ids, dtype=torch.long)
        position_ids[b, :n] = row_positions
        position_ids[b, n:] = int(row_positions[-1]) + 1 if n else length
        seen[b, :n, :length] = row_visible[:, :length]
        seen[b, :n, width : width + n] = row_visible[:, length:]
        seen[b, own[n:], width + own[n:]] = True
    return input_ids, position_ids, additive_mask(seen, dtype)[0, 0][:, None]  # mask: (B, 1, Q, S + Q)


def _forward_kwargs(model, cache, position_ids: torch.Tensor, mask: torch.Tensor | None, keep) -> dict:
    """The model call's keywords: the cache, position ids and additive mask (None: causal) on the model's
    device and dtype, the rows to keep (``logits_to_keep``)."""
    kwargs = {_cache_kwarg(model): cache, "position_ids": position_ids.to(model.device), "use_cache": True,
              "logits_to_keep": keep, **_gqa_kwargs(model)}
    if mask is not None:
        kwargs["attention_mask"] = mask.to(device=model.device, dtype=model.dtype)
    return kwargs


# --- packed rows: several sessions in one forward, each row against its own cache -------------------------

PACKED_ATTENTION = "specdec_packed"


@dataclass(frozen=True)
class PackedSegment:
    """One session's rows inside a packed forward: query rows [start, start + rows) of the packed
    sequence, attending to ``cache`` (its L cached slots; the rows' new KV is appended to it) plus
    its own new rows, through ``mask`` [1, 1, rows, L + rows] additive (0 = visible; None: one row seeing all)."""

    start: int
    rows: int
    cache: object
    mask: torch.Tensor | None


def _sdpa_attention(module, query, key, value, attention_mask, native_gqa: bool = False, **kwargs):
    """transformers' ``sdpa_attention_forward``, but with SDPA's own grouped-query attention (Ainslie et al. 2023,
    "GQA", §2.2) for several masked CPU query rows where transformers copies heads (``repeat_kv``). query: [B, H, Q, D],
    key / value: [B, H_kv, S, D], mask: [B, 1, Q, S] or None. Returns ([B, Q, H, D], None)."""
    if (not native_gqa or attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or getattr(module, "num_key_value_groups", 1) == 1):
        # without a mask transformers already picks enable_gqa itself (head_dim <= 256); one row: its own
        # packed-query path; CUDA: transformers avoids enable_gqa with a mask (the math kernel), not checked here
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"),
        enable_gqa=True)  # (B, H, Q, D)
    return out.transpose(1, 2).contiguous(), None


def _packed_attention(module, query, key, value, attention_mask, packed_rows: tuple[PackedSegment, ...] | None = None,
                      **kwargs):
    """``_sdpa_attention``, or segment by segment against each segment's own cache given ``packed_rows``, the plan
    of a packed forward (a keyword of the model call, handed down to every attention call; the causal mask unread).
    query: [1, H, T, D], key / value: [1, H_kv, T, D]. Returns ([1, T, H, D], None)."""
    if packed_rows is None:
        return _sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # (1, T, H, D)
    for seg in packed_rows:
        rows = slice(seg.start, seg.start + seg.rows)
        keys, values = seg.cache.update(key[:, :, rows], value[:, :, rows], module.layer_idx)  # (1, H_kv, L + n, D)
        out[:, rows], _ = _sdpa_attention(module, query[:, :, rows], keys, values, seg.mask, **kwargs)
    return out, None


def _gqa_kwargs(model) -> dict:
    """The keyword that turns on ``_sdpa_attention``'s grouped-query path, for a model whose attention
    is ours (``use_packed_attention``); nothing for other models (their attention would not read it)."""
    return {"native_gqa": True} if model.config._attn_implementation == PACKED_ATTENTION else {}


def use_packed_attention(model) -> None:
    """Route ``model``'s attention (via ``model.config``) through ``_packed_attention``, plain sdpa for
    unpacked forwards. Raises ValueError for attention other than ``sdpa`` or a class that does not take
    a registered attention function."""
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
def model_forward_packed(model, caches: Sequence, input_ids: Sequence[Sequence[int]],
                         position_ids: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
                         logits_rows: Sequence[int | None] | None = None, argmax_head=None,
                         argmax_rows: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """Run ``model`` once on the new rows of B sessions packed into one sequence, T = sum n_b rows, each
    session attending to its own cache (Krell et al. 2021, "Efficient Sequence Packing without
    Cross-contamination", §3, with a KV cache behind each block as vLLM's varlen attention).

    caches: B dynamic caches (L_b slots, each grows by n_b); input_ids: B lists of n_b >= 1 ids;
    position_ids: B [n_b] int64; masks: B [1, 1, n_b, L_b + n_b] additive (None: one row seeing all);
    logits_rows: per session, its last rows kept (None = all). Returns B [k_b, V] float32, or argmax ids
    [k_b] int64 for sessions with argmax_rows[b] (``ArgmaxHead``). Logits equal the solo forward's up to
    float32 round-off. Not for dynamic / longrope RoPE. Raises ValueError for mismatched lengths, an empty
    row, a bad mask shape or a model without packed attention; after a forward error, truncate the caches."""
    if model.config._attn_implementation != PACKED_ATTENTION:
        raise ValueError("model: call use_packed_attention(model) before packed forwards")
    keep = list(logits_rows) if logits_rows is not None else [None] * len(input_ids)
    if not (len(caches) == len(input_ids) == len(position_ids) == len(masks) == len(keep)) or not caches:
        raise ValueError(f"caches / input_ids / position_ids / masks / logits_rows: lengths {len(caches)} / "
                         f"{len(input_ids)} / {len(position_ids)} / {len(masks)} / {len(keep)} must be equal and >= 1")
    segments, kept = _pack_segments(model, caches, input_ids, masks, keep)
    kwargs = _packed_kwargs(model, input_ids, position_ids, segments, kept)
    ids = torch.tensor([[t for row in input_ids for t in row]], dtype=torch.long, device=model.device)  # (1, T)
    greedy = _argmax_sessions(argmax_head, argmax_rows, kept)
    if not any(greedy):
        logits = model(ids, **kwargs).logits[0].float()  # (K, V)
        return list(logits.split([len(span) for span in kept]))
    hidden = _decoder_hidden(model, ids, kwargs)[0]  # (K, H)
    return _heads_by_session(model, hidden, kept, greedy, argmax_head)


def _pack_segments(model, caches, input_ids, masks, keep) -> tuple[list[PackedSegment], list[range]]:
    """Each session's PackedSegment and its kept packed rows. Sessions of 3 and 2 rows keeping 1 and all ->
    starts 0 and 3, kept [range(2, 3), range(3, 5)]. Raises ValueError for an empty row or a bad mask."""
    device = model.device
    segments, kept, start = [], [], 0
    for b, (cache, ids, mask, k) in enumerate(zip(caches, input_ids, masks, keep)):
        n, cached = len(ids), cache.get_seq_length()
        if mask is None and n == 1:  # one row seeing every slot: no mask
            segments.append(PackedSegment(start, n, cache, None))
        elif not n or mask is None or tuple(mask.shape) != (1, 1, n, cached + n):
            raise ValueError(f"masks[{b}]: shape {None if mask is None else tuple(mask.shape)}, expected "
                             f"(1, 1, {n}, {cached + n}) for {n} >= 1 rows after {cached} cached slots (None: 1 row)")
        else:
            segments.append(PackedSegment(start, n, cache, mask.to(device=device, dtype=model.dtype)))
        kept.append(range(start + n - min(k or n, n), start + n))
        start += n
    return segments, kept


def _packed_kwargs(model, input_ids, position_ids, segments, kept) -> dict:
    """The model call's keyword arguments for a packed forward: positions (1, T), the segments,
    the kept rows (K,) as ``logits_to_keep``, and no cache (each segment writes its own)."""
    device = model.device
    positions = torch.cat([p.to(torch.long) for p in position_ids]).to(device)[None]  # (1, T)
    rows = torch.tensor([r for span in kept for r in span], dtype=torch.long, device=device)  # (K,)
    return {
        _cache_kwarg(model): None,
        "position_ids": positions,
        # any 4-D mask makes transformers skip building its own (the packed attention does not read it)
        "attention_mask": torch.zeros(1, 1, 1, 1, dtype=model.dtype, device=device),
        "use_cache": False,
        "packed_rows": tuple(segments),
        "logits_to_keep": rows,
        **_gqa_kwargs(model),
    }


def _argmax_sessions(argmax_head, argmax_rows, kept) -> list[bool]:
    """Per session, whether its kept rows go through the argmax head; [] (none) without a head or when
    the greedy rows outnumber ``argmax_head.max_rows`` (the full head is then the faster for all)."""
    flags = [bool(flag) for flag in argmax_rows] if argmax_head is not None and argmax_rows is not None else []
    if flags and len(flags) != len(kept):
        raise ValueError(f"argmax_rows: {len(flags)} flags for {len(kept)} sessions")
    if sum(len(span) for span, flag in zip(kept, flags) if flag) > getattr(argmax_head, "max_rows", 0):
        return []
    return flags


def _heads_by_session(model, hidden: torch.Tensor, kept, greedy: list[bool], argmax_head) -> list[torch.Tensor]:
    """hidden [K, H] (the kept rows, session by session) -> per session the argmax ids [k_b] int64
    (greedy[b]) or the LM head's logits [k_b, V] float32, each head run once over its sessions' rows."""
    per_session = hidden.split([len(span) for span in kept])
    chosen = [i for i, flag in enumerate(greedy) if flag]
    other = [i for i, flag in enumerate(greedy) if not flag]
    out: list = [None] * len(kept)
    ids_out = argmax_head.argmax(torch.cat([per_session[i] for i in chosen]))  # (K_greedy,)
    for i, ids in zip(chosen, ids_out.split([len(kept[i]) for i in chosen])):
        out[i] = ids
    if other:
        logits = model.get_output_embeddings()(torch.cat([per_session[i] for i in other])).float()  # (K_other, V)
        for i, rows in zip(other, logits.split([len(kept[i]) for i in other])):
            out[i] = rows
    return out


class ModelRuntime:
    """What the draft and target runtimes share: ``model``, ``sessions`` by id, ``packed`` (``packed_layout``)
    and ``_forward``, one session's forward (``DirectDecoder`` where ``direct`` and it knows the model)."""

    role = "model"  # in the UnknownSessionError message

    def __init__(self, model, packed: bool | None = None, direct: bool = True):
        self.model = model
        self.sessions: dict = {}
        self.packed = packed_layout(model, packed)
        decoder = DirectDecoder.of(model) if direct else None
        self._forward = decoder if decoder is not None else functools.partial(model_forward, model)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one cached token holds (``specdec.kv_budget``)."""
        return kv_bytes_per_token(self.model.config, self.model.dtype.itemsize)

    @property
    def device(self) -> str:
        """The model's device, e.g. "cpu" or "cuda:1" (where the KV cache grows)."""
        return str(self.model.device)

    def release(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def _session(self, session_id: str):
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"session_id: unknown {self.role} session {session_id!r}") from None

    def _forward_padded(self, caches: list, ids: list, positions: list, visible: list) -> list[torch.Tensor]:
        """B sessions' new rows as one padded batch after their stacked caches (``padded_batch_inputs``), each
        session's new KV then appended to its own cache. Returns B logits [n_b, V] float32."""
        lengths = [cache.get_seq_length() for cache in caches]
        stacked = stack_kv(caches, lengths, self.model.config)  # (B, H, S, D)
        batch = padded_batch_inputs(ids, positions, visible, lengths, self.model.dtype)
        logits = model_forward_batch(self.model, stacked, *batch)  # (B, Q, V)
        for b, cache in enumerate(caches):
            append_kv_row(cache, stacked, b, max(lengths), len(ids[b]))
        return [logits[b, : len(row)] for b, row in enumerate(ids)]
