"""Where the front's requests run: this process (``LocalBackend``) or Ray actors (``RayBackend``, imported only
with ``front.use_ray``). A downstream failure reaches the runner as ``UpstreamError`` with its gRPC status.
"""

from __future__ import annotations

import abc
from typing import AsyncIterator

import grpc

from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.service import build_orchestrator
from specdec.config import FrontConfig, GrpcConfig
from specdec.stats import GenerationStats, RoundRecord


class UpstreamError(RuntimeError):
    """A downstream service failed a request; carries its gRPC status (picklable across Ray)."""

    def __init__(self, code_name: str, details: str):
        super().__init__(f"{code_name}: {details}")
        self.code_name = code_name
        self.details = details


class Backend(abc.ABC):
    """Where requests run. info: the target's Info (vocabulary, context and tree limits), once started."""

    info = None

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    def cost(self) -> dict | None:
        """The cost-aware control's cost model (``CostModel.snapshot``), None without that control."""

    @abc.abstractmethod
    def stream(self, request: GenerationRequest, request_id: str, timeout_s: float | None,
               carrier: dict) -> AsyncIterator[tuple[list[int], RoundRecord | None, GenerationStats | None]]:
        """Run a request: (tokens, its round's record, the end's stats) per round. carrier: W3C trace context."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


class LocalBackend(Backend):
    """Requests run in this process's event loop (no Ray)."""

    def __init__(self, front: FrontConfig, grpc_cfg: GrpcConfig, tok_dir: str | None):
        self.orchestrator = build_orchestrator(front, grpc_cfg, tok_dir)

    async def start(self) -> None:
        await self.orchestrator.connect()

    @property
    def info(self):
        return self.orchestrator.info

    def cost(self) -> dict | None:
        return self.orchestrator.cost_snapshot()

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
