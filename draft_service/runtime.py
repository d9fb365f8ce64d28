"""In-process draft worker: the draft model, one KV cache per session, tree proposal and rollback.

Dims: S cached slots, P nodes fed in one step, V vocabulary.

Draft cache layout while proposing (example: 7 committed tokens, 5 of them cached):
    slots 0..4  committed, cached before this round
    slots 5..6  pending committed tokens (the last is the root R), fed causally at step 0
    slots 7..8  the topHead[1] depth-1 nodes fed at step 1, then step 2's nodes, ...
R sits at position 6 and a node of depth d at position 6 + d. After commit the cache keeps the
committed prefix plus the accepted nodes that were fed, compacted; the rest is dropped, so the
draft never re-prefills the whole context.

Each session keeps the request's SamplingParams (given once, at ``start``) and, when sampling, its own
random generator (a stream of the request seed distinct from the target's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from draft_service.tree_builder import build_tree
from specdec.forward import model_forward
from specdec.interfaces import UnknownSessionError
from specdec.kv_cache import cache_length, compact_kv, new_cache, truncate_kv
from specdec.sampling import GREEDY, SamplingParams, session_rng
from specdec.tree import ROOT, DraftTree, additive_mask, ancestors, node_depths
from specdec.tree_spec import TreeSpec


@dataclass
class DraftSession:
    tokens: list[int]  # all committed tokens (prompt + generated)
    cache: object
    cached_len: int = 0  # committed tokens whose KV is in the cache
    sampling: SamplingParams = GREEDY
    rng: np.random.Generator | None = None  # sampled requests only
    slot_of_node: dict[int, int] = field(default_factory=dict)  # last tree's fed nodes -> cache slot
    round_start: int | None = None  # cached_len before an uncommitted proposal (for a retry)


class DraftRuntime:
    """Implements DraftWorker (specdec.interfaces) over a transformers causal LM."""

    def __init__(self, model, vocab_size: int | None = None):
        self.model = model
        self.vocab_size = vocab_size  # ids both models share; None = the draft's own
        self.sessions: dict[str, DraftSession] = {}

    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams = GREEDY) -> None:
        """Open a session; sampling: the request's parameters, used by every propose of the session."""
        rng = None if sampling.greedy else session_rng(sampling, "draft")
        self.sessions[session_id] = DraftSession(list(prompt_ids), new_cache(self.model.config), sampling=sampling, rng=rng)

    def prefill(self, session_id: str, max_tokens: int | None = None) -> bool:
        """Feed the committed tokens but the last into the cache now, at most ``max_tokens`` of them
        (None = all) (the draft service calls this right after ``start``, chunk by chunk, so the
        draft's prefill overlaps the target's and other sessions' proposes get in between chunks);
        the first ``propose`` then feeds only what is left. Without it, the first propose feeds them
        all. Returns True when tokens are left to prefill."""
        s = self.sessions.get(session_id)
        if s is None:  # released before its queued prefill ran
            return False
        pending = s.tokens[s.cached_len : -1][:max_tokens]
        if not pending or s.round_start is not None or max(pending) >= self.model.config.vocab_size:
            return False
        positions = torch.arange(s.cached_len, s.cached_len + len(pending))
        model_forward(self.model, s.cache, pending, positions, mask=None, logits_rows=1)
        s.cached_len += len(pending)
        return s.cached_len < len(s.tokens) - 1

    def release(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def _session(self, session_id: str) -> DraftSession:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"session_id: unknown draft session {session_id!r}") from None

    def propose(self, session_id: str, spec: TreeSpec, max_depth: int) -> DraftTree:
        """Grow a tree after the session's committed tokens; gamma is capped at max_depth (>= 1)."""
        s = self._session(session_id)
        if s.round_start is not None:  # a retry: drop the uncommitted proposal, pending tokens included
            s.cached_len = s.round_start
            truncate_kv(s.cache, s.cached_len)
        s.round_start = s.cached_len
        s.slot_of_node = {}
        if max(s.tokens[s.cached_len :]) >= self.model.config.vocab_size:
            # The target committed an id the draft has no embedding for (its vocabulary is
            # smaller): no tree from here on; the engine verifies the empty tree = plain decoding.
            return DraftTree((), ())

        def expand(nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            if nodes == [ROOT]:
                return self._feed_pending(s)
            return self._feed_nodes(s, nodes, tokens, parents)

        return build_tree(spec, expand, max_depth=max_depth, vocab_size=self.vocab_size,
                          sampling=s.sampling, rng=s.rng)

    def _feed_pending(self, s: DraftSession) -> torch.Tensor:
        """Step 0: feed the committed tokens not yet cached (R last); log-probs after R: [1, V]."""
        pending = s.tokens[s.cached_len :]
        positions = torch.arange(s.cached_len, len(s.tokens))
        logits = model_forward(self.model, s.cache, pending, positions, mask=None, logits_rows=1)
        s.cached_len = len(s.tokens)
        return torch.log_softmax(logits, dim=-1)  # (1, V)

    def _feed_nodes(self, s: DraftSession, nodes, tokens, parents) -> torch.Tensor:
        """Step d >= 1: feed P tree nodes with a draft tree mask; log-probs after each: [P, V]."""
        base = s.cached_len  # committed slots; tree slots follow
        start = cache_length(s.cache)
        depths = node_depths(parents)
        visible = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool)  # (P, S + P)
        visible[:, :base] = True
        for row, node in enumerate(nodes):
            for anc in ancestors(parents, node)[:-1]:
                visible[row, s.slot_of_node[anc]] = True
            visible[row, start + row] = True
            s.slot_of_node[node] = start + row
        positions = torch.tensor([base - 1 + depths[n] for n in nodes])
        mask = additive_mask(visible, self.model.dtype)
        logits = model_forward(self.model, s.cache, [tokens[n] for n in nodes], positions, mask)
        return torch.log_softmax(logits, dim=-1)  # (P, V)

    def commit(self, session_id: str, tokens: list[int], accepted_nodes: list[int]) -> None:
        """Append the round's committed tokens; keep the KV of accepted nodes the draft had fed."""
        s = self._session(session_id)
        fed = [s.slot_of_node[n] for n in accepted_nodes if n in s.slot_of_node]
        # Fed nodes form a prefix of the accepted path (a fed node's parent was fed too).
        compact_kv(s.cache, s.cached_len, fed)
        s.cached_len += len(fed)
        s.tokens.extend(tokens)
        s.slot_of_node = {}
        s.round_start = None
