"""Verify batching (DESIGN.md "Batching"): concurrent verifies of different sessions, one forward.

``specdec.batching.SessionBatcher`` with the target's calls: up to ``max_batch`` distinct sessions
waiting ``wait_ms`` go to one ``verify_batch`` (or ``verify`` in a loop where the runtime lacks it).
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
    """One item's outcome: its result, sessions sharing the call, the call's time (ms), and the rows it
    computed (packed: sum of nodes + 1; padded: B x Q)."""

    result: VerifyResult
    batch_size: int
    verify_ms: float
    batch_rows: int = 0


class VerifyBatcher(SessionBatcher):
    """Merges concurrent verifies into ``runtime.verify_batch`` calls. worker: the runtime's ModelWorker;
    max_batch, wait_ms, on_done(session_id, outcome), gather: as ``SessionBatcher``."""

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
        """Feed the next chunk of a session's prompt in the next verify forward (``PrefillChunk``). Raises
        the runtime's error (SessionStateError, UnknownSessionError, ...) or DeadlineExpiredError."""
        await self.submit(session_id, PrefillChunk(tuple(tokens), still_open), deadline)

    async def verify(self, session_id: str, tree: DraftTree, deadline: float | None = None) -> BatchedVerify:
        """Verify one tree, merged with concurrent ones. Raises the item's runtime error or DeadlineExpiredError."""
        return await self.submit(session_id, tree, deadline)

    async def verify_many(self, items: Sequence[tuple[str, DraftTree]], deadline: float | None = None) -> list[BatchedVerify | Exception]:
        """Verify several sessions' trees (distinct sessions), queued together; per-item outcomes."""
        futures = self.enqueue(items, deadline)
        return list(await asyncio.gather(*futures, return_exceptions=True))
