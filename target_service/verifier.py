"""Acceptance along one root path of a verified token tree (DESIGN.md "Verification").

Dims: N tree nodes, V vocabulary. Row 0 of the target logits belongs to the root R, row i + 1 to
node i: row r holds the target's distribution for the token that follows that row's token.
"""

from __future__ import annotations

import torch

from specdec.interfaces import VerifyResult
from specdec.tree import ROOT, children


def verify_greedy(tokens, parents, target_logits: torch.Tensor) -> VerifyResult:
    """Greedy tree verification: from the root, move to the child equal to the target argmax.

    tokens, parents: [N] the tree; target_logits: [N + 1, V] float32. Stops at the first node whose
    argmax is not among its children; that argmax is the bonus token. Only one path is walked:
    matches on other branches do not count (SpecInfer, Miao et al. ASPLOS'24, §4.1 greedy case).
    """
    assert target_logits.shape[0] == len(tokens) + 1, "target_logits: need one row per node plus the root"
    argmax = target_logits.argmax(dim=-1).tolist()  # (N + 1,)
    kids = children(parents)
    node, path = ROOT, []
    while True:
        want = argmax[node + 1]
        nxt = next((c for c in kids[node + 1] if tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(tuple(path), tuple(tokens[n] for n in path) + (want,))
        path.append(nxt)
        node = nxt
