"""In-process target worker: one tree-masked forward per verify, KV compaction on commit.

Dims: L cached slots, N tree nodes, V vocabulary. Verify feeds [R, node 0, ..., node N-1] at slots L..L+N;
commit keeps R and the accepted nodes, compacted to slots L, L+1, ... (docs/design.md "KV rollback").
``start`` prefills the whole prompt, R included, and keeps R's logits, so the first verify feeds only the
nodes; until that first commit the cache holds L + 1 slots. Each session has its own random generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np
import torch

from specdec.argmax_head import argmax_head_of
from specdec.forward import ModelRuntime, model_forward_packed, padded_batch_inputs
from specdec.interfaces import SessionStateError, UnknownSessionError, VerifyResult
from specdec.kv_cache import compact_kv, new_cache, restore_tail_kv, tail_kv, truncate_kv
from specdec.sampling import GREEDY, SamplingParams, processed_probs, session_rng, token_logprobs
from specdec.tree_spec import MAX_TREE_NODES
from specdec.tree import (
    DraftTree, MalformedTreeError, tree_attention_mask, tree_position_ids, tree_visibility, validate_tree,
)
from target_service.verifier import verify_greedy, verify_sampled


@dataclass
class TargetSession:
    cache: object
    cache_len: int  # L: committed tokens with KV in the cache
    root: int  # R: the last committed token
    sampling: SamplingParams = GREEDY
    rng: np.random.Generator | None = None  # sampled requests only
    pending: VerifyResult | None = None
    root_logits: torch.Tensor | None = None  # [V] R's logits while R's KV is cached (from start to the first commit)
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs of prompt tokens 1.. (sampling.prompt_logprobs)


@dataclass(frozen=True)
class PrefillChunk:
    """The next prompt chunk of a session, fed as a chain [R, tokens...] in a ``verify_batch`` forward, as
    ``extend`` would. tokens: [C] ids, C >= 1; still_open: checked before the forward, False = the session is
    gone (maybe reopened under the same id): UnknownSessionError."""

    tokens: tuple[int, ...]
    still_open: Callable[[], bool] | None = field(default=None, compare=False)

    @property
    def size(self) -> int:
        """Rows past R (as a tree's node count)."""
        return len(self.tokens)

    def as_tree(self) -> DraftTree:
        """The chunk as a chain tree under R (node i's parent is node i - 1)."""
        return DraftTree(self.tokens, tuple(range(-1, len(self.tokens) - 1)))


class PrefillChunkFed:
    """A PrefillChunk's outcome in ``verify_batch``: its tokens are cached, the last one is R."""

    def __repr__(self) -> str:
        return "PrefillChunkFed()"


CHUNK_FED = PrefillChunkFed()


class TargetRuntime(ModelRuntime):
    """Implements TargetWorker (specdec.interfaces) over a transformers causal LM."""

    batch_prefill_chunks = True  # verify_batch takes PrefillChunk items
    role = "target"

    def __init__(self, model, max_tree_nodes: int = MAX_TREE_NODES, packed: bool | None = None, direct: bool = True):
        """packed: ``verify_batch`` layout, True = one packed sequence (``model_forward_packed``), False = a padded [B,
        Q] batch, None = packed where the model supports it (``packed_layout``); direct: see ``ModelRuntime``."""
        super().__init__(model, packed, direct)
        self.vocab_size = model.config.vocab_size
        self.max_tree_nodes = max_tree_nodes
        self.argmax_head = argmax_head_of(model)  # greedy rows' argmax without the full LM head, where attached

    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams = GREEDY) -> tuple:
        """As ``TargetWorker.start`` (R's KV cached too, with its logits); () without sampling.prompt_logprobs."""
        if not prompt_ids:
            raise ValueError("prompt_ids: empty prompt")
        cache = new_cache(self.model.config)
        positions = torch.arange(len(prompt_ids))
        rows = None if sampling.prompt_logprobs is not None else 1  # every row's logits for the prompt's logprobs
        logits = self._forward(cache, prompt_ids, positions, mask=None, logits_rows=rows)  # (1 or T, V)
        rng = None if sampling.greedy else session_rng(sampling, "target")
        s = self.sessions[session_id] = TargetSession(cache, len(prompt_ids) - 1, prompt_ids[-1], sampling, rng,
                                                      root_logits=logits[-1])
        _score_prompt(s, logits[:-1], prompt_ids[1:])
        return tuple(s.prompt_logprobs)

    def prompt_logprobs(self, session_id: str) -> tuple:
        """The TokenLogprobs of the session's prompt tokens but the first, so far (start, then its chunks)."""
        return tuple(self._session(session_id).prompt_logprobs)

    def extend(self, session_id: str, prompt_ids: list[int]) -> None:
        """Chunked prefill: feed the next prompt chunk [C], C >= 1, as if ``start`` had had the whole prompt so far.
        Raises ValueError for an empty chunk, SessionStateError once the session has verified."""
        s = self._prefilling(session_id)
        if not prompt_ids:
            raise ValueError("prompt_ids: empty prefill chunk")
        first = s.cache_len + 1  # R's slot is cached: the chunk follows it
        positions = torch.arange(first, first + len(prompt_ids))
        rows = None if s.sampling.prompt_logprobs is not None else 1
        logits = self._forward(s.cache, list(prompt_ids), positions, mask=None, logits_rows=rows)  # (1 or C, V)
        _score_prompt(s, torch.cat([s.root_logits[None], logits[:-1]]), prompt_ids)
        s.cache_len += len(prompt_ids)
        s.root = prompt_ids[-1]
        s.root_logits = logits[-1]

    def tree_logits(self, session_id: str, tree: DraftTree, argmax: bool = False) -> torch.Tensor:
        """One forward over [R, nodes]: [N + 1, V] float32 (argmax: ids [N + 1] int64, via
        ``self.argmax_head`` where attached). The cache grows by N + 1 slots."""
        s = self._session(session_id)
        validate_tree(tree.tokens, tree.parents, self.vocab_size, self.max_tree_nodes)
        if s.root_logits is not None:
            return self._first_tree_logits(s, tree, argmax)
        truncate_kv(s.cache, s.cache_len)  # drop the slots of an earlier verify that failed mid-way
        positions = tree_position_ids(tree.parents, s.cache_len, self.model.device)  # (N + 1,)
        mask = self._tree_mask(tree, s.cache_len)  # (1, 1, N+1, L+N+1)
        return self._rows(self._forward(s.cache, [s.root, *tree.tokens], positions, mask,
                                        argmax_head=self.argmax_head if argmax else None), argmax)

    def _first_tree_logits(self, s: TargetSession, tree: DraftTree, argmax: bool = False) -> torch.Tensor:
        """The first verify after ``start``: R's KV and logits are cached, the nodes fed alone (7-token prompt: L = 6,
        R at slot 6; depths [1, 1, 2] go to slots 7..9 at positions [7, 7, 8]). Returns as ``tree_logits``."""
        truncate_kv(s.cache, s.cache_len + 1)  # keep R; drop the slots of an earlier verify that failed mid-way
        root = s.root_logits.argmax(dim=-1, keepdim=True) if argmax else s.root_logits[None]  # (1,) or (1, V)
        if not tree.size:
            return root  # no forward
        positions = tree_position_ids(tree.parents, s.cache_len, self.model.device)[1:]  # (N,)
        mask = tree_attention_mask(tree.parents, s.cache_len, self.model.dtype, self.model.device)[:, :, 1:]
        rows = self._forward(s.cache, list(tree.tokens), positions, mask,
                             argmax_head=self.argmax_head if argmax else None)  # (N, V) or (N,)
        return torch.cat([root, self._rows(rows, argmax)])

    def _tree_mask(self, tree: DraftTree, cache_len: int) -> torch.Tensor | None:
        """``tree_attention_mask`` of [R, nodes] on the model's device; None for R alone (no mask: fastest kernel)."""
        return tree_attention_mask(tree.parents, cache_len, self.model.dtype, self.model.device) if tree.size else None

    @staticmethod
    def _rows(rows: torch.Tensor, argmax: bool) -> torch.Tensor:
        """A forward's output as asked: logits [K, V] as they are, or argmax ids [K]."""
        return rows.argmax(dim=-1) if argmax and rows.dim() == 2 else rows

    def verify(self, session_id: str, tree: DraftTree) -> VerifyResult:
        """Verify a tree (an empty tree is one plain decoding step); the result waits for commit."""
        s = self._session(session_id)
        if s.pending is not None:
            raise SessionStateError(f"session_id: {session_id!r} has an uncommitted verify")
        rows = self.tree_logits(session_id, tree, argmax=_argmax_only(s))  # (N + 1, V); greedy: (N + 1,)
        return self._accept(s, tree, rows)

    @staticmethod
    def _accept(s: TargetSession, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        """Walk the tree on logits [N + 1, V] (greedy: or argmax ids [N + 1] int64); store as pending."""
        if s.sampling.greedy:
            argmax = logits.tolist() if logits.dim() == 1 else logits.argmax(dim=-1).tolist()
            s.pending = verify_greedy(tree.tokens, tree.parents, argmax)
        else:
            def row_probs(row: int):  # processed only for the rows the walk visits
                return processed_probs(logits[row], s.sampling)

            s.pending = verify_sampled(tree.tokens, tree.parents, row_probs, s.rng, tree.proposals, tree.sources)
        if s.sampling.logprobs is not None:  # each token's row: R's, then its parent node's
            rows = [0, *(n + 1 for n in s.pending.accepted_nodes)]
            s.pending = replace(s.pending, logprobs=token_logprobs(logits[rows], s.pending.tokens, s.sampling.logprobs))
        return s.pending

    def commit(self, session_id: str, num_tokens: int) -> None:
        """Commit the first ``num_tokens`` of the pending result; the last committed token becomes R."""
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
        s.root_logits = None

    def verify_batch(self, items: Sequence[tuple[str, DraftTree]]) -> list[VerifyResult | Exception]:
        """Verify the trees of several sessions in one target forward (packed or padded: ``packed``).
        items: B pairs (session_id, DraftTree | PrefillChunk), one per session. Returns per item what ``verify``
        (CHUNK_FED for ``extend``) alone would give, or the exception it would raise (SessionStateError also for
        a session repeated in the batch, TypeError for a bad item). An error of the shared forward itself is
        raised, no session then pending. Rows' logits equal their solo forward's up to float32 round-off."""
        results: list[VerifyResult | Exception | None] = [None] * len(items)
        batch = self._check_batch(items, results)
        if len(batch) == 1:
            index, session_id, _, tree = batch[0]
            try:
                if isinstance(tree, PrefillChunk):
                    self.extend(session_id, list(tree.tokens))
                    results[index] = CHUNK_FED
                else:
                    results[index] = self.verify(session_id, tree)
            except Exception as error:  # noqa: BLE001 - returned in its slot, as documented
                results[index] = error
        elif batch:
            self._verify_together(batch, results)
        return results  # type: ignore[return-value]

    def _check_batch(self, items, results: list) -> list[tuple[int, str, TargetSession, DraftTree]]:
        """The verifiable items as (item index, session id, session, tree); refused items' errors go to ``results``."""
        first_at: dict = {}
        batch: list[tuple[int, str, TargetSession, DraftTree]] = []
        for index, item in enumerate(items):
            try:
                session_id, tree = self._batch_item(item)
                if session_id in first_at:
                    raise SessionStateError(
                        f"session_id: {session_id!r} appears more than once in the batch"
                        f" (first at item {first_at[session_id]})"
                    )
                first_at[session_id] = index
                batch.append((index, session_id, self._verifiable(session_id, tree), tree))
            except (UnknownSessionError, SessionStateError, MalformedTreeError, TypeError) as error:
                results[index] = error
        return batch

    def _verify_together(self, batch: list[tuple[int, str, TargetSession, DraftTree]], results: list) -> None:
        """One forward over B >= 2 sessions' trees; each item's result (or error) goes to its slot."""
        sessions = [s for _, _, s, _ in batch]
        trees = [tree.as_tree() if isinstance(tree, PrefillChunk) else tree for _, _, _, tree in batch]
        prefilling = [s for s, (_, _, _, tree) in zip(sessions, batch) if isinstance(tree, PrefillChunk)]
        saved = []
        for s in prefilling:  # R's slot and logits, put back if the shared forward fails (extend needs them)
            truncate_kv(s.cache, s.cache_len + 1)
            saved.append((s.root_logits, tail_kv(s.cache, s.cache_len)))
        for s in sessions:
            truncate_kv(s.cache, s.cache_len)  # drop the slots of an earlier verify that failed mid-way
            s.root_logits = None  # a first verify: R's KV (from start) is dropped and R fed again, as in every row
        try:
            if self.packed:
                rows_of = self._forward_packed(batch, sessions, trees)
            else:
                rows_of = self._forward_padded([s.cache for s in sessions], *batched_tree_rows(
                    [s.root for s in sessions], trees, [s.cache_len for s in sessions]))
        except BaseException:
            for s in sessions:  # some layers of some caches may hold the new rows already
                truncate_kv(s.cache, s.cache_len)
            for s, (root_logits, tail) in zip(prefilling, saved):
                restore_tail_kv(s.cache, s.cache_len, tail)
                s.root_logits = root_logits
            raise
        for b, (index, _, s, tree) in enumerate(batch):
            try:
                rows = rows_of[b]  # (N_b + 1, V); greedy and packed: (N_b + 1,) argmax ids; packed chunk: (1, V)
                if isinstance(tree, PrefillChunk):  # R and the chunk stay cached; the chunk's last token is R
                    _score_prompt(s, rows[:-1], tree.tokens)
                    s.cache_len += tree.size
                    s.root = tree.tokens[-1]
                    s.root_logits = rows[-1].clone()
                    results[index] = CHUNK_FED
                else:
                    results[index] = self._accept(s, tree, rows)
            except Exception as error:  # noqa: BLE001 - one item's failure must not affect the others
                results[index] = error

    def _forward_packed(self, batch, sessions, trees) -> list[torch.Tensor]:
        """``_verify_together``'s forward with packed rows, each session's rows on its own cache: B rows."""
        return model_forward_packed(
            self.model,
            [s.cache for s in sessions],
            [[s.root, *tree.tokens] for s, tree in zip(sessions, trees)],
            [tree_position_ids(tree.parents, s.cache_len, self.model.device) for s, tree in zip(sessions, trees)],
            [self._tree_mask(tree, s.cache_len) for s, tree in zip(sessions, trees)],
            [1 if isinstance(item[3], PrefillChunk) and s.sampling.prompt_logprobs is None else None
             for s, item in zip(sessions, batch)],  # a chunk: its last row only (all: for its prompt logprobs)
            argmax_head=self.argmax_head,
            argmax_rows=[_argmax_only(s) and not isinstance(item[3], PrefillChunk)
                         for s, item in zip(sessions, batch)],
        )  # B x (N_b + 1, V); greedy sessions: (N_b + 1,) argmax ids; (1, V) for a chunk

    @staticmethod
    def _batch_item(item) -> tuple[str, DraftTree]:
        try:
            session_id, tree = item
        except (TypeError, ValueError):
            raise TypeError(f"items: expected (session_id, DraftTree) pairs, got {item!r}") from None
        if not isinstance(tree, (DraftTree, PrefillChunk)):
            raise TypeError(f"tree: expected a DraftTree or PrefillChunk, got {type(tree).__name__}")
        hash(session_id)  # TypeError for an unhashable id
        return session_id, tree

    def _verifiable(self, session_id: str, tree: DraftTree | PrefillChunk) -> TargetSession:
        """The session, after the checks ``verify`` (``extend`` for a chunk) makes before its forward."""
        if isinstance(tree, PrefillChunk):
            s = self._prefilling(session_id)
            if tree.still_open is not None and not tree.still_open():
                raise UnknownSessionError(f"session_id: {session_id!r} was released during its prefill")
            if not tree.tokens:
                raise MalformedTreeError("prompt_ids: empty prefill chunk")
            for i, token in enumerate(tree.tokens):
                if not 0 <= token < self.vocab_size:
                    raise MalformedTreeError(f"prefill chunk token {i} = {token}: outside the vocabulary [0, {self.vocab_size})")
            return s
        s = self._session(session_id)
        if s.pending is not None:
            raise SessionStateError(f"session_id: {session_id!r} has an uncommitted verify")
        validate_tree(tree.tokens, tree.parents, self.vocab_size, self.max_tree_nodes)
        return s

    def _prefilling(self, session_id: str) -> TargetSession:
        """The session, or SessionStateError once it has verified (past its prefill)."""
        s = self._session(session_id)
        if s.root_logits is None or s.pending is not None:
            raise SessionStateError(f"session_id: {session_id!r} is past its prefill (it has verified)")
        return s


def _score_prompt(s: TargetSession, logits: torch.Tensor, tokens) -> None:
    """Append the prompt tokens' TokenLogprobs (logits [C, V], row i before tokens[i]) if the session asks."""
    if s.sampling.prompt_logprobs is not None and len(tokens):
        s.prompt_logprobs += token_logprobs(logits, tokens, s.sampling.prompt_logprobs)


def _argmax_only(s: TargetSession) -> bool:
    """Greedy without logprobs: the rows' argmax ids suffice (``argmax_head``); else full logit rows."""
    return s.sampling.greedy and s.sampling.logprobs is None


def batched_tree_rows(roots: Sequence[int], trees: Sequence[DraftTree], cache_lens: Sequence[int]):
    """B sessions' [R_b, nodes...] rows as (ids, positions [N_b + 1], visible [N_b + 1, L_b + N_b + 1] bool):
    roots: [B] root tokens R_b; trees: B trees of N_b nodes; cache_lens: [B] cached slots L_b."""
    if not (len(roots) == len(cache_lens) == len(trees)):
        raise ValueError(f"roots / trees / cache_lens: lengths {len(roots)} / {len(trees)} / {len(cache_lens)} differ")
    return ([[root, *tree.tokens] for root, tree in zip(roots, trees)],
            [tree_position_ids(tree.parents, length) for tree, length in zip(trees, cache_lens)],
            [torch.cat([torch.ones(tree.size + 1, length, dtype=torch.bool), tree_visibility(tree.parents)], dim=1)
             for tree, length in zip(trees, cache_lens)])


def batched_tree_inputs(roots: Sequence[int], trees: Sequence[DraftTree], cache_lens: Sequence[int],
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``padded_batch_inputs`` of ``batched_tree_rows``."""
    return padded_batch_inputs(*batched_tree_rows(roots, trees, cache_lens), cache_lens, dtype)
