"""Acceptance along one root path of a verified token tree; the rules are in docs/design.md "Verification".

Dims: N tree nodes, V vocabulary, K siblings. Row 0 of the target logits belongs to the root R, row
i + 1 to node i: the target's distribution for the token after that row's token.

Sampled children are drawn without replacement from q, so sibling i is tested against q_i = q without
siblings 0..i-1, renormalised. Exact by induction over the siblings: one step outputs min(p_i, q_i)
directly and on rejection a token of law p_{i+1}, and min(p, q) + max(0, p - q) = p. SpecInfer
multi-step speculative sampling (Miao et al. ASPLOS'24 §4.2) with the without-replacement update of
Recursive Speculative Decoding (Jeon et al. 2024); one sibling is Leviathan et al. 2023, Algorithm 1.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from specdec.interfaces import VerifyResult
from specdec.sampling import accept, residual, sample, without_token
from specdec.tree import ROOT, SOURCE_DRAFT, MalformedTreeError, Proposal, children


def verify_greedy(tokens, parents, argmax: list[int]) -> VerifyResult:
    """Greedy tree verification: from the root, move to the child equal to the target argmax; the first
    miss's argmax is the bonus token. tokens, parents: [N]; argmax: each row's target argmax, [N + 1] token
    ids (row 0 = the root's). (SpecInfer, Miao et al. ASPLOS'24, §4.1 greedy case.)"""
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


def verify_sampled(tokens, parents, target_probs: Callable[[int], np.ndarray], rng: np.random.Generator,
                   proposals: tuple[Proposal, ...] = (), sources: tuple[int, ...] = ()) -> VerifyResult:
    """Lossless sampled tree verification. tokens, parents: [N]; target_probs(r): [V] float64 after row r, processed as
    the draft processed q (``processed_probs``), asked only for visited rows; rng: the session's generator; proposals:
    recorded q per expanded node (treeType 1); sources: [N] SOURCE_DRAFT / SOURCE_CONTEXT (() = all draft)."""
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
    """Recursive rejection sampling over siblings drawn without replacement from q. p, q: [V] at the parent;
    candidates: [K] tokens in draw order. Returns (accepted sibling index or None, the token of law p)."""
    for i, token in enumerate(candidates):
        if not q[token] > 0:
            raise MalformedTreeError(f"proposals: sibling token {token} has q = 0, it cannot have been drawn from q")
        if accept(p, q, token, rng):
            return i, token
        p = residual(p, q)  # p_{i+1} = norm(max(0, p_i - q_i))
        if i + 1 < len(candidates):
            q = without_token(q, token)  # q_{i+1}: the next draw's law, without replacement
    return None, sample(p, rng)
