"""In-process draft worker: the draft model, one KV cache per session, tree proposal and rollback.

Dims: S cached slots, P nodes fed in one step, V vocabulary.

Draft cache layout while proposing (example: 7 committed tokens, 5 of them cached):
    slots 0..4  committed, cached before this round
    slots 5..6  pending committed tokens (the last is the root R), fed causally at step 0
    slots 7..8  the topHead[1] depth-1 nodes fed at step 1, then step 2's nodes, ...
R sits at position 6 and a node of depth d at position 6 + d. Commit: docs/design.md "KV rollback";
aheads and pre-drafting (PEARL, Liu et al. 2024; SSD): docs/control.md "Pipelining".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Generator, NamedTuple, Sequence

import numpy as np
import torch

from draft_service.tree_builder import Step, tree_steps
from specdec.forward import ModelRuntime, model_forward_packed
from specdec.interfaces import MAX_AHEAD_CANDIDATES, AheadCandidate, DraftWorker, SessionStateError
from specdec.kv_cache import cache_length, compact_kv, new_cache, restore_tail_kv, tail_kv, truncate_kv
from specdec.sampling import GREEDY, SamplingParams, session_rng
from specdec.tree import ROOT, DraftTree, additive_mask, ancestors, node_depths
from specdec.tree_spec import TreeSpec


MAX_BATCHED_ROWS = 32  # a step feeding more rows than this (a long pending prefix) runs alone, not holding up others


@dataclass
class DraftSession:
    tokens: list[int]  # all committed tokens (prompt + generated)
    cache: object
    cached_len: int = 0  # committed tokens whose KV is in the cache
    sampling: SamplingParams = GREEDY
    rng: np.random.Generator | None = None  # sampled requests only
    slot_of_node: dict[int, int] = field(default_factory=dict)  # last tree's fed nodes -> cache slot
    round_start: int | None = None  # cached_len before an uncommitted proposal (for a retry)
    last_tree: DraftTree | None = None  # the last proposed tree (ahead paths are checked against it)
    ahead: "_AheadSnapshot | None" = None  # set while an ahead proposal is unresolved
    alternatives: list = field(default_factory=list)  # (tokens added, tree, rng state) of the other candidates
    prefill_chunk: int | None = None  # tokens per call of a started chunked ``prefill`` (None: none, or all in one call)


@dataclass(frozen=True)
class _AheadSnapshot:
    """A session as it was before ``propose_ahead`` (what ``resolve_ahead(adopt=False)`` restores)."""

    tokens_len: int  # committed tokens
    cached_len: int  # committed tokens whose KV is cached (slots past it are dropped on discard)
    round_start: int | None
    last_tree: DraftTree | None
    rng_state: dict | None  # the session generator's bit_generator.state (sampled requests)
    slot_of_node: dict[int, int] = field(default_factory=dict)  # with ``tail``: the last tree's fed nodes
    tail: list | None = None  # the KV from slot cached_len - 1 on (R and the tree's slots), for other candidates


class AheadTree(NamedTuple):
    """What ``propose_ahead`` returns: the draft's guess of the bonus token and the next round's tree."""

    guess: int
    tree: DraftTree


class DraftRuntime(ModelRuntime, DraftWorker):
    """Implements DraftWorker (specdec.interfaces) over a transformers causal LM."""

    drafts_ahead = True
    role = "draft"

    def __init__(self, model, vocab_size: int | None = None, packed: bool | None = None, direct: bool = True):
        """vocab_size: ids both models share (None = the draft's own); packed, direct: as ``ModelRuntime``."""
        super().__init__(model, packed, direct)
        self.vocab_size = vocab_size
        self.scale_per_call = activation_scale_per_call(model)

    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams = GREEDY) -> None:
        """Open a session; sampling: the request's parameters, used by every propose of the session."""
        rng = None if sampling.greedy else session_rng(sampling, "draft")
        self.sessions[session_id] = DraftSession(list(prompt_ids), new_cache(self.model.config), sampling=sampling, rng=rng)

    def prefill(self, session_id: str, max_tokens: int | None = None) -> bool:
        """Feed at most ``max_tokens`` (None = all) of the committed tokens but the last into the cache; True when
        tokens are left. The first ``propose`` feeds the rest in calls of the same size (so a quantized draft's
        activation scales never depend on how far this got). A failing forward leaves the cache as it was."""
        s = self.sessions.get(session_id)
        if s is None:  # released before its queued prefill ran
            return False
        pending = s.tokens[s.cached_len : -1][:max_tokens]
        if not pending or s.round_start is not None or max(pending) >= self.model.config.vocab_size:
            return False
        s.prefill_chunk = max_tokens
        positions = torch.arange(s.cached_len, s.cached_len + len(pending))
        try:
            self._forward(s.cache, pending, positions, mask=None, logits_rows=1)
        except BaseException:
            truncate_kv(s.cache, s.cached_len)  # layers the failed forward reached hold part of the chunk
            raise
        s.cached_len += len(pending)
        return s.cached_len < len(s.tokens) - 1

    def _finish_prefill(self, session_id: str, s: DraftSession) -> None:
        """A started chunked prefill ends in its own chunks (``prefill``), before the first tree."""
        if s.prefill_chunk is not None and s.last_tree is None:
            while self.prefill(session_id, s.prefill_chunk):
                pass

    def _propose_one(self, item: tuple):
        (out,) = self.propose_batch([item])
        if isinstance(out, Exception):
            raise out
        return out

    def propose(self, session_id: str, spec: TreeSpec, max_depth: int) -> DraftTree:
        """Grow a tree after the committed tokens; gamma capped at max_depth (>= 1). Raises UnknownSessionError."""
        return self._propose_one((session_id, spec, max_depth))

    def propose_ahead(self, session_id: str, path_nodes: Sequence[int], spec: TreeSpec, max_depth: int) -> AheadTree:
        """As ``DraftWorker.propose_ahead``. Raises UnknownSessionError, SessionStateError (an ahead unresolved, or
        a path without a tree since the last commit), ValueError naming ``path_nodes``."""
        return self._propose_one((session_id, spec, max_depth, tuple(path_nodes)))

    def propose_candidates(self, session_id: str, candidates: Sequence[AheadCandidate],
                           spec: TreeSpec) -> list[AheadTree]:
        """As ``DraftWorker.propose_candidates``, every tree grown from the session as it is now (a seeded session
        draws what an in-line propose after that outcome would). Raises as ``propose_ahead``, ValueError naming
        ``candidates``."""
        return self._propose_one((session_id, spec, 0, tuple(candidates)))

    def resolve_ahead(self, session_id: str, adopt: bool, candidate: int = 0) -> None:
        """As ``DraftWorker.resolve_ahead``; adopting candidate c > 0 rolls back, then commits its path and token
        uncached with its tree as the last one. Raises UnknownSessionError, SessionStateError, ValueError."""
        s = self._session(session_id)
        snap, alternatives = s.ahead, s.alternatives
        if snap is None:
            raise SessionStateError(f"adopt: session {session_id!r} has no unresolved ahead proposal")
        if adopt and not 0 <= candidate <= len(alternatives):
            raise ValueError(f"candidate: {candidate} is not one of the {len(alternatives) + 1} candidates")
        s.ahead, s.alternatives = None, []
        if adopt and candidate == 0:
            return
        truncate_kv(s.cache, snap.cached_len)
        _roll_back(s, snap)
        s.slot_of_node = {}  # the tree slots are gone: commit keeps no node KV
        if adopt:  # candidate c > 0: its path and token committed, its tree the last one (no node fed)
            added, s.last_tree, rng_state = alternatives[candidate - 1]
            s.tokens.extend(added)
            s.round_start = s.cached_len
            if s.rng is not None:
                s.rng.bit_generator.state = rng_state

    def _restore(self, s: DraftSession) -> None:
        """Back to the snapshot of an alternative's ahead, tree slots included (bitwise)."""
        snap, s.ahead = s.ahead, None
        restore_tail_kv(s.cache, max(snap.cached_len - 1, 0), snap.tail)
        _roll_back(s, snap)
        s.slot_of_node = dict(snap.slot_of_node)

    def _draft_alternatives(self, session_id: str, spec: TreeSpec, all_candidates) -> list[tuple]:
        """The other candidates' (token, tree, tokens added, rng state after), each grown alone from the
        session as it is, which is restored after each."""
        out = []
        for i, cand in enumerate(all_candidates[1:], 1):
            token = self._begin_ahead(session_id, tuple(cand.path_nodes), tuple(cand.exclude), keep_tail=True,
                                      earlier=_same_path(all_candidates[:i], cand))
            s = self.sessions[session_id]
            try:
                tree = self._grow_alone(session_id, spec, cand.max_depth)
                added, rng_state = s.tokens[s.ahead.tokens_len :], _rng_state(s)
            finally:
                self._restore(s)
            out.append((token, tree, added, rng_state))
        return out

    def _grow_alone(self, session_id: str, spec: TreeSpec, max_depth: int) -> DraftTree:
        """One ahead tree grown in forwards of its own (the session tentatively committed)."""
        s = self._begin_round(session_id, ahead=True)
        if s is None:
            return DraftTree((), ())
        steps = tree_steps(spec, max_depth=max_depth, vocab_size=self.vocab_size, sampling=s.sampling, rng=s.rng)
        results: list = [None]
        try:
            self._run_steps({0: (s, steps, next(steps))}, results)
        except StopIteration as done:
            results[0] = s.last_tree = done.value
        if isinstance(results[0], Exception):
            raise results[0]
        return results[0]

    def _begin_ahead(self, session_id: str, path_nodes: tuple[int, ...], exclude: tuple[int, ...] = (),
                     keep_tail: bool = False, earlier: tuple[tuple[int, ...], ...] = ()) -> int:
        """Snapshot, commit ``path_nodes`` tentatively, feed what is pending, append and return the guess (the
        argmax not in ``exclude`` nor picked by the ``earlier`` same-path candidates, whose excludes these are).
        Example: committed [a b R], path n0 (fed) -> n2 (leaf): the cache keeps a b R n0, n2 is fed now, tokens
        become [a b R n0 n2 g] with g pending. keep_tail: the snapshot keeps R's and the tree's KV."""
        s = self._session(session_id)
        if s.ahead is not None:
            raise SessionStateError(f"ahead: session {session_id!r} already has an unresolved ahead proposal")
        tree = s.last_tree
        if path_nodes:
            if tree is None or s.round_start is None:
                raise SessionStateError(f"path_nodes: session {session_id!r} has no proposed tree since its last commit")
            check_root_path(tree.parents, path_nodes)
        elif s.round_start is None:
            self._finish_prefill(session_id, s)
            if max(s.tokens[s.cached_len :], default=0) >= self.model.config.vocab_size:
                raise SessionStateError(f"session_id: {session_id!r} holds a token beyond the draft's vocabulary")
        tail = tail_kv(s.cache, max(s.cached_len - 1, 0)) if keep_tail else None
        s.ahead = _AheadSnapshot(len(s.tokens), s.cached_len, s.round_start, tree, _rng_state(s),
                                 dict(s.slot_of_node), tail)
        fed = [s.slot_of_node[n] for n in path_nodes if n in s.slot_of_node]  # a prefix of the path
        compact_kv(s.cache, s.cached_len, fed)
        s.cached_len += len(fed)
        s.tokens.extend(tree.tokens[n] for n in path_nodes)
        s.slot_of_node, s.round_start = {}, None
        if s.cached_len == len(s.tokens):  # every path node was fed: re-feed the last for its logits
            s.cached_len -= 1
            truncate_kv(s.cache, s.cached_len)
        pending = s.tokens[s.cached_len :]
        logits = self._forward(s.cache, pending, torch.arange(s.cached_len, len(s.tokens)),
                               mask=None, logits_rows=1)  # (1, V)
        s.cached_len = len(s.tokens)
        row, picked = logits[-1, : self.vocab_size], []
        for excluded in (*earlier, exclude):  # the same row each time: picks consistent in any drafting order
            masked = row.clone()
            masked[[t for t in (*excluded, *picked) if 0 <= t < row.shape[0]]] = float("-inf")
            picked.append(int(masked.argmax()))
        s.tokens.append(picked[-1])
        return picked[-1]

    def propose_batch(self, items: Sequence[tuple]) -> list[DraftTree | AheadTree | Exception]:
        """Grow the trees of several sessions together: one draft forward per tree depth for all of them.
        items: B triples (session_id, spec, max_depth), distinct sessions; a fourth entry (path_nodes, or
        AheadCandidates) makes the item an ahead. Returns per item what ``propose`` (``propose_ahead`` /
        ``propose_candidates``) alone would give, or the exception it would raise. An error of a shared forward
        is raised (ahead items rolled back first). A session feeding over ``MAX_BATCHED_ROWS`` rows runs alone, as
        does a seeded sampled one on a dynamically quantized draft (one activation scale per call); other rows'
        log-probs equal their solo forward's up to float32 round-off."""
        results: list[DraftTree | Exception | None] = [None] * len(items)
        running: dict[int, tuple[DraftSession, Generator, Step]] = {}
        seen: dict[str, int] = {}
        guesses: dict[int, int] = {}  # item -> guess, for ahead items
        others: dict[int, list] = {}  # item -> the other candidates' AheadTrees (candidate items)
        for index, (session_id, spec, max_depth, *ahead) in enumerate(items):
            try:
                if session_id in seen:
                    raise SessionStateError(f"session_id: {session_id!r} is already at item {seen[session_id]} of this batch")
                seen[session_id] = index
                if ahead:
                    max_depth, guesses[index] = self._begin_candidates(session_id, spec, max_depth, ahead[0],
                                                                       others, index)
                s = self._begin_round(session_id, ahead=bool(ahead))
                if s is None:
                    results[index] = DraftTree((), ())
                    continue
                steps = tree_steps(spec, max_depth=max_depth, vocab_size=self.vocab_size, sampling=s.sampling, rng=s.rng)
                running[index] = (s, steps, next(steps))
            except StopIteration as done:
                results[index] = s.last_tree = done.value
            except Exception as error:  # noqa: BLE001 - returned in its slot, as documented
                results[index] = error
        try:
            self._run_steps(running, results)
        except BaseException:  # a shared forward failed: the caller retries each item alone (SessionBatcher)
            for index in guesses:  # so every ahead item goes back to its state before the ahead
                session = self.sessions.get(items[index][0])
                if session is not None and session.ahead is not None:
                    self.resolve_ahead(items[index][0], adopt=False)
            raise
        for index, guess in guesses.items():
            if isinstance(results[index], DraftTree):
                results[index] = AheadTree(guess, results[index])
                if index in others:
                    results[index] = [results[index], *others[index]]
        return results  # type: ignore[return-value]

    def _begin_candidates(self, session_id: str, spec: TreeSpec, max_depth: int, entry: Sequence,
                          others: dict, index: int) -> tuple[int, int]:
        """An ahead item's start: a path or AheadCandidates, whose others are grown first (into ``others[index]``).
        Returns (the first's max depth, its guess)."""
        if not (entry and isinstance(entry[0], AheadCandidate)):
            return max_depth, self._begin_ahead(session_id, tuple(entry))
        if len(entry) > MAX_AHEAD_CANDIDATES:
            raise ValueError(f"candidates: {len(entry)} given, at most {MAX_AHEAD_CANDIDATES}")
        drafted = self._draft_alternatives(session_id, spec, tuple(entry))
        first = entry[0]
        guess = self._begin_ahead(session_id, tuple(first.path_nodes), tuple(first.exclude))  # no earlier one
        self.sessions[session_id].alternatives = [(added, tree, rng) for _, tree, added, rng in drafted]
        others[index] = [AheadTree(token, tree) for token, tree, _, _ in drafted]
        return first.max_depth, guess

    def _run_steps(self, running: dict, results: list) -> None:
        """Drive the sessions' ``tree_steps`` in lockstep, one (shared) forward per step, until each has its tree
        (or error) in ``results``; an error of a shared forward is raised."""
        while running:
            rows = {index: self._step_rows(s, *step) for index, (s, _, step) in running.items()}
            logprobs = self._forward_rows(rows)
            for index in list(running):
                s, steps, _ = running[index]
                try:
                    running[index] = (s, steps, steps.send(logprobs[index]))
                except StopIteration as done:
                    results[index] = s.last_tree = done.value
                    del running[index]
                except Exception as error:  # noqa: BLE001
                    results[index] = error
                    del running[index]

    def _begin_round(self, session_id: str, ahead: bool = False) -> DraftSession | None:
        """The session, its cache back at the round's start; None when the committed tokens hold an id beyond the
        draft's vocabulary (plain decoding from here on)."""
        s = self._session(session_id)
        if s.ahead is not None and not ahead:
            raise SessionStateError(f"session_id: {session_id!r} has an unresolved ahead proposal (resolve_ahead first)")
        if s.round_start is not None:
            s.cached_len = s.round_start
            truncate_kv(s.cache, s.cached_len)
            s.round_start = None
        if not ahead:
            self._finish_prefill(session_id, s)
        s.round_start = s.cached_len
        s.slot_of_node = {}
        if max(s.tokens[s.cached_len :]) >= self.model.config.vocab_size:
            return None
        return s

    def _step_rows(self, s: DraftSession, nodes: list[int], tokens: list[int], parents: list[int]) -> _StepRows:
        """One session's rows of a draft step. Step 0 (nodes = [ROOT]): the committed tokens not yet cached, R last,
        causal; step d >= 1: the P depth-d nodes, each seeing the committed slots, its ancestors and itself."""
        start = cache_length(s.cache)  # C: committed slots, then the tree slots of earlier steps
        if nodes == [ROOT]:
            pending = s.tokens[s.cached_len :]
            visible = torch.ones(len(pending), start + len(pending), dtype=torch.bool).tril(start)  # (P, C + P)
            return _StepRows(s, pending, torch.arange(s.cached_len, len(s.tokens)), visible, True, len(pending) == 1)
        base = s.cached_len
        depths = node_depths(parents)
        visible = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool)  # (P, C + P)
        visible[:, :base] = True
        for row, node in enumerate(nodes):
            above = ancestors(parents, node)[:-1]
            for anc in above:
                visible[row, s.slot_of_node[anc]] = True
            visible[row, start + row] = True
            s.slot_of_node[node] = start + row
        positions = torch.tensor([base - 1 + depths[n] for n in nodes])
        plain = len(nodes) == 1 and len(above) == start - base  # one row whose ancestors are all the tree slots
        return _StepRows(s, [tokens[n] for n in nodes], positions, visible, False, plain)

    def _forward_rows(self, rows: dict[int, _StepRows]) -> dict[int, torch.Tensor]:
        """Log-probs of each session's step rows ([1, V] at step 0, [P, V] after), batched where two or more can."""
        together = [i for i, r in rows.items()
                    if len(r.ids) <= MAX_BATCHED_ROWS and not (self.scale_per_call and r.session.sampling.seeded)]
        alone = [i for i in rows if i not in together or len(together) < 2]
        out = {i: self._forward_one(rows[i]) for i in alone}
        together = [i for i in together if i not in out]
        if together:
            out.update(zip(together, self._forward_together([rows[i] for i in together])))
        return out

    def _forward_one(self, r: _StepRows) -> torch.Tensor:
        """One session's own forward: step 0 plainly causal, later steps with the tree mask."""
        if r.root:
            logits = self._forward(r.session.cache, r.ids, r.positions, mask=None, logits_rows=1)
            r.session.cached_len = len(r.session.tokens)
        else:
            logits = self._forward(r.session.cache, r.ids, r.positions, self._mask(r))
        return torch.log_softmax(logits, dim=-1)  # (1 or P, V)

    def _forward_together(self, rows: list[_StepRows]) -> list[torch.Tensor]:
        """One forward over B >= 2 sessions' step rows: B log-prob tensors, [1, V] at step 0, [P_b, V] after."""
        caches, ids, positions = [r.session.cache for r in rows], [r.ids for r in rows], [r.positions for r in rows]
        if self.packed:  # step 0: only R's row is drafted from
            logits = model_forward_packed(self.model, caches, ids, positions, [self._mask(r) for r in rows],
                                          [1 if r.root else None for r in rows])
        else:
            logits = self._forward_padded(caches, ids, positions, [r.visible for r in rows])
            logits = [rows_logits[-1:] if r.root else rows_logits for r, rows_logits in zip(rows, logits)]
        out = []
        for r, rows_logits in zip(rows, logits):
            if r.root:
                r.session.cached_len = len(r.session.tokens)
            out.append(torch.log_softmax(rows_logits, dim=-1))
        return out

    def _mask(self, r: _StepRows) -> torch.Tensor | None:
        """The rows' additive mask on the model's device; None for a plain row (no mask: the fastest kernel)."""
        return None if r.plain else additive_mask(r.visible, self.model.dtype, self.model.device)

    def commit(self, session_id: str, tokens: list[int], accepted_nodes: list[int]) -> None:
        """Append the round's committed tokens; keep the KV of accepted nodes the draft had fed."""
        s = self._session(session_id)
        if s.ahead is not None:
            raise SessionStateError(f"session_id: {session_id!r} has an unresolved ahead proposal (resolve_ahead first)")
        fed = [s.slot_of_node[n] for n in accepted_nodes if n in s.slot_of_node]  # a prefix of the path
        compact_kv(s.cache, s.cached_len, fed)
        s.cached_len += len(fed)
        s.tokens.extend(tokens)
        s.slot_of_node = {}
        s.round_start = None


def _rng_state(s: DraftSession) -> dict | None:
    return copy.deepcopy(s.rng.bit_generator.state) if s.rng is not None else None


def _roll_back(s: DraftSession, snap: _AheadSnapshot) -> None:
    """The session's tokens, counters, last tree and random state as in ``snap`` (the cache is the caller's)."""
    del s.tokens[snap.tokens_len :]
    s.cached_len, s.round_start, s.last_tree = snap.cached_len, snap.round_start, snap.last_tree
    if s.rng is not None:
        s.rng.bit_generator.state = snap.rng_state


def _same_path(earlier: Sequence[AheadCandidate], cand: AheadCandidate) -> tuple[tuple[int, ...], ...]:
    """The excludes of the ``earlier`` candidates with ``cand``'s path (their picks are ``cand``'s exclusions too)."""
    return tuple(tuple(c.exclude) for c in earlier if tuple(c.path_nodes) == tuple(cand.path_nodes))


def check_root_path(parents: Sequence[int], path: Sequence[int], field: str = "path_nodes") -> None:
    """Raises ValueError naming ``field`` unless ``path`` is a non-empty root path of the tree of ``parents``."""
    if not path:
        raise ValueError(f"{field}: empty (an ahead needs >= 1 node of the last tree)")
    parent = ROOT
    for i, node in enumerate(path):
        if not 0 <= node < len(parents):
            raise ValueError(f"{field}[{i}] = {node}: not a node of the last proposed tree ({len(parents)} nodes)")
        if parents[node] != parent:
            raise ValueError(f"{field}[{i}] = {node}: its parent is {parents[node]}, not {parent} (not a root path)")
        parent = node


@dataclass
class _StepRows:
    """One session's rows of one draft step: P ids, positions [P], visible [P, C + P] bool (C cached slots);
    root: step 0 (only the last row's log-probs are used); plain: one row that sees every slot (no mask)."""

    session: DraftSession
    ids: list[int]
    positions: torch.Tensor
    visible: torch.Tensor
    root: bool
    plain: bool


def activation_scale_per_call(model) -> bool:
    """Whether the model holds dynamically quantized linears (one int8 activation scale over a call's rows)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    return any(isinstance(m, DynamicLinear) for m in model.modules())
