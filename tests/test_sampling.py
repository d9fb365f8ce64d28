"""The sampling rule in isolation (specdec.sampling, target_service.verifier) with scripted p and q.

- SamplingParams validation names the field; processed_probs equals transformers' temperature ->
  top-k -> top-p warpers;
- draws: sample, sample_without_replacement (ordered law of the draws);
- acceptance: a fixed draft token x ~ q is accepted with min(1, p(x)/q(x)), so sum_x min(p, q) on
  average (chains, Leviathan et al. 2023); siblings follow the recursive-rejection formula and the
  committed token has law p (trees);
- random draws: exactly one per tested sibling plus one per token not taken from the tree.

Statistical checks use fixed seeds and a chi-square / z bound far in the tail (p > 1e-4, |z| < 4.5).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from draft_service.tree_builder import build_tree
from specdec.sampling import (
    SamplingParams,
    SamplingParamsError,
    acceptance_probability,
    processed_probs,
    residual,
    sample,
    sample_without_replacement,
    session_rng,
    without_token,
)
from specdec.tree import MalformedTreeError, Proposal
from specdec.tree_spec import TreeSpec
from target_service.verifier import sample_siblings, verify_sampled
from tests.conftest import chi2_pvalue

P_MIN = 1e-4  # chi-square p-value floor
Z_MAX = 4.5


def random_dist(rng: np.random.Generator, vocab: int, zeros: int = 0) -> np.ndarray:
    p = rng.random(vocab) + 0.05
    p[rng.choice(vocab, zeros, replace=False)] = 0
    return p / p.sum()


# ------------------------------------------------------------------------------------------------
# Parameters and processing
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.2), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(seed=-3), "seed"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=f"^{field}: ") as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and isinstance(info.value, ValueError)


def test_valid_params():
    assert SamplingParams().greedy and SamplingParams().describe() == "greedy"
    params = SamplingParams(temperature=0.7, top_p=1.0, top_k=0, seed=0)
    assert not params.greedy and params.describe() == "temperature 0.7, top-p 1, top-k 0, seed 0"
    SamplingParams(temperature=1e-3, top_p=1e-3, top_k=10**6, seed=2**63 - 1)


def _transformers_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=t, top_p=p, top_k=k)
    for t in (0.3, 0.7, 1.0, 1.5) for p, k in ((1.0, 0), (0.9, 0), (1.0, 5), (0.8, 7))
])
def test_processed_probs_equals_transformers_warpers(params):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 3  # (B, V)
    ours = processed_probs(logits, params)  # (B, V) float64
    theirs = _transformers_probs(logits, params).double().numpy()
    assert ours.dtype == np.float64 and ours.shape == (6, 40)
    np.testing.assert_array_equal(ours > 0, theirs > 0)  # the same tokens kept
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    np.testing.assert_allclose(ours.sum(-1), 1.0, atol=1e-12)
    # The draft hands its log-probs, the target its logits: the result is the same distribution.
    np.testing.assert_allclose(processed_probs(torch.log_softmax(logits, -1), params), ours, atol=1e-6)


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_on_a_large_vocabulary(top_p):
    """Past 1024 tokens top-p sorts only the most likely candidates (growing them when needed)."""
    logits = torch.randn(3, 20_000, generator=torch.Generator().manual_seed(4)) * 2  # (B, V)
    params = SamplingParams(temperature=0.7, top_p=top_p)
    ours = processed_probs(logits, params)
    theirs = _transformers_probs(logits, params).double().numpy()
    np.testing.assert_array_equal(ours > 0, theirs > 0)
    np.testing.assert_allclose(ours, theirs, atol=1e-7)


def test_processing_order_top_k_before_top_p():
    """top-k first renormalises, so top-p then keeps fewer tokens than top-p alone would."""
    logits = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1]))
    both = processed_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    # top-3: [0.4, 0.333, 0.267]; top-p 0.7 drops the 0.267 (cumulative 0.267 <= 0.3), keeps two.
    assert (both > 0).tolist() == [True, True, False, False, False]
    assert (processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.7)) > 0).sum() == 3


# ------------------------------------------------------------------------------------------------
# Draws
# ------------------------------------------------------------------------------------------------

def test_sample_law_and_support():
    rng = np.random.default_rng(0)
    p = random_dist(rng, 8, zeros=2)
    n = 20_000
    counts = np.bincount([sample(p, rng) for _ in range(n)], minlength=8)
    assert counts[p == 0].sum() == 0
    assert chi2_pvalue(dict(enumerate(counts)), dict(enumerate(p)), n) > P_MIN


def test_sample_without_replacement_is_sequential_draws():
    """P(first = a, second = b) = q(a) q(b) / (1 - q(a)); capped at the support; distinct."""
    rng = np.random.default_rng(1)
    q = random_dist(rng, 6, zeros=1)
    n = 20_000
    counts: dict = {}
    for _ in range(n):
        a, b = sample_without_replacement(q, 2, rng)
        counts[(a, b)] = counts.get((a, b), 0) + 1
    expected = {(a, b): q[a] * q[b] / (1 - q[a]) for a, b in itertools.permutations(range(6), 2) if q[a] * q[b] > 0}
    assert chi2_pvalue(counts, expected, n) > P_MIN
    support = set(np.flatnonzero(q).tolist())
    drawn = sample_without_replacement(q, 10, rng)
    assert len(drawn) == 5 and set(drawn) == support


def test_session_rng_streams():
    a, b = SamplingParams(1.0, seed=5), SamplingParams(1.0, seed=6)
    draws = lambda params, stream: session_rng(params, stream).random(4).tolist()  # noqa: E731
    assert draws(a, "target") == draws(a, "target")
    assert draws(a, "target") != draws(a, "draft")
    assert draws(a, "target") != draws(b, "target")
    assert draws(SamplingParams(1.0), "target") != draws(SamplingParams(1.0), "target")  # unseeded


# ------------------------------------------------------------------------------------------------
# Acceptance, chains: min(1, p(x) / q(x)) per token, sum min(p, q) on average
# ------------------------------------------------------------------------------------------------

def test_acceptance_probability_formula():
    rng = np.random.default_rng(2)
    for zeros_p, zeros_q in [(0, 0), (3, 0), (0, 3), (2, 2)]:
        p, q = random_dist(rng, 10, zeros_p), random_dist(rng, 10, zeros_q)
        support = np.flatnonzero(q)
        per_token = [acceptance_probability(p, q, int(x)) for x in support]
        assert per_token == pytest.approx([min(1.0, p[x] / q[x]) for x in support])
        assert sum(q[x] * a for x, a in zip(support, per_token)) == pytest.approx(np.minimum(p, q).sum())


def _chain_tree(tokens: list[int], qs: list[np.ndarray]):
    """A chain R -> tokens[0] -> tokens[1] ...; node i's token was drawn from qs[i] at its parent."""
    parents = tuple(range(-1, len(tokens) - 1))
    proposals = tuple(Proposal(parent, q) for parent, q in zip(parents, qs))
    return tuple(tokens), parents, proposals


def _z(successes: int, n: int, prob: float) -> float:
    sd = math.sqrt(n * prob * (1 - prob))
    return 0.0 if sd == 0 and successes == n * prob else (successes - n * prob) / max(sd, 1e-12)


@pytest.mark.parametrize("zeros_p, zeros_q", [(0, 0), (2, 0), (0, 3)])
def test_chain_acceptance_of_each_fixed_token(zeros_p, zeros_q):
    """verify_sampled on a one-node chain accepts a fixed x with probability min(1, p(x)/q(x));
    weighting by q gives sum min(p, q). zeros_p: target truncated (top-k/top-p) where q is not."""
    rng = np.random.default_rng(10 + zeros_p + zeros_q)
    p, q = random_dist(rng, 8, zeros_p), random_dist(rng, 8, zeros_q)
    n = 4000
    rate = {}
    for x in np.flatnonzero(q).tolist():
        tokens, parents, proposals = _chain_tree([x], [q])
        results = [verify_sampled(tokens, parents, lambda r: p, rng, proposals) for _ in range(n)]
        accepted = sum(len(res.accepted_nodes) for res in results)
        want = min(1.0, p[x] / q[x])
        assert abs(_z(accepted, n, want)) < Z_MAX, (x, accepted / n, want)
        rate[x] = accepted / n
    expected_total = np.minimum(p, q).sum()
    measured_total = sum(q[x] * r for x, r in rate.items())
    assert measured_total == pytest.approx(expected_total, abs=Z_MAX * 0.5 / math.sqrt(n))


def test_two_token_chain_acceptance():
    """Both nodes of R -> x1 -> x2 are accepted with min(1, p1/q1)(x1) * min(1, p2/q2)(x2)."""
    rng = np.random.default_rng(20)
    p1, q1, p2, q2 = (random_dist(rng, 6) for _ in range(4))
    x1, x2 = 2, 4
    tokens, parents, proposals = _chain_tree([x1, x2], [q1, q2])
    rows = {0: p1, 1: p2, 2: random_dist(rng, 6)}
    n = 20_000
    lengths = np.bincount([len(verify_sampled(tokens, parents, rows.__getitem__, rng, proposals).accepted_nodes)
                           for _ in range(n)], minlength=3)
    a1, a2 = min(1, p1[x1] / q1[x1]), min(1, p2[x2] / q2[x2])
    expected = {0: 1 - a1, 1: a1 * (1 - a2), 2: a1 * a2}
    assert chi2_pvalue(dict(enumerate(lengths)), expected, n) > P_MIN


# ------------------------------------------------------------------------------------------------
# Acceptance, siblings: recursive rejection sampling (without replacement)
# ------------------------------------------------------------------------------------------------

def sibling_outcome_law(p: np.ndarray, q: np.ndarray, candidates: list[int]) -> dict:
    """Exact law of sample_siblings' outcome, written from the rule: sibling i is accepted with
    min(1, p_i/q_i)(x_i); p_{i+1} = norm(max(0, p_i - q_i)); q_{i+1} = q_i without x_i; else the
    token comes from the last residual. Keys: ("sibling", i) or ("token", y)."""
    law, reach = {}, 1.0
    for i, x in enumerate(candidates):
        a = min(1.0, p[x] / q[x])
        law[("sibling", i)] = reach * a
        reach *= 1 - a
        r = np.maximum(p - q, 0)
        p = r / r.sum() if r.sum() > 0 else p
        q = q.copy()
        q[x] = 0
        q = q / q.sum() if q.sum() > 0 else q
    for y in np.flatnonzero(p).tolist():
        law[("token", y)] = reach * p[y]
    return law


@pytest.mark.parametrize("case", ["dense", "target_truncated", "draft_truncated", "p_equals_q"])
def test_fixed_siblings_follow_the_tree_formula(case):
    rng = np.random.default_rng(30)
    p, q = random_dist(rng, 7), random_dist(rng, 7)
    if case == "target_truncated":
        p = random_dist(rng, 7, zeros=3)
    elif case == "draft_truncated":
        q = random_dist(rng, 7, zeros=3)
    elif case == "p_equals_q":
        p = q.copy()
    candidates = np.flatnonzero(q)[[2, 0, 1]].tolist()  # three siblings, in a scripted draw order
    n = 30_000
    counts: dict = {}
    with np.errstate(all="raise"):  # no division by zero anywhere (p == q gives an all-zero residual)
        for _ in range(n):
            pick, token = sample_siblings(p, q, candidates, rng)
            key = ("sibling", pick) if pick is not None else ("token", token)
            assert pick is None or candidates[pick] == token
            counts[key] = counts.get(key, 0) + 1
    law = sibling_outcome_law(p, q, candidates)
    assert sum(law.values()) == pytest.approx(1.0)
    assert chi2_pvalue(counts, law, n) > P_MIN


def test_acceptance_over_sibling_draws_and_output_law():
    """Siblings drawn without replacement from q (production draw): P(some sibling accepted) is the
    tree formula sum over ordered pairs q(x1) q(x2) / (1 - q(x1)) [a1 + (1 - a1) a2], and the
    committed token has law p."""
    rng = np.random.default_rng(40)
    p, q = random_dist(rng, 6, zeros=1), random_dist(rng, 6, zeros=1)
    n = 40_000
    accepted, tokens = 0, np.zeros(6, dtype=int)
    for _ in range(n):
        candidates = sample_without_replacement(q, 2, rng)
        pick, token = sample_siblings(p, q, candidates, rng)
        accepted += pick is not None
        tokens[token] += 1
    formula = 0.0
    for x1, x2 in itertools.permutations(np.flatnonzero(q).tolist(), 2):
        law = sibling_outcome_law(p, q, [x1, x2])
        formula += q[x1] * q[x2] / (1 - q[x1]) * (law[("sibling", 0)] + law[("sibling", 1)])
    assert abs(_z(accepted, n, formula)) < Z_MAX, (accepted / n, formula)
    assert chi2_pvalue(dict(enumerate(tokens)), dict(enumerate(p)), n) > P_MIN


def test_residual_edge_cases():
    p = np.array([0.5, 0.5, 0.0])
    with np.errstate(all="raise"):
        assert residual(p, p.copy()) is p  # all-zero residual: sample from p
        np.testing.assert_allclose(residual(p, np.array([0.0, 0.0, 1.0])), p)
        np.testing.assert_allclose(residual(np.array([0.6, 0.4, 0.0]), np.array([0.2, 0.8, 0.0])), [1.0, 0.0, 0.0])
        assert without_token(np.array([0.0, 1.0, 0.0]), 1).sum() == 0
        np.testing.assert_allclose(without_token(np.array([0.5, 0.25, 0.25]), 0), [0.0, 0.5, 0.5])


def test_sibling_outside_q_support_is_malformed():
    q = np.array([0.5, 0.5, 0.0])
    with pytest.raises(MalformedTreeError, match="proposals"):
        sample_siblings(np.array([0.2, 0.3, 0.5]), q, [2], np.random.default_rng(0))
    with pytest.raises(MalformedTreeError, match="proposals"):  # the same token twice
        sample_siblings(np.array([0.0, 0.0, 1.0]), q, [0, 0], np.random.default_rng(0))


# ------------------------------------------------------------------------------------------------
# Random draws happen only for sampled tokens
# ------------------------------------------------------------------------------------------------

class CountingRng:
    """Wraps a NumPy generator and counts the uniform draws the sampling code makes."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.uniforms = 0

    def random(self, *args):
        self.uniforms += 1
        return self.rng.random(*args)


def _expected_uniforms(result, proposals_by_parent, kids) -> int:
    """One per node visited without a proposal; at a node with one, one per tested sibling plus one
    if none was accepted."""
    count, node = 0, -1
    for nxt in list(result.accepted_nodes) + [None]:
        siblings = kids[node + 1]
        if node in proposals_by_parent and siblings:
            count += siblings.index(nxt) + 1 if nxt is not None else len(siblings) + 1
        else:
            count += 1
        node = nxt
    return count


@pytest.mark.parametrize("tree_type", [0, 1])
def test_draws_only_for_sampled_tokens(tree_type):
    from specdec.tree import children

    spec = TreeSpec(gamma=2, topKSpec=[[3], [2, 1]], topHead=[1, 2], treeType=tree_type)
    params = SamplingParams(temperature=1.0, seed=0)
    gen = torch.Generator().manual_seed(0)
    vocab = 9
    rows = torch.randn(64, vocab, generator=gen)  # draft log-probs, any context
    target = processed_probs(torch.randn(16, vocab, generator=gen), params)
    draft_rng = np.random.default_rng(0)
    for trial in range(200):
        tree = build_tree(spec, lambda nodes, t, p: torch.log_softmax(rows[: len(nodes)] * (1 + trial % 3), -1),
                          sampling=params, rng=draft_rng)
        rng = CountingRng(trial)
        result = verify_sampled(tree.tokens, tree.parents, lambda r: target[r], rng, tree.proposals)
        by_parent = {pr.parent: pr for pr in tree.proposals}
        assert rng.uniforms == _expected_uniforms(result, by_parent, children(tree.parents))
        assert (tree_type == 1) == bool(tree.proposals)


def test_greedy_draft_draws_nothing_and_treetype1_tree_shape():
    """Greedy trees ignore treeType (top-k children, no rng); sampled treeType 1 trees have
    distinct siblings inside q's support, at most its size, and one proposal per expanded node."""
    vocab = 10
    row = torch.log_softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(1)), -1)  # (V,)
    expand = lambda nodes, t, p: row.expand(len(nodes), vocab)  # noqa: E731 (the same row everywhere)
    spec = TreeSpec(gamma=2, topKSpec=[[6], [4, 4]], topHead=[1, 2], treeType=1)
    greedy = build_tree(spec, expand)
    assert greedy == build_tree(spec.model_copy(update={"tree_type": 0}), expand) and greedy.proposals == ()
    params = SamplingParams(temperature=1.0, top_k=3)
    tree = build_tree(spec, expand, sampling=params, rng=np.random.default_rng(0))
    assert [pr.parent for pr in tree.proposals] == [-1] + [n for n, e in enumerate(tree.expanded) if e]
    for proposal in tree.proposals:
        kids = [tree.tokens[i] for i, parent in enumerate(tree.parents) if parent == proposal.parent]
        assert len(kids) == len(set(kids)) == 3  # capped at the top-3 support
        assert set(kids) <= set(proposal.sparse()[0].tolist())
        np.testing.assert_allclose(proposal.dense(vocab), processed_probs(row, params), atol=1e-12)
        ids, probs = proposal.sparse()
        np.testing.assert_array_equal(Proposal.from_sparse(proposal.parent, ids, probs, vocab + 2).dense(vocab + 2)[:vocab],
                                      proposal.probs)  # the wire form round-trips
    top3 = row.topk(3).indices.tolist()
    deterministic = build_tree(spec.model_copy(update={"tree_type": 0}), expand, sampling=params)  # no rng
    assert deterministic.proposals == () and list(deterministic.tokens[:3]) == top3
