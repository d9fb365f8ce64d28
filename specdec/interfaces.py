"""The narrow worker interface shared by embedded (in-process) and distributed (gRPC) modes.

A round: ``draft.propose`` -> ``target.verify`` -> the orchestrator's stop checks ->
``target.commit`` and ``draft.commit``. ``release`` frees a session's KV. ``start`` opens a session
with the request's SamplingParams, which hold for all its rounds (both workers must apply them
identically: ``specdec.sampling``).

Cache invariant (both sides, after every commit): the cache holds KV for a prefix of the committed
tokens; the target's holds exactly all committed tokens but the last one (the root R of the next
tree, whose KV the next verify computes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from specdec.tree_spec import TreeSpec


class UnknownSessionError(KeyError):
    """No session with that id on a worker (never started, or released)."""


class SessionStateError(RuntimeError):
    """Calls out of order, e.g. commit without a pending verify."""


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one tree.

    accepted_nodes: node indices of the accepted path, root side first (may be empty);
    tokens: the accepted path's tokens followed by the bonus token (len = len(accepted_nodes) + 1);
    batch_size, batch_rows: the sessions and the rows of the target forward (packed: the sum of
    every session's nodes + 1; padded: sessions x the largest tree's nodes + 1, padding included)
    that verified it, as the target service reports them (0 rows = not reported: in-process, the
    forward held this tree alone; batch_size 0 = no forward ran, a replayed pending result);
    mergeable: sessions open at the target service when it answered, at most its max_batch (0 =
    not reported: in-process); forward_ms: the target service's time for that forward (0 = not
    reported). Not part of equality: the outcome is the path and the tokens.
    """

    accepted_nodes: tuple[int, ...]
    tokens: tuple[int, ...]
    batch_size: int = field(default=1, compare=False)
    batch_rows: int = field(default=0, compare=False)
    mergeable: int = field(default=0, compare=False)
    forward_ms: float = field(default=0.0, compare=False)

    @property
    def bonus_token(self) -> int:
        return self.tokens[-1]


class DraftWorker:
    """The draft side of a round, and the one place its optional parts are declared (with defaults,
    so the round loop never probes). In-process: ``draft_service.runtime.DraftRuntime``; over gRPC:
    ``orchestrator.loop.clients.DraftClient`` (the same methods, awaitable; every failure there raises
    ``DraftUnavailableError`` and the request goes on without the draft).

    Dims: T prompt tokens, N tree nodes, K tokens committed in a round, A accepted nodes.
    """

    in_process = False  # True: its calls take turns with the event loop, nothing runs beside them
    drafts_ahead = False  # True: propose_ahead / resolve_ahead work (pipelining, ``RoundController(pipeline=True)``)

    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams) -> int | None:
        """Open a session whose committed tokens are ``prompt_ids`` [T], T >= 1: the request's committed
        tokens (prompt plus the tokens generated so far, after a re-open), or the part of them the
        round loop's draft window keeps (specdec.config.DraftWindowConfig: the first and the most
        recent tokens; the draft's positions then count from its own first token). ``sampling``
        holds for every propose.

        Returns the draft's context limit (max positions, tokens) when the worker knows it (the gRPC
        client: the server's DraftStarted.context_limit), else None: the caller then uses the limit
        it was given (``RoundController(draft_context_limit=...)``; the in-process runtime returns None).
        """
        raise NotImplementedError

    def propose(self, session_id: str, spec: TreeSpec, max_depth: int) -> DraftTree:
        """Grow a tree after the session's committed tokens, as ``spec`` says, at most
        min(spec.gamma, max_depth) deep (max_depth >= 1: the tokens the request may still commit,
        less the bonus token).

        Returns N nodes, parents before children, token ids below the vocabulary both models share;
        N = 0 (the empty tree: a plain decoding step) when the draft cannot propose (a committed id
        outside its vocabulary). A second propose before ``commit`` replaces the first (a retry).
        Raises UnknownSessionError.
        """
        raise NotImplementedError

    def commit(self, session_id: str, tokens: list[int], accepted_nodes: list[int]) -> None:
        """Append the round's committed tokens [K], K >= 1 (the accepted path's tokens and the bonus
        token, cut short by a stop), whose first A <= K came from ``accepted_nodes`` [A] (node indices
        of the last proposed tree, root side first). The draft keeps the KV of the accepted nodes it
        fed and drops the rest of the tree. Raises UnknownSessionError.
        """
        raise NotImplementedError

    def release(self, session_id: str) -> None:
        """Free the session and its KV; an unknown id is a no-op."""
        raise NotImplementedError

    def propose_ahead(self, session_id: str, path_nodes: list[int], spec: TreeSpec,
                      max_depth: int) -> tuple[int, DraftTree]:
        """Pipelining (where ``drafts_ahead``): after a propose, before its commit, take the root path
        ``path_nodes`` [A] of that tree and the draft's argmax guess of the bonus token as committed
        and grow the next tree (no random draw for the guess; the tree's draws come from the
        session's generator). Returns (guess, tree)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft ahead")

    def resolve_ahead(self, session_id: str, adopt: bool) -> None:
        """adopt = keep the ahead's state (no commit for the guessed round); else roll back exactly,
        then ``commit`` as usual. While an ahead is unresolved, propose and commit raise SessionStateError."""
        raise NotImplementedError(f"{type(self).__name__} does not draft ahead")

    def last_batch_size(self, session_id: str) -> int | None:
        """Sessions whose tree steps shared the draft forwards of this session's last proposal
        (a draft service's reply says; None = not reported)."""
        return None

    def last_forward_ms(self, session_id: str) -> float | None:
        """ms of the draft call that grew this session's last tree, without queue or transport
        (a draft service's reply says; None = not reported)."""
        return None


class WorkerAdapter(DraftWorker):
    """Another worker (a draft or a target) whose calls each go through ``call``: awaitable for an
    in-process worker (``orchestrator.loop.controller.InProcessWorker``), blocking for an awaitable
    one (``orchestrator.planning.cost_model.measure_service_costs``). Reports pass through as they are."""

    def __init__(self, worker):
        self.worker = worker

    @property
    def drafts_ahead(self) -> bool:
        return self.worker.drafts_ahead

    def call(self, name: str, method, *args, **kwargs):
        """The worker's ``method`` (its ``name``) called with the arguments."""
        raise NotImplementedError

    def start(self, *args, **kwargs):
        return self.call("start", self.worker.start, *args, **kwargs)

    def propose(self, *args, **kwargs):
        return self.call("propose", self.worker.propose, *args, **kwargs)

    def verify(self, *args, **kwargs):
        return self.call("verify", self.worker.verify, *args, **kwargs)

    def commit(self, *args, **kwargs):
        return self.call("commit", self.worker.commit, *args, **kwargs)

    def release(self, *args, **kwargs):
        return self.call("release", self.worker.release, *args, **kwargs)

    def propose_ahead(self, *args, **kwargs):
        return self.call("propose_ahead", self.worker.propose_ahead, *args, **kwargs)

    def resolve_ahead(self, *args, **kwargs):
        return self.call("resolve_ahead", self.worker.resolve_ahead, *args, **kwargs)

    def last_batch_size(self, session_id: str) -> int | None:
        return self.worker.last_batch_size(session_id)

    def last_forward_ms(self, session_id: str) -> float | None:
        return self.worker.last_forward_ms(session_id)


class TargetWorker(Protocol):
    """The target side of a round. In-process: ``target_service.runtime.TargetRuntime`` (or the
    tensor-parallel ``target_service.tp.TensorParallelTarget``); over gRPC:
    ``orchestrator.loop.clients.TargetClient`` (the same methods, awaitable; errors arrive as
    ``grpc.aio.AioRpcError`` with the status the server maps them to). A runtime may also offer
    ``verify_batch(items)`` (several sessions in one forward), which the target server's batcher uses.

    Dims: T prompt tokens, N tree nodes, A accepted nodes, L cached slots.
    """

    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Open a session: prefill ``prompt_ids`` [T], T >= 1, but the last token, which becomes the
        root R (L = T - 1). ``sampling`` holds for every verify. Raises ValueError for an empty prompt.

        Returns None: the target's context limit is fixed for the worker (the caller's
        ``context_limit``; over gRPC, ``TargetClient.info()``).
        """
        ...

    def verify(self, session_id: str, tree: DraftTree) -> VerifyResult:
        """Verify a tree of N >= 0 nodes (N = 0: one plain decoding step) in one forward over
        [R, node 0..N-1]; the cache grows by N + 1 slots until ``commit``.

        Returns accepted_nodes [A] and tokens [A + 1] (the bonus token last), pending until commit.
        Raises UnknownSessionError, SessionStateError (a verify is still uncommitted) or
        MalformedTreeError (structure, ids outside the vocabulary, too many nodes).
        """
        ...

    def commit(self, session_id: str, num_tokens: int) -> None:
        """Commit the first ``num_tokens`` tokens of the pending result, 1 <= num_tokens <= A + 1
        (fewer after a stop): the cache keeps R and the committed accepted nodes (L grows by
        num_tokens) and the last committed token becomes the new R.

        Raises UnknownSessionError, SessionStateError (no pending verify) or ValueError (num_tokens
        out of range).
        """
        ...

    def release(self, session_id: str) -> None:
        """Free the session and its KV; an unknown id is a no-op."""
        ...
