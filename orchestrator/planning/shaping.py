"""Cost-aware token trees: each round's tree maximizes expected committed tokens (1 + the sum of its nodes' values,
each the chance of lying on the accepted path) per predicted round ms (docs/control.md). Sources: EAGLE-2 (Li et
al. 2024, §4: dynamic trees ranked by draft confidence), Sequoia (Chen et al. 2024, §3: hardware-aware tree size),
SpecDec++ (Huang et al. 2024) and DISCO (Mamou et al. 2024) on when to stop drafting.
"""

from __future__ import annotations

import heapq
import math
import threading
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

from orchestrator.planning.cost_model import CostModel
from specdec.ngram import match_continuation
from specdec.tree import ROOT, DraftTree, children, merge_chain, node_depths, select_nodes

_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 0.95, 1.0)


def _bin(q: float) -> int:
    for i in range(len(_EDGES) - 2, -1, -1):
        if q >= _EDGES[i]:
            return i
    return 0


class _Calibration:
    """Acceptance counts by key; an estimate is (hits + p w) / (seen + w), shrunk towards a prior p worth w
    observations: another calibration's estimate (``prior``, worth ``prior_weight`` per key) or a fixed one."""

    def __init__(self, prior=None, prior_weight: float = 4.0):
        self.prior = prior
        self.prior_weight = prior_weight
        self.hits: dict = {}
        self.seen: dict = {}
        self._lock = threading.Lock()

    def _estimate(self, key, p: float, w: float) -> float:
        return (self.hits.get(key, 0.0) + p * w) / (self.seen.get(key, 0.0) + w)

    def _count(self, key, accepted: bool) -> None:
        with self._lock:
            self.hits[key] = self.hits.get(key, 0.0) + accepted
            self.seen[key] = self.seen.get(key, 0.0) + 1


class AcceptanceCalibration(_Calibration):
    """a(q): P(a draft child is accepted | its parent is), binned by the child's draft probability q; without a
    ``prior`` (another AcceptanceCalibration) a(q) starts at 0.8 q, worth 2."""

    def a_bin(self, b: int) -> float:
        if self.prior is not None:
            return self._estimate(b, self.prior.a_bin(b), self.prior_weight)
        return self._estimate(b, 0.8 * ((_EDGES[b] + _EDGES[b + 1]) / 2), 2.0)

    def __call__(self, q: float) -> float:
        """Calibrated acceptance chance of a child with draft probability q in [0, 1]."""
        return self.a_bin(_bin(q))

    def observe(self, q: float, accepted: bool) -> None:
        self._count(_bin(q), accepted)


class ContextCalibration(_Calibration):
    """P(a context node is accepted | its parent is), by (n, k): n the ``match_bucket``, k the node's place
    (capped at 4); prior 0.4 worth 2 observations, or another ContextCalibration's estimates."""

    def __call__(self, n: int, k: int) -> float:
        p, w = (self.prior(n, k), self.prior_weight) if self.prior is not None else (0.4, 2.0)
        return self._estimate((n, min(k, 4)), p, w)

    def observe(self, n: int, k: int, accepted: bool) -> None:
        self._count((n, min(k, 4)), accepted)


@dataclass(frozen=True)
class ShapedTree:
    """The tree a round verifies: draft_index: [N] index in the draft's own tree (None for context nodes); values:
    [N] acceptance chances; context: {node: (n, k)} calibration keys of the context branch's nodes (shared draft
    nodes too); drafted: nodes the draft proposed; expected_accepted: sum of values (tokens, bonus excluded)."""

    tree: DraftTree
    draft_index: tuple[int | None, ...]
    values: tuple[float, ...]
    context: dict
    drafted: int
    expected_accepted: float

    @property
    def depth(self) -> int:
        return max(node_depths(self.tree.parents), default=0)

    @classmethod
    def of(cls, tree: DraftTree) -> "ShapedTree":
        """The drafted tree verified as it is (controls that do not shape trees)."""
        return cls(tree, tuple(range(tree.size)), (0.0,) * tree.size, {}, tree.size, 0.0)


def node_values(tree: DraftTree, calib: AcceptanceCalibration) -> list[float]:
    """[N] value of each draft node: product of a(q) along its path (q = exp(draft log-prob))."""
    values: list[float] = []
    for i, p in enumerate(tree.parents):
        q = math.exp(tree.draft_logprobs[i]) if tree.draft_logprobs else 0.5
        values.append((1.0 if p == ROOT else values[p]) * calib(q))
    return values


def _selectable(tree: DraftTree, parent: int, kids: list[list[int]], taken: set[int]) -> list[int]:
    """Children of ``parent`` that may be taken next: every context child, and for a parent with a
    proposal (sampled treeType 1) only the first drawn child not yet taken (draw-order prefix)."""
    has_q = any(q.parent == parent for q in tree.proposals)
    out, first_drawn = [], True
    for c in kids[parent + 1]:
        if c in taken:
            continue
        if has_q and tree.drawn(c):
            if first_drawn:
                out.append(c)
            first_drawn = False
        else:
            out.append(c)
    return out


def select_by_rate(tree: DraftTree, values: Sequence[float], cost: CostModel, sunk_ms: float,
                   drafted: bool = False) -> list[int]:
    """Kept node indices (ancestor-closed, possibly empty): best value first, while (1 + sum of values) /
    (sunk_ms + V(1 + n)) is highest. sunk_ms: ms spent this round; drafted: price with ``cost.drafted_verify``."""
    verify = cost.drafted_verify if drafted else cost.verify
    kids = children(tree.parents)
    taken: set[int] = set()
    order: list[int] = []
    heap = [(-values[c], c) for c in _selectable(tree, ROOT, kids, taken)]
    heapq.heapify(heap)
    total, best_rate, best_n = 1.0, 1.0 / (sunk_ms + verify(1)), 0
    while heap:
        neg, node = heapq.heappop(heap)
        if node in taken:
            continue
        taken.add(node)
        order.append(node)
        total += -neg
        rate = total / (sunk_ms + verify(1 + len(order)))
        if rate > best_rate:
            best_rate, best_n = rate, len(order)
        for c in _selectable(tree, node, kids, taken) + _selectable(tree, tree.parents[node], kids, taken):
            heapq.heappush(heap, (-values[c], c))
    return order[:best_n]


Lookup = Callable[[Sequence[int], int], tuple[list[int], int]]  # (context, max tokens) -> (chain, calibration key n)


def shape_tree(tree: DraftTree, context: Sequence[int], calib: AcceptanceCalibration, ctx_calib: ContextCalibration,
               cost: CostModel, sunk_ms: float, ngram_tokens: int = 8, max_ngram: int = 3,
               max_depth: int | None = None, lookup: Lookup | None = None) -> ShapedTree:
    """Merge the context's n-gram continuation into the drafted tree (may be empty), then keep the nodes that pay.
    context: [T] committed tokens; max_depth: deepest node allowed; lookup: replaces ``ngram_continuation``."""
    values = node_values(tree, calib)
    drafted = tree.size
    ctx_keys: dict[int, tuple[int, int]] = {}
    chain, n = context_chain(context, ngram_tokens, max_ngram, max_depth, lookup)
    if chain:
        tree, path = merge_chain(tree, ROOT, chain)
        parent_value = 1.0
        for k, node in enumerate(path, start=1):
            v = parent_value * ctx_calib(n, k)
            if node >= len(values):
                values.append(v)
            else:
                values[node] = max(values[node], v)  # a draft node the n-gram also proposes
            ctx_keys[node] = (n, k)  # shared nodes too: the branch's chances are learnt where the draft agrees
            parent_value = values[node]
    keep = select_by_rate(tree, values, cost, sunk_ms, drafted=drafted > 0)
    sub, old = select_nodes(tree, keep)
    draft_index = tuple(o if o < drafted else None for o in old)
    context_keys = {j: ctx_keys[o] for j, o in enumerate(old) if o in ctx_keys}
    kept_values = tuple(values[o] for o in old)
    return ShapedTree(sub, draft_index, kept_values, context_keys, drafted, sum(kept_values))


def context_chain(context: Sequence[int], ngram_tokens: int, max_ngram: int, max_depth: int | None,
                  lookup: Lookup | None = None) -> tuple[list[int], int]:
    """This round's context branch: (continuation of at most min(ngram_tokens, max_depth) tokens, its
    calibration key), ([], 0) when there is none; ``lookup`` replaces ``ngram_continuation``."""
    limit = ngram_tokens if max_depth is None else min(ngram_tokens, max_depth)
    if limit <= 0:
        return [], 0
    return (lookup or partial(ngram_continuation, max_ngram=max_ngram))(context, limit)


def context_path(context: Sequence[int], ctx_calib: ContextCalibration, cost: CostModel, sunk_ms: float,
                 ngram_tokens: int = 8, max_ngram: int = 3, max_depth: int | None = None,
                 lookup: Lookup | None = None) -> list[float]:
    """[m] values of the context branch's nodes that ``shape_tree`` would keep with no draft tree (value k: the
    chance its first k tokens are all accepted); [] when there is no branch."""
    chain, n = context_chain(context, ngram_tokens, max_ngram, max_depth, lookup)
    if not chain:
        return []
    values, v = [], 1.0
    for k in range(1, len(chain) + 1):
        v *= ctx_calib(n, k)
        values.append(v)
    tree, _ = merge_chain(DraftTree((), ()), ROOT, chain)
    return values[:len(select_by_rate(tree, values, cost, sunk_ms))]  # falling values: the kept nodes are a prefix


def match_bucket(match: int) -> int:
    """Calibration key of a branch matching the context's last ``match`` tokens: 1, 2, 3, 4 (4-5) or 5 (6+);
    ``match`` < 1 is returned as it is. The match length predicts acceptance."""
    return match if match <= 3 else 4 if match <= 5 else 5


def ngram_continuation(context: Sequence[int], max_tokens: int, max_ngram: int = 3) -> tuple[list[int], int]:
    """(n-gram continuation of at most max_tokens tokens, its ``match_bucket``); ([], 0) when none."""
    chain, match = match_continuation(context, max_tokens, max_ngram=max_ngram, max_match=6)  # 6+: one bucket
    return chain, match_bucket(match)  # ([], 0) when nothing matches


def observe_verified(shaped: ShapedTree, accepted_nodes: Sequence[int], calib: AcceptanceCalibration,
                     ctx_calib: ContextCalibration) -> None:
    """Teach both calibrations from one verified tree: one sample per node whose parent was accepted."""
    tree = shaped.tree
    on_path = set(accepted_nodes)
    for i, p in enumerate(tree.parents):
        if p != ROOT and p not in on_path:
            continue
        hit = i in on_path
        if i in shaped.context:
            ctx_calib.observe(*shaped.context[i], hit)
        if shaped.draft_index[i] is not None and tree.draft_logprobs:
            calib.observe(math.exp(tree.draft_logprobs[i]), hit)
