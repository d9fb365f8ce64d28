"""The front on Ray: async orchestrator actors, each running many requests; each round's tokens stream back as they
land (``num_returns="streaming"``); cancelling the stream or ``abort`` cancels the request's task, freeing its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import grpc
import ray

from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.service import Orchestrator, StartCosts, build_orchestrator, control_factory
from orchestrator.serving.backends import Backend, UpstreamError
from orchestrator.serving.failover import Resumption
from specdec.config import FrontConfig, GrpcConfig
from specdec.stats import GenerationStats
from specdec.telemetry import setup_tracing

log = logging.getLogger(__name__)

ACTOR_EXPORT_DELAY_MS = 200  # an actor's spans reach the collector within about this


def actor_env() -> dict[str, str]:
    """The OTEL_* variables of this process, for the actors' runtime_env (traces go where ours go)."""
    return {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class OrchestratorActor:
    def __init__(self, front_json: str, grpc_json: str, tokenizer_dir: str | None, start: StartCosts | None):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        setup_tracing("specdec-orchestrator",  # OTEL_BSP_SCHEDULE_DELAY, when set, wins
                      export_delay_ms=None if "OTEL_BSP_SCHEDULE_DELAY" in os.environ else ACTOR_EXPORT_DELAY_MS)
        front, grpc_cfg = FrontConfig.model_validate_json(front_json), GrpcConfig.model_validate_json(grpc_json)
        self.orchestrator = build_orchestrator(front, grpc_cfg, tokenizer_dir, start)

    async def ready(self) -> int:
        """Connect to the services; returns the target's vocabulary size."""
        if self.orchestrator.controller is None:
            await self.orchestrator.connect()
        return self.orchestrator.info.vocab_size

    async def stream(self, request: GenerationRequest, request_id: str, timeout_s: float | None, carrier: dict):
        """Yields (tokens, RoundRecord | None, GenerationStats | None) per round, then the final stats."""
        await self.ready()  # a restarted actor connects on its first request
        async for chunk in self.orchestrator.stream(request, request_id, timeout_s, carrier):
            yield chunk.tokens, chunk.round, chunk.stats

    async def abort(self, request_id: str) -> bool:
        return await self.orchestrator.abort(request_id)

    async def cost(self) -> dict | None:
        return self.orchestrator.cost_snapshot()


def _log_ray_auth() -> None:
    """Say whether the Ray cluster authenticates its callers (``RAY_AUTH_MODE=token``)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
        enabled = is_token_auth_enabled()
    except ImportError:  # a Ray before token authentication
        enabled = False
    if enabled:
        log.info("ray: token authentication on")
    else:
        log.warning("ray: token authentication off (RAY_AUTH_MODE=%s): anyone who reaches the Ray ports can run code "
                    "on its nodes; set RAY_AUTH_MODE=token", os.environ.get("RAY_AUTH_MODE", "unset"))


class RayBackend(Backend):
    """Requests run in ``front.workers`` OrchestratorActors, least-loaded first, failing over when one dies, on a
    local Ray (``front.ray_address`` unset) or a cluster."""

    def __init__(self, front: FrontConfig, grpc_cfg: GrpcConfig, tok_dir: str | None):
        self.front, self.grpc_cfg, self.tok_dir = front, grpc_cfg, tok_dir
        self.actors = []
        self.inflight: dict[int, int] = {}
        self.owner: dict[str, object] = {}
        self.failed: dict[int, asyncio.Task] = {}  # actors that failed a request, until they answer again
        self.aborted: set[str] = set()  # requests aborted while between actors (failing over)
        self.info = None
        self.start_cost: dict | None = None  # the cost model the actors started from (the probe's snapshot)

    async def start(self) -> None:
        front = self.front
        if not ray.is_initialized():
            ray.init(address=front.ray_address, num_cpus=front.ray_num_cpus if front.ray_address is None else None,
                     include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
                     runtime_env={"env_vars": actor_env()} if actor_env() else None)
            _log_ray_auth()
        # one probe reads the target's limits and measures once for all actors (together they would disturb each other)
        probe = Orchestrator(front, self.grpc_cfg, control_factory=control_factory(front))
        await probe.connect()
        self.info = probe.info
        await probe.close()
        start = None
        if probe.shared is not None:  # the cost-aware control's cost model
            cost = probe.shared.cost
            if front.speculate and cost.source in ("measured", "prior"):
                start = StartCosts.of(cost)  # its figures, or no measuring where it failed
            self.start_cost = cost.snapshot()
        front_json, grpc_json = front.model_dump_json(by_alias=True), self.grpc_cfg.model_dump_json()
        self.actors = [OrchestratorActor.remote(front_json, grpc_json, self.tok_dir, start) for _ in range(front.workers)]
        self.inflight = {i: 0 for i in range(len(self.actors))}
        await asyncio.gather(*[actor.ready.remote() for actor in self.actors])

    def cost(self) -> dict | None:  # the cost model the actors started from (each then learns its own)
        return self.start_cost

    PROBE_INTERVAL_S = 0.5  # a failed actor is asked for ``ready`` this often until it answers (Ray restarts it)
    RECOVERY_WAIT_S = 30.0  # with every actor failed, a request waits this long at most for one to answer

    async def _pick(self, time_left_s: float | None, request_id: str | None = None) -> int:
        """The least-loaded healthy actor; while every actor is failed, wait for one (at most RECOVERY_WAIT_S and
        time_left_s; an abort ends the wait), then take the least-loaded of all."""
        wait_s = self.RECOVERY_WAIT_S if time_left_s is None else min(self.RECOVERY_WAIT_S, time_left_s)
        until = time.monotonic() + wait_s
        while len(self.failed) == len(self.actors) and time.monotonic() < until and request_id not in self.aborted:
            await asyncio.sleep(0.05)
        healthy = [i for i in self.inflight if i not in self.failed] or list(self.inflight)
        return min(healthy, key=self.inflight.get)

    async def _until_ready(self, index: int) -> None:
        try:
            while True:
                try:
                    await self.actors[index].ready.remote()
                    return
                except ray.exceptions.RayActorError:  # still dead or restarting
                    await asyncio.sleep(self.PROBE_INTERVAL_S)
                except Exception:  # noqa: BLE001 - it answered, with an error of its own (a request will tell it)
                    return
        finally:
            self.failed.pop(index, None)

    async def stream(self, request: GenerationRequest, request_id: str, timeout_s, carrier):
        """Run on an actor, failing over to another from the tokens already streamed (docs/serving.md). At most
        ``len(actors)`` fail-overs, then UpstreamError UNAVAILABLE; past the deadline, DEADLINE_EXCEEDED."""
        progress = Resumption(request, timeout_s, max_failovers=len(self.actors))
        self.owner[request_id] = None  # between actors: ``abort`` marks it for the next part to end it
        try:
            while True:
                index = await self._pick(progress.time_left_s(), request_id)
                if request_id in self.aborted:  # aborted between actors (also while _pick waited)
                    yield [], None, progress.final(GenerationStats(stop_reason="aborted"))
                    return
                try:
                    async with contextlib.aclosing(self._part(index, progress, request_id, carrier)) as part:
                        async for tokens, record, stats in part:  # closed at once when the client goes
                            progress.record(tokens, record)
                            yield tokens, record, None if stats is None else progress.final(stats)
                            if stats is not None:  # the final chunk is out: an actor dying now changes nothing
                                return
                    return
                except ray.exceptions.RayActorError as exc:  # ActorUnavailableError included
                    if index not in self.failed:  # skipped by _pick until it answers ``ready`` again
                        self.failed[index] = asyncio.ensure_future(self._until_ready(index))
                    if progress.ended:  # died after the last round, before its stats: nothing to continue
                        log.warning("request %s: orchestrator actor %d died after the request's last round (%s)",
                                    request_id, index, type(exc).__name__)
                        yield [], None, progress.final(None)
                        return
                    if not progress.fail_over():
                        raise UpstreamError("UNAVAILABLE", f"orchestrator actor died: {exc}") from None
                    log.warning("request %s: orchestrator actor %d failed after %d streamed tokens (%s); continuing "
                                "on another actor (fail-over %d of %d)", request_id, index, len(progress.streamed),
                                type(exc).__name__, progress.failovers, progress.max_failovers)
        finally:
            self.owner.pop(request_id, None)
            self.aborted.discard(request_id)

    async def _part(self, index: int, progress: Resumption, request_id: str, carrier):
        """One part of a request on actor ``index``: (tokens, record, stats) chunks. Raises RayActorError when the
        actor dies, UpstreamError or ValueError for a failed request (DEADLINE_EXCEEDED when no time is left)."""
        time_left_s = progress.time_left_s()
        if time_left_s is not None and time_left_s <= 0:
            raise UpstreamError("DEADLINE_EXCEEDED", f"deadline of {progress.timeout_s} s passed before a fail-over")
        actor = self.actors[index]
        self.inflight[index] += 1
        gen, finished = None, False
        try:
            self.owner[request_id] = actor  # the front refuses a second running request with this id
            gen = actor.stream.options(num_returns="streaming").remote(progress.next_part(), request_id, time_left_s,
                                                                      carrier)
            async for ref in gen:
                chunk = await ref
                finished = chunk[2] is not None
                yield chunk
        except ray.exceptions.RayTaskError as exc:
            raise _task_error(exc) from None
        finally:
            self.inflight[index] -= 1
            self.owner[request_id] = None
            if gen is not None and not finished:
                with contextlib.suppress(Exception):  # the actor is gone: nothing left to cancel
                    ray.cancel(gen)

    async def abort(self, request_id: str) -> bool:
        """Abort a running request; one between actors (failing over) ends before its next part."""
        if request_id not in self.owner:
            return False
        actor = self.owner[request_id]
        if actor is not None:
            try:
                return await actor.abort.remote(request_id)
            except ray.exceptions.RayActorError:  # its actor is dying: the fail-over sees the mark
                pass
        self.aborted.add(request_id)
        return True

    async def close(self) -> None:
        for probe in list(self.failed.values()):
            probe.cancel()
        for actor in self.actors:
            ray.kill(actor)
        ray.shutdown()  # stops a local Ray we started; only disconnects from a cluster we attached to


def _task_error(exc) -> Exception:
    """The error a request failed with inside an actor (exc: ray's RayTaskError), as the front raises it."""
    cause = exc.cause
    if isinstance(cause, UpstreamError):
        return cause
    if isinstance(cause, grpc.aio.AioRpcError):
        return UpstreamError(cause.code().name, cause.details() or "")
    if isinstance(cause, ValueError):
        return ValueError(str(cause))
    return UpstreamError("INTERNAL", str(cause or exc))
