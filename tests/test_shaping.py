"""Cost-aware tree shaping (orchestrator.planning.shaping, orchestrator.planning.cost_aware): the rules on scripted costs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from orchestrator.planning.cost_aware import DepthEstimates, plan_depth, stop_threshold
from orchestrator.planning.cost_model import CostModel
from orchestrator.planning.shaping import (
    AcceptanceCalibration, ContextCalibration, context_path, ngram_continuation, node_values, observe_verified,
    select_by_rate, shape_tree,
)
from specdec.tree import SOURCE_CONTEXT, DraftTree, Proposal

# A drafted tree: 3 root children (q 0.6, 0.25, 0.1), a chain of 4 under the first (q 0.8 each).
TREE = DraftTree(
    tokens=(10, 11, 12, 13, 14, 15, 16),
    parents=(-1, -1, -1, 0, 3, 4, 5),
    draft_logprobs=tuple(math.log(q) for q in (0.6, 0.25, 0.1, 0.8, 0.8, 0.8, 0.8)),
    expanded=(True, False, False, True, True, True, False),
)
CHEAP_ROWS = CostModel({1: 300.0, 64: 301.0}, {1: 40.0})  # extra verify rows nearly free
DEAR_ROWS = CostModel({1: 300.0, 2: 600.0, 64: 19200.0}, {1: 40.0})  # each row costs a target step


def test_cheap_rows_keep_wider_and_deeper_trees():
    calib = AcceptanceCalibration()
    values = node_values(TREE, calib)
    cheap = select_by_rate(TREE, values, CHEAP_ROWS, sunk_ms=160.0)
    dear = select_by_rate(TREE, values, DEAR_ROWS, sunk_ms=160.0)
    assert sorted(cheap) == list(range(TREE.size))  # every node pays when rows are free
    assert dear == []  # no node is worth a whole target step: plain verify of R alone
    mid = CostModel({1: 300.0, 64: 300.0 + 63 * 40.0}, {1: 40.0})  # 40 ms a row
    kept = select_by_rate(TREE, values, mid, sunk_ms=160.0)
    assert 0 < len(kept) < TREE.size
    assert kept[0] == 0 and 2 not in kept  # best first; the q = 0.1 sibling does not pay for 40 ms


def test_selection_is_ancestor_closed_and_best_first():
    values = node_values(TREE, AcceptanceCalibration())
    order = select_by_rate(TREE, values, CHEAP_ROWS, sunk_ms=0.0)
    seen = set()
    for node in order:
        assert TREE.parents[node] == -1 or TREE.parents[node] in seen
        seen.add(node)


def test_sampled_siblings_are_kept_as_a_draw_order_prefix():
    """treeType-1 children were drawn in order; keeping sibling 1 without sibling 0 would break the
    recursive rejection sampling, so the low-value first draw must come along (here it pays, for
    the sake of sibling 1). Deterministic children (no proposal) are taken alone."""
    q = np.full(20, 0.05)
    drawn = DraftTree((1, 2), (-1, -1), (math.log(0.01), math.log(0.9)), (False, False), (Proposal(-1, q),))
    values = [0.001, 0.9]
    mid = CostModel({1: 300.0, 64: 300.0 + 63 * 40.0}, {1: 40.0})
    assert select_by_rate(drawn, values, mid, 0.0) == [0, 1]
    top_k = DraftTree(drawn.tokens, drawn.parents, drawn.draft_logprobs, drawn.expanded)
    assert select_by_rate(top_k, values, mid, 0.0) == [1]


def test_plan_depth_follows_costs_and_values():
    est = DepthEstimates(value=[0.8, 0.64, 0.51, 0.41], rows=[1.0, 1.0, 1.0, 1.0])
    heads = [1] * 8
    cheap_draft = CostModel({1: 300.0, 64: 320.0}, {1: 5.0})
    dear_draft = CostModel({1: 300.0, 64: 320.0}, {1: 250.0})
    g_cheap, _ = plan_depth(est, cheap_draft, heads, 8)
    g_dear, _ = plan_depth(est, dear_draft, heads, 8)
    assert g_cheap == 8 and g_dear < 3
    hopeless = DepthEstimates(value=[0.01, 0.0001], rows=[1.0, 1.0])
    assert plan_depth(hopeless, cheap_draft, heads, 8)[0] == 0  # a draft that is always wrong: no draft


def test_plan_depth_values_this_rounds_context_branch():
    """With this round's branch given (context_path), a likely long branch leaves the draft nothing to
    add (its value at depth d counts only where the branch fails by d): no draft. A short unlikely
    branch leaves drafting worth it, and an empty one replaces the average of past rounds' branches."""
    est = DepthEstimates(value=[0.8, 0.64, 0.51, 0.41], rows=[1.0, 1.0, 1.0, 1.0])
    heads = [1] * 8
    cost = CostModel({1: 300.0, 64: 300.0 + 63 * 10.0}, {1: 40.0})  # 10 ms a row, 40 ms a draft step
    g_none, rate_none = plan_depth(est, cost, heads, 8)
    assert g_none >= 3
    likely = [0.95 ** k for k in range(1, 9)]  # a copied passage: 8 tokens, 95% each
    g_likely, rate_likely = plan_depth(est, cost, heads, 8, context_path=likely)
    assert g_likely == 0 and rate_likely > rate_none
    assert plan_depth(est, cost, heads, 8, context_path=[0.3, 0.09])[0] >= 3
    # the past rounds' average branch (value 5, 8 rows) is not this round's when this round has none
    assert plan_depth(est, cost, heads, 8, 5.0, 8.0, context_path=[]) == (g_none, rate_none)
    assert plan_depth(est, cost, heads, 8, 5.0, 8.0)[1] > rate_none  # without a path: the average counts
    # the discount itself: where the branch is certain to depth 2, drafting 2 steps adds no token
    sure = [1.0, 1.0]
    _, rate_sure = plan_depth(est, cost, heads, 2, context_path=sure)
    assert rate_sure == pytest.approx((1 + 2) / cost.round_ms(3))


def test_context_path_is_what_shape_tree_keeps_without_a_draft():
    """The plan's branch (context_path) is the one the shaping verifies when the draft adds nothing:
    the values of the context nodes ``shape_tree`` keeps from an empty draft tree, in depth order.
    200 random contexts, calibrations, costs and budgets; some keep the whole branch, some a part."""
    whole = part = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        passage = [int(t) for t in rng.integers(0, 6, size=12)]
        filler = [int(t) for t in rng.integers(0, 6, size=int(rng.integers(0, 6)))]
        context = passage + filler + passage[: int(rng.integers(1, 9))]
        ctx = ContextCalibration()
        for _ in range(int(rng.integers(0, 60))):
            ctx.observe(int(rng.integers(1, 6)), int(rng.integers(1, 6)), bool(rng.random() < 0.7))
        per_row = float(rng.choice([1.0, 20.0, 80.0, 400.0]))
        cost = CostModel({1: 300.0, 64: 300.0 + 63 * per_row}, {1: 40.0})
        sunk, limit = float(rng.choice([0.0, 150.0])), int(rng.integers(1, 9))
        shaped = shape_tree(DraftTree((), ()), context, AcceptanceCalibration(), ctx, cost, sunk, ngram_tokens=8,
                            max_depth=limit)
        assert shaped.draft_index == (None,) * shaped.tree.size
        path = context_path(context, ctx, cost, sunk, ngram_tokens=8, max_depth=limit)
        assert path == pytest.approx(list(shaped.values))
        chain = ngram_continuation(context, limit)[0]
        whole += bool(path) and len(path) == len(chain)
        part += 0 < len(path) < len(chain)
    assert whole >= 20 and part >= 5


def test_stop_threshold_grows_with_cost():
    cheap = stop_threshold(CHEAP_ROWS, rate=1 / 200, heads=1, width=1, decay=0.7, raw_per_value=1.0)
    dear = stop_threshold(CostModel({1: 300.0, 2: 400.0}, {1: 200.0}), 1 / 200, 1, 1, 0.7, 1.0)
    assert 0 < cheap < dear <= 0.95


def test_shape_tree_merges_the_context_branch():
    context = [5, 10, 11, 6, 7, 5]  # the last token 5 was followed by 10, 11 before
    calib, ctx = AcceptanceCalibration(), ContextCalibration()
    shaped = shape_tree(TREE, context, calib, ctx, CHEAP_ROWS, sunk_ms=100.0, ngram_tokens=3)
    # chain [10, 11, 6]: 10 is draft node 0 (shared); 11 and 6 are new context nodes below it
    assert shaped.tree.size == TREE.size + 2
    assert shaped.draft_index[: TREE.size] == tuple(range(TREE.size))
    new = [i for i, d in enumerate(shaped.draft_index) if d is None]
    assert [shaped.tree.tokens[i] for i in new] == [11, 6]
    assert all(shaped.tree.sources[i] == SOURCE_CONTEXT for i in new)
    assert shaped.tree.parents[new[0]] == 0 and shaped.tree.parents[new[1]] == new[0]
    assert shaped.context == {0: (1, 1), new[0]: (1, 2), new[1]: (1, 3)}  # the shared node is the branch's too
    assert shaped.expected_accepted == pytest.approx(sum(shaped.values))


def test_shape_tree_respects_the_depth_budget_and_empty_drafts():
    shaped = shape_tree(DraftTree((), ()), [1, 2, 3, 1, 2], AcceptanceCalibration(), ContextCalibration(),
                        CHEAP_ROWS, 0.0, ngram_tokens=8, max_depth=1)
    assert shaped.tree.tokens == (3,) and shaped.draft_index == (None,)


def test_calibration_learns_from_verified_trees():
    calib, ctx = AcceptanceCalibration(), ContextCalibration()
    shaped = shape_tree(TREE, [1, 2, 3], calib, ctx, CHEAP_ROWS, 0.0)
    before = calib(0.6)
    for _ in range(50):  # the q = 0.6 root child is never accepted; its siblings are judged too
        observe_verified(shaped, [], calib, ctx)
    assert calib(0.6) < before / 5
    assert calib.seen.get(0, 0) == 0  # no node with q < 0.02 was judged
    # nodes below a rejected parent are not samples: the chain's q = 0.8 bin saw nothing
    assert calib(0.8) == pytest.approx(AcceptanceCalibration()(0.8))
