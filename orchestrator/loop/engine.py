"""Synchronous entry to the round loop for embedded mode and tests: each call drives an event loop."""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

from orchestrator.loop.controller import (GenerationRequest, GenerationResult, RoundController, gather_or_cancel,
                                          sync_worker)
from specdec.config import DraftWindowConfig
from specdec.interfaces import DraftWorker, TargetWorker


class SpeculativeEngine:
    """RoundController over in-process (sync) workers; arguments as RoundController's."""

    def __init__(self, target: TargetWorker, draft: DraftWorker | None, eos_token_ids, context_limit: int,
                 decode=None, control_factory=None, draft_context_limit: int | None = None,
                 pipeline: bool | str = False, draft_window: DraftWindowConfig | None = None,
                 ahead_candidates: int = 1):
        self.target = target
        self.draft = draft
        self.controller = RoundController(sync_worker(target), sync_worker(draft) if draft is not None else None,
                                          eos_token_ids, context_limit, decode, control_factory=control_factory,
                                          draft_context_limit=draft_context_limit, pipeline=pipeline,
                                          draft_window=draft_window, ahead_candidates=ahead_candidates)

    @property
    def eos_token_ids(self):
        return self.controller.eos_token_ids

    @property
    def context_limit(self) -> int:
        return self.controller.context_limit

    def generate(self, request: GenerationRequest, on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Generate until a stop; ``on_tokens`` gets each round's committed tokens. Raises ValueError (naming the
        field) for an invalid request."""
        return self.generate_batch([request], [on_tokens])[0]

    def generate_batch(self, requests: Sequence[GenerationRequest],
                       on_tokens: Sequence[Callable[[list[int]], None] | None] | None = None) -> list[GenerationResult]:
        """Run requests side by side, one round of each in turn, each with its solo run's tokens. on_tokens: one per
        request. Raises ValueError before anything runs if any is invalid."""
        for request in requests:
            self.controller.check(request)
        callbacks = list(on_tokens) if on_tokens is not None else [None] * len(requests)

        async def run_all():
            return await gather_or_cancel([asyncio.ensure_future(self.controller.generate(r, cb))
                                           for r, cb in zip(requests, callbacks, strict=True)])

        return asyncio.run(run_all())
