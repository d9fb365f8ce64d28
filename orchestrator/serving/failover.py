"""Fail-over of a request whose orchestrator actor died: what the front streamed, and how it goes on.

The front knows every token it has streamed to the client. When the actor running a request dies
(orchestrator.serving.backends.RayBackend), the request continues on another actor as a new
``GenerationRequest`` whose prompt is the original prompt + the streamed tokens (new target and
draft sessions prefilled with them), with what is left of max_new_tokens and of the deadline. The
client sees one unbroken stream:

- greedy output is unchanged (the target's greedy continuation of the same committed tokens);
- stop strings spanning the hand-over still stop where they would have: the continuation's
  ``resumed_tokens`` makes its stop checker see the streamed tokens as output (orchestrator.loop.stops);
- a sampled request cannot replay the dead actor's random stream: it continues from a fresh seed
  derived from the request's and the number of committed tokens, so its output still follows the
  target's law, but a seeded sampled request that fails over is not bit-identical to one that
  did not (with nothing streamed yet, the request is resent unchanged);
- the final statistics count the whole request (every part's rounds) and its fail-overs.

Worked example: prompt [5, 6, 7], max_new_tokens 10, 4 tokens [1, 2, 3, 4] streamed when the actor
died: the continuation is prompt [5, 6, 7, 1, 2, 3, 4] with resumed_tokens 4 and max_new_tokens 6.
"""

from __future__ import annotations

import dataclasses
import time

from orchestrator.loop.controller import GenerationRequest
from specdec.sampling import derive_seed
from specdec.stats import GenerationStats, RoundRecord


class Resumption:
    """One request's progress as streamed to the client, across the actors that ran its parts.

    request: the request as the client sent it; timeout_s: its deadline, seconds from now (None =
    none); max_failovers: how many times it may move to another actor. ``record`` each streamed
    chunk; ``next_part`` gives the request (and deadline) to send to the next actor; ``final`` the
    statistics the client gets.
    """

    def __init__(self, request: GenerationRequest, timeout_s: float | None, max_failovers: int):
        self.request = request
        self.timeout_s = timeout_s
        self.max_failovers = max_failovers
        self.started = time.monotonic()
        self.streamed: list[int] = []  # tokens yielded to the client, all parts
        self.seen = GenerationStats()  # the streamed rounds of all parts
        self.stop_reason: str | None = None  # set by the round that ended the request
        self.failovers = 0

    def record(self, tokens: list[int], record: RoundRecord | None) -> None:
        """Note one chunk streamed to the client (tokens: the round's committed ids)."""
        self.streamed.extend(tokens)
        if record is not None:
            self.seen.add(record, time.monotonic() - self.started)
            self.stop_reason = record.stop_reason

    @property
    def ended(self) -> bool:
        """True once a streamed round ended the request (only its stats were still to come)."""
        return self.stop_reason is not None

    def fail_over(self) -> bool:
        """Count one move to another actor; False when the request has used up its fail-overs."""
        if self.failovers >= self.max_failovers:
            return False
        self.failovers += 1
        return True

    def time_left_s(self) -> float | None:
        """Seconds left of the request's deadline (<= 0: past it; None: no deadline)."""
        if self.timeout_s is None:
            return None
        return self.timeout_s - (time.monotonic() - self.started)

    def next_part(self) -> GenerationRequest:
        """The request for the next actor: the original one while nothing was streamed, else its
        continuation from the streamed tokens (prompt + streamed, the rest of max_new_tokens, the
        same stop strings, tree, EOS rule; a sampling seed derived from the request's). Called only
        for a request that has not ended, so prompt + streamed fits the target's context (one that
        reached it ended with stop reason context_limit) and max_new_tokens stays >= 1."""
        if not self.streamed:
            return self.request
        n = len(self.streamed)
        sampling = self.request.sampling
        if sampling.seed is not None:  # a fresh stream: the dead actor's draws cannot be replayed
            sampling = dataclasses.replace(sampling, seed=derive_seed(sampling.seed, f"resume/{n}"))
        return dataclasses.replace(self.request, prompt_ids=[*self.request.prompt_ids, *self.streamed],
                                   max_new_tokens=self.request.max_new_tokens - n, sampling=sampling,
                                   resumed_tokens=self.request.resumed_tokens + n)

    def final(self, stats: GenerationStats | None) -> GenerationStats:
        """The statistics of the whole request. stats: the last part's (None = its actor died after
        the request's last round, before sending them). Without a fail-over they pass unchanged;
        otherwise the counters of every streamed round, the last part's stop reason and the
        fail-overs (total_s: from the first part's start)."""
        if stats is not None and self.failovers == 0:
            return stats
        total = dataclasses.replace(self.seen, failovers=self.failovers, new_tokens=len(self.streamed),
                                    total_s=time.monotonic() - self.started)
        total.stop_reason = stats.stop_reason if stats is not None else self.stop_reason
        return total
