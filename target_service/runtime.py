"""In-process target worker: one tree-masked forward per verify, KV compaction on commit.

Dims: L cached slots, N tree nodes, V vocabulary.

Target cache invariant: after ``start`` and every ``commit`` the cache holds KV for all committed
tokens but the last one, the root R. Verify feeds [R, node 0, ..., node N-1] at slots L..L+N with
tree position ids (R at L, a depth-d node at L + d) and the tree attention mask; commit keeps R and
the accepted nodes, compacted to slots L, L+1, ..., and drops the rest (KV cache rollback).

Each session keeps the request's SamplingParams (given once, at ``start``) and, when sampling, its own
random generator, so a request's draws never depend on other sessions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.forward import model_forward
from specdec.interfaces import UnknownSessionError, VerifyResult
from specdec.kv_cache import compact_kv, new_cache, truncate_kv
from specdec.sampling import GREEDY, SamplingParams, processed_probs, session_rng
from specdec.tree_spec import MAX_TREE_NODES
from specdec.tree import DraftTree, tree_attention_mask, tree_position_ids, validate_tree
from target_service.verifier import verify_greedy, verify_sampled


class SessionStateError(RuntimeError):
    """Calls out of order, e.g. commit without a pending verify."""


@dataclass
class TargetSession:
    cache: object
    cache_len: int  # L: committed tokens with KV in the cache
    root: int  # R: the last committed token
    sampling: SamplingParams = GREEDY
    rng: np.random.Generator | None = None  # sampled requests only
    pending: VerifyResult | None = None


class TargetRuntime:
    """Implements TargetWorker (specdec.interfaces) over a transformers causal LM."""

    def __init__(self, model, max_tree_nodes: int = MAX_TREE_NODES):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_tree_nodes = max_tree_nodes
        self.sessions: dict[str, TargetSession] = {}

    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams = GREEDY) -> None:
        """Prefill all prompt tokens but the last, which becomes the root R. prompt_ids: [T], T >= 1;
        sampling: the request's parameters, used by every verify of the session."""
        if not prompt_ids:
            raise ValueError("prompt_ids: empty prompt")
        cache = new_cache(self.model.config)
        if len(prompt_ids) > 1:
            positions = torch.arange(len(prompt_ids) - 1)
            model_forward(self.model, cache, prompt_ids[:-1], positions, mask=None, logits_rows=1)
        rng = None if sampling.greedy else session_rng(sampling, "target")
        self.sessions[session_id] = TargetSession(cache, len(prompt_ids) - 1, prompt_ids[-1], sampling, rng)

    def release(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def _session(self, session_id: str) -> TargetSession:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"session_id: unknown target session {session_id!r}") from None

    def tree_logits(self, session_id: str, tree: DraftTree) -> torch.Tensor:
        """One forward over [R, nodes]: [N + 1, V] float32. The cache grows by N + 1 slots."""
        s = self._session(session_id)
        validate_tree(tree.tokens, tree.parents, self.vocab_size, self.max_tree_nodes)
        truncate_kv(s.cache, s.cache_len)  # drop the slots of an earlier verify that failed mid-way
        positions = tree_position_ids(tree.parents, s.cache_len)  # (N + 1,)
        mask = tree_attention_mask(tree.parents, s.cache_len, self.model.dtype)  # (1, 1, N+1, L+N+1)
        return model_forward(self.model, s.cache, [s.root, *tree.tokens], positions, mask)

    def verify(self, session_id: str, tree: DraftTree) -> VerifyResult:
        """Verify a tree (an empty tree is one plain decoding step); the result waits for commit."""
        s = self._session(session_id)
        if s.pending is not None:
            raise SessionStateError(f"session_id: {session_id!r} has an uncommitted verify")
        logits = self.tree_logits(session_id, tree)  # (N + 1, V)
        if s.sampling.greedy:
            s.pending = verify_greedy(tree.tokens, tree.parents, logits)
        else:
            def row_probs(row: int):  # processed only for the rows the walk visits
                return processed_probs(logits[row], s.sampling)

            s.pending = verify_sampled(tree.tokens, tree.parents, row_probs, s.rng, tree.proposals)
        return s.pending

    def commit(self, session_id: str, num_tokens: int) -> None:
        """Commit the first ``num_tokens`` tokens of the pending result (fewer after a stop).

        Keeps R plus the accepted nodes before the last committed token, which becomes the new R.
        """
        s = self._session(session_id)
        result = s.pending
        if result is None:
            raise SessionStateError(f"session_id: {session_id!r} has no verify to commit")
        if not 1 <= num_tokens <= len(result.tokens):
            raise ValueError(f"num_tokens: {num_tokens} outside [1, {len(result.tokens)}]")
        kept_nodes = result.accepted_nodes[: num_tokens - 1]
        root_slot = s.cache_len
        compact_kv(s.cache, root_slot + 1, [root_slot + 1 + n for n in kept_nodes])
        s.cache_len += 1 + len(kept_nodes)
        s.root = result.tokens[num_tokens - 1]
        s.pending = None
