"""Every front request's one path (gRPC and HTTP): validate a GenerateCall, admit it, stream it from the backend
as StreamEvents, feed each round to the metrics and the acceptance monitor."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
import uuid
from typing import AsyncIterator, Sequence

from opentelemetry import propagate

from orchestrator.loop.controller import GenerationRequest
from orchestrator.serving.admission import Admission, Ticket, client_key
from orchestrator.serving.backends import Backend
from orchestrator.serving.requests import GenerateCall, RequestIdInUse, StreamEvent, check_call, to_generation
from specdec.config import FrontConfig
from specdec.sampling import TokenLogprob
from specdec.stats import GenerationStats, RoundRecord


class TextDeltas:
    """Text deltas of a growing token list, held back while ending in an incomplete UTF-8 sequence (U+FFFD).
    Incremental (as vLLM's detokenizer): each decodes the new tokens with the previous delta's as context."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: the context of the next delta, already sent
        self.read = 0

    def push(self, tokens: list[int]) -> str:
        self.ids.extend(tokens)
        return self._delta(final=False)

    def final(self) -> str:
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        text = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


class RequestRunner:
    """Runs the front's requests on a backend. auth_tokens: accepted bearer tokens (empty = no auth)."""

    def __init__(self, front: FrontConfig, backend: Backend, tokenizer, metrics=None, monitor=None,
                 auth_tokens: Sequence[str] = ()):
        self.front = front
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.monitor = monitor
        self.auth_tokens = tuple(t.encode() for t in auth_tokens)
        self.admission = Admission(front.limits)
        # (client, request_id) -> the backend's id, for every open stream: ids are scoped per client
        self.running: dict[tuple[str, str], str] = {}
        self._ids = (f"{uuid.uuid4().hex[:8]}{n:x}" for n in itertools.count())

    def client_of(self, authorization: str, host: str) -> str:  # authorization: the header's value ("" = absent)
        return client_key(self.auth_tokens, authorization, host)

    async def run(self, call: GenerateCall) -> AsyncIterator[StreamEvent]:
        """Validate a call and run it: a StreamEvent per round with tokens, then the final one. Aborted while
        waiting for a slot: stop reason "aborted". Raises ValueError naming the field (before any event),
        RequestIdInUse, AdmissionRefused or UpstreamError. Closing early frees its KV and slot or queue place.
        Its deadline: the client's time left or ``front.limits.request_timeout_s``, whichever is shorter."""
        arrived = time.monotonic()  # the deadline left to the backend is what tokenizing and waiting did not use
        check_call(call, self.front)  # before anything costs: the bounds that need no tokenizer
        key = (call.client, call.request_id)
        if key in self.running:
            raise RequestIdInUse(f"request_id: {call.request_id!r} is already running")
        # it tokenizes: off the event loop (the tokenizer releases the GIL)
        req = await asyncio.to_thread(to_generation, call, self.tokenizer, self.front, self.backend.info)
        if key in self.running:  # taken while this one was tokenized
            raise RequestIdInUse(f"request_id: {call.request_id!r} is already running")
        request_id = f"{call.request_id}~{next(self._ids)}"  # unique across clients and fronts; "~" is no id's
        timeout_s = min((t for t in (call.timeout_s, self.front.limits.request_timeout_s) if t is not None),
                        default=None)
        carrier = call.carrier
        if carrier is None:
            carrier = {}
            propagate.inject(carrier)
        deltas = TextDeltas(self.tokenizer, call.skip_special_tokens)
        started = time.perf_counter()
        ticket = self.admission.enter(call.client, request_id)  # raises AdmissionRefused
        self.running[key] = request_id
        stream = self._admitted(ticket, req, request_id, timeout_s, arrived, carrier)
        if self.metrics is not None:  # request latency, TTFT, inter-token latency, running / waiting (queued too)
            stream = self.metrics.track_stream(stream)
        scoring = req.sampling.prompt_logprobs is not None
        try:
            async for tokens, record, stats in stream:
                if record is not None:
                    self._observe(request_id, record)
                prompt = ()  # the prompt's logprobs (first round), its first token's too: None (OpenAI's echo)
                if record is not None and scoring:
                    prompt, scoring = (TokenLogprob(req.prompt_ids[0], None), *record.prompt_logprobs), False
                if tokens or prompt:
                    yield StreamEvent(tokens, deltas.push(tokens), logprobs=record.logprobs if record else (),
                                      prompt_logprobs=prompt)
                if stats is not None:
                    yield StreamEvent([], deltas.final(), self._final_stats(stats, started), len(req.prompt_ids))
        finally:
            try:
                await stream.aclose()  # ended early: the backend's stream ends first (its KV freed), then the slot
            finally:  # a second cancel or an error while closing must not keep the slot or the id
                self.admission.leave(ticket)
                self.running.pop(key, None)
                if self.monitor is not None:
                    self.monitor.release(request_id)

    async def _admitted(self, ticket: Ticket, req: GenerationRequest, request_id: str, timeout_s: float | None,
                        arrived: float, carrier: dict):
        """The backend's stream once the request holds a slot (aborted while waiting: one "aborted" chunk)."""
        if not await ticket.granted:
            yield [], None, GenerationStats(stop_reason="aborted")
            return
        if timeout_s is not None:
            timeout_s = max(timeout_s - (time.monotonic() - arrived), 0.0)
        async with contextlib.aclosing(self.backend.stream(req, request_id, timeout_s, carrier)) as stream:
            async for chunk in stream:
                yield chunk

    def _final_stats(self, stats: GenerationStats, started: float) -> GenerationStats:
        """The request's statistics, its fail-overs and link round trips into the metrics; total_s set if unset."""
        if self.metrics is not None:
            self.metrics.failovers.inc(stats.failovers)
            self.metrics.observe_links(stats.draft_link_rtt_ms, stats.target_link_rtt_ms)
        if not stats.total_s:
            stats = dataclasses.replace(stats, total_s=time.perf_counter() - started)
        return stats

    def _observe(self, request_id: str, record: RoundRecord) -> None:
        if self.metrics is not None:
            self.metrics.observe_round(record)
            for phase, seconds in (("draft", record.draft_s), ("verify", record.verify_s), ("commit", record.commit_s)):
                if seconds is not None:
                    self.metrics.observe_phase(phase, seconds)
        if self.monitor is not None and record.proposed:
            self.monitor.record(request_id, record.proposed, record.accepted)

    async def abort(self, client: str, request_id: str) -> bool:
        """End ``client``'s request by id, waiting or running; whether it had one (others' are not touched)."""
        internal = self.running.get((client, request_id))
        if internal is None:
            return False
        return self.admission.abort(internal) or await self.backend.abort(internal)
