"""Acceptance along one root path of a verified token tree (DESIGN.md "Verification").

Dims: N tree nodes, V vocabulary, K siblings. Row 0 of the target logits belongs to the root R,
row i + 1 to node i: row r holds the target's distribution for the token that follows that row's
token.

Three rules, all exact (the committed tokens have the target's own law):
- greedy (temperature 0): follow the target argmax (``verify_greedy``);
- sampled, deterministic children (treeType 0, or any node without a recorded proposal): draw
  x ~ p at the node; move to the child equal to x, else commit x (``verify_sampled``);
- sampled, children drawn from the draft (treeType 1): recursive rejection sampling over the
  siblings (``sample_siblings``), see below;
- context children (n-gram branches, ``specdec.tree.SOURCE_CONTEXT``) beside drawn siblings: they
  were not drawn from q, so they take no part in the rejection sampling; the token that comes out
  of it (law p whatever happened) moves to a context child holding that token. Following a child
  whose token equals the emitted one is exact for any child: its row is the target's
  distribution given the prefix plus that token, which is what the next step needs.

Sampled children are drawn *without replacement* from the draft's q (``draft_service.tree_builder``),
so sibling i was drawn from q_i = q with siblings 0..i-1 removed and renormalised. Sibling i is
accepted with min(1, p_i(x_i) / q_i(x_i)); on rejection p_{i+1} = norm(max(0, p_i - q_i)). When all
siblings fail, the token is drawn from the last residual. Exact by induction over the siblings: one
step outputs min(p_i, q_i) directly and, on rejection (probability 1 - sum min(p_i, q_i)), a
token with law p_{i+1} whatever the remaining draws were, and min(p, q) + max(0, p - q) = p.
(SpecInfer multi-step speculative sampling, Miao et al. ASPLOS'24 §4.2, with the without-replacement
proposal update of Recursive Speculative Decoding, Jeon et al. 2024; a single sibling is Leviathan
et al. 2023, Algorithm 1.) With replacement the update would keep q_{i+1} = q_i instead.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from specdec.interfaces import VerifyResult
from specdec.sampling import accept, residual, sample, without_token
from specdec.tree import ROOT, SOURCE_DRAFT, MalformedTreeError, Proposal, children


def verify_greedy(tokens, parents, target_logits: torch.Tensor) -> VerifyResult:
    """Greedy tree verification: from the root, move to the child equal to the target argmax.

    tokens, parents: [N] the tree; target_logits: [N + 1, V] float32. Stops at the first node whose
    argmax is not among its children; that argmax is the bonus token. Only one path is walked:
    matches on other branches do not count (SpecInfer, Miao et al. ASPLOS'24, §4.1 greedy case).
    """
    assert target_logits.shape[0] == len(tokens) + 1, "target_logits: need one row per node plus the root"
    return verify_greedy_ids(tokens, parents, target_logits.argmax(dim=-1).tolist())


def verify_greedy_ids(tokens, parents, argmax: list[int]) -> VerifyResult:
    """``verify_greedy`` given each row's target argmax instead of the logits: argmax [N + 1] token
    ids (row 0 = the root's), e.g. from ``specdec.argmax_head.ArgmaxHead``."""
    assert len(argmax) == len(tokens) + 1, "argmax: need one id per node plus the root"
    kids = children(parents)
    node, path = ROOT, []
    while True:
        want = argmax[node + 1]
        nxt = next((c for c in kids[node + 1] if tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(tuple(path), tuple(tokens[n] for n in path) + (want,))
        path.append(nxt)
        node = nxt


def verify_sampled(
    tokens,
    parents,
    target_probs: Callable[[int], np.ndarray],
    rng: np.random.Generator,
    proposals: tuple[Proposal, ...] = (),
    sources: tuple[int, ...] = (),
) -> VerifyResult:
    """Lossless sampled tree verification (rules in the module docstring).

    tokens, parents: [N] the tree; target_probs(r): [V] float64, the target's distribution after
    row r (0 = R, i + 1 = node i) processed with the request's SamplingParams exactly as the draft
    processed q (``specdec.sampling.processed_probs``), asked only for visited rows; rng: the
    session's generator; proposals: the tree's recorded q per expanded node (treeType 1); sources:
    [N] per-node SOURCE_DRAFT / SOURCE_CONTEXT (() = all draft). Random draws happen only at
    visited nodes: one per tested sibling plus one per token not taken from the tree.
    """
    kids = children(parents)
    q_of = {proposal.parent: proposal for proposal in proposals}
    node, path = ROOT, []
    while True:
        p = target_probs(node + 1)  # (V,)
        siblings = kids[node + 1]
        drawn = [c for c in siblings if not sources or sources[c] == SOURCE_DRAFT]
        if node in q_of and drawn:
            pick, token = sample_siblings(p, q_of[node].dense(len(p)), [tokens[c] for c in drawn], rng)
            context = (c for c in siblings if sources and sources[c] != SOURCE_DRAFT and tokens[c] == token)
            nxt = drawn[pick] if pick is not None else next(context, None)
        else:
            token = sample(p, rng)
            nxt = next((c for c in siblings if tokens[c] == token), None)
        if nxt is None:
            return VerifyResult(tuple(path), tuple(tokens[n] for n in path) + (token,))
        path.append(nxt)
        node = nxt


def sample_siblings(p: np.ndarray, q: np.ndarray, candidates: list[int], rng: np.random.Generator) -> tuple[int | None, int]:
    """Recursive rejection sampling over siblings drawn without replacement from q.

    p: [V] target probs at the parent; q: [V] the draft's q there; candidates: [K] sibling tokens in
    draw order. Returns (index of the accepted sibling or None, the token); the token has law p.
    """
    for i, token in enumerate(candidates):
        if not q[token] > 0:
            raise MalformedTreeError(f"proposals: sibling token {token} has q = 0, it cannot have been drawn from q")
        if accept(p, q, token, rng):
            return i, token
        p = residual(p, q)  # p_{i+1} = norm(max(0, p_i - q_i))
        if i + 1 < len(candidates):
            q = without_token(q, token)  # q_{i+1}: the next draw's law, without replacement
    return None, sample(p, rng)
