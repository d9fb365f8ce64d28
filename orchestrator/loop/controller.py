"""Round control of one request (docs/design.md), asynchronous, for every mode: the draft grows a tree, the
target verifies it, the tokens pass the stop checks, both workers commit exactly those. Control, fallback, draft
window and pipelining (PEARL, Liu et al. 2024): docs/control.md. Workers: awaitable DraftWorker / TargetWorker
(specdec.interfaces), gRPC clients or in-process runtimes wrapped by ``sync_worker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

from opentelemetry import trace

from orchestrator.planning.control import (DRAFT_OPENING, DRAFT_UNAVAILABLE, EMPTY_TREE, PREDRAFT, ControlFactory,
                                           FixedControl, RoundObservation)
from orchestrator.planning.shaping import ShapedTree
from orchestrator.loop.stops import StopChecker
from specdec.config import DraftWindowConfig
from specdec.interfaces import MAX_AHEAD_CANDIDATES, AheadCandidate, VerifyResult, WorkerAdapter
from specdec.sampling import GREEDY, SamplingParams, derive_seed
from specdec.stats import GenerationStats, RoundRecord
from specdec.tree import ROOT, DraftTree, node_depths
from specdec.tree_spec import TreeSpec

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("specdec.orchestrator")
_session_ids = itertools.count()


# a draft session's first propose may still wait for its prefill: extra deadline per token it opened with
FRESH_DRAFT_S_PER_TOKEN = 0.02
FRESH_DRAFT_MAX_S = 120.0  # at most this much more (a hung draft must not hold a request for long)


class DraftUnavailableError(RuntimeError):
    """The draft worker failed, is unreachable, or broke its session; the request goes on without it."""


@dataclass
class GenerationRequest:
    """What to generate. prompt_ids: [T] token ids, T >= 1."""

    prompt_ids: list[int]
    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = ()
    spec: TreeSpec | None = None  # None = plain target decoding (no draft)
    sampling: SamplingParams = GREEDY  # temperature 0 = greedy; applied identically by draft and target
    ignore_eos: bool = False  # EOS tokens do not end generation (vLLM's ignore_eos): fixed-length runs
    min_tokens: int = 0  # no EOS, stop token or stop string ends generation before this many new tokens (vLLM's)
    stop_token_ids: tuple[int, ...] = ()  # generating one ends generation (kept in the output), even with ignore_eos
    resumed_tokens: int = 0  # trailing prompt_ids an earlier part of this request generated (fail-over): stop strings see them

    def __post_init__(self):
        if isinstance(self.stop_strings, str):  # one stop string, not one per character
            self.stop_strings = (self.stop_strings,)


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list = field(default_factory=list)  # one TokenLogprob per token when sampling.logprobs is set
    prompt_logprobs: tuple = ()  # prompt_ids[1:]'s TokenLogprobs when sampling.prompt_logprobs is set


class InProcessWorker(WorkerAdapter):
    """An in-process worker (sync methods) as an awaitable one: each call, then one turn of the event loop, so
    concurrent requests interleave round by round."""

    in_process = True

    async def call(self, name: str, method, *args, **kwargs):
        out = method(*args, **kwargs)
        await asyncio.sleep(0)
        return out


sync_worker = InProcessWorker


async def _maybe_await(value):
    if inspect.isawaitable(value):
        return await value
    return value


class RoundController:
    """Runs requests round by round over an (async) draft and target worker.

    context_limit: max tokens (prompt + generated); decode: ids -> text, for stop strings; control_factory:
    TreeSpec -> Control (default FixedControl); draft_deadline_s: a slower draft reply is a draft failure;
    draft_context_limit: the draft's max positions (None = unlimited); pipeline: True, False or "auto" (the
    control decides per round); ahead_candidates: candidate next trees per ahead; draft_window: None = every token.
    """

    def __init__(self, target, draft, eos_token_ids, context_limit: int, decode=None,
                 control_factory: ControlFactory | None = None, draft_deadline_s: float | None = None,
                 draft_context_limit: int | None = None, on_round: Callable[[RoundRecord], None] | None = None,
                 pipeline: bool | str = False, draft_window: DraftWindowConfig | None = None,
                 ahead_candidates: int = 1):
        self.target = target
        self.draft = draft
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_limit = context_limit
        self.decode = decode
        self.control_factory = control_factory or FixedControl
        self.draft_deadline_s = draft_deadline_s
        self.draft_context_limit = draft_context_limit
        self.on_round = on_round
        if pipeline not in (True, False, "auto"):
            raise ValueError(f"pipeline: true, false or auto, got {pipeline!r}")
        if not 1 <= ahead_candidates <= MAX_AHEAD_CANDIDATES:
            raise ValueError(f"ahead_candidates: must be in [1, {MAX_AHEAD_CANDIDATES}], got {ahead_candidates}")
        self.pipeline = pipeline
        self.ahead_candidates = ahead_candidates
        self.draft_window = draft_window
        self.running = 0  # requests in generate now (a new one's control may defer its draft's open)

    def check(self, request: GenerationRequest) -> None:
        """Raises ValueError naming the field for a request that cannot run."""
        if not request.prompt_ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        if len(request.prompt_ids) >= self.context_limit:
            raise ValueError(f"prompt: {len(request.prompt_ids)} tokens leave no room under the context limit "
                             f"of {self.context_limit} tokens")
        if any(not s for s in request.stop_strings):
            raise ValueError("stop_strings: an empty stop string would stop after the first token")
        if request.stop_strings and self.decode is None:
            raise ValueError("stop_strings: this engine has no decode function (tokenizer) to match text")
        if request.max_new_tokens < (0 if request.sampling.prompt_logprobs is not None else 1):
            raise ValueError(f"max_new_tokens: must be >= 1 (0 only to score the prompt), got {request.max_new_tokens}")
        if not 0 <= request.resumed_tokens < len(request.prompt_ids):
            raise ValueError(f"resumed_tokens: must be in [0, {len(request.prompt_ids)}) (the prompt's length), "
                             f"got {request.resumed_tokens}")

    async def generate(self, request: GenerationRequest,
                       on_tokens: Callable[[list[int]], Awaitable[None] | None] | None = None,
                       session_id: str | None = None, on_round: Callable[[RoundRecord], None] | None = None) -> GenerationResult:
        """Generate until a stop; ``on_tokens`` gets each round's committed tokens, ``on_round`` its RoundRecord.
        Raises ValueError (naming the field) for a bad request; target errors propagate; cancellation releases
        both sessions."""
        self.check(request)
        run = _Request(self, request, session_id or f"req-{next(_session_ids)}", on_round)
        self.running += 1
        try:
            await run.open()
            if not request.max_new_tokens:
                await run.scored()
            while run.stops.reason is None and request.max_new_tokens:
                committed = await run.round()
                if on_tokens is not None:
                    await _maybe_await(on_tokens(committed))
        finally:
            self.running -= 1
            await asyncio.shield(run.close())
        return GenerationResult(list(run.stops.generated), run.stats, run.logprobs, run.prompt_logprobs)


@dataclass(frozen=True)
class _Drafted:  # what the draft phase of a round produced
    tree: DraftTree = EMPTY_TREE  # the tree to verify (empty = a plain target step)
    depth: int = 0  # tree levels of ``tree``
    fallback: str | None = None  # why the round runs without the draft (orchestrator.planning.control reasons)
    draft_s: float | None = None  # wall time of the draft phase, seconds (None = the draft was not asked)
    pipelined: bool = False  # the tree came from an adopted ahead (drafted during the previous verify)
    ahead_s: float | None = None  # pipelined: wall time of that ahead, seconds (off the critical path)
    candidate: int = 0  # pipelined: the adopted candidate (0 = best path + guess; > 0 = pre-drafted)


@dataclass(frozen=True)
class _Ahead:  # an ahead proposal: the next round's tree for each candidate outcome of this round
    candidates: tuple[tuple[tuple[int, ...], DraftTree], ...]  # (the tokens it commits: path + final token, tree)
    draft_s: float  # wall time of the ahead, seconds


@dataclass(frozen=True)
class _AheadOutcome:
    """How a round's ahead ended: "hit" (candidate 0 adopted), "predraft" (another one adopted), "miss"
    (discarded) or "failed" (a draft failure)."""

    kind: str
    ahead_s: float | None  # wall time of the ahead, seconds (None when it failed)
    wait_s: float  # time the round waited for it after the verify returned, seconds


class _Request:  # one request in flight: sessions, stop checker, control policy, statistics
    def __init__(self, controller: RoundController, request: GenerationRequest, sid: str, on_round=None):
        self.controller = controller
        self.on_round = on_round
        self.request = request
        self.sid = sid
        self.spec = request.spec if controller.draft is not None else None
        self.control = controller.control_factory(self.spec) if self.spec is not None else None  # per-request policy
        if self.control is not None:
            self.control.bind_request(request.sampling)
        self.stops = StopChecker(len(request.prompt_ids), request.max_new_tokens, controller.context_limit,
                                 frozenset() if request.ignore_eos else controller.eos_token_ids,
                                 tuple(request.stop_strings), controller.decode,
                                 streamed=tuple(request.prompt_ids[len(request.prompt_ids) - request.resumed_tokens:]),
                                 min_tokens=request.min_tokens, stop_token_ids=frozenset(request.stop_token_ids))
        self.stats = GenerationStats()
        self.logprobs: list = []  # the committed tokens' TokenLogprobs (sampling.logprobs set)
        self.prompt_logprobs: tuple = ()  # the target's prefill's (sampling.prompt_logprobs set)
        self.started = time.perf_counter()
        self.draft_sid: str | None = None  # open draft session
        self.draft_opens = 0
        self.target_open = False
        self.pipeline = controller.pipeline if self.spec is not None and controller.draft.drafts_ahead else False
        # a draft beside this process (a service): its calls run while the loop waits on others
        self.draft_beside = controller.draft is None or not controller.draft.in_process
        self.adopted: _Drafted | None = None  # the next round's tree, from an adopted ahead
        self.draft_limit = controller.draft_context_limit  # the draft's max positions (None = unknown)
        self.draft_skipped = 0  # committed tokens the open draft session left out (DraftWindowConfig)
        self.draft_widened = False  # the draft session was re-opened with the whole context (full_after_tokens)
        self.draft_positions: int | None = None  # the draft's max positions, as its start reported (None = unknown)
        self.draft_widen_failed = False  # a whole-context draft session failed: the window for the rest
        self.draft_fresh = 0  # tokens of the open draft session not known to be prefilled (until its first propose)

    @property
    def committed_tokens(self) -> list[int]:
        return [*self.request.prompt_ids, *self.stops.generated]

    async def open(self) -> None:
        """Open both sessions at once (in services mode the two prefills run side by side)."""
        self.target_open = True  # before the call: a cancel during Prefill must still release (harmless if unknown)
        starts = [asyncio.ensure_future(self.controller.target.start(self.sid, self.request.prompt_ids, self.request.sampling))]
        others = self.controller.running - 1  # other requests of this controller running now
        if self.spec is not None and self.request.max_new_tokens and not self.control.defer_draft_open(others):
            starts.append(asyncio.ensure_future(self._open_draft()))  # deferred: opened by the first drafted round
        self.prompt_logprobs = tuple((await gather_or_cancel(starts))[0] or ())

    async def scored(self) -> None:
        """A request of max_new_tokens 0 (prompt logprobs only) ends: one empty RoundRecord carries them."""
        self.stats.stop_reason = "max_new_tokens"
        self.stats.total_s = time.perf_counter() - self.started
        await self._report(RoundRecord((), 0, 0, 0, None, 0, None, 0.0, 0.0, stop_reason="max_new_tokens",
                                       prompt_logprobs=self.prompt_logprobs))

    async def _report(self, record: RoundRecord) -> None:
        for callback in (self.on_round, self.controller.on_round):
            if callback is not None:
                await _maybe_await(callback(record))

    async def _open_draft(self) -> bool:
        sid = self.sid if self.draft_opens == 0 else f"{self.sid}#{self.draft_opens}"
        self.draft_opens += 1
        self.draft_sid = sid  # before the call: a cancel during start must still close (release) the session
        tokens = self.committed_tokens
        window = self.controller.draft_window
        if window is not None and not self.draft_widened and self._full_context_due(len(tokens) + self.stops.budget() - 1):
            self.draft_widened = True  # a retry or deferred open after full_after_tokens: no windowed detour
        if self.draft_widened:
            window = None
        context = window.context(tokens) if window is not None else tokens
        self.draft_skipped = len(tokens) - len(context)
        self.draft_fresh = len(context)  # tokens its first propose may still be prefilling (a longer deadline)
        sampling = self.request.sampling
        if self.draft_opens > 1 and sampling.seed is not None:  # a re-opened session must not replay its draws
            sampling = replace(sampling, seed=derive_seed(sampling.seed, f"draft-reopen/{self.draft_opens - 1}"))
        try:
            limit = await self._draft_call(self.controller.draft.start(sid, context, sampling))
            limit = limit or self.controller.draft_context_limit  # gRPC clients report the draft's, in-process the engine's
            self.control.draft_opened()
            if limit:
                self.draft_positions = limit
                limit += self.draft_skipped  # in committed tokens: the draft's positions start after the skipped ones
                self.control.set_draft_context_limit(limit)
                self.draft_limit = limit
        except DraftUnavailableError as exc:
            await self._drop_draft(exc, "unavailable at start")
            return False
        return True

    async def _release_quietly(self, sid: str) -> None:
        with contextlib.suppress(Exception):  # the draft is already gone; its stream end frees the KV
            await asyncio.wait_for(self.controller.draft.release(sid), 1.0)

    async def _draft_call(self, awaitable, extra_s: float = 0.0):
        """A draft call under the deadline (+ ``extra_s`` s); past it, DraftUnavailableError."""
        base = self.controller.draft_deadline_s
        deadline = None if base is None else base + extra_s
        try:
            return await asyncio.wait_for(awaitable, deadline)  # None: no deadline
        except asyncio.TimeoutError as exc:
            raise DraftUnavailableError(f"draft slower than its deadline of {deadline:g} s") from exc

    async def _drop_draft(self, exc: Exception, what: str = "failed") -> None:
        log.warning("request %s: draft %s (%s); decoding without it", self.sid, what, exc)
        if self.draft_widened:  # a failed whole-context session (full_after_tokens) is not tried again
            self.draft_widened, self.draft_widen_failed = False, True  # retries open the window
        self.control.draft_failed(time.monotonic())
        sid, self.draft_sid = self.draft_sid, None
        await self._release_quietly(sid)

    async def round(self) -> list[int]:
        """One round: draft, shape, verify, stop checks, commit, record (gpt-fast's ``speculative_decode`` phases);
        returns the tokens it committed."""
        max_depth = self.stops.budget() - 1  # the accepted path plus the bonus must fit the budget
        t0 = time.perf_counter()
        with _tracer.start_as_current_span("round", attributes={"request.id": self.sid, "round": self.stats.rounds}) as span:
            drafted, self.adopted = self.adopted or await self._draft(max_depth), None
            shaped = self._shape(drafted, max_depth)
            t1 = time.perf_counter()
            beside = self.draft_beside
            ahead = self._start_ahead(drafted, shaped, max_depth) if beside else None  # round r+1 beside this verify
            try:
                result = await self._verify(shaped.tree)
                t2 = time.perf_counter()
                if not beside:  # in-process the calls take turns: after the verify, so its time stays its own
                    ahead = self._start_ahead(drafted, shaped, max_depth)
                committed = self._stop_checks(result.tokens)
                accepted = list(result.accepted_nodes[: len(committed)])  # node indices of the committed draft tokens
                outcome = await self._commit(committed, _draft_nodes(shaped, accepted), ahead)
            except BaseException:
                if ahead is not None:  # a failed round (target error, cancel) leaves no ahead running
                    ahead.cancel()
                    await asyncio.gather(ahead, return_exceptions=True)
                raise
            t3 = time.perf_counter()
            _round_attributes(span, drafted, shaped, self._gamma(), result, committed, outcome)
        await self._record(drafted, shaped, result, committed, accepted, (t2 - t1, t3 - t2, t3 - t0), outcome)
        return committed

    def _gamma(self) -> int:  # the request's speculation depth, tree levels (0 without a control policy)
        return self.control.gamma if self.control is not None else 0

    async def _draft(self, max_depth: int) -> _Drafted:
        """Speculate or not (the control decides); a tree of at most max_depth levels, or none."""
        if self.control is None or max_depth < 1:
            return _Drafted()
        t0 = time.perf_counter()
        committed_len = len(self.request.prompt_ids) + len(self.stops.generated)
        self.control.round_context(self.committed_tokens)
        if not self.control.speculate(time.monotonic(), committed_len, max_depth):
            return _Drafted(fallback=self.control.reason)
        if self.draft_sid is not None and self._widen_due(committed_len, max_depth):
            await self._widen_draft()
        if self.draft_sid is None:  # deferred at open, or a retry after a failure
            beside = self.draft_beside and not self.request.sampling.seeded
            if await self._open_draft() and beside:  # this round runs plain beside the draft's prefill
                self.control.prefill_beside()
                return _Drafted(fallback=DRAFT_OPENING, draft_s=time.perf_counter() - t0)
        if self.draft_sid is None:
            return _Drafted(fallback=DRAFT_UNAVAILABLE)
        if self.stats.rounds and self._predraft_plain(max_depth):  # the first round keeps its own
            return _Drafted(fallback=PREDRAFT)
        tree = await self._propose(max_depth)
        return _Drafted(tree, depth=max(node_depths(tree.parents), default=0), draft_s=time.perf_counter() - t0,
                        fallback=DRAFT_UNAVAILABLE if self.draft_sid is None else None)

    def _widen_due(self, committed_len: int, max_depth: int) -> bool:  # the window gives way to the whole context
        return bool(self.draft_skipped) and self._full_context_due(committed_len + max_depth)

    def _full_context_due(self, positions: int) -> bool:
        """full_after_tokens generated, no whole-context failure yet, ``positions`` fit the draft's context."""
        window = self.controller.draft_window
        if window is None or window.full_after_tokens is None or self.draft_widen_failed:
            return False
        if len(self.stops.generated) < window.full_after_tokens:
            return False
        limit = self.draft_positions or self.controller.draft_context_limit
        return limit is None or positions <= limit

    async def _widen_draft(self) -> None:
        """Release the windowed draft session; the caller opens the next with every committed token."""
        log.info("request %s: %d tokens generated; the draft re-opens with the whole context (%d tokens)",
                 self.sid, len(self.stops.generated), len(self.committed_tokens))
        trace.get_current_span().add_event("draft.widen", {"generated": len(self.stops.generated),
                                                           "skipped": self.draft_skipped})
        sid, self.draft_sid, self.draft_widened = self.draft_sid, None, True
        await self._release_quietly(sid)

    async def _propose(self, max_depth: int) -> DraftTree:
        """The draft's tree at the control's shape; an empty tree (and the draft dropped) when it fails."""
        spec = self.control.spec(self.spec)
        with _tracer.start_as_current_span("draft", attributes={"gamma": spec.gamma, "max_depth": max_depth}):
            extra_s, self.draft_fresh = min(FRESH_DRAFT_S_PER_TOKEN * self.draft_fresh, FRESH_DRAFT_MAX_S), 0
            try:
                tree = await self._draft_call(self.controller.draft.propose(self.draft_sid, spec, max_depth), extra_s)
            except DraftUnavailableError as exc:
                self._timed_out(exc)
                await self._drop_draft(exc)
                return EMPTY_TREE
        batch_size = self.controller.draft.last_batch_size(self.draft_sid)
        if batch_size is not None:  # a draft service's reply: how many sessions' steps shared its forwards
            self.control.draft_merged(batch_size)
        forward_ms = self.controller.draft.last_forward_ms(self.draft_sid)
        if forward_ms is not None:  # a draft service's reply: the draft call's own time, without the queue
            self.control.draft_forward(forward_ms / 1000)
        return tree

    def _timed_out(self, exc: BaseException) -> None:
        """Tell the control when a proposal failed by its (base) deadline, a lower bound on the draft's reply time."""
        if isinstance(exc.__cause__, asyncio.TimeoutError):
            self.control.draft_timed_out(self.controller.draft_deadline_s)

    async def _verify(self, tree: DraftTree):  # one target forward (an empty tree = one plain step)
        with _tracer.start_as_current_span("verify", attributes={"tree.nodes": tree.size}):
            return await self.controller.target.verify(self.sid, tree)

    def _stop_checks(self, tokens) -> list[int]:  # the verified tokens up to and including the first that stops
        stop = next((i for i, token in enumerate(tokens) if self.stops.push(token)), len(tokens) - 1)
        return list(tokens[:stop + 1])

    async def _commit(self, committed: list[int], accepted: list[int],
                      ahead: "asyncio.Future | None" = None) -> _AheadOutcome | None:
        """Both workers keep exactly the committed tokens; accepted: their draft node indices; ahead: the round's
        ahead task, adopted here (no draft commit then) or discarded first."""
        with _tracer.start_as_current_span("commit", attributes={"tokens": len(committed)}):
            await self.controller.target.commit(self.sid, len(committed))
            outcome = await self._resolve_ahead(ahead, committed) if ahead is not None else None
            if outcome is not None and outcome.kind in ("hit", "predraft"):
                return outcome
            if self.draft_sid is not None:
                try:
                    await self._draft_call(self.controller.draft.commit(self.draft_sid, committed, accepted))
                except DraftUnavailableError as exc:
                    await self._drop_draft(exc)
        return outcome

    def _pipelining(self) -> bool:  # ``pipeline`` true, or "auto" and the control pre-drafts
        if not self.pipeline or self.draft_sid is None:
            return False
        return self.pipeline is True or (self.draft_beside and self.control.predraft(
            self.controller.draft.link_rtt_s, self.controller.ahead_candidates))

    def _plain_ahead_room(self, max_depth: int) -> bool:  # after one plain token: budget and draft context left
        return max_depth >= 2 and not (self.draft_limit and len(self.committed_tokens) + 1 >= self.draft_limit)

    def _predraft_plain(self, max_depth: int) -> bool:  # run this round plain, pre-drafting the next tree beside it
        return (self.draft_beside and self._plain_ahead_room(max_depth) and self._pipelining()
                and self.control.predraft_plain(self.controller.draft.link_rtt_s, self.controller.ahead_candidates))

    def _start_ahead(self, drafted: _Drafted, shaped: ShapedTree, max_depth: int) -> "asyncio.Future | None":
        """Pipelining: a task drafting round r+1 for this round's likely outcomes (``_candidates``; a plain step's:
        the draft's likeliest next tokens); None without a kept draft path, depth budget or draft context."""
        if not self._pipelining():
            return None
        count = self.controller.ahead_candidates
        spec = self.control.spec(self.spec)
        if not shaped.tree.size:  # a plain step commits one token: candidate c is the draft's c-th likeliest
            if not self._plain_ahead_room(max_depth):
                return None
            return asyncio.ensure_future(self._ahead([AheadCandidate((), max_depth - 1)] * count, [()] * count, spec))
        if not drafted.tree.size:
            return None
        path = _best_path(drafted.tree, shaped)
        next_depth = max_depth - len(path) - 1  # round r+1's max_depth when path + guess are committed
        next_committed = len(self.committed_tokens) + len(path) + 1
        if not path or next_depth < 1 or (self.draft_limit and next_committed >= self.draft_limit):
            return None
        candidates = _candidates(drafted.tree, shaped, path, max_depth, count)
        paths = [tuple(drafted.tree.tokens[n] for n in c.path_nodes) for c in candidates]
        return asyncio.ensure_future(self._ahead(candidates, paths, spec))  # copies the context: under round r's span

    async def _ahead(self, candidates: list[AheadCandidate], paths: list[tuple[int, ...]],
                     spec: TreeSpec) -> _Ahead | Exception:
        """The ahead proposal (a ``draft.ahead`` span); paths: each candidate's path tokens. Failures are returned."""
        t0 = time.perf_counter()
        first, draft = candidates[0], self.controller.draft
        with _tracer.start_as_current_span("draft.ahead", attributes={
                "gamma": spec.gamma, "max_depth": first.max_depth, "ahead.path_length": len(first.path_nodes),
                "ahead.candidates": len(candidates)}) as span:
            # each candidate is a proposal's work: the deadline once per candidate; a fresh session's prefill extra
            extra_s = (len(candidates) - 1) * (self.controller.draft_deadline_s or 0.0)
            extra_s, self.draft_fresh = extra_s + min(FRESH_DRAFT_S_PER_TOKEN * self.draft_fresh, FRESH_DRAFT_MAX_S), 0
            try:
                if len(candidates) == 1:
                    call = draft.propose_ahead(self.draft_sid, list(first.path_nodes), spec, first.max_depth)
                    out = [await self._draft_call(call, extra_s)]
                else:
                    out = await self._draft_call(draft.propose_candidates(self.draft_sid, candidates, spec), extra_s)
            except Exception as exc:  # noqa: BLE001 - any ahead failure is a draft failure; the output never depends on it
                span.set_attribute("ahead.failed", True)
                return exc
            span.set_attribute("ahead.guess", out[0][0])
            span.set_attribute("tree.nodes", out[0][1].size)
        outcomes = tuple(((*path, token), tree) for path, (token, tree) in zip(paths, out))
        return _Ahead(outcomes, time.perf_counter() - t0)

    async def _resolve_ahead(self, task: asyncio.Future, committed: list[int]) -> _AheadOutcome:
        """Adopt the candidate whose path + final token the committed tokens are (nothing stopped), else discard."""
        t0 = time.perf_counter()
        ahead = await task
        wait_s = time.perf_counter() - t0
        hit = None  # the adopted candidate
        proposal_failed = isinstance(ahead, Exception)  # the ahead proposal itself (not its resolve)
        if not proposal_failed:
            if self.stops.reason is None:
                hit = next((c for c, (tokens, _) in enumerate(ahead.candidates) if tokens == tuple(committed)), None)
            draft = self.controller.draft
            try:
                resolve = draft.resolve_ahead(self.draft_sid, True, hit) if hit else draft.resolve_ahead(
                    self.draft_sid, hit is not None)  # candidate 0 or none: the call pipelining has always made
                await self._draft_call(resolve)
            except Exception as exc:  # noqa: BLE001 - as in _ahead: any failure here is a draft failure
                ahead = exc
        if isinstance(ahead, Exception):
            if self.draft_sid is not None:
                if proposal_failed:  # a resolve runs no draft steps: its timeout prices none
                    self._timed_out(ahead)
                await self._drop_draft(ahead)
            return _AheadOutcome("failed", None, wait_s)
        if hit is None:
            return _AheadOutcome("miss", ahead.draft_s, wait_s)
        tree = ahead.candidates[hit][1]
        self.adopted = _Drafted(tree, depth=max(node_depths(tree.parents), default=0), draft_s=0.0,
                                pipelined=True, ahead_s=ahead.draft_s, candidate=hit)
        return _AheadOutcome("predraft" if hit else "hit", ahead.draft_s, wait_s)

    def _shape(self, drafted: _Drafted, max_depth: int) -> ShapedTree:  # the tree to verify, as the control shapes it
        if self.control is None or max_depth < 1 or drafted.fallback == PREDRAFT:  # plain: its ahead needs one token
            return ShapedTree.of(drafted.tree)
        sunk_ms = (drafted.draft_s or 0.0) * 1000
        return self.control.shape(drafted.tree, self.committed_tokens, max_depth, sunk_ms)

    async def _record(self, drafted: _Drafted, shaped: ShapedTree, result: VerifyResult, committed: list[int],
                      accepted: list[int], timing: tuple[float, float, float],
                      ahead: _AheadOutcome | None = None) -> None:
        """The control learns the outcome, the statistics count the round, the callbacks get its RoundRecord.
        timing: (verify, commit, round) wall times, seconds."""
        tree = shaped.tree
        accepted_path = result.accepted_nodes
        verify_s, commit_s, round_s = timing
        if drafted.tree.size:
            self.control.record(drafted.depth, drafted.tree.size, len(_draft_nodes(shaped, accepted_path)))
        if self.control is not None:
            draft_s = None if drafted.pipelined else drafted.draft_s
            overhead_s = round_s - verify_s - (draft_s or 0.0) - (ahead.wait_s if ahead else 0.0)
            self.control.observe(RoundObservation(
                shaped, accepted_path, verify_s, draft_s, overhead_s, drafted.tree, result.batch_size,
                result.batch_rows, result.mergeable, result.forward_ms / 1000,
                reply_s=drafted.ahead_s if drafted.pipelined else None))
        context_nodes = sum(1 for d in shaped.draft_index if d is None)
        record = RoundRecord(tuple(committed), logprobs=result.logprobs[:len(committed)],
                             prompt_logprobs=() if self.stats.rounds else self.prompt_logprobs, proposed=tree.size,
                             accepted=len(accepted), depth=shaped.depth, fallback=drafted.fallback,
                             gamma=self._gamma(), draft_s=drafted.draft_s, verify_s=verify_s, commit_s=commit_s,
                             drafted=drafted.tree.size, context_proposed=context_nodes,
                             context_accepted=sum(1 for n in accepted if shaped.draft_index[n] is None),
                             expected_accepted=shaped.expected_accepted, stop_reason=self.stops.reason,
                             pipelined=drafted.pipelined and not drafted.candidate,
                             predrafted=drafted.pipelined and drafted.candidate > 0,
                             ahead=ahead.kind if ahead else None, ahead_s=ahead.ahead_s if ahead else None,
                             cost=self.control.cost_snapshot() if self.control is not None else None)
        self.stats.add(record, time.perf_counter() - self.started)
        self.logprobs += record.logprobs
        if self.stops.reason is not None:
            self.stats.total_s = time.perf_counter() - self.started
            self.stats.new_tokens = len(self.stops.generated)
            self.stats.stop_reason = self.stops.reason
        await self._report(record)

    async def close(self) -> None:
        """Release both sessions (KV freed); errors here are logged, never raised."""
        if self.stats.stop_reason is None:
            self.stats.total_s = time.perf_counter() - self.started
            self.stats.new_tokens = len(self.stops.generated)
        if self.draft_sid is not None:
            try:
                await asyncio.wait_for(self.controller.draft.release(self.draft_sid), 5.0)
            except Exception as exc:  # noqa: BLE001
                log.debug("request %s: draft release failed: %s", self.sid, exc)
        if self.target_open:
            try:
                await asyncio.wait_for(self.controller.target.release(self.sid), 5.0)
            except Exception as exc:  # noqa: BLE001
                log.warning("request %s: target release failed: %s", self.sid, exc)


async def gather_or_cancel(tasks: list[asyncio.Future]) -> list:
    """``asyncio.gather`` of the tasks; when one fails (or this is cancelled), the others are cancelled first."""
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _best_path(tree: DraftTree, shaped: ShapedTree) -> list[int]:
    """The most likely root path among the kept draft nodes (draft numbering): the best log-prob child at each level
    (the first of equals)."""
    kept = {d for d in shaped.draft_index if d is not None}
    logprobs = tree.draft_logprobs or (0.0,) * tree.size
    path, node = [], ROOT
    while True:
        kids = [i for i in sorted(kept) if tree.parents[i] == node]
        if not kids:
            return path
        node = max(kids, key=lambda i: logprobs[i])
        path.append(node)


def _candidates(tree: DraftTree, shaped: ShapedTree, path: list[int], max_depth: int,
                count: int) -> list[AheadCandidate]:
    """The outcomes an ahead drafts for (docs/control.md "Pipelining"; SSD): ``path`` all accepted, then up to
    count - 1 early rejections, likeliest first (q = exp(log-prob)): the path kept up to depth d, its node there
    rejected, chance q_1 ... q_d (1 - q_{d+1}); the final token: the draft's argmax that no verified child there is."""
    logprobs = tree.draft_logprobs or (0.0,) * tree.size
    chances, reach = [], 1.0
    for d, node in enumerate(path):
        q = math.exp(logprobs[node])
        chances.append((reach * (1.0 - q), d))
        reach *= q
    kept = sorted(chances, key=lambda c: (-c[0], -c[1]))[: count - 1]
    return [AheadCandidate(tuple(path[:d]), max_depth - d - 1, _children_tokens(shaped, path[d - 1] if d else ROOT))
            for d in [len(path), *(d for _, d in kept)]]


def _children_tokens(shaped: ShapedTree, node: int) -> tuple[int, ...]:  # of draft node ``node``'s verified children
    at = ROOT if node == ROOT else shaped.draft_index.index(node)
    return tuple(sorted({t for t, p in zip(shaped.tree.tokens, shaped.tree.parents) if p == at}))


def _draft_nodes(shaped: ShapedTree, accepted: list[int]) -> list[int]:
    """The accepted nodes as the draft numbered them, up to the first context node."""
    indices = [shaped.draft_index[node] for node in accepted]
    return indices[:indices.index(None)] if None in indices else indices


def _round_attributes(span, drafted: _Drafted, shaped: ShapedTree, gamma: int, result, committed,
                      ahead: _AheadOutcome | None = None) -> None:
    """The round span's attributes: the control's decision and what happened."""
    attributes = {"pipelined": drafted.pipelined and not drafted.candidate,
                  "predrafted": drafted.pipelined and drafted.candidate > 0, "gamma": gamma,
                  "tree.nodes": shaped.tree.size, "tree.depth": shaped.depth, "tree.drafted": drafted.tree.size,
                  "tree.context_nodes": sum(1 for d in shaped.draft_index if d is None),
                  "expected_accepted": float(shaped.expected_accepted),
                  "accepted_length": len(result.accepted_nodes), "committed": len(committed)}
    if drafted.ahead_s is not None:
        attributes["ahead.draft_s"] = drafted.ahead_s
    if ahead is not None:
        attributes.update({"ahead.outcome": ahead.kind, "ahead.hit": ahead.kind in ("hit", "predraft")})
    if drafted.fallback:
        attributes["fallback.reason"] = drafted.fallback
    span.set_attributes(attributes)
