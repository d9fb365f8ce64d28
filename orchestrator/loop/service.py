"""The orchestrator proper: requests over the draft and target services, one asyncio task each, in-process
(``front.use_ray: false``) or inside Ray actors, both wired by ``build_orchestrator``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from opentelemetry import propagate, trace
from transformers import AutoTokenizer

from orchestrator.loop.clients import DraftClient, TargetClient, channel_options, request_deadline
from orchestrator.planning.control import FixedControl
from orchestrator.planning.cost_aware import CostAwareFactory, SharedState
from orchestrator.planning.cost_model import CostModel, measure_service_costs
from orchestrator.loop.controller import GenerationRequest, GenerationResult, RoundController
from specdec.config import FrontConfig, GrpcConfig, ModelsConfig
from specdec.models import DEFAULT_TARGET, resolve_model_dir
from specdec.placement import Placement, shares_compute
from specdec.security import aio_channel
from specdec.stats import GenerationStats, RoundRecord
from specdec.tree_spec import MAX_TREE_NODES

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("specdec.orchestrator")


@dataclass
class Chunk:
    """One message of a request's stream: tokens committed by a round, or the end (stats set)."""

    tokens: list[int]
    stats: GenerationStats | None = None
    round: RoundRecord | None = None  # the round's record (controller on_round)


class Orchestrator:
    """Runs generation requests over a draft service and a target service. decode: ids -> text (None = stop
    strings refused); control_factory: (TreeSpec, max_nodes) -> Control (None = fixed TreeSpec); may_measure: False
    = never time the services at connect (a Ray actor given its probe's figures)."""

    def __init__(self, front, grpc_cfg, decode=None, control_factory=None, on_round=None, may_measure: bool = True):
        self.front = front
        self.may_measure = may_measure
        self.grpc_cfg = grpc_cfg
        self.decode = decode
        self.control_factory = control_factory
        # the cost-aware controls' front-wide state (None: another control, which learns nothing together)
        self.shared: SharedState | None = control_factory.shared if isinstance(control_factory, CostAwareFactory) else None
        self.on_round = on_round
        self.controller: RoundController | None = None
        self.tasks: dict[str, asyncio.Task] = {}
        self.stopping: set[str] = set()  # requests being aborted or cancelled (``_stop``)
        self.info = None
        self.links: tuple[DraftClient | None, TargetClient | None] = (None, None)  # (draft, target); set by connect

    async def connect(self, timeout: float = 60.0) -> None:
        """Open the channels, read the target's Info; for the cost-aware control, time the services (timeout: s)."""
        options = channel_options(self.grpc_cfg.max_message_bytes)
        self.target_channel = aio_channel(self.front.target_address, self.grpc_cfg, options)  # TLS / mTLS when configured
        self.draft_channel = aio_channel(self.front.draft_address, self.grpc_cfg, options)
        target = TargetClient(self.target_channel)
        self.info = await target.info(timeout=timeout)
        max_nodes = self.info.max_tree_nodes or 512
        draft = DraftClient(self.draft_channel, self.info.vocab_size, max_nodes) if self.front.speculate else None
        factory = self.control_factory
        if factory is not None:
            factory = functools.partial(factory, max_nodes=max_nodes)
        shared = await self._shared_compute(draft) if draft is not None else False
        if draft is not None and self.shared is not None:
            self.shared.shared_compute = shared
            await self._measure_costs(target, draft)
        window = self.front.draft_window if self.front.draft_window.applies(shared) else None
        self.links = (draft, target)
        self.controller = RoundController(target, draft, list(self.info.eos_token_ids), self.info.context_limit,
                                          self.decode, control_factory=factory, on_round=self.on_round,
                                          draft_deadline_s=self.front.fallback.draft_deadline_ms / 1000,
                                          pipeline=self.front.pipeline, draft_window=window,
                                          ahead_candidates=self.front.ahead_candidates)

    async def _measure_costs(self, target: TargetClient, draft: DraftClient) -> None:
        """Measure V(n) and D(p) through the services instead of priors (``measure_at_start``); failed: priors."""
        state = self.shared
        if state.cost.source != "prior" or not (self.may_measure and self.front.cost_aware.measure_at_start):
            return
        try:
            cost = await measure_service_costs(target, draft, self.info.vocab_size,
                                               context_limit=self.info.context_limit or None,
                                               max_rows=self.info.max_tree_nodes + 1 if self.info.max_tree_nodes else None)
        except Exception as exc:  # noqa: BLE001 - optional: whatever failed, the front starts from the priors
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            log.warning("cost model: measuring through the services failed (%s: %s); starting from the prior "
                        "figures", code, exc)
            return
        state.cost = cost
        figures = cost.snapshot()
        log.info("cost model measured through the services: V(n) %s ms, D(p) %s ms",
                 figures["verify_ms"], figures["draft_step_ms"])

    async def _shared_compute(self, draft: DraftClient) -> bool:
        """Whether the draft computes on the target's hardware ("auto": from the two Info placements)."""
        setting = self.front.cost_aware.shared_compute
        if setting != "auto":
            return bool(setting)
        try:
            info = await draft.info()
        except grpc.aio.AioRpcError as exc:
            log.warning("draft Info failed (%s): taking the draft as on its own hardware", exc.code())
            return False
        shared = shares_compute(Placement(info.host, info.device, tuple(info.cpus)),
                                Placement(self.info.host, self.info.device, tuple(self.info.cpus)))
        log.info("draft on %s %s cpus %s, target on %s %s cpus %s: %s compute", info.host, info.device, list(info.cpus),
                 self.info.host, self.info.device, list(self.info.cpus), "shared" if shared else "separate")
        return shared

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.target_channel.close()
        await self.draft_channel.close()

    async def stream(self, request: GenerationRequest, request_id: str, timeout_s: float | None = None,
                     carrier: dict | None = None) -> AsyncIterator[Chunk]:
        """Run one request; yields a Chunk per round, then a final Chunk with stats. timeout_s: the client's time left;
        carrier: W3C trace context. Raises ValueError (naming the field) and the target's grpc errors. Closing early
        cancels the request and frees its KV; ``abort``: stop reason "aborted"."""
        if request_id in self.tasks:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.controller.check(request)
        queue: asyncio.Queue = asyncio.Queue()
        partial = GenerationStats()  # what the rounds streamed so far reported (for an aborted request)
        started = time.perf_counter()
        task = asyncio.create_task(self._run(request, request_id, timeout_s, carrier, self._round_sink(request_id, queue)))
        task.add_done_callback(lambda _: queue.put_nowait(None))  # the end, after every round it queued
        self.tasks[request_id] = task
        try:
            while (record := await queue.get()) is not None:
                partial.add(record, time.perf_counter() - started)
                yield Chunk(list(record.tokens), round=record)
            if task.cancelled():
                partial.stop_reason = "aborted"
                partial.total_s = time.perf_counter() - started
                yield Chunk([], self._with_links(partial))
            else:
                yield Chunk([], self._with_links(task.result().stats))
        finally:
            if not task.done():
                await self._stop(request_id, task)
            self.tasks.pop(request_id, None)

    def _with_links(self, stats: GenerationStats) -> GenerationStats:
        """``stats`` with the service links' round trips measured so far (ms; None: no draft or no sample yet)."""
        def ms(worker) -> float | None:
            rtt = None if worker is None else worker.link_rtt_s
            return None if rtt is None else rtt * 1000
        stats.draft_link_rtt_ms, stats.target_link_rtt_ms = map(ms, self.links)
        return stats

    def _round_sink(self, request_id: str, queue: asyncio.Queue):
        """The request's on_round: queue the record; a request being stopped ends at this round (Python 3.11's
        ``asyncio.wait_for`` can swallow a cancel that arrives as its call completes, gh-86296)."""
        def on_round(record) -> None:
            queue.put_nowait(record)
            if request_id in self.stopping:
                raise asyncio.CancelledError(f"request {request_id!r} stopped")
        return on_round

    async def _stop(self, request_id: str, task: asyncio.Task) -> None:
        """Cancel the request's task and wait for its end; a swallowed cancel ends it after this round."""
        self.stopping.add(request_id)
        try:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            self.stopping.discard(request_id)

    async def _run(self, request: GenerationRequest, request_id: str, timeout_s: float | None,
                   carrier: dict | None, on_round) -> GenerationResult:
        """The request's task: deadline and trace context of the caller, one ``generate`` span."""
        ctx = propagate.extract(carrier or {})
        if timeout_s is not None:
            request_deadline.set(time.monotonic() + timeout_s)
        with _tracer.start_as_current_span("generate", context=ctx, attributes={
                "request.id": request_id, "prompt.tokens": len(request.prompt_ids),
                "max_new_tokens": request.max_new_tokens}) as span:
            # service-side session ids are unique per run, whatever ids clients choose
            session_id = f"{request_id}/{uuid.uuid4().hex[:8]}"
            result = await self.controller.generate(request, session_id=session_id, on_round=on_round)
            stats = result.stats
            span.set_attributes({"new_tokens": stats.new_tokens, "acceptance_rate": stats.acceptance_rate})
            return result

    def cost_snapshot(self) -> dict | None:  # the cost-aware control's CostModel.snapshot (None: another control)
        return None if self.shared is None else self.shared.cost.snapshot()

    async def abort(self, request_id: str) -> bool:
        """Cancel a running request (its KV is freed on both services). False if unknown."""
        task = self.tasks.get(request_id)
        if task is None or task.done():
            return False
        await self._stop(request_id, task)
        return True


def tokenizer_dir(front: FrontConfig, models: ModelsConfig) -> str:
    """Where the front's tokenizer comes from: front.tokenizer, else models.target, else the default target."""
    return front.tokenizer or str(resolve_model_dir(models.target, DEFAULT_TARGET, "models.target"))


def load_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True)
class StartCosts:
    """A Ray front's measured costs for its actors (verify ms by rows, draft step ms by parents; None: not measured);
    an actor given StartCosts never measures itself."""

    verify_ms: dict[int, float] | None = None
    draft_step_ms: dict[int, float] | None = None

    @classmethod
    def of(cls, cost: CostModel) -> "StartCosts":
        """A probe's cost model as its actors' start: its points where it measured, else none."""
        return cls(dict(cost.verify.points), dict(cost.draft_step.points)) if cost.source == "measured" else cls()


def control_factory(front: FrontConfig, start: StartCosts | None = None):
    """(TreeSpec, max_nodes) -> Control: CostAwareControl when enabled (one SharedState, its costs from ``start``,
    else ``cost_aware.verify_ms``, else priors), else FixedControl."""
    if front.cost_aware.enabled:
        aware = front.cost_aware
        shared = SharedState()
        verify_ms, draft_ms = ((start.verify_ms, start.draft_step_ms) if start is not None and start.verify_ms
                               else (aware.verify_ms, aware.draft_step_ms))
        if verify_ms:
            shared.cost = CostModel(verify_ms, draft_ms, source="configured")
        return CostAwareFactory(aware, front.fallback, shared)
    return lambda spec, max_nodes=MAX_TREE_NODES: FixedControl(spec, front.fallback)


def build_orchestrator(front: FrontConfig, grpc_cfg: GrpcConfig, tok_dir: str | None,
                       start: StartCosts | None = None) -> Orchestrator:
    """An Orchestrator for these sections; ``start``: a Ray front's starting costs."""
    tokenizer = load_tokenizer(tok_dir) if tok_dir else None
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer is not None else None
    return Orchestrator(front, grpc_cfg, decode, control_factory=control_factory(front, start),
                        may_measure=start is None)
