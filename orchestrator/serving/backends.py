"""Where the front's requests run: in this process (``LocalBackend``) or in Ray actors (``RayBackend``).

Both have one interface for the front's servicer (orchestrator.serving.front): ``start``, ``info`` (the
target's limits), ``stream(request, request_id, timeout_s, carrier)`` yielding ``(tokens, round
record | None, stats | None)`` per round, ``abort`` and ``close``. A failure of a downstream service
reaches the servicer as ``UpstreamError`` carrying its gRPC status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from orchestrator.loop.controller import GenerationRequest
from orchestrator.serving.failover import Resumption
from orchestrator.loop.service import Orchestrator, build_orchestrator, control_factory, with_costs
from specdec.config import ServeConfig
from specdec.stats import GenerationStats

log = logging.getLogger(__name__)


class UpstreamError(RuntimeError):
    """A downstream service failed a request; carries its gRPC status (picklable across Ray)."""

    def __init__(self, code_name: str, details: str):
        super().__init__(f"{code_name}: {details}")
        self.code_name = code_name
        self.details = details


class LocalBackend:
    """Requests run in this process's event loop (no Ray)."""

    def __init__(self, config: ServeConfig, tok_dir: str | None):
        self.orchestrator = build_orchestrator(config, tok_dir)

    async def start(self) -> None:
        await self.orchestrator.connect()

    @property
    def info(self):
        return self.orchestrator.info

    def cost(self) -> dict | None:
        """The cost-aware control's cost model (``CostModel.snapshot``), None without that control."""
        state = getattr(self.orchestrator.control_factory, "shared", None)
        return state.cost.snapshot() if state is not None else None

    async def stream(self, request: GenerationRequest, request_id: str, timeout_s, carrier):
        try:
            async for chunk in self.orchestrator.stream(request, request_id, timeout_s, carrier):
                yield chunk.tokens, chunk.round, chunk.stats
        except grpc.aio.AioRpcError as exc:
            raise UpstreamError(exc.code().name, exc.details() or "") from exc

    async def abort(self, request_id: str) -> bool:
        return await self.orchestrator.abort(request_id)

    async def close(self) -> None:
        await self.orchestrator.close()


class RayBackend:
    """Requests run in ``front.workers`` Ray async actors (orchestrator.serving.actors), least-loaded first;
    a request whose actor dies continues on another (``stream``, orchestrator.serving.failover).

    Starts a local Ray (``front.ray_address`` unset) or attaches to a cluster (``auto`` or an
    address). ``ray`` and orchestrator.serving.actors (which imports it) are imported inside the methods:
    a front with ``front.use_ray: false`` runs without Ray and skips its import (~1 s).
    """

    def __init__(self, config: ServeConfig, tok_dir: str | None):
        self.config = config
        self.tok_dir = tok_dir
        self.actors = []
        self.inflight: dict[int, int] = {}
        self.owner: dict[str, object] = {}
        self.failed: dict[int, asyncio.Task] = {}  # actors that failed a request, until they answer again
        self.aborted: set[str] = set()  # requests aborted while between actors (failing over)
        self.info = None
        self.start_cost: dict | None = None  # the cost model the actors started from (the probe's snapshot)

    async def start(self) -> None:
        import ray

        from orchestrator.serving.actors import OrchestratorActor, actor_env

        front = self.config.front
        if not ray.is_initialized():
            ray.init(address=front.ray_address, num_cpus=front.ray_num_cpus if front.ray_address is None else None,
                     include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
                     runtime_env={"env_vars": actor_env()} if actor_env() else None)
        # The front needs the target's limits too (prompt checks): one direct Info call. Where the
        # cost-aware control would start from prior figures, this probe measures the services once
        # (Orchestrator.connect) and the actors start from its figures (measuring together, they
        # would disturb each other's timings).
        factory = control_factory(self.config)
        probe = Orchestrator(front, self.config.grpc, control_factory=factory)
        await probe.connect()
        self.info = probe.info
        await probe.target_channel.close()
        await probe.draft_channel.close()
        config = self.config
        state = getattr(factory, "shared", None)
        if state is not None and front.speculate and state.cost.source in ("measured", "prior"):
            config = with_costs(config, state.cost)  # its figures, or no measuring where it failed
        self.start_cost = state.cost.snapshot() if state is not None else None
        config_json = config.model_dump_json(by_alias=True)
        self.actors = [OrchestratorActor.remote(config_json, self.tok_dir) for _ in range(front.workers)]
        self.inflight = {i: 0 for i in range(len(self.actors))}
        await asyncio.gather(*[actor.ready.remote() for actor in self.actors])

    def cost(self) -> dict | None:
        """The cost model the actors started from (each then learns its own from its rounds; the
        front's metrics follow every round's), None without the cost-aware control."""
        return self.start_cost

    PROBE_INTERVAL_S = 0.5  # a failed actor is asked for ``ready`` this often until it answers (Ray restarts it)
    RECOVERY_WAIT_S = 30.0  # with every actor failed, a request waits this long at most for one to answer

    async def _pick(self, time_left_s: float | None, request_id: str | None = None) -> int:
        """The least-loaded actor, among those that did not fail or answered again since. While
        every actor is failed, wait for one (at most RECOVERY_WAIT_S and time_left_s, the request's
        time left; an abort of ``request_id`` ends the wait), then take the least-loaded of all."""
        wait_s = self.RECOVERY_WAIT_S if time_left_s is None else min(self.RECOVERY_WAIT_S, time_left_s)
        until = time.monotonic() + wait_s
        while (len(self.failed) == len(self.actors) and time.monotonic() < until
               and request_id not in self.aborted):
            await asyncio.sleep(0.05)
        healthy = [i for i in self.inflight if i not in self.failed] or list(self.inflight)
        return min(healthy, key=self.inflight.get)

    def _mark_failed(self, index: int) -> None:
        """Skip actor ``index`` (``_pick``) until it answers ``ready`` again."""
        if index not in self.failed:
            self.failed[index] = asyncio.ensure_future(self._until_ready(index))

    async def _until_ready(self, index: int) -> None:
        """Ask a failed actor for ``ready`` until it answers (a restarted actor also connects to the
        services then), then count it healthy again."""
        import ray

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
        """Run on an actor. A request whose actor dies or is restarting continues on another actor
        from the tokens already streamed (orchestrator.serving.failover): the client sees one unbroken
        stream, greedy output unchanged, a sampled one still from the target's law (from a seed
        derived from the request's: a seeded sampled request that fails over is not bit-identical to
        one that did not). A failed actor is skipped until it answers again; while every actor is
        failed, the request waits for one (``_pick``). At most ``len(actors)`` fail-overs per
        request, then UpstreamError UNAVAILABLE; past the deadline at a fail-over, DEADLINE_EXCEEDED.
        Yields (tokens, RoundRecord | None, GenerationStats | None) as ``LocalBackend.stream``."""
        import ray

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
                    self._mark_failed(index)
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
        """One part of a request on actor ``index``: (tokens, record, stats) chunks as the actor streams
        them. Raises ray's RayActorError when the actor dies, UpstreamError or ValueError for a failed
        request (its downstream status), UpstreamError DEADLINE_EXCEEDED when no time is left."""
        import ray

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
                try:
                    ray.cancel(gen)
                except Exception:  # noqa: BLE001 - the actor is gone; nothing left to cancel
                    pass

    async def abort(self, request_id: str) -> bool:
        """Abort a running request; one between actors (failing over) ends before its next part."""
        import ray

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
        import ray

        for probe in list(self.failed.values()):
            probe.cancel()
        for actor in self.actors:
            ray.kill(actor)
        ray.shutdown()  # stops a local Ray we started; only disconnects from a cluster we attached to


def _task_error(exc) -> Exception:
    """The error a request failed with inside an actor (ray's RayTaskError), as the front raises it."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, UpstreamError):
        return cause
    if isinstance(cause, grpc.aio.AioRpcError):
        return UpstreamError(cause.code().name, cause.details() or "")
    if isinstance(cause, ValueError):
        return ValueError(str(cause))
    return UpstreamError("INTERNAL", str(cause or exc))
