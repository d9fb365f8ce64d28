"""Pipelining (DESIGN.md "Pipelining"): the draft drafts round r+1 from round r's best path and its
own guess of the bonus token while the target verifies round r.

Runtime: ``propose_ahead`` + adopt = commit + propose; ``propose_ahead`` + discard + commit +
propose = the same without the ahead; caches equal a fresh prefill; a sampled session's random
state after a discard equals the state before. Round loop and services: further below."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draft_service.runtime import DraftRuntime
from specdec.interfaces import SessionStateError
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree import ROOT
from specdec.tree_spec import TreeSpec
from tests.conftest import assert_kv_equal, cache_kv, prefill_kv, random_prompt, tiny_model

SPEC = TreeSpec(gamma=3, topKSpec=[[3], [2, 1], [1, 1]], topHead=[1, 2, 2])
SAMPLED_SPEC = TreeSpec(gamma=3, topKSpec=[[3], [2, 1], [1, 1]], topHead=[1, 2, 2], treeType=1)
SAMPLED = SamplingParams(temperature=0.9, top_k=20, seed=123)
STD = 0.2  # keeps float32 round-off between tree forwards and a fresh prefill well inside 1e-5


def best_path(tree, depth: int | None = None) -> list[int]:
    """The chain of highest draft log-prob children from the root (``depth`` nodes at most)."""
    path, node = [], ROOT
    while depth is None or len(path) < depth:
        kids = [i for i, p in enumerate(tree.parents) if p == node]
        if not kids:
            break
        node = max(kids, key=lambda i: tree.draft_logprobs[i])
        path.append(node)
    return path


def assert_same_tree(actual, expected):
    assert actual.tokens == expected.tokens
    assert actual.parents == expected.parents
    np.testing.assert_allclose(actual.draft_logprobs, expected.draft_logprobs, atol=1e-5)


def assert_fresh(runtime: DraftRuntime, model, sid: str):
    s = runtime.sessions[sid]
    assert_kv_equal(cache_kv(s.cache), prefill_kv(model, s.tokens[: s.cached_len]), what="draft cache")


def _pair(sampling=GREEDY, seed=3):
    model = tiny_model("qwen2", seed=seed, init_std=STD)
    prompt = random_prompt(seed=11, length=9)
    runtimes = DraftRuntime(model), DraftRuntime(model)
    for r in runtimes:
        r.start("s", prompt, sampling)
    return model, runtimes


@pytest.mark.parametrize("sampling,spec", [(GREEDY, SPEC), (SAMPLED, SAMPLED_SPEC), (SAMPLED, SPEC)])
@pytest.mark.parametrize("depth", [1, 2, 3])  # path ends at a fed node (1, 2) or at a leaf (3)
def test_ahead_adopt_equals_commit_then_propose(sampling, spec, depth):
    model, (ahead, plain) = _pair(sampling)
    tree = ahead.propose("s", spec, 3)
    assert_same_tree(plain.propose("s", spec, 3), tree)
    path = best_path(tree, depth)
    guess, next_tree = ahead.propose_ahead("s", path, spec, 3)
    ahead.resolve_ahead("s", adopt=True)
    plain.commit("s", [tree.tokens[n] for n in path] + [guess], path)
    assert_same_tree(next_tree, plain.propose("s", spec, 3))
    assert guess == int(torch.argmax(_logits_after(model, plain.sessions["s"].tokens[:-1])))
    for runtime in (ahead, plain):  # the next round goes on identically
        runtime.commit("s", [next_tree.tokens[0], 7], [0])
        assert_fresh(runtime, model, "s")
    assert_same_tree(ahead.propose("s", spec, 2), plain.propose("s", spec, 2))


def _logits_after(model, ids):
    return model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()


@pytest.mark.parametrize("sampling,spec", [(GREEDY, SPEC), (SAMPLED, SAMPLED_SPEC)])
@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_ahead_discard_then_commit_equals_no_ahead(sampling, spec, accepted):
    model, (ahead, plain) = _pair(sampling)
    tree = ahead.propose("s", spec, 3)
    plain.propose("s", spec, 3)
    s = ahead.sessions["s"]
    before = (list(s.tokens), s.cached_len, cache_kv(s.cache), s.rng.bit_generator.state if s.rng else None)
    ahead.propose_ahead("s", best_path(tree), spec, 3)
    ahead.resolve_ahead("s", adopt=False)
    assert (s.tokens, s.cached_len) == (before[0], before[1])
    # the committed slots are back as they were; the tree's slots are dropped (commit keeps no node KV)
    kept = [(k[:, :, : s.cached_len], v[:, :, : s.cached_len]) for k, v in before[2]]
    assert_kv_equal(cache_kv(s.cache), kept, what="draft cache after discard", atol=0, rtol=0)
    if s.rng is not None:
        assert s.rng.bit_generator.state == before[3]
    path = best_path(tree, accepted)
    committed = [tree.tokens[n] for n in path] + [5]
    for runtime in (ahead, plain):
        runtime.commit("s", committed, path)
        assert_fresh(runtime, model, "s")
    assert_same_tree(ahead.propose("s", spec, 3), plain.propose("s", spec, 3))


def test_ahead_kv_after_adopt_equals_fresh_prefill():
    model, (ahead, _) = _pair()
    tree = ahead.propose("s", SPEC, 3)
    guess, _tree = ahead.propose_ahead("s", best_path(tree), SPEC, 3)
    ahead.resolve_ahead("s", adopt=True)
    s = ahead.sessions["s"]
    assert s.tokens[-1] == guess
    # the cache holds the committed tokens (guess included: the ahead tree's step 0 fed it) and the tree slots
    s_len = s.cached_len
    assert s_len == len(s.tokens)
    got = [(k[:, :, :s_len], v[:, :, :s_len]) for k, v in cache_kv(s.cache)]
    assert_kv_equal(got, prefill_kv(model, s.tokens), what="draft cache after adopt")


def test_ahead_errors_name_the_field():
    _, (runtime, _) = _pair()
    with pytest.raises(SessionStateError, match="path_nodes"):
        runtime.propose_ahead("s", [0], SPEC, 3)  # no tree proposed yet
    tree = runtime.propose("s", SPEC, 3)
    leaf = next(i for i, p in enumerate(tree.parents) if p != ROOT)
    with pytest.raises(ValueError, match=r"path_nodes\[0\]"):
        runtime.propose_ahead("s", [leaf], SPEC, 3)
    with pytest.raises(ValueError, match=r"path_nodes\[0\] = 99"):
        runtime.propose_ahead("s", [99], SPEC, 3)
    with pytest.raises(SessionStateError, match="adopt"):
        runtime.resolve_ahead("s", adopt=True)
    runtime.propose_ahead("s", [0], SPEC, 3)
    with pytest.raises(SessionStateError, match="ahead"):
        runtime.propose_ahead("s", [0], SPEC, 3)
    with pytest.raises(SessionStateError, match="resolve_ahead"):
        runtime.propose("s", SPEC, 3)
    with pytest.raises(SessionStateError, match="resolve_ahead"):
        runtime.commit("s", [1], [])
    runtime.resolve_ahead("s", adopt=False)
    runtime.commit("s", [tree.tokens[0], 4], [0])


def test_ahead_merges_with_other_sessions_proposes():
    """An ahead item and a plain item in one propose_batch give what each gets alone."""
    model = tiny_model("qwen2", seed=3, init_std=STD)
    batch, solo = DraftRuntime(model), DraftRuntime(model)
    for r in (batch, solo):
        r.start("a", random_prompt(seed=1, length=7))
        r.start("b", random_prompt(seed=2, length=12))
    tree_a = batch.propose("a", SPEC, 3)
    solo.propose("a", SPEC, 3)
    path = best_path(tree_a)
    out = batch.propose_batch([("a", SPEC, 3, path), ("b", SPEC, 2)])
    assert out[0].guess == solo.propose_ahead("a", path, SPEC, 3).guess
    solo_a = solo.sessions["a"].last_tree
    assert_same_tree(out[0].tree, solo_a)
    assert_same_tree(out[1], solo.propose("b", SPEC, 2))
