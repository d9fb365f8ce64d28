"""Grow a token tree from a TreeSpec, one batched draft forward per depth (DESIGN.md "TreeSpec").

Step d (0-based) expands ``topHead[d]`` depth-d nodes: the root at d = 0; for d >= 1 the depth-d
nodes with the highest path probability (product of draft probabilities from the root), ties broken
by tree order. The j-th expanded node (in that ranking) keeps its draft top ``topKSpec[d][j]``
children. ``gammaThreshold`` > 0 stops deepening once the best depth-d path probability falls below
it. Tree shapes after Sequoia/SpecInfer-style static trees (Miao et al. ASPLOS'24 §3; Chen et al. 2024).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from specdec.tree import ROOT, DraftTree
from specdec.tree_spec import TreeSpec

# expand(nodes, tokens, parents) -> [P, V] draft log-probabilities after each of the P nodes
# (node -1 = the root). ``tokens``/``parents`` are the tree built so far.
ExpandFn = Callable[[list[int], list[int], list[int]], torch.Tensor]


def build_tree(spec: TreeSpec, expand: ExpandFn, max_depth: int | None = None, vocab_size: int | None = None) -> DraftTree:
    """Build a deterministic top-k token tree (treeType 0).

    max_depth caps gamma (context or token budget left); vocab_size restricts children to ids
    below it (the ids both models share). Returns a DraftTree with nodes in breadth-first order.
    """
    depth_limit = spec.gamma if max_depth is None else min(spec.gamma, max_depth)
    tokens: list[int] = []
    parents: list[int] = []
    logprobs: list[float] = []
    path_logp: list[float] = []
    expanded: list[bool] = []
    frontier: list[int] = []  # nodes created by the previous step (all of one depth)
    for d in range(depth_limit):
        chosen = [ROOT] if d == 0 else _top_nodes(frontier, path_logp, spec.top_head[d])
        if d > 0 and spec.gamma_threshold > 0 and math.exp(path_logp[chosen[0]]) < spec.gamma_threshold:
            break
        step_logprobs = expand(chosen, tokens, parents)  # (P, V)
        if vocab_size is not None:
            step_logprobs = step_logprobs[:, :vocab_size]
        for node in chosen:
            if node != ROOT:
                expanded[node] = True
        frontier = []
        for j, node in enumerate(chosen):
            values, ids = step_logprobs[j].topk(spec.top_k_spec[d][j])
            base = 0.0 if node == ROOT else path_logp[node]
            for value, token in zip(values.tolist(), ids.tolist()):
                frontier.append(len(tokens))
                tokens.append(token)
                parents.append(node)
                logprobs.append(value)
                path_logp.append(base + value)
                expanded.append(False)
    return DraftTree(tuple(tokens), tuple(parents), tuple(logprobs), tuple(expanded))


def _top_nodes(candidates: list[int], path_logp: list[float], k: int) -> list[int]:
    """The k candidates with the highest path log-probability, best first (stable: tree order on ties)."""
    ranked = sorted(candidates, key=lambda n: -path_logp[n])  # sorted() is stable
    return ranked[:k]
