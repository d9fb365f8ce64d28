"""Verify batching (DESIGN.md "Batching"): concurrent verifies of different sessions, one forward.

A verify waits up to ``wait_ms`` for company; the first ``max_batch`` waiting items with distinct
sessions then go to the runtime as one ``verify_batch(items)`` call on the model worker thread, and
each caller gets its own result (or exception) back. While that forward runs, new verifies queue for
the next batch. Example with wait_ms = 2, max_batch = 8: sessions a, b, c call at t = 0.0, 0.5 and
1.2 ms -> one call ``verify_batch([(a, ta), (b, tb), (c, tc)])`` at t = 2.0 ms, batch size 3.

Deadlines: an item whose deadline (time.monotonic()) has passed when its forward is about to start,
or whose caller has gone (cancelled), is left out of the forward and never touches its session.
A runtime without ``verify_batch`` is served by ``verify`` in a loop (same results, one forward each).
Plain asyncio, no gRPC: tests drive it directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specdec.interfaces import VerifyResult
from specdec.model_worker import ModelWorker
from specdec.service_errors import DeadlineExpiredError
from specdec.tree import DraftTree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchedVerify:
    """One item's outcome: its result, how many sessions shared the call, the call's time (ms), and
    the call's rows over all its sessions (each tree's nodes + 1: what its latency depends on)."""

    result: VerifyResult
    batch_size: int
    verify_ms: float
    batch_rows: int = 0


@dataclass
class _Item:
    session_id: str
    tree: DraftTree
    deadline: float | None  # time.monotonic(); None = none
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class VerifyBatcher:
    """Merges concurrent verifies into ``runtime.verify_batch`` calls.

    runtime: has ``verify(session_id, tree)`` and optionally ``verify_batch(items)`` (returning one
    VerifyResult or Exception per item); worker: the runtime's ModelWorker (the forward runs there,
    in order with the runtime's other calls); max_batch: sessions per call (>= 1); wait_ms: how long
    the first waiting item waits for company (>= 0); on_done(session_id, outcome): called on the
    event loop exactly once for every queued item, even when its caller has gone, with the
    VerifyResult, the exception, or None when the item was dropped unrun (caller cancelled): the
    owner's bookkeeping of sessions with a verify in flight or pending.
    """

    def __init__(self, runtime, worker: ModelWorker, max_batch: int = 8, wait_ms: float = 2.0,
                 on_done: Callable[[str, VerifyResult | Exception | None], None] | None = None):
        if max_batch < 1 or wait_ms < 0:
            raise ValueError(f"max_batch / wait_ms: need >= 1 / >= 0, got {max_batch} / {wait_ms}")
        self.runtime = runtime
        self.worker = worker
        self.max_batch = max_batch
        self.wait_s = wait_ms / 1000
        self.on_done = on_done or (lambda session_id, outcome: None)
        self.batched_forwards = 0  # calls that verified more than one session
        self.calls = 0  # runtime calls made (any size)
        self._queue: list[_Item] = []
        self._full = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def verify(self, session_id: str, tree: DraftTree, deadline: float | None = None) -> BatchedVerify:
        """Verify one tree, merged with concurrent ones. Raises the item's exception from the
        runtime (UnknownSessionError, SessionStateError, ...) or DeadlineExpiredError."""
        (future,) = self._enqueue([(session_id, tree)], deadline)
        return await future

    async def verify_many(self, items: Sequence[tuple[str, DraftTree]], deadline: float | None = None) -> list[BatchedVerify | Exception]:
        """Verify several sessions' trees (distinct sessions), queued together; per-item outcomes."""
        futures = self._enqueue(items, deadline)
        return list(await asyncio.gather(*futures, return_exceptions=True))

    def _enqueue(self, items, deadline) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        futures = []
        for session_id, tree in items:
            future = loop.create_future()
            self._queue.append(_Item(session_id, tree, deadline, future))
            futures.append(future)
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
            batch = self._take()
            if batch:
                await self._run(batch)

    def _take(self) -> list[_Item]:
        """Up to max_batch waiting items, one per session (a session's second verify waits)."""
        batch, rest, seen = [], [], set()
        for item in self._queue:
            if item.future.done():  # caller gone
                self.on_done(item.session_id, None)
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

    async def _run(self, batch: list[_Item]) -> None:
        try:
            ran, results, verify_ms = await self.worker.run(self._forward, batch)
        except Exception as exc:  # noqa: BLE001 - delivered to every caller of the batch
            ran, results, verify_ms = batch, [exc] * len(batch), 0.0
        if len(ran) > 1:
            self.batched_forwards += 1
            log.info("verify batch of %d sessions", len(ran))
        outcomes = dict(zip(map(id, ran), results))
        rows = sum(item.tree.size + 1 for item in ran)
        for item in batch:
            outcome = outcomes.get(id(item), DeadlineExpiredError("deadline: expired before the verify forward started"))
            self.on_done(item.session_id, outcome if id(item) in outcomes else None)
            if item.future.done():
                continue
            if isinstance(outcome, Exception):
                item.future.set_exception(outcome)
            else:
                item.future.set_result(BatchedVerify(outcome, len(ran), verify_ms, rows))

    def _forward(self, batch: list[_Item]) -> tuple[list[_Item], list, float]:
        """On the worker thread: drop expired or abandoned items, then one runtime call.

        Returns (items that ran, their outcomes, the call's time in ms).
        """
        now = time.monotonic()
        # future.done() read from this thread: a stale False only means running an abandoned item.
        live = [item for item in batch if not item.future.done() and not item.expired(now)]
        if not live:
            return [], [], 0.0
        self.calls += 1
        started = time.perf_counter()
        results = self._call([(item.session_id, item.tree) for item in live])
        return live, results, (time.perf_counter() - started) * 1000

    def _call(self, pairs: list[tuple[str, DraftTree]]) -> list:
        verify_batch = getattr(self.runtime, "verify_batch", None)
        if verify_batch is None:
            return [self._solo(session_id, tree) for session_id, tree in pairs]
        try:
            results = list(verify_batch(pairs))
        except Exception as exc:  # noqa: BLE001 - the shared forward failed: retry each item alone
            if len(pairs) == 1:
                return [exc]
            log.warning("verify batch of %d sessions failed (%s: %s); verifying them one by one",
                        len(pairs), type(exc).__name__, exc)
            return [self._call([pair])[0] for pair in pairs]
        if len(results) != len(pairs):
            error = RuntimeError(f"verify_batch returned {len(results)} results for {len(pairs)} items")
            return [error] * len(pairs)
        return results

    def _solo(self, session_id: str, tree: DraftTree):
        try:
            return self.runtime.verify(session_id, tree)
        except Exception as exc:  # noqa: BLE001 - per-item outcome
            return exc
