"""The two speed paths of specdec.forward give the transformers forward's logits and KV bit for bit.

- ``DirectDecoder`` (the draft's one-session forward, layer by layer over the model's own modules)
  against ``model_forward`` (the transformers model forward), on Qwen2 and Llama, float32 and int8
  (the draft default), attention switched to ours or plain sdpa, over every call shape the draft
  runtime makes: a prefill from an empty cache, a chunk after cached slots, a root step of several
  pending tokens, one row with and without a mask, tree rows with a tree mask, last-row logits only.
- ``_sdpa_attention``'s grouped-query path (several masked rows) against transformers' own sdpa
  path (``repeat_kv``), and only for the forwards that come through this module: a plain model call
  on the same model object (HF generate) keeps transformers' path.

Equality is exact (``torch.equal``): a wrong rotary, norm, residual, mask, cache or head would move
logits far beyond float32 round-off, and a reordered sum would move them by round-off, both caught.
"""

from __future__ import annotations

import copy

import pytest
import torch

import specdec.forward as forward
from specdec.forward import DirectDecoder, model_forward, use_packed_attention
from specdec.kv_cache import new_cache
from specdec.model_setup import quantize_draft
from specdec.tree import additive_mask
from tests.conftest import VOCAB, cache_kv, random_prompt, tiny_model


def _variant(kind: str, int8: bool, ours: bool):
    model = copy.deepcopy(tiny_model(kind, seed=7))  # own copy: quantizing and switching attention mutate it
    if int8:
        model = quantize_draft(model)
    if ours:
        use_packed_attention(model)
    return model


def _tree_mask(cached: int, parents: list[int]) -> torch.Tensor:
    """[1, 1, P, cached + P] additive: every row sees the cache, its ancestors among the P rows and itself."""
    p = len(parents)
    visible = torch.zeros(p, cached + p, dtype=torch.bool)
    visible[:, :cached] = True
    for row, parent in enumerate(parents):
        visible[row, cached + row] = True
        while parent >= 0:
            visible[row, cached + parent] = True
            parent = parents[parent]
    return additive_mask(visible, torch.float32)


def _calls(cached: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None, int | None]]:
    """The draft runtime's call shapes after ``cached`` prompt slots: (ids, positions, mask, logits_rows)."""
    ids = random_prompt(seed=31, length=12)
    at = cached
    out = []
    for n, mask_kind, keep in ((3, None, 1), (1, None, None), (1, "plain", None), (4, "tree", None),
                               (6, "tree", None), (2, None, None)):
        if mask_kind is None:
            mask = None
        elif mask_kind == "plain":
            mask = additive_mask(torch.ones(1, at + 1, dtype=torch.bool), torch.float32)
        else:
            mask = _tree_mask(at, [-1, 0, 0, 1, 3, -1][:n])
        out.append((ids[:n], torch.arange(at, at + n), mask, keep))
        at += n
        ids = ids[n:] + ids[:n]
    return out


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("ours", [True, False], ids=["our-attention", "sdpa"])
def test_direct_decoder_equals_the_model_forward_bit_for_bit(kind, int8, ours):
    model = _variant(kind, int8, ours)
    direct = DirectDecoder.of(model)
    assert direct is not None
    prompt = random_prompt(seed=30, length=40)
    ref_cache, cache = new_cache(model.config), new_cache(model.config)
    calls = [(prompt[:25], torch.arange(25), None, 1), (prompt[25:], torch.arange(25, 40), None, 1)]  # prefill, chunk
    calls += _calls(40)
    for i, (ids, positions, mask, keep) in enumerate(calls):
        expected = model_forward(model, ref_cache, ids, positions, mask, logits_rows=keep)
        got = direct(cache, ids, positions, mask, logits_rows=keep)
        assert got.shape == expected.shape == ((keep or len(ids)), VOCAB), i
        assert got.dtype == torch.float32
        assert torch.equal(got, expected), (i, (got - expected).abs().max().item())
        for (k, v), (ref_k, ref_v) in zip(cache_kv(cache), cache_kv(ref_cache)):
            assert torch.equal(k, ref_k) and torch.equal(v, ref_v), i


def test_direct_int8_linears_call_the_quantized_op_and_match_the_module():
    model = _variant("qwen2", int8=True, ours=True)
    layer = model.get_decoder().layers[0].mlp.gate_proj
    op = forward._direct_linear(layer)
    assert op is not layer  # bound to the op, not the module
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(op(x), layer(x))
    plain = tiny_model("qwen2", seed=7).get_decoder().layers[0].mlp.gate_proj
    assert forward._direct_linear(plain) is plain


def test_direct_decoder_is_none_for_layouts_it_does_not_know():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    eager = copy.deepcopy(tiny_model("qwen2", seed=7))
    eager.set_attn_implementation("eager")
    assert DirectDecoder.of(eager) is None
    training = copy.deepcopy(tiny_model("qwen2", seed=7)).train()
    assert DirectDecoder.of(training) is None
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=1)
    sliding = Qwen2ForCausalLM(config).eval()
    assert "sliding_attention" in sliding.config.layer_types
    assert DirectDecoder.of(sliding) is None
    extra = copy.deepcopy(tiny_model("qwen2", seed=7))
    extra.get_decoder().layers[1].self_attn.q_norm = torch.nn.LayerNorm(8)  # a Qwen3-style extra norm
    assert DirectDecoder.of(extra) is None
    assert DirectDecoder.of(tiny_model("llama", seed=7)) is not None


class _SdpaSpy:
    """Records, per attention call, whether transformers' sdpa path ran and SDPA's enable_gqa."""

    def __init__(self, monkeypatch):
        self.transformers_calls: list[int] = []  # query rows of each call through transformers' path
        self.native_calls: list[int] = []  # query rows of each call SDPA got with enable_gqa from us
        real_hf, real_sdpa = forward.sdpa_attention_forward, forward.F.scaled_dot_product_attention
        inside = []  # non-empty while transformers' path runs (it may ask SDPA for enable_gqa itself)

        def hf(module, query, *args, **kwargs):
            self.transformers_calls.append(query.shape[2])
            inside.append(True)
            try:
                return real_hf(module, query, *args, **kwargs)
            finally:
                inside.pop()

        def sdpa(query, *args, **kwargs):
            if kwargs.get("enable_gqa") and not inside:
                self.native_calls.append(query.shape[2])
            return real_sdpa(query, *args, **kwargs)

        monkeypatch.setattr(forward, "sdpa_attention_forward", hf)
        monkeypatch.setattr(forward.F, "scaled_dot_product_attention", sdpa)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_masked_rows_use_grouped_query_sdpa_with_transformers_logits(kind, monkeypatch):
    """A tree verify (masked rows) through our attention: SDPA's grouped-query path, logits and KV
    equal to the same forward on plain sdpa (transformers' repeat_kv path); one row keeps transformers'."""
    ours, plain = _variant(kind, int8=False, ours=True), _variant(kind, int8=False, ours=False)
    prompt = random_prompt(seed=32, length=30)
    caches = {}
    for name, model in (("ours", ours), ("plain", plain)):
        caches[name] = new_cache(model.config)
        model_forward(model, caches[name], prompt, torch.arange(30), None, logits_rows=1)
    spy = _SdpaSpy(monkeypatch)
    mask = _tree_mask(30, [-1, 0, 0, 1, 3])
    got = model_forward(ours, caches["ours"], [5, 6, 7, 8, 9], torch.tensor([30, 31, 31, 32, 33]), mask)
    assert spy.native_calls == [5, 5] and spy.transformers_calls == []  # both layers, grouped in SDPA
    expected = model_forward(plain, caches["plain"], [5, 6, 7, 8, 9], torch.tensor([30, 31, 31, 32, 33]), mask)
    assert spy.native_calls == [5, 5]  # plain sdpa: transformers' own registered function, not ours
    assert torch.equal(got, expected)
    for (k, v), (ref_k, ref_v) in zip(cache_kv(caches["ours"]), cache_kv(caches["plain"])):
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    spy.transformers_calls.clear()
    spy.native_calls.clear()
    model_forward(ours, caches["ours"], [4], torch.tensor([35]), _tree_mask(35, [-1]))
    assert spy.transformers_calls == [1, 1] and spy.native_calls == []  # one row: transformers' packed query


def test_a_plain_model_call_on_our_attention_keeps_transformers_path(monkeypatch):
    """HF generate on the same model object (the bench's target-only and HF columns) calls the model
    without our keyword: transformers' sdpa path for its masked rows, as on a model never switched."""
    model = _variant("qwen2", int8=False, ours=True)
    spy = _SdpaSpy(monkeypatch)
    ids = torch.tensor([random_prompt(seed=33, length=9)])
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        cache = new_cache(model.config)
        model(ids[:, :5], cache=cache, use_cache=True)
        model(ids[:, 5:], cache=cache, use_cache=True)  # 4 rows after 5 cached: a masked causal forward
    assert spy.native_calls == []
    assert 4 in spy.transformers_calls
