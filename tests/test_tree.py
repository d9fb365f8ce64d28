"""Tree attention mask and position ids of specdec.tree (DESIGN.md "Token tree"): pure-function unit
tests, and the property that one tree-masked forward gives every node the logits (and KV) of a plain
causal forward over the prefix plus that node's root path — for the target runtime and for the draft
runtime."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draft_service.runtime import DraftRuntime
from specdec.tree import (
    DraftTree,
    MalformedTreeError,
    ancestors,
    children,
    node_depths,
    tree_attention_mask,
    tree_position_ids,
    tree_visibility,
)
from specdec.tree_spec import SEED_SPEC, TreeSpec
from target_service.runtime import TargetRuntime
from tests.conftest import VOCAB, causal_logits, path_tokens, prefill_kv, tiny_model

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
NEG = torch.finfo(torch.float32).min


# ------------------------------------------------------------------------------------------------
# Pure functions
# ------------------------------------------------------------------------------------------------

def test_style_example_positions():
    """STYLE.md: depths [1, 1, 2] after a 7-token prefix -> R at 7, nodes at [8, 8, 9]."""
    parents = [-1, -1, 0]
    assert node_depths(parents) == [1, 1, 2]
    positions = tree_position_ids(parents, 7)
    assert positions.dtype == torch.long
    assert positions.tolist() == [7, 8, 8, 9]
    assert tree_position_ids([], 5).tolist() == [5]


def test_style_example_mask():
    mask = tree_attention_mask([-1, -1, 0], 7, torch.float32)
    assert mask.shape == (1, 1, 4, 11)
    visible = mask[0, 0] == 0
    prefix = [True] * 7
    assert visible.tolist() == [
        prefix + [True, False, False, False],  # R: prefix + itself
        prefix + [True, True, False, False],  # node 0: R + itself
        prefix + [True, False, True, False],  # node 1: R + itself (not its sibling)
        prefix + [True, True, False, True],  # node 2: R + parent node 0 + itself
    ]
    assert set(mask.unique().tolist()) == {0.0, NEG}
    half = tree_attention_mask([-1, -1, 0], 7, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.min().item() == torch.finfo(torch.bfloat16).min


def test_worked_example_depths():
    parents = [-1] * 6 + [0, 0, 1, 1] + [6, 8]
    assert node_depths(parents) == [1] * 6 + [2] * 4 + [3] * 2
    assert tree_position_ids(parents, 7).tolist() == [7] + [8] * 6 + [9] * 4 + [10] * 2
    assert ancestors(parents, 10) == [0, 6, 10]
    assert ancestors(parents, 11) == [1, 8, 11]
    assert ancestors(parents, 3) == [3]
    kids = children(parents)
    assert kids[0] == [0, 1, 2, 3, 4, 5]
    assert kids[1] == [6, 7] and kids[2] == [8, 9] and kids[7] == [10] and kids[9] == [11]
    assert kids[3] == kids[11] == kids[12] == []


@st.composite
def random_trees(draw, max_nodes: int = 12):
    """(tokens, parents) with parents[i] in [-1, i)."""
    n = draw(st.integers(1, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    return tokens, parents


def _ancestor_set(parents, i):
    out = set()
    while i != -1:
        out.add(i)
        i = parents[i]
    return out


@settings(max_examples=80, **SETTINGS)
@given(tree=random_trees(max_nodes=20), cache_len=st.integers(0, 10))
def test_mask_and_positions_properties(tree, cache_len):
    _, parents = tree
    n = len(parents)
    positions = tree_position_ids(parents, cache_len).tolist()
    mask = tree_attention_mask(parents, cache_len, torch.float32)
    assert mask.shape == (1, 1, n + 1, cache_len + n + 1)
    visible = (mask[0, 0] == 0).tolist()
    assert positions[0] == cache_len
    assert visible[0] == [True] * (cache_len + 1) + [False] * n
    for i in range(n):
        anc = _ancestor_set(parents, i)
        # Position = cache_len + depth = cache_len + number of nodes on the root path.
        assert positions[i + 1] == cache_len + len(anc)
        expected = [True] * (cache_len + 1) + [j in anc for j in range(n)]
        assert visible[i + 1] == expected
    assert tree_visibility(parents).shape == (n + 1, n + 1)


def test_malformed_trees_rejected():
    with pytest.raises(MalformedTreeError, match=r"parents\[1\]"):
        DraftTree((1, 2), (-1, 1))  # a node cannot be its own parent
    with pytest.raises(MalformedTreeError, match=r"parents\[0\]"):
        DraftTree((1,), (-2,))
    with pytest.raises(MalformedTreeError, match="parents"):
        DraftTree((1, 2), (-1,))


def test_target_rejects_bad_tree_tokens():
    model = tiny_model("qwen2", seed=0)
    target = TargetRuntime(model, max_tree_nodes=4)
    target.start("s", [1, 2, 3])
    with pytest.raises(MalformedTreeError, match=r"tokens\[1\]"):
        target.verify("s", DraftTree((1, VOCAB), (-1, 0)))
    with pytest.raises(MalformedTreeError, match="tokens"):
        target.verify("s", DraftTree((1,) * 5, (-1,) * 5))
    # The rejected trees left no pending verify and no KV behind.
    assert target.sessions["s"].pending is None
    assert target.sessions["s"].cache.get_seq_length() == 3  # the prompt, R included, until the first commit


# ------------------------------------------------------------------------------------------------
# Target: one tree-masked forward == plain causal forwards over every root path
# ------------------------------------------------------------------------------------------------

MODELS = {"qwen2": lambda: tiny_model("qwen2", seed=0), "llama": lambda: tiny_model("llama", seed=1)}


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@settings(max_examples=40, **SETTINGS)
@given(tree=random_trees(), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10))
def test_tree_forward_matches_causal(kind, tree, prompt):
    model = MODELS[kind]()
    tokens, parents = tree
    target = TargetRuntime(model)
    target.start("s", prompt)
    cache_len = len(prompt) - 1
    logits = target.tree_logits("s", DraftTree(tuple(tokens), tuple(parents)))  # (N + 1, V)
    assert logits.shape == (len(tokens) + 1, VOCAB)
    cache = target.sessions["s"].cache
    assert cache.get_seq_length() == cache_len + 1 + len(tokens)

    for row in range(len(tokens) + 1):
        path = prompt + path_tokens(tokens, parents, row - 1)  # row 0 = R (path to the root)
        ref = causal_logits(model, path)[-1]
        torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=0, msg=lambda m: f"row {row}: {m}")
        # The row's KV slot equals the KV of the last token of a causal prefill of its path.
        slot = cache_len + row
        for layer, (k_ref, v_ref) in zip(cache.layers, prefill_kv(model, path)):
            torch.testing.assert_close(layer.keys[:, :, slot], k_ref[:, :, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer.values[:, :, slot], v_ref[:, :, -1], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# Draft: the log-probs the builder sees equal causal forwards, round after round (its own tree mask,
# position ids and cache rollback)
# ------------------------------------------------------------------------------------------------

@st.composite
def random_specs(draw):
    gamma = draw(st.integers(1, 4))
    rows, heads = [], []
    available = 1
    for d in range(gamma):
        h = 1 if d == 0 else draw(st.integers(1, min(3, available)))
        row = [draw(st.integers(1, 3)) for _ in range(h)]
        rows.append(row)
        heads.append(h)
        available = sum(row)
    return TreeSpec(gamma=gamma, topKSpec=rows, topHead=heads)


def _check_draft_tree(model, committed, tree: DraftTree, spec: TreeSpec):
    """Every node's draft log-prob and every expanded node's children match causal forwards."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    for parent, nodes in kids.items():
        path = committed + path_tokens(tree.tokens, tree.parents, parent)
        ref = torch.log_softmax(causal_logits(model, path)[-1], dim=-1)  # (V,)
        got = [tree.tokens[i] for i in nodes]
        # The children are the reference top-k, in order.
        assert got == ref.topk(len(nodes)).indices.tolist(), f"children of node {parent}"
        for i in nodes:
            assert tree.draft_logprobs[i] == pytest.approx(ref[tree.tokens[i]].item(), abs=1e-4)
    depths = node_depths(tree.parents)
    assert max(depths) <= spec.gamma
    assert tree.size == sum(sum(row) for row in spec.top_k_spec[: max(depths)])
    expanded = [i for i, e in enumerate(tree.expanded) if e]
    assert sorted(expanded) == sorted(p for p in kids if p != -1)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@settings(max_examples=20, **SETTINGS)
@given(spec=random_specs(), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_draft_tree_matches_causal(kind, spec, prompt, seed):
    model = MODELS[kind]()
    rng = random.Random(seed)
    draft = DraftRuntime(model)
    draft.start("s", prompt)
    committed = list(prompt)
    for _ in range(3):
        tree = draft.propose("s", spec, max_depth=spec.gamma)
        _check_draft_tree(model, committed, tree, spec)
        # Accept the root path of a random node (or nothing), then a random bonus token.
        node = rng.randrange(-1, tree.size)
        accepted = ancestors(tree.parents, node) if node != -1 else []
        tokens = [tree.tokens[i] for i in accepted] + [rng.randrange(VOCAB)]
        draft.commit("s", tokens, accepted)
        committed += tokens
        s = draft.sessions["s"]
        assert s.tokens == committed
        assert s.cache.get_seq_length() == s.cached_len <= len(committed)


def test_draft_seed_spec_three_rounds():
    """A fixed SEED_SPEC case with a deep accepted path (node fed at step 2 kept in the cache)."""
    model = tiny_model("qwen2", seed=0)
    draft = DraftRuntime(model)
    prompt = [5, 9, 33, 2, 61, 7]
    draft.start("s", prompt)
    committed = list(prompt)
    for _ in range(3):
        tree = draft.propose("s", SEED_SPEC, max_depth=3)
        _check_draft_tree(model, committed, tree, SEED_SPEC)
        deep = tree.size - 2  # first depth-3 node: its parent (depth 2) was fed at step 2
        accepted = ancestors(tree.parents, deep)
        assert len(accepted) == 3
        before = len(committed)  # propose fed every committed token (R included)
        draft.commit("s", [tree.tokens[i] for i in accepted] + [3], accepted)
        committed += [tree.tokens[i] for i in accepted] + [3]
        # The depth-1 and depth-2 accepted nodes were fed (expanded); the depth-3 leaf was not.
        assert draft.sessions["s"].cached_len == before + 2
