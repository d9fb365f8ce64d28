"""Verify batching (DESIGN.md "Batching"): concurrent verifies of different sessions, one forward.

``specdec.batching.SessionBatcher`` with the target's calls: a verify waits up to ``wait_ms`` for
company; the first ``max_batch`` waiting items with distinct sessions then go to the runtime as one
``verify_batch(items)`` call on the model worker thread, and each caller gets its own result (or
exception) back, with the batch's size, rows and time (``BatchedVerify``). Deadlines and abandoned
callers as there. A runtime without ``verify_batch`` is served by ``verify`` in a loop (same
results, one forward each). Plain asyncio, no gRPC: tests drive it directly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Sequence

from specdec.batching import BatchItem, SessionBatcher
from specdec.interfaces import VerifyResult
from specdec.model_worker import ModelWorker
from specdec.tree import DraftTree
from target_service.runtime import PrefillChunk


@dataclass(frozen=True)
class BatchedVerify:
    """One item's outcome: its result, how many sessions shared the call, the call's time (ms), and
    the rows the call computed over all its sessions (what its latency depends on): packed, the
    sum of every session's nodes + 1; padded, B x Q, each session's row padded to the largest
    tree's nodes + 1 (one session: its tree's nodes + 1)."""

    result: VerifyResult
    batch_size: int
    verify_ms: float
    batch_rows: int = 0


class VerifyBatcher(SessionBatcher):
    """Merges concurrent verifies into ``runtime.verify_batch`` calls (``SessionBatcher``).

    runtime: has ``verify(session_id, tree)`` and optionally ``verify_batch(items)`` (returning one
    VerifyResult or Exception per item); worker: the runtime's ModelWorker; max_batch, wait_ms,
    on_done(session_id, outcome), gather: as ``SessionBatcher`` (on_done: the owner's bookkeeping of
    sessions with a verify in flight or pending; gather: waiting for sessions expected back).
    """

    def __init__(self, runtime, worker: ModelWorker, max_batch: int = 8, wait_ms: float = 2.0,
                 on_done: Callable[[str, VerifyResult | Exception | None], None] | None = None, gather: float = 0.0):
        super().__init__(worker, getattr(runtime, "verify_batch", None), lambda sid, tree: runtime.verify(sid, tree),
                         max_batch, wait_ms, on_done, what="verify", gather=gather)
        self.runtime = runtime

    def answer(self, outcome: VerifyResult, ran: list[BatchItem], call_ms: float) -> BatchedVerify:
        sizes = [item.payload.size + 1 for item in ran]
        rows = sum(sizes) if getattr(self.runtime, "packed", False) else len(ran) * max(sizes)
        return BatchedVerify(outcome, len(ran), call_ms, rows)

    def reports(self, item: BatchItem) -> bool:
        """A prefill chunk is not a verify: the owner's verify bookkeeping does not hear of it."""
        return not isinstance(item.payload, PrefillChunk)

    def rider(self, item: BatchItem) -> bool:
        """A prefill chunk rides in the decoding sessions' next verify forward."""
        return isinstance(item.payload, PrefillChunk)

    async def prefill_chunk(self, session_id: str, tokens: Sequence[int], deadline: float | None = None,
                            still_open: Callable[[], bool] | None = None) -> None:
        """Feed the next chunk of a session's prompt in the next verify forward (chunked prefill
        mixed with the other sessions' verifies; the runtime must take ``PrefillChunk`` items).
        still_open: ``PrefillChunk.still_open`` (False right before the forward = the chunk is not
        fed). Raises the runtime's error (SessionStateError past the prefill, UnknownSessionError
        once released, ...) or DeadlineExpiredError."""
        await self.submit(session_id, PrefillChunk(tuple(tokens), still_open), deadline)

    async def verify(self, session_id: str, tree: DraftTree, deadline: float | None = None) -> BatchedVerify:
        """Verify one tree, merged with concurrent ones. Raises the item's exception from the
        runtime (UnknownSessionError, SessionStateError, ...) or DeadlineExpiredError."""
        return await self.submit(session_id, tree, deadline)

    async def verify_many(self, items: Sequence[tuple[str, DraftTree]], deadline: float | None = None) -> list[BatchedVerify | Exception]:
        """Verify several sessions' trees (distinct sessions), queued together; per-item outcomes."""
        futures = self.enqueue(items, deadline)
        return list(await asyncio.gather(*futures, return_exceptions=True))
