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
from tests.conftest import VOCAB, cache_kv, random_prompt, tiny_model, tree_mask


def _variant(kind: str, int8: bool, ours: bool, bf16: bool = False):
    model = copy.deepcopy(tiny_model(kind, seed=7))  # own copy: quantizing and switching attention mutate it
    if bf16:
        model = model.to(torch.bfloat16)
    if int8:
        model = quantize_draft(model)
    if ours:
        use_packed_attention(model)
    return model


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
            mask = tree_mask(at, [-1, 0, 0, 1, 3, -1][:n])
        out.append((ids[:n], torch.arange(at, at + n), mask, keep))
        at += n
        ids = ids[n:] + ids[:n]
    return out


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("weights", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("ours", [True, False], ids=["our-attention", "sdpa"])
def test_direct_decoder_equals_the_model_forward_bit_for_bit(kind, weights, ours):
    """(The masks are float32 additive, as the draft runtime builds them for a float32 draft: a
    bfloat16 model gets them cast, as the model forward casts them.)"""
    model = _variant(kind, weights == "int8", ours, bf16=weights == "bfloat16")
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
    not_causal = copy.deepcopy(tiny_model("qwen2", seed=7))
    not_causal.config.is_causal = False
    assert DirectDecoder.of(not_causal) is None
    patched = copy.deepcopy(tiny_model("qwen2", seed=7))  # a replaced norm forward (as a hub kernel does)
    norm = patched.get_decoder().layers[0].input_layernorm
    norm.forward = lambda x: x * 2.0
    assert forward._direct_norm(norm) is norm  # called as the module: the replacement runs
    assert forward._direct_norm(patched.get_decoder().layers[1].input_layernorm) is not patched.get_decoder().layers[1].input_layernorm
    decoder = DirectDecoder.of(patched)
    cache, ref = new_cache(patched.config), new_cache(patched.config)
    ids = random_prompt(seed=38, length=6)
    assert torch.equal(decoder(cache, ids, torch.arange(6), None), model_forward(patched, ref, ids, torch.arange(6), None))
    assert DirectDecoder.of(tiny_model("llama", seed=7)) is not None
    hooked = copy.deepcopy(tiny_model("qwen2", seed=7))  # a forward hook the layer-by-layer calls would skip
    handle = hooked.get_decoder().layers[1].mlp.down_proj.register_forward_hook(lambda *_: None)
    assert DirectDecoder.of(hooked) is None
    handle.remove()
    assert DirectDecoder.of(hooked) is not None
    handle = hooked.get_decoder().layers[0].self_attn.register_forward_pre_hook(lambda *_: None)
    assert DirectDecoder.of(hooked) is None
    handle.remove()
    hooked.get_decoder().layers[0].mlp._hf_hook = object()  # accelerate's dispatch / offload hook
    assert DirectDecoder.of(hooked) is None
    del hooked.get_decoder().layers[0].mlp._hf_hook
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)  # a global hook
    try:
        assert DirectDecoder.of(hooked) is None
    finally:
        handle.remove()
    assert DirectDecoder.of(hooked) is not None
    with torch.inference_mode():  # leaves transformers' output-capturing hooks on the layers: idle outside a capture
        hooked(torch.tensor([random_prompt(seed=39, length=4)]), output_hidden_states=True)
    assert any(m._forward_hooks for m in hooked.modules())
    decoder = DirectDecoder.of(hooked)
    cache, ref = new_cache(hooked.config), new_cache(hooked.config)
    ids = random_prompt(seed=40, length=5)
    assert torch.equal(decoder(cache, ids, torch.arange(5), None), model_forward(hooked, ref, ids, torch.arange(5), None))


def test_the_draft_runtime_forwards_through_the_direct_decoder_with_the_same_trees():
    """DraftRuntime's one-session forwards go through DirectDecoder where it knows the model (and not
    with direct=False, or for eager attention), and its trees, log-probs and cache are the same."""
    from draft_service.runtime import DraftRuntime
    from specdec.tree_spec import TreeSpec

    spec = TreeSpec(gamma=3, topKSpec=[[3], [1, 1], [1, 1]], topHead=[1, 2, 2])

    model = _variant("qwen2", int8=True, ours=False)
    direct, plain = DraftRuntime(model), DraftRuntime(model, direct=False)
    assert isinstance(direct._forward, DirectDecoder) and not isinstance(plain._forward, DirectDecoder)
    eager = copy.deepcopy(tiny_model("qwen2", seed=7))
    eager.set_attn_implementation("eager")
    assert not isinstance(DraftRuntime(eager, packed=False)._forward, DirectDecoder)
    prompt = random_prompt(seed=34, length=20)
    for runtime in (direct, plain):
        runtime.start("a", prompt)
        runtime.prefill("a", 8)
    for accept in (2, 0, 3, 1):  # partial acceptance along the first-child path, then a bonus token
        trees = [runtime.propose("a", spec, 3) for runtime in (direct, plain)]
        assert (trees[0].tokens, trees[0].parents) == (trees[1].tokens, trees[1].parents), accept
        assert trees[0].draft_logprobs == trees[1].draft_logprobs, accept
        path, node = [], -1
        while len(path) < accept and node in trees[0].parents:
            node = trees[0].parents.index(node)
            path.append(node)
        for runtime in (direct, plain):
            runtime.commit("a", [*[trees[0].tokens[n] for n in path], 9], path)
    for (k, v), (ref_k, ref_v) in zip(cache_kv(direct.sessions["a"].cache), cache_kv(plain.sessions["a"].cache)):
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


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
    for model in (ours, plain):  # a scale that is not SDPA's default: the new path must pass it on
        for layer in model.get_decoder().layers:
            layer.self_attn.scaling = 0.3
    prompt = random_prompt(seed=32, length=30)
    caches = {}
    for name, model in (("ours", ours), ("plain", plain)):
        caches[name] = new_cache(model.config)
        model_forward(model, caches[name], prompt, torch.arange(30), None, logits_rows=1)
    spy = _SdpaSpy(monkeypatch)
    mask = tree_mask(30, [-1, 0, 0, 1, 3])
    got = model_forward(ours, caches["ours"], [5, 6, 7, 8, 9], torch.tensor([30, 31, 31, 32, 33]), mask)
    assert spy.native_calls == [5, 5] and spy.transformers_calls == []  # both layers, grouped in SDPA
    expected = model_forward(plain, caches["plain"], [5, 6, 7, 8, 9], torch.tensor([30, 31, 31, 32, 33]), mask)
    assert spy.native_calls == [5, 5]  # plain sdpa: transformers' own registered function, not ours
    assert torch.equal(got, expected)
    for (k, v), (ref_k, ref_v) in zip(cache_kv(caches["ours"]), cache_kv(caches["plain"])):
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    spy.transformers_calls.clear()
    spy.native_calls.clear()
    model_forward(ours, caches["ours"], [4], torch.tensor([35]), tree_mask(35, [-1]))
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


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_batched_verify_rows_use_grouped_query_sdpa_with_transformers_logits(layout, monkeypatch):
    """Several sessions' masked rows in one forward (the target's merged verify, the draft's merged
    steps), packed or padded: SDPA's grouped-query path, logits equal to plain sdpa's."""
    from specdec.forward import model_forward_batch, model_forward_packed
    from specdec.kv_cache import stack_kv

    ours, plain = _variant("qwen2", int8=False, ours=True), _variant("qwen2", int8=False, ours=False)
    prompts = [random_prompt(seed=35, length=12), random_prompt(seed=36, length=12)]
    parents = [[-1, 0, 0, 1], [-1, 0, 1, 2]]
    ids = [[3, 4, 5, 6], [7, 8, 9, 10]]
    masks = [tree_mask(12, p) for p in parents]
    positions = [torch.tensor([12, 13, 13, 14]), torch.tensor([12, 13, 14, 15])]
    outs = {}
    for name, model in (("ours", ours), ("plain", plain)):
        caches = []
        for prompt in prompts:
            caches.append(new_cache(model.config))
            model_forward(model, caches[-1], prompt, torch.arange(12), None, logits_rows=1)
        spy = _SdpaSpy(monkeypatch)
        if layout == "packed" and name == "ours":
            outs[name] = torch.stack(model_forward_packed(model, caches, ids, positions, masks))
        elif layout == "packed":  # plain sdpa cannot pack: the same rows one session at a time
            outs[name] = torch.stack([model_forward(model, c, i, p, m) for c, i, p, m in zip(caches, ids, positions, masks)])
        else:
            stacked = stack_kv(caches, [12, 12], model.config)
            outs[name] = model_forward_batch(model, stacked, torch.tensor(ids), torch.stack(positions), torch.cat(masks))
        expected_native = ([4, 4] * 2 if layout == "packed" else [4, 4]) if name == "ours" else []
        assert spy.native_calls == expected_native, (name, spy.native_calls)
        monkeypatch.undo()
    assert torch.equal(outs["ours"], outs["plain"])


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_direct_decoder_on_a_prepacked_target_with_its_argmax_head(kind):
    """The CPU target's load path (argmax screen attached, linears pre-packed for oneDNN): logits and
    the screened argmax ids equal the model forward's, and TargetRuntime forwards through it."""
    from specdec.argmax_head import argmax_head_of, attach_argmax_head, fbgemm_available
    from specdec.cpu_linear import PackedLinear, prepack_linears
    from target_service.runtime import TargetRuntime

    model = copy.deepcopy(tiny_model(kind, seed=7))
    screened = fbgemm_available() and attach_argmax_head(model)
    assert screened == fbgemm_available()  # the tiny head is a plain float32 linear: it takes the screen
    assert prepack_linears(model) > 0
    assert type(model.get_output_embeddings()) is PackedLinear
    runtime = TargetRuntime(model)
    assert isinstance(runtime._forward, DirectDecoder)
    assert not isinstance(TargetRuntime(model, direct=False)._forward, DirectDecoder)
    direct, head = runtime._forward, argmax_head_of(model) if screened else None
    prompt = random_prompt(seed=37, length=30)
    ref_cache, cache = new_cache(model.config), new_cache(model.config)
    assert torch.equal(direct(cache, prompt, torch.arange(30), None, logits_rows=1),
                       model_forward(model, ref_cache, prompt, torch.arange(30), None, logits_rows=1))
    for i, (ids, positions, mask, keep) in enumerate(_calls(30)):
        expected = model_forward(model, ref_cache, ids, positions, mask, logits_rows=keep, argmax_head=head)
        got = direct(cache, ids, positions, mask, logits_rows=keep, argmax_head=head)
        assert torch.equal(got, expected), i
        if head is not None:
            assert got.dtype == torch.int64 and got.shape == ((keep or len(ids)),), i
    for (k, v), (ref_k, ref_v) in zip(cache_kv(cache), cache_kv(ref_cache)):
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


def test_a_packed_linear_runs_its_op_bound_to_its_buffers():
    from specdec.cpu_linear import PackedLinear

    layer = PackedLinear(torch.nn.Linear(16, 8))
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    op = forward._direct_linear(layer)
    assert op is not layer and torch.equal(op(x), layer(x)) and op(x).shape == (2, 3, 8)
