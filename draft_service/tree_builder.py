"""Grow a token tree from a TreeSpec, one batched draft forward per depth (docs/design.md "TreeSpec").

Static trees as Sequoia / SpecInfer (Miao et al. ASPLOS'24 §3; Chen et al. 2024). Children: greedy, the draft's
top-k; sampled, from q = ``processed_probs`` of the draft's log-probs: treeType 0 its top-k, treeType 1 k draws
without replacement, recording q in ``DraftTree.proposals`` for the verifier.
"""

from __future__ import annotations

import math
from typing import Callable, Generator

import numpy as np
import torch

from specdec.sampling import GREEDY, SamplingParams, processed_probs, sample_without_replacement
from specdec.tree import ROOT, DraftTree, Proposal
from specdec.tree_spec import TreeSpec

# expand(nodes, tokens, parents) -> [P, V] draft log-probabilities after each of the P nodes
# (node -1 = the root). ``tokens``/``parents`` are the tree built so far.
ExpandFn = Callable[[list[int], list[int], list[int]], torch.Tensor]

# What ``tree_steps`` yields: (nodes, tokens, parents), the arguments of one ExpandFn call.
Step = tuple[list[int], list[int], list[int]]


def build_tree(spec: TreeSpec, expand: ExpandFn, max_depth: int | None = None, vocab_size: int | None = None,
               sampling: SamplingParams = GREEDY, rng: np.random.Generator | None = None) -> DraftTree:
    """Build a token tree of ``spec``'s shape. max_depth caps gamma; vocab_size: children below it;
    rng: needed for sampled children. Returns a DraftTree, nodes breadth-first, siblings in draw order."""
    steps = tree_steps(spec, max_depth, vocab_size, sampling, rng)
    try:
        step = next(steps)
        while True:
            step = steps.send(expand(*step))
    except StopIteration as done:
        return done.value


def tree_steps(spec: TreeSpec, max_depth: int | None = None, vocab_size: int | None = None,
               sampling: SamplingParams = GREEDY,
               rng: np.random.Generator | None = None) -> Generator[Step, torch.Tensor, DraftTree]:
    """``build_tree`` as a generator, so several trees' steps can share one forward: yields each step's
    ExpandFn arguments, takes back its [P, V] log-probs (``send``), returns the DraftTree."""
    sampled_children = spec.tree_type == 1 and not sampling.greedy
    assert rng is not None or not sampled_children, "build_tree: sampled children need an rng"
    depth_limit = spec.gamma if max_depth is None else min(spec.gamma, max_depth)
    tokens: list[int] = []
    parents: list[int] = []
    logprobs: list[float] = []
    path_logp: list[float] = []
    expanded: list[bool] = []
    proposals: list[Proposal] = []
    frontier: list[int] = []  # nodes created by the previous step (all of one depth)
    for d in range(depth_limit):
        chosen = [ROOT] if d == 0 else _top_nodes(frontier, path_logp, spec.top_head[d])
        if d > 0 and spec.gamma_threshold > 0 and math.exp(path_logp[chosen[0]]) < spec.gamma_threshold:
            break
        step_logprobs = yield chosen, tokens, parents  # (P, V)
        if vocab_size is not None:
            step_logprobs = step_logprobs[:, :vocab_size]
        # Greedy: children by raw log-prob; sampling: from q, the target's processing of these rows.
        rows = step_logprobs if sampling.greedy else processed_probs(step_logprobs, sampling)  # (P, V)
        for node in chosen:
            if node != ROOT:
                expanded[node] = True
        frontier = []
        greedy_picks = _greedy_children(rows, spec.top_k_spec[d][: len(chosen)]) if sampling.greedy else None
        for j, node in enumerate(chosen):
            if greedy_picks is not None:
                ids, values = greedy_picks[j]
            else:
                ids, values = _pick_children(spec.top_k_spec[d][j], rows[j], sampled_children, rng)
            if sampled_children:
                proposals.append(Proposal(node, rows[j]))
            base = 0.0 if node == ROOT else path_logp[node]
            for value, token in zip(values, ids):
                frontier.append(len(tokens))
                tokens.append(token)
                parents.append(node)
                logprobs.append(value)
                path_logp.append(base + value)
                expanded.append(False)
    return DraftTree(tuple(tokens), tuple(parents), tuple(logprobs), tuple(expanded), tuple(proposals))


def _greedy_children(rows: torch.Tensor, ks) -> list[tuple[list[int], list[float]]]:
    """Greedy children of a step's P expanded nodes: per node j its top ``ks[j]`` (token ids, draft
    log-probs), best first, from rows [P, V] raw draft log-probs; one top-k and one host copy per step."""
    values, ids = rows.topk(min(max(ks), rows.shape[-1]), dim=-1)  # (P, K)
    picked = torch.cat([ids.to(torch.float64), values.to(torch.float64)], dim=-1).tolist()  # ids exact in float64
    half = ids.shape[-1]
    return [([int(t) for t in row[:k]], row[half : half + k]) for row, k in zip(picked, ks)]


def _pick_children(k: int, row: np.ndarray, sampled: bool, rng) -> tuple[list[int], list[float]]:
    """Sampled children of one expanded node: (token ids, their draft log-probs), in tree order. row: q [V]
    (NumPy float64); at most q's support."""
    if sampled:
        ids = sample_without_replacement(row, k, rng)  # draw order
    else:
        k = min(k, int(np.count_nonzero(row)))
        top = np.argpartition(-row, k - 1)[:k] if k < len(row) else np.arange(len(row))
        ids = top[np.argsort(-row[top], kind="stable")].tolist()  # best first
    return ids, np.log(row[ids]).tolist()


def _top_nodes(candidates: list[int], path_logp: list[float], k: int) -> list[int]:
    """The k candidates with the highest path log-probability, best first (stable: tree order on ties)."""
    ranked = sorted(candidates, key=lambda n: -path_logp[n])  # sorted() is stable
    return ranked[:k]
