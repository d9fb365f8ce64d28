"""Where the front's requests run: in this process (``LocalBackend``) or in Ray actors (``RayBackend``).

Both have one interface for the front's servicer (orchestrator.front): ``start``, ``info`` (the
target's limits), ``stream(request, request_id, timeout_s, carrier)`` yielding ``(tokens, round
record | None, stats | None)`` per round, ``abort`` and ``close``. A failure of a downstream service
reaches the servicer as ``UpstreamError`` carrying its gRPC status.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from orchestrator.controller import GenerationRequest
from orchestrator.service import Orchestrator, build_orchestrator
from specdec.config import ServeConfig

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
    """Requests run in ``front.workers`` Ray async actors (orchestrator.actors), least-loaded first.

    Starts a local Ray (``front.ray_address`` unset) or attaches to a cluster (``auto`` or an
    address). ``ray`` and orchestrator.actors (which imports it) are imported inside the methods:
    a front with ``front.use_ray: false`` runs without Ray and skips its import (~1 s).
    """

    def __init__(self, config: ServeConfig, tok_dir: str | None):
        self.config = config
        self.tok_dir = tok_dir
        self.actors = []
        self.inflight: dict[int, int] = {}
        self.owner: dict[str, object] = {}
        self.unhealthy_until: dict[int, float] = {}
        self.info = None

    async def start(self) -> None:
        import ray

        from orchestrator.actors import OrchestratorActor, actor_env

        front = self.config.front
        if not ray.is_initialized():
            ray.init(address=front.ray_address, num_cpus=front.ray_num_cpus if front.ray_address is None else None,
                     include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
                     runtime_env={"env_vars": actor_env()} if actor_env() else None)
        config_json = self.config.model_dump_json(by_alias=True)
        self.actors = [OrchestratorActor.remote(config_json, self.tok_dir) for _ in range(front.workers)]
        self.inflight = {i: 0 for i in range(len(self.actors))}
        await asyncio.gather(*[actor.ready.remote() for actor in self.actors])
        # The front needs the target's limits too (prompt checks): one direct Info call.
        probe = Orchestrator(front, self.config.grpc)
        await probe.connect()
        self.info = probe.info
        await probe.target_channel.close()
        await probe.draft_channel.close()

    ACTOR_COOLDOWN_S = 5.0  # an actor that failed a request is skipped this long (it is restarting)

    def _pick(self) -> int:
        """The least-loaded actor, preferring those that did not fail in the last ACTOR_COOLDOWN_S."""
        now = time.monotonic()
        healthy = [i for i in self.inflight if self.unhealthy_until.get(i, 0.0) <= now] or list(self.inflight)
        return min(healthy, key=self.inflight.get)

    async def stream(self, request: GenerationRequest, request_id: str, timeout_s, carrier):
        """Run on an actor; a request whose actor dies or is restarting before its first token is
        sent to another actor (nothing was streamed, so nothing is lost or repeated); after the first
        token it fails with UNAVAILABLE."""
        import ray

        for attempt in range(len(self.actors) + 1):
            index = self._pick()
            actor = self.actors[index]
            self.inflight[index] += 1
            self.owner[request_id] = actor  # the front refuses a second running request with this id
            gen = actor.stream.options(num_returns="streaming").remote(request, request_id, timeout_s, carrier)
            finished = streamed = False
            try:
                async for ref in gen:
                    tokens, record, stats = await ref
                    streamed = True
                    yield tokens, record, stats
                    if stats is not None:
                        finished = True
                return
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, UpstreamError):
                    raise cause from None
                if isinstance(cause, grpc.aio.AioRpcError):
                    raise UpstreamError(cause.code().name, cause.details() or "") from None
                if isinstance(cause, ValueError):
                    raise ValueError(str(cause)) from None
                raise UpstreamError("INTERNAL", str(cause or exc)) from None
            except ray.exceptions.RayActorError as exc:  # ActorUnavailableError included
                self.unhealthy_until[index] = time.monotonic() + self.ACTOR_COOLDOWN_S
                if streamed or attempt == len(self.actors):
                    raise UpstreamError("UNAVAILABLE", f"orchestrator actor died: {exc}") from None
                log.warning("request %s: orchestrator actor %d unavailable before the first token (%s); trying another",
                            request_id, index, type(exc).__name__)
            finally:
                self.inflight[index] -= 1
                if self.owner.get(request_id) is actor:
                    self.owner.pop(request_id, None)
                if not finished:
                    try:
                        ray.cancel(gen)
                    except Exception:  # noqa: BLE001 - the actor is gone; nothing left to cancel
                        pass

    async def abort(self, request_id: str) -> bool:
        actor = self.owner.get(request_id)
        if actor is None:
            return False
        return await actor.abort.remote(request_id)

    async def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        ray.shutdown()  # stops a local Ray we started; only disconnects from a cluster we attached to
