"""Fail-over of a request whose orchestrator actor died (docs/serving.md "Ray and fail-over"). Example: prompt
[5, 6, 7], max_new_tokens 10, [1, 2, 3, 4] streamed: the continuation is prompt [5, 6, 7, 1, 2, 3, 4] with
resumed_tokens 4 (its stop checker sees them) and max_new_tokens 6.
"""

from __future__ import annotations

import dataclasses
import time

from orchestrator.loop.controller import GenerationRequest
from specdec.sampling import derive_seed
from specdec.stats import GenerationStats, RoundRecord


class Resumption:
    """One request's progress as streamed to the client, across actors. timeout_s: its deadline, s from now."""

    def __init__(self, request: GenerationRequest, timeout_s: float | None, max_failovers: int):
        self.request = request
        self.timeout_s = timeout_s
        self.max_failovers = max_failovers
        self.started = time.monotonic()
        self.streamed: list[int] = []  # tokens yielded to the client, all parts
        self.seen = GenerationStats()  # the streamed rounds of all parts
        self.stop_reason: str | None = None  # set by the round that ended the request
        self.failovers = 0

    def record(self, tokens: list[int], record: RoundRecord | None) -> None:  # one chunk streamed to the client
        self.streamed.extend(tokens)
        if record is not None:
            self.seen.add(record, time.monotonic() - self.started)
            self.stop_reason = record.stop_reason

    @property
    def ended(self) -> bool:  # a streamed round ended the request (only its stats were still to come)
        return self.stop_reason is not None

    def fail_over(self) -> bool:
        """Count one move to another actor; False when the request has used up its fail-overs."""
        if self.failovers >= self.max_failovers:
            return False
        self.failovers += 1
        return True

    def time_left_s(self) -> float | None:  # <= 0: past the deadline; None: no deadline
        return None if self.timeout_s is None else self.timeout_s - (time.monotonic() - self.started)

    def next_part(self) -> GenerationRequest:
        """The request for the next actor: the original while nothing was streamed, else its continuation. Only
        for a request not ended, so prompt + streamed fits the context and max_new_tokens stays >= 1."""
        if not self.streamed:
            return self.request
        n = len(self.streamed)
        sampling = dataclasses.replace(self.request.sampling, prompt_logprobs=None)  # the client has the prompt's
        if sampling.seed is not None:  # a fresh stream: the dead actor's draws cannot be replayed
            sampling = dataclasses.replace(sampling, seed=derive_seed(sampling.seed, f"resume/{n}"))
        return dataclasses.replace(self.request, prompt_ids=[*self.request.prompt_ids, *self.streamed],
                                   max_new_tokens=self.request.max_new_tokens - n, sampling=sampling,
                                   min_tokens=max(self.request.min_tokens - n, 0),
                                   resumed_tokens=self.request.resumed_tokens + n)

    def final(self, stats: GenerationStats | None) -> GenerationStats:
        """The whole request's statistics; stats: the last part's (None = its actor died before sending them).
        After a fail-over: every streamed round's counters, the last stop reason, total_s from the first start."""
        if stats is not None and self.failovers == 0:
            return stats
        total = dataclasses.replace(self.seen, failovers=self.failovers, new_tokens=len(self.streamed),
                                    total_s=time.monotonic() - self.started)
        total.stop_reason = stats.stop_reason if stats is not None else self.stop_reason
        if stats is not None:  # the link round trips the last part measured
            total.draft_link_rtt_ms, total.target_link_rtt_ms = stats.draft_link_rtt_ms, stats.target_link_rtt_ms
        return total
