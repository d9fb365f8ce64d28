"""Round control of one request (DESIGN.md "Control"), asynchronous, for every mode.

A round: the draft grows a token tree (``propose``), the target verifies it in one forward
(``verify``: accepted path + bonus token), the tokens pass the stop checks one at a time, and both
workers commit exactly the tokens that passed (KV cache rollback of the rest). Around that loop:

- dynamic gamma: the speculation depth of the next tree follows the request's own acceptance
  (``orchestrator.policy.DynamicGamma``); rows past the TreeSpec repeat its last row;
- fallback: a round without the draft (an empty tree = one plain target step) when acceptance says
  speculation does not pay, when the draft fails, is unreachable or slower than its deadline, or
  when the draft's context limit is reached (``orchestrator.policy.FallbackPolicy``). A failed
  draft session is re-opened on the committed tokens when the policy retries it. Plain rounds commit
  the same tokens a speculative round would, so no token is lost, repeated or changed;
- traces: one ``round`` span per round with ``draft``, ``verify`` and ``commit`` children.

Workers are awaitables with the DraftWorker / TargetWorker methods (specdec.interfaces): gRPC
clients (orchestrator.clients) or in-process runtimes wrapped by ``sync_worker``. The controller
keeps no model state; many requests run concurrently on one event loop, each at its own pace.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from opentelemetry import trace

from orchestrator.stops import StopChecker
from specdec.sampling import GREEDY, SamplingParams
from specdec.stats import GenerationStats, RoundRecord
from specdec.tree import DraftTree, node_depths
from specdec.tree_spec import TreeSpec

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("specdec.orchestrator")
_EMPTY_TREE = DraftTree((), ())
_session_ids = itertools.count()


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

    def __post_init__(self):
        if isinstance(self.stop_strings, str):  # one stop string, not one per character
            self.stop_strings = (self.stop_strings,)


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


class FixedControl:
    """No adaptation: the request's TreeSpec every round, the draft always used while it works.

    A failed draft is not retried. The interface (``gamma``, ``speculate``, ``record``,
    ``draft_failed``, ``reason``) is what the controller asks of a control policy;
    ``orchestrator.policy.RequestControl`` implements the adaptive one.
    """

    def __init__(self, spec: TreeSpec):
        self.gamma = spec.gamma
        self._failed = False
        self.reason: str | None = None

    def spec(self, base: TreeSpec) -> TreeSpec:
        return base

    def speculate(self, now: float, committed_len: int, depth: int) -> bool:
        self.reason = "draft_unavailable" if self._failed else None
        return not self._failed

    def record(self, depth: int, proposed: int, accepted: int) -> None:
        pass

    def draft_failed(self, now: float) -> None:
        self._failed = True

    def set_draft_context_limit(self, limit: int | None) -> None:
        pass  # a fixed policy never stops for the draft's context (the draft runtime falls back itself)


ControlFactory = Callable[[TreeSpec], Any]


def sync_worker(worker) -> Any:
    """Wrap an in-process worker (sync methods) as an awaitable one; each call yields to the loop
    afterwards, so concurrent requests interleave round by round."""

    class _Async:
        def __getattr__(self, name):
            method = getattr(worker, name)

            async def call(*args, **kwargs):
                out = method(*args, **kwargs)
                await asyncio.sleep(0)
                return out

            return call

    return _Async()


async def _maybe_await(value):
    if inspect.isawaitable(value):
        return await value
    return value


class RoundController:
    """Runs requests round by round over an (async) draft and target worker.

    eos_token_ids: ids that end generation; context_limit: max total tokens (prompt + generated);
    decode: ids -> text, for stop strings; control: TreeSpec -> per-request control policy
    (default FixedControl); draft_deadline_s: a draft reply slower than this is a draft failure;
    draft_context_limit: the draft's max positions (None = unlimited); on_round: called with
    each round's RoundRecord (metrics).
    """

    def __init__(self, target, draft, eos_token_ids, context_limit: int, decode=None,
                 control: ControlFactory | None = None, draft_deadline_s: float | None = None,
                 draft_context_limit: int | None = None, on_round: Callable[[RoundRecord], None] | None = None):
        self.target = target
        self.draft = draft
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_limit = context_limit
        self.decode = decode
        self.control = control or FixedControl
        self.draft_deadline_s = draft_deadline_s
        self.draft_context_limit = draft_context_limit
        self.on_round = on_round

    def check(self, request: GenerationRequest) -> None:
        """Raises ValueError naming the field for a request that cannot run."""
        if not request.prompt_ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        if len(request.prompt_ids) >= self.context_limit:
            raise ValueError(
                f"prompt: {len(request.prompt_ids)} tokens leave no room under the context limit "
                f"of {self.context_limit} tokens"
            )
        if any(not s for s in request.stop_strings):
            raise ValueError("stop_strings: an empty stop string would stop after the first token")
        if request.stop_strings and self.decode is None:
            raise ValueError("stop_strings: this engine has no decode function (tokenizer) to match text")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {request.max_new_tokens}")

    async def generate(self, request: GenerationRequest,
                       on_tokens: Callable[[list[int]], Awaitable[None] | None] | None = None,
                       session_id: str | None = None, on_round: Callable[[RoundRecord], None] | None = None) -> GenerationResult:
        """Generate until a stop; ``on_tokens`` receives each round's committed tokens as they land,
        ``on_round`` the round's RoundRecord (specdec.stats).

        Raises ValueError (naming the field) for a bad request; errors of the target propagate.
        Cancellation (client gone, Abort) releases the sessions on both workers.
        """
        self.check(request)
        run = _Request(self, request, session_id or f"req-{next(_session_ids)}", on_round)
        try:
            await run.open()
            while run.stops.reason is None:
                committed = await run.round()
                if on_tokens is not None:
                    await _maybe_await(on_tokens(committed))
        finally:
            await asyncio.shield(run.close())
        return GenerationResult(list(run.stops.generated), run.stats)


class _Request:
    """One request in flight: sessions, stop checker, control policy, statistics."""

    def __init__(self, ctl: RoundController, request: GenerationRequest, sid: str, on_round=None):
        self.ctl = ctl
        self.on_round = on_round
        self.request = request
        self.sid = sid
        self.spec = request.spec if ctl.draft is not None else None
        self.control = ctl.control(self.spec) if self.spec is not None else None
        self.stops = StopChecker(len(request.prompt_ids), request.max_new_tokens, ctl.context_limit,
                                 ctl.eos_token_ids, tuple(request.stop_strings), ctl.decode)
        self.stats = GenerationStats()
        self.started = time.perf_counter()
        self.draft_sid: str | None = None  # open draft session
        self.draft_opens = 0
        self.target_open = False

    @property
    def committed_tokens(self) -> list[int]:
        return [*self.request.prompt_ids, *self.stops.generated]

    async def open(self) -> None:
        self.target_open = True  # before the call: a cancel during Prefill must still release (harmless if unknown)
        await self.ctl.target.start(self.sid, self.request.prompt_ids, self.request.sampling)
        if self.spec is not None:
            await self._open_draft()

    async def _open_draft(self) -> bool:
        sid = self.sid if self.draft_opens == 0 else f"{self.sid}#{self.draft_opens}"
        self.draft_opens += 1
        self.draft_sid = sid  # before the call: a cancel during start must still close (release) the session
        try:
            limit = await self._draft_call(self.ctl.draft.start(sid, self.committed_tokens, self.request.sampling))
            limit = limit or self.ctl.draft_context_limit  # gRPC clients report the draft's, in-process the engine's
            if limit:
                self.control.set_draft_context_limit(limit)
        except DraftUnavailableError as exc:
            log.warning("request %s: draft unavailable at start (%s); decoding without it", self.sid, exc)
            self.draft_sid = None
            self.control.draft_failed(time.monotonic())
            await self._release_quietly(sid)
            return False
        return True

    async def _release_quietly(self, sid: str) -> None:
        try:
            await asyncio.wait_for(self.ctl.draft.release(sid), 1.0)
        except Exception:  # noqa: BLE001 - the draft is already gone; its stream end frees the KV
            pass

    async def _draft_call(self, awaitable):
        """A draft call under the draft deadline; every failure becomes DraftUnavailableError."""
        try:
            if self.ctl.draft_deadline_s is None:
                return await awaitable
            return await asyncio.wait_for(awaitable, self.ctl.draft_deadline_s)
        except DraftUnavailableError:
            raise
        except asyncio.TimeoutError as exc:
            raise DraftUnavailableError(f"draft slower than its deadline of {self.ctl.draft_deadline_s} s") from exc

    async def _drop_draft(self, exc: Exception) -> None:
        log.warning("request %s: draft failed (%s); decoding without it", self.sid, exc)
        self.control.draft_failed(time.monotonic())
        sid, self.draft_sid = self.draft_sid, None
        await self._release_quietly(sid)

    async def round(self) -> list[int]:
        """One round; returns the tokens it committed."""
        stops, stats = self.stops, self.stats
        max_depth = stops.budget() - 1  # the accepted path plus the bonus must fit the budget
        with _tracer.start_as_current_span("round", attributes={"request.id": self.sid, "round": stats.rounds}) as span:
            tree, depth, fallback = _EMPTY_TREE, 0, None
            draft_s = None
            t0 = time.perf_counter()
            if self.control is not None and max_depth >= 1:
                now = time.monotonic()
                committed_len = len(self.request.prompt_ids) + len(stops.generated)
                if self.control.speculate(now, committed_len, min(self.control.gamma, max_depth)):
                    if self.draft_sid is None:
                        await self._open_draft()
                    if self.draft_sid is not None:
                        spec = self.control.spec(self.spec)
                        with _tracer.start_as_current_span("draft", attributes={"gamma": spec.gamma, "max_depth": max_depth}):
                            try:
                                tree = await self._draft_call(self.ctl.draft.propose(self.draft_sid, spec, max_depth))
                            except DraftUnavailableError as exc:
                                await self._drop_draft(exc)
                        depth = max(node_depths(tree.parents), default=0)
                        draft_s = time.perf_counter() - t0
                    if self.draft_sid is None:
                        fallback = "draft_unavailable"
                else:
                    fallback = self.control.reason
                if fallback:
                    span.set_attribute("fallback.reason", fallback)
            span.set_attribute("gamma", self.control.gamma if self.control is not None else 0)
            span.set_attribute("tree.nodes", tree.size)
            t1 = time.perf_counter()
            with _tracer.start_as_current_span("verify", attributes={"tree.nodes": tree.size}):
                result = await self.ctl.target.verify(self.sid, tree)
            t2 = time.perf_counter()
            committed: list[int] = []
            for token in result.tokens:
                committed.append(token)
                if stops.push(token):
                    break
            accepted = list(result.accepted_nodes[: len(committed)])
            with _tracer.start_as_current_span("commit", attributes={"tokens": len(committed)}):
                await self.ctl.target.commit(self.sid, len(committed))
                if self.draft_sid is not None:
                    try:
                        await self._draft_call(self.ctl.draft.commit(self.draft_sid, committed, accepted))
                    except DraftUnavailableError as exc:
                        await self._drop_draft(exc)
            t3 = time.perf_counter()
            span.set_attribute("accepted_length", len(result.accepted_nodes))
            span.set_attribute("committed", len(committed))
        if tree.size:
            self.control.record(depth, tree.size, len(result.accepted_nodes))
        record = RoundRecord(tuple(committed), proposed=tree.size, accepted=len(accepted), depth=depth,
                             fallback=fallback, gamma=self.control.gamma if self.control is not None else 0,
                             draft_s=draft_s, verify_s=t2 - t1, commit_s=t3 - t2)
        stats.add(record, time.perf_counter() - self.started)
        if stops.reason is not None:
            stats.total_s = time.perf_counter() - self.started
            stats.new_tokens = len(stops.generated)
            stats.stop_reason = stops.reason
        for callback in (self.on_round, self.ctl.on_round):
            if callback is not None:
                await _maybe_await(callback(record))
        return committed

    async def close(self) -> None:
        """Release both sessions (KV freed); errors here are logged, never raised."""
        if self.stats.stop_reason is None:
            self.stats.total_s = time.perf_counter() - self.started
            self.stats.new_tokens = len(self.stops.generated)
        if self.draft_sid is not None:
            try:
                await asyncio.wait_for(self.ctl.draft.release(self.draft_sid), 5.0)
            except Exception as exc:  # noqa: BLE001
                log.debug("request %s: draft release failed: %s", self.sid, exc)
        if self.target_open:
            try:
                await asyncio.wait_for(self.ctl.target.release(self.sid), 5.0)
            except Exception as exc:  # noqa: BLE001
                log.warning("request %s: target release failed: %s", self.sid, exc)
