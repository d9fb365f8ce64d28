"""The narrow worker interface shared by embedded (in-process) and distributed (gRPC) modes.

A round: ``draft.propose`` -> ``target.verify`` -> the stop checks -> ``target.commit`` and ``draft.commit``.
Cache invariant after every commit: docs/design.md "KV rollback".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from specdec.tree_spec import TreeSpec


class UnknownSessionError(KeyError):
    """No session with that id on a worker (never started, or released)."""


class SessionStateError(RuntimeError):
    """Calls out of order, e.g. commit without a pending verify."""


MAX_AHEAD_CANDIDATES = 4  # candidate next trees one ahead may draft (front.ahead_candidates at most)


class AheadCandidate(NamedTuple):
    """One outcome of the round being verified that an ahead drafts the next tree for (docs/control.md
    "Pipelining"): ``path_nodes`` [A] (a root path of the last tree; empty = the root rejected) accepted, then
    the draft's argmax token not in ``exclude``, then a tree of at most ``max_depth`` >= 1."""

    path_nodes: tuple[int, ...]
    max_depth: int
    exclude: tuple[int, ...] = ()


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one tree. accepted_nodes: [A] node indices of the accepted path, root side first; tokens: [A
    + 1], the bonus last. Reported by the target service, 0 = not reported (not part of equality): batch_size,
    batch_rows of the forward (batch_size 0 = a replayed result), mergeable (open sessions, at most max_batch),
    forward_ms. logprobs: [A + 1] ``TokenLogprob`` of tokens when the session's sampling asks for them, else empty (not
    part of equality: batched and solo forwards differ in float32 round-off)."""

    accepted_nodes: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple = field(default=(), compare=False)
    batch_size: int = field(default=1, compare=False)
    batch_rows: int = field(default=0, compare=False)
    mergeable: int = field(default=0, compare=False)
    forward_ms: float = field(default=0.0, compare=False)


class DraftWorker:
    """The draft side of a round, with its optional parts declared (defaults) so the round loop never
    probes. Over gRPC every failure raises ``DraftUnavailableError`` and the request goes on without it.

    Dims: T prompt tokens, N tree nodes, K tokens committed in a round, A accepted nodes."""

    in_process = False  # True: its calls take turns with the event loop, nothing runs beside them
    drafts_ahead = False  # True: propose_ahead / resolve_ahead work (pipelining, ``RoundController(pipeline=True)``)

    @property
    def link_rtt_s(self) -> float | None:
        """The link's measured round trip, s (a call's wall time minus the service's); None in-process or unknown."""
        return None

    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams) -> int | None:
        """Open a session whose committed tokens are ``prompt_ids`` [T], T >= 1 (or the draft window's
        part of them, positions counting from its first); ``sampling`` holds for every propose. Returns
        the draft's context limit (tokens) where the worker knows it, else None."""
        raise NotImplementedError

    def propose(self, session_id: str, spec: TreeSpec, max_depth: int) -> DraftTree:
        """Grow a tree of at most min(spec.gamma, max_depth) depth, max_depth >= 1. Returns N nodes,
        parents first, ids in the shared vocabulary; N = 0 when the draft cannot propose. A second
        propose before ``commit`` replaces the first. Raises UnknownSessionError."""
        raise NotImplementedError

    def commit(self, session_id: str, tokens: list[int], accepted_nodes: list[int]) -> None:
        """Append the round's committed tokens [K], K >= 1, the first A from ``accepted_nodes`` [A] (root
        side first); the draft keeps the accepted nodes' KV. Raises UnknownSessionError."""
        raise NotImplementedError

    def release(self, session_id: str) -> None:
        """Free the session and its KV; an unknown id is a no-op."""
        raise NotImplementedError

    def propose_ahead(self, session_id: str, path_nodes: list[int], spec: TreeSpec,
                      max_depth: int) -> tuple[int, DraftTree]:
        """Pipelining (where ``drafts_ahead``): take root path ``path_nodes`` [A] plus the draft's argmax
        guess of the bonus as committed and grow the next tree (A = 0: the guess after the committed tokens,
        no tree proposed since the last commit needed: a plain round's). Returns (guess, tree)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft ahead")

    def propose_candidates(self, session_id: str, candidates: list[AheadCandidate],
                           spec: TreeSpec) -> list[tuple[int, DraftTree]]:
        """Pre-drafting (where ``drafts_ahead``): the next tree for each candidate outcome [C], C >= 1, candidates[0]
        the best path fully accepted (after a plain round all paths are empty: the draft's likeliest next tokens; a
        candidate excludes the earlier same-path ones' tokens). Returns (token, tree) per candidate, in order, or only
        the first where the worker drafts one (this default: ``propose_ahead``, ``exclude`` ignored)."""
        first = candidates[0]
        return [tuple(self.propose_ahead(session_id, list(first.path_nodes), spec, first.max_depth))]

    def resolve_ahead(self, session_id: str, adopt: bool, candidate: int = 0) -> None:
        """adopt = keep candidate ``candidate``'s state (no commit for the guessed round); else roll back
        exactly, then ``commit`` as usual. While an ahead is unresolved, propose and commit raise SessionStateError."""
        raise NotImplementedError(f"{type(self).__name__} does not draft ahead")

    def last_batch_size(self, session_id: str) -> int | None:
        """Sessions that shared the draft forwards of this session's last proposal (None = not reported)."""
        return None

    def last_forward_ms(self, session_id: str) -> float | None:
        """ms of the draft call that grew this session's last tree, without queue or transport (None = not reported)."""
        return None


def _through_call(name: str):
    """A ``WorkerAdapter`` method that runs the worker's method ``name`` through ``call``."""
    def method(self, *args, **kwargs):
        return self.call(name, getattr(self.worker, name), *args, **kwargs)

    method.__name__ = name
    return method


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

    start, propose, verify = _through_call("start"), _through_call("propose"), _through_call("verify")
    commit, release = _through_call("commit"), _through_call("release")
    propose_ahead, propose_candidates = _through_call("propose_ahead"), _through_call("propose_candidates")
    resolve_ahead = _through_call("resolve_ahead")

    def last_batch_size(self, session_id: str) -> int | None:
        return self.worker.last_batch_size(session_id)

    def last_forward_ms(self, session_id: str) -> float | None:
        return self.worker.last_forward_ms(session_id)


class TargetWorker(Protocol):
    """The target side of a round (over gRPC errors arrive as ``grpc.aio.AioRpcError``). A runtime may
    also offer ``verify_batch(items)``, which the target server's batcher uses.

    Dims: T prompt tokens, N tree nodes, A accepted nodes, L cached slots."""

    link_rtt_s = DraftWorker.link_rtt_s

    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Prefill ``prompt_ids`` [T], T >= 1, but the last token, the root R (L = T - 1); ``sampling``
        holds for every verify. Returns prompt_ids[1:]'s TokenLogprobs with sampling.prompt_logprobs (else () or
        None). Raises ValueError for an empty prompt."""
        ...

    def verify(self, session_id: str, tree: DraftTree) -> VerifyResult:
        """Verify a tree of N >= 0 nodes in one forward over [R, nodes] (cache + N + 1 until ``commit``); the result is
        pending until commit. Raises UnknownSessionError, SessionStateError or MalformedTreeError."""
        ...

    def commit(self, session_id: str, num_tokens: int) -> None:
        """Commit the first ``num_tokens`` (1..A + 1) of the pending result: L grows by num_tokens, the
        last committed token becomes R. Raises UnknownSessionError, SessionStateError or ValueError."""
        ...

    def release(self, session_id: str) -> None:
        """Free the session and its KV; an unknown id is a no-op."""
        ...
