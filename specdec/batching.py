"""Merging concurrent per-session calls into one runtime call (docs/serving.md "Limits", verify batching).

A call waits up to ``wait_ms`` for company; the first ``max_batch`` waiting items with distinct sessions then
go to the runtime as one batch call on the model worker thread. With ``gather`` > 0 a call first waits at most
``gather`` x the mean call time for sessions predicted back (each session's moving-average gap after its
answer), so requests a few ms apart do not split into alternating groups. Items past their deadline
(time.monotonic()) or abandoned are left out unrun; when the batch call fails, each item is retried alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from specdec.interfaces import UnknownSessionError
from specdec.model_worker import ModelWorker
from specdec.service_errors import DeadlineExpiredError

log = logging.getLogger(__name__)

# batch_call([(session_id, payload), ...]) -> one outcome (result or Exception) per pair, in order
BatchCall = Callable[[list[tuple[str, Any]]], Sequence[Any]]
# solo_call(session_id, payload) -> result (raises on failure)
SoloCall = Callable[[str, Any], Any]


@dataclass
class BatchItem:
    session_id: str
    payload: Any
    deadline: float | None  # time.monotonic(); None = none
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class SessionBatcher:
    """Merges concurrent calls of distinct sessions into ``batch_call`` calls (module docstring). worker: the runtime's
    ModelWorker; batch_call: None = ``solo_call`` per item; on_done(session_id, outcome): called once for every queued
    item, even when its caller has gone (None = dropped unrun); what: the calls' name in logs. Subclasses shape answers
    with ``answer(outcome, company, ms)``. Raises ValueError for max_batch < 1, wait_ms < 0 or gather outside [0, 1]."""

    def __init__(self, worker: ModelWorker, batch_call: BatchCall | None, solo_call: SoloCall, max_batch: int = 8,
                 wait_ms: float = 2.0, on_done: Callable[[str, Any], None] | None = None, what: str = "call",
                 gather: float = 0.0):
        if max_batch < 1 or wait_ms < 0:
            raise ValueError(f"max_batch / wait_ms: need >= 1 / >= 0, got {max_batch} / {wait_ms}")
        if not 0.0 <= gather <= 1.0:
            raise ValueError(f"gather: need a fraction in [0, 1], got {gather}")
        self.worker = worker
        self.batch_call = batch_call
        self.solo_call = solo_call
        self.max_batch = max_batch
        self.wait_s = wait_ms / 1000
        self.on_done = on_done or (lambda session_id, outcome: None)
        self.what = what
        self.batched_forwards = 0  # calls that held more than one session
        self.calls = 0  # runtime calls made (any size)
        self.gather = gather
        self.gathered = 0  # items that joined a call while it waited for sessions expected back
        self._queue: list[BatchItem] = []
        self._full = asyncio.Event()
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._answered: dict[str, float] = {}  # session -> time.monotonic() its last outcome was delivered
        self._gap: dict[str, float] = {}  # session -> moving average of s from that answer to its next item
        self._call_s = 0.0  # moving average of a call's time (s)
        self._in_call: set[str] = set()  # sessions of the call running now (riders not counted)
        self._forgotten: set[str] = set()  # sessions of the running call released meanwhile

    def answer(self, outcome, ran: list[BatchItem], call_ms: float):
        """What a caller whose item ran gets back (default: the outcome itself)."""
        return outcome

    def reports(self, item: BatchItem) -> bool:
        """Whether ``on_done`` hears of this item (default: every item)."""
        return True

    def rider(self, item: BatchItem) -> bool:
        """Whether this item should rather share another session's call than run alone (the target's
        prefill chunks; default no)."""
        return False

    async def _ride(self) -> None:
        """Riders alone in the queue: wait for the next item of a session that is mid-round."""
        if not self._queue or not all(self.rider(item) for item in self._queue):
            return
        riders = {item.session_id for item in self._queue}
        limit = max((self._back_by(sid, at) for sid, at in self._answered.items() if sid not in riders),
                    default=time.monotonic())
        while all(self.rider(item) for item in self._queue) and await self._arrival(limit):
            pass

    def _back_by(self, session_id: str, answered: float) -> float:
        """When a session answered at ``answered`` counts as gone: twice its usual gap (or the mean
        call time) + 20 ms later."""
        return answered + 2 * max(self._gap.get(session_id, 0.0), self._call_s) + 0.02

    async def _arrival(self, limit: float) -> bool:
        """Wait for the next enqueue until ``limit`` (time.monotonic()); False = none came in time."""
        now = time.monotonic()
        if now >= limit:
            return False
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), limit - now)
        except asyncio.TimeoutError:
            return False
        return True

    def _done(self, item: BatchItem, outcome) -> None:
        if self.reports(item):
            self.on_done(item.session_id, outcome)

    def busy(self, session_id: str | None = None) -> bool:
        """Whether sessions other than ``session_id`` (riders aside) are mid-round: queued, in the running
        call, or answered and not yet overdue (``_back_by``)."""
        if any(item.session_id != session_id and not self.rider(item) for item in self._queue) \
                or self._in_call - {session_id}:
            return True
        now = time.monotonic()
        return any(now <= self._back_by(sid, at) for sid, at in self._answered.items() if sid != session_id)

    async def submit(self, session_id: str, payload, deadline: float | None = None):
        """One item, merged with concurrent ones; raises the item's exception or DeadlineExpiredError."""
        (future,) = self.enqueue([(session_id, payload)], deadline)
        return await future

    def forget(self, session_id: str) -> None:
        """The session was released: stop expecting it and fail its queued items with UnknownSessionError
        (they must not run on a new session under the same id). Call it after the caller's own books drop it."""
        self._unexpect(session_id)
        if session_id in self._in_call:
            self._forgotten.add(session_id)
        dropped = [item for item in self._queue if item.session_id == session_id]
        if not dropped:
            return
        self._queue = [item for item in self._queue if item.session_id != session_id]
        for item in dropped:
            self._done(item, None)
            if not item.future.done():
                item.future.set_exception(UnknownSessionError(
                    f"session_id: {session_id!r} was released while its {self.what} was queued"))

    def _unexpect(self, session_id: str) -> None:
        self._answered.pop(session_id, None)
        self._gap.pop(session_id, None)

    def enqueue(self, items: Sequence[tuple[str, Any]], deadline: float | None) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        futures = []
        for session_id, payload in items:
            future = loop.create_future()
            self._queue.append(BatchItem(session_id, payload, deadline, future))
            futures.append(future)
            answered = self._answered.pop(session_id, None)
            if answered is not None and not self.rider(self._queue[-1]):
                gap, seen = now - answered, self._gap.get(session_id)
                self._gap[session_id] = gap if seen is None else seen + 0.3 * (gap - seen)
        self._arrived.set()
        if len(self._queue) >= self.max_batch:
            self._full.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._dispatch())
        return futures

    async def _dispatch(self) -> None:
        """Form batches while items wait: wait for company (or a full batch), then run one call."""
        while self._queue:
            wait = self._queue[0].arrived + self.wait_s - time.monotonic()
            if wait > 0 and len(self._queue) < self.max_batch:
                self._full.clear()
                try:
                    await asyncio.wait_for(self._full.wait(), wait)
                except asyncio.TimeoutError:
                    pass
            await self._ride()
            await self._gather()
            batch = self._take()
            if batch:
                await self._run(batch)

    def _expected(self, now: float, limit: float) -> list[str]:
        """Sessions not queued whose next item is predicted by ``limit`` and is not overdue."""
        queued = {item.session_id for item in self._queue}
        late = self.gather * self._call_s
        return [sid for sid, answered in self._answered.items()
                if sid not in queued and sid in self._gap
                and answered + self._gap[sid] <= limit and now <= answered + 2 * self._gap[sid] + late]

    async def _gather(self) -> None:
        """Wait (at most ``gather`` x the mean call time) for the sessions expected back soon."""
        if not self.gather or not self._call_s or not self._answered:
            return
        limit = time.monotonic() + self.gather * self._call_s
        waited_for: set[str] = set()
        while len({item.session_id for item in self._queue}) < self.max_batch:
            expected = self._expected(time.monotonic(), limit)
            if not expected:
                break
            waited_for.update(expected)
            if not await self._arrival(limit):
                break
        self.gathered += sum(1 for item in self._queue if item.session_id in waited_for)

    def _take(self) -> list[BatchItem]:
        """Up to max_batch waiting items, one per session (a session's second call waits)."""
        batch, rest, seen = [], [], set()
        for item in self._queue:
            if item.future.done():  # caller gone
                self._done(item, None)
                continue
            if len(batch) < self.max_batch and item.session_id not in seen:
                seen.add(item.session_id)
                batch.append(item)
            else:
                rest.append(item)
        self._queue = rest
        if len(rest) < self.max_batch:
            self._full.clear()
        return batch

    async def _run(self, batch: list[BatchItem]) -> None:
        self._in_call = {item.session_id for item in batch if not self.rider(item)}
        self._forgotten = set()
        try:
            ran, results, call_ms, alone_ms = await self.worker.run(self._forward, batch)
        except Exception as exc:  # noqa: BLE001 - delivered to every caller of the batch
            ran, results, call_ms, alone_ms = batch, [exc] * len(batch), 0.0, None
        finally:
            self._in_call = set()
        if len(ran) > 1 and alone_ms is None:
            self.batched_forwards += 1
            log.info("%s batch of %d sessions", self.what, len(ran))
        if ran and call_ms:
            self._call_s += 0.3 * (call_ms / 1000 - self._call_s) if self._call_s else call_ms / 1000
        answered = time.monotonic()
        for sid in [sid for sid, at in self._answered.items() if answered - at > 60.0]:
            self._unexpect(sid)  # gone without a release (nothing waits this long for it anyway)
        outcomes = {id(item): k for k, item in enumerate(ran)}
        for item in batch:
            if id(item) in outcomes and not self.rider(item) and item.session_id not in self._forgotten:
                self._answered[item.session_id] = answered
            k = outcomes.get(id(item))
            outcome = results[k] if k is not None else DeadlineExpiredError(
                f"deadline: expired before the {self.what} forward started")
            self._done(item, outcome if k is not None else None)
            if item.future.done():
                continue
            if isinstance(outcome, Exception):
                item.future.set_exception(outcome)
            elif alone_ms is None:
                item.future.set_result(self.answer(outcome, ran, call_ms))
            else:  # it ran by itself (no batch call, or the shared one failed): its own figures
                item.future.set_result(self.answer(outcome, [item], alone_ms[k]))

    def _forward(self, batch: list[BatchItem]) -> tuple[list[BatchItem], list, float, list[float] | None]:
        """On the worker thread: drop expired or abandoned items, then one runtime call. Returns (items
        run, outcomes, call ms, each item's ms when they ran one by one, else None)."""
        now = time.monotonic()
        # future.done() read from this thread: a stale False only means running an abandoned item.
        live = [item for item in batch if not item.future.done() and not item.expired(now)]
        if not live:
            return [], [], 0.0, None
        self.calls += 1
        started = time.perf_counter()
        results, alone_ms = self._call([(item.session_id, item.payload) for item in live])
        return live, results, (time.perf_counter() - started) * 1000, alone_ms

    def _call(self, pairs: list[tuple[str, Any]]) -> tuple[list, list[float] | None]:
        """(outcomes, None) after one shared call; (outcomes, each item's ms) when they ran alone."""
        if self.batch_call is not None:
            try:
                results = list(self.batch_call(pairs))
            except Exception as exc:  # noqa: BLE001 - the shared forward failed: retry each item alone
                if len(pairs) == 1:
                    return [exc], None
                log.warning("%s batch of %d sessions failed (%s: %s); running them one by one",
                            self.what, len(pairs), type(exc).__name__, exc)
                return self._each(lambda sid, payload: self._call([(sid, payload)])[0][0], pairs)
            if len(results) != len(pairs):
                error = RuntimeError(f"{self.what} batch returned {len(results)} results for {len(pairs)} items")
                return [error] * len(pairs), None
            return results, None
        if len(pairs) == 1:
            return [self._solo(*pairs[0])], None
        return self._each(self._solo, pairs)

    @staticmethod
    def _each(run, pairs) -> tuple[list, list[float]]:
        outcomes, times = [], []
        for session_id, payload in pairs:
            started = time.perf_counter()
            outcomes.append(run(session_id, payload))
            times.append((time.perf_counter() - started) * 1000)
        return outcomes, times

    def _solo(self, session_id: str, payload):
        try:
            return self.solo_call(session_id, payload)
        except Exception as exc:  # noqa: BLE001 - per-item outcome
            return exc
