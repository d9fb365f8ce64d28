"""The token tree: one flat representation and the pure functions derived from it (docs/design.md "Token tree").

Dims: N tree nodes, L cached tokens, V vocabulary. ``parents[i] < i``, ``-1`` for a child of the implicit root R;
forwards put R in row 0 and node i in row i + 1. Positions: L = 7, depths [1, 1, 2] -> R 7, nodes [8, 8, 9].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

ROOT = -1
SOURCE_DRAFT = 0  # node proposed by the draft model
SOURCE_CONTEXT = 1  # node copied from the context (n-gram / prompt lookup), never drawn from q


@dataclass(frozen=True)
class Proposal:
    """The draft distribution q one expanded node's children were drawn from (treeType 1). parent: the
    node (-1 = root); probs: [V'] float64 over the draft's ids (V' <= V), processed, summing to 1;
    ``sparse`` / ``from_sparse`` give the wire form."""

    parent: int
    probs: np.ndarray

    def sparse(self) -> tuple[np.ndarray, np.ndarray]:
        """(token_ids [S] int64, probs [S] float64) on q's support."""
        token_ids = self.probs.nonzero()[0]  # (S,)
        return token_ids, self.probs[token_ids]

    @classmethod
    def from_sparse(cls, parent: int, token_ids, probs, vocab_size: int) -> "Proposal":
        q = np.zeros(vocab_size)
        q[np.asarray(token_ids, dtype=np.int64)] = probs
        return cls(parent, q)

    def dense(self, vocab_size: int) -> np.ndarray:
        """q as a [vocab_size] array (zero-padded past the draft's ids)."""
        if len(self.probs) == vocab_size:
            return self.probs
        if len(self.probs) > vocab_size:
            raise MalformedTreeError(f"proposals: q over {len(self.probs)} ids exceeds the vocabulary of {vocab_size}")
        return np.concatenate([self.probs, np.zeros(vocab_size - len(self.probs))])


@dataclass(frozen=True)
class DraftTree:
    """A speculated token tree, the hand-off from draft to target (fields: docs/design.md "Token tree").
    tokens, parents, draft_logprobs, expanded: [N]; proposals: treeType 1 only, one per expanded node;
    sources: [N] SOURCE_DRAFT / SOURCE_CONTEXT, or () = all draft. Siblings are in draw order."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    draft_logprobs: tuple[float, ...] = ()
    expanded: tuple[bool, ...] = ()
    proposals: tuple[Proposal, ...] = field(default=(), compare=False)
    sources: tuple[int, ...] = ()

    def __post_init__(self):
        validate_tree(self.tokens, self.parents)
        if self.sources and len(self.sources) != len(self.tokens):
            raise MalformedTreeError(f"sources: length {len(self.sources)} != tokens length {len(self.tokens)}")
        if any(src not in (SOURCE_DRAFT, SOURCE_CONTEXT) for src in self.sources):
            raise MalformedTreeError(f"sources: values must be {SOURCE_DRAFT} (draft) or {SOURCE_CONTEXT} (context)")

    @property
    def size(self) -> int:
        return len(self.tokens)

    def source(self, i: int) -> int:
        """SOURCE_DRAFT or SOURCE_CONTEXT of node i."""
        return self.sources[i] if self.sources else SOURCE_DRAFT

    def drawn(self, i: int) -> bool:
        """Whether node i is a draft child (drawn from q when its parent has a proposal)."""
        return self.source(i) == SOURCE_DRAFT


class MalformedTreeError(ValueError):
    """A tree violates the representation rules; the message names the offending field."""


def validate_tree(tokens, parents, vocab_size: int | None = None, max_nodes: int | None = None) -> None:
    """Check the representation rules; raise MalformedTreeError naming the field that breaks them."""
    if len(tokens) != len(parents):
        raise MalformedTreeError(f"parents: length {len(parents)} != tokens length {len(tokens)}")
    if max_nodes is not None and len(tokens) > max_nodes:
        raise MalformedTreeError(f"tokens: {len(tokens)} nodes exceed the limit of {max_nodes}")
    for i, p in enumerate(parents):
        if not (ROOT <= p < i):
            raise MalformedTreeError(f"parents[{i}] = {p}: must be -1 (root) or a smaller node index")
    if vocab_size is not None:
        for i, t in enumerate(tokens):
            if not (0 <= t < vocab_size):
                raise MalformedTreeError(f"tokens[{i}] = {t}: outside the vocabulary [0, {vocab_size})")


def node_depths(parents) -> list[int]:
    """Depth of every node: children of the root have depth 1. [N] -> [N]."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p == ROOT else depths[p] + 1)
    return depths


def ancestors(parents, i: int) -> list[int]:
    """Node indices from the top of the tree down to node i, inclusive (root excluded)."""
    path = []
    while i != ROOT:
        path.append(i)
        i = parents[i]
    return path[::-1]


def children(parents) -> list[list[int]]:
    """children[i + 1] lists the children of node i; children[0] those of the root."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def tree_position_ids(parents, cache_len: int, device=None) -> torch.Tensor:
    """Position ids of [R, nodes]: [N + 1] int64 on ``device`` (None = CPU); R at ``cache_len``, a depth-d
    node at ``cache_len + d``."""
    return _depths(tuple(parents), torch.device(device or "cpu")) + cache_len


def tree_visibility(parents) -> torch.Tensor:
    """[N + 1, N + 1] bool over [R, nodes]: every row sees R; node i (row i + 1) its ancestors and itself."""
    n = len(parents)
    visible = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    visible[:, 0] = True
    for i, p in enumerate(parents):
        if p != ROOT:
            visible[i + 1] = visible[p + 1]
        visible[i + 1, i + 1] = True
    return visible


def additive_mask(visible: torch.Tensor, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Turn a [Q, K] bool visibility matrix into a [1, 1, Q, K] additive mask (0 or dtype min) on ``device``
    (None = visible's); only the bool matrix crosses devices."""
    visible = visible.to(device) if device is not None else visible
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]  # (1, 1, Q, K)


def tree_attention_mask(parents, cache_len: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Tree attention mask over [R, nodes] after ``cache_len`` cached tokens: [1, 1, N + 1, cache_len + N + 1]
    additive on ``device`` (None = CPU); each row sees the prefix, R, its ancestors and itself (SpecInfer,
    Miao et al. ASPLOS'24, §4). Built on the device from a per-shape copy of the tree part (no host copy)."""
    n = len(parents)
    device = torch.device(device or "cpu")
    mask = torch.zeros(1, 1, n + 1, cache_len + n + 1, dtype=dtype, device=device)
    mask[0, 0, :, cache_len:] = _tree_mask(tuple(parents), dtype, device)
    return mask


@functools.lru_cache(maxsize=256)
def _depths(parents: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Depths of [R, nodes] on ``device``: [N + 1] int64, R 0; cached per tree shape, never written."""
    return torch.tensor([0, *node_depths(parents)], dtype=torch.long, device=device)


@functools.lru_cache(maxsize=256)
def _tree_mask(parents: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``tree_visibility`` as an additive [N + 1, N + 1] mask on ``device``; cached per tree shape, never written."""
    return additive_mask(tree_visibility(parents), dtype, device)[0, 0]


def select_nodes(tree: DraftTree, keep) -> tuple[DraftTree, list[int]]:
    """The sub-tree of the ancestor-closed ``keep``: (tree', old), node j of tree' = node old[j]. The caller
    must keep a draw-order prefix of drawn siblings. Raises MalformedTreeError for an orphan.
    Example: parents [-1, -1, 0, 1], keep {0, 2} -> parents [-1, 0], old [0, 2]."""
    old = sorted(set(keep))
    new_of = {o: j for j, o in enumerate(old)}
    parents = []
    for o in old:
        p = tree.parents[o]
        if p != ROOT and p not in new_of:
            raise MalformedTreeError(f"keep: node {o} is kept but its parent {p} is not")
        parents.append(ROOT if p == ROOT else new_of[p])
    pick = lambda values: tuple(values[o] for o in old) if values else ()  # noqa: E731
    proposals = tuple(Proposal(ROOT if q.parent == ROOT else new_of[q.parent], q.probs)
                      for q in tree.proposals if q.parent == ROOT or q.parent in new_of)
    sub = DraftTree(pick(tree.tokens), tuple(parents), pick(tree.draft_logprobs), pick(tree.expanded),
                    proposals, pick(tree.sources))
    return sub, old


def merge_chain(tree: DraftTree, parent: int, chain, source: int = SOURCE_CONTEXT) -> tuple[DraftTree, list[int]]:
    """Hang a chain of tokens below ``parent`` (-1 = root), sharing existing nodes with the same tokens and
    appending the rest (of ``source``) after all existing nodes, whose indices stay. Returns (tree', path),
    path[k] the node holding chain[k]. Example: parents [-1, 0] tokens [7, 8], chain [7, 9] under the
    root -> parents [-1, 0, 0], path [0, 2]."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    n = len(tokens)
    sources = list(tree.sources) if tree.sources else [SOURCE_DRAFT] * n
    logprobs = list(tree.draft_logprobs) if tree.draft_logprobs else [0.0] * n
    expanded = list(tree.expanded) if tree.expanded else [False] * n
    kids = children(parents)
    node, path = parent, []
    for k, token in enumerate(chain):
        match = next((c for c in kids[node + 1] if tokens[c] == token), None) if node < n else None
        if match is None:
            for token in chain[k:]:
                tokens.append(token)
                parents.append(node)
                sources.append(source)
                logprobs.append(0.0)  # no draft probability: not drawn from the draft
                expanded.append(False)
                node = len(tokens) - 1
                path.append(node)
            break
        node = match
        path.append(node)
    merged = DraftTree(tuple(tokens), tuple(parents), tuple(logprobs), tuple(expanded), tree.proposals, tuple(sources))
    return merged, path
