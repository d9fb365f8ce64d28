"""Ray actors of the orchestrator: each an async actor running many requests concurrently.

The front's RayBackend (orchestrator.serving.backends) starts or attaches to Ray, creates ``front.workers``
actors and sends each request to the least-loaded one. ``OrchestratorActor.stream`` is an async generator: Ray
streams each round's tokens back as it lands (``num_returns="streaming"``); cancelling the
stream (client gone) or ``abort`` cancels the request's task in the actor, which releases its KV on
both services. Round and control logic stay in plain classes (controller, control); the actor is only
the process boundary.
"""

from __future__ import annotations

import logging
import os

import ray

from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.service import build_orchestrator
from specdec.config import ServeConfig
from specdec.telemetry import setup_tracing

log = logging.getLogger(__name__)

OTEL_PREFIXES = ("OTEL_",)
ACTOR_EXPORT_DELAY_MS = 200  # an actor's spans reach the collector within about this


def actor_env() -> dict[str, str]:
    """The OTEL_* variables of this process, for the actors' runtime_env (traces go where ours go)."""
    return {k: v for k, v in os.environ.items() if k.startswith(OTEL_PREFIXES)}


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class OrchestratorActor:
    """Hosts an orchestrator.loop.service.Orchestrator (gRPC clients + round controller)."""

    def __init__(self, config_json: str, tokenizer_dir: str | None):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # batched on the SDK's thread, exported every 200 ms: exporting each span as it ends (a
        # blocking OTLP call on this event loop) held up every request's rounds, so concurrent
        # requests drifted apart and their verifies stopped merging at the target
        setup_tracing("specdec-orchestrator",  # OTEL_BSP_SCHEDULE_DELAY, when set, wins
                      export_delay_ms=None if "OTEL_BSP_SCHEDULE_DELAY" in os.environ else ACTOR_EXPORT_DELAY_MS)
        self.config = ServeConfig.model_validate_json(config_json)
        self.orchestrator = build_orchestrator(self.config, tokenizer_dir)

    async def ready(self) -> int:
        """Connect to the services; returns the target's vocabulary size."""
        if self.orchestrator.controller is None:
            await self.orchestrator.connect()
        return self.orchestrator.info.vocab_size

    async def load(self) -> int:
        return self.orchestrator.active()

    async def stream(self, request: GenerationRequest, request_id: str, timeout_s: float | None, carrier: dict):
        """Yields (tokens, RoundRecord | None, GenerationStats | None) per round, then the final stats."""
        if self.orchestrator.controller is None:  # a restarted actor connects on its first request
            await self.orchestrator.connect()
        async for chunk in self.orchestrator.stream(request, request_id, timeout_s, carrier):
            yield chunk.tokens, chunk.round, chunk.stats

    async def abort(self, request_id: str) -> bool:
        return await self.orchestrator.abort(request_id)

    async def cost(self) -> dict | None:
        """The cost-aware control's cost model now (``CostModel.snapshot``: its figures and where they
        started from), None without that control."""
        state = getattr(self.orchestrator.control_factory, "shared", None)
        return state.cost.snapshot() if state is not None else None
