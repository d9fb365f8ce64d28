"""Target service gRPC server (protos/specdec/v1/target.proto; docs/serving.md "The services' calls"): transport
only; sessions, KV accounting and idempotent Verify are ``target_service.sessions``, merged verifies
``VerifyBatcher``, tensor parallelism (``target.tp`` > 1) ``TensorParallelTarget``.

    specdec target-server --config deploy/specdec.yaml [--port 0] [--tp N] ...   (or python -m target_service)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Mapping

import grpc
from grpc_health.v1 import health_pb2

from specdec.config import ServeConfig, TargetServerConfig
from specdec.grpc_host import ServiceHost, deadline_of, rpc_errors, run_service, serve_model, status_for
from specdec.interfaces import SessionStateError, UnknownSessionError, VerifyResult
from specdec.model_setup import load_target, resolve_dtype, target_info
from specdec.model_worker import ModelWorker
from specdec.models import ModelError
from specdec.placement import placement
from specdec.process_entry import check_device, fail
from specdec.sampling import SamplingParamsError
from specdec.telemetry import tracer
from specdec.tree import DraftTree, MalformedTreeError
from specdec.v1 import target_pb2, target_pb2_grpc
from specdec.wire import logprobs_to_proto, sampling_from_proto, tree_from_proto
from target_service.batcher import BatchedVerify, VerifyBatcher
from target_service.commits import DeferredCommits
from specdec.kv_budget import service_budget
from target_service.runtime import TargetRuntime
from target_service.sessions import SessionExistsError, SessionSlots, TargetSessions
from target_service.tp import RankFailureError, build_target

log = logging.getLogger(__name__)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
_CODES = {SessionStateError: grpc.StatusCode.FAILED_PRECONDITION, RankFailureError: grpc.StatusCode.UNAVAILABLE,
          SessionExistsError: grpc.StatusCode.ALREADY_EXISTS}


def _unavailable(exc: RankFailureError) -> str:
    return (f"target unavailable: a tensor-parallel rank failed ({exc}); the service reports NOT_SERVING "
            "and must be restarted")


def _rpc(handler):
    """``rpc_errors(_CODES)``; a RankFailureError first marks the service NOT_SERVING, then ends the call."""
    @functools.wraps(handler)
    async def watched(self, request, context):
        try:
            return await handler(self, request, context)
        except RankFailureError as exc:
            await self.rank_failed(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, _unavailable(exc))

    return rpc_errors(_CODES)(watched)


def _response(result: VerifyResult, out: BatchedVerify | None = None, mergeable: int = 0) -> target_pb2.VerifyResponse:
    """out: the batched forward that verified it (None: a replayed pending result, no forward ran);
    mergeable: open sessions, at most max_batch (``VerifyResponse.mergeable_sessions``)."""
    response = target_pb2.VerifyResponse(accepted_nodes=list(result.accepted_nodes), tokens=list(result.tokens),
                                         mergeable_sessions=mergeable, logprobs=logprobs_to_proto(result.logprobs))
    if out is not None:
        response.verify_ms, response.batch_size, response.batch_rows = out.verify_ms, out.batch_size, out.batch_rows
    return response


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """gRPC TargetService over a target runtime (``TargetRuntime`` or ``TensorParallelTarget``), on the servicer's
    worker thread only. health: set NOT_SERVING at the first RankFailureError (then in ``failure``). Create inside
    the running event loop; ``close()`` at the end."""

    def __init__(self, runtime, *, context_limit: int, eos_token_ids=(), model_name: str = "",
                 config: TargetServerConfig = TargetServerConfig(), health=None, worker: ModelWorker | None = None):
        self.runtime = DeferredCommits(runtime)  # a commit does not wait behind other sessions' forwards
        self.vocab_size: int = runtime.vocab_size
        self.context_limit = context_limit
        self.eos_token_ids = sorted(eos_token_ids)
        self.model_name = model_name
        self.config = config
        self.max_kv_tokens = service_budget("target-service", config, runtime)
        self.sessions = TargetSessions(self.max_kv_tokens, context_limit, config.session_idle_s, config.max_sessions)
        if self.max_kv_tokens < context_limit:
            log.warning("target-service: max_kv_tokens %d < the context limit %d: one long request can be refused "
                        "RESOURCE_EXHAUSTED (raise target.kv_memory_fraction or set target.max_kv_tokens)",
                        self.max_kv_tokens, context_limit)
        self.worker = worker or ModelWorker("target-runtime")
        self.batcher = VerifyBatcher(self.runtime, self.worker, config.max_batch, config.batch_wait_ms, self.sessions.verified,
                                     gather=config.batch_gather)
        self.health = health
        self.placement = placement(getattr(runtime, "device", "cpu"))
        self.failure: RankFailureError | None = None
        self._tracer = tracer("target_service")

    def close(self) -> None:
        self.worker.close()

    async def reap_idle(self) -> None:
        """Release sessions idle for ``session_idle_s`` (their KV too). Runs until cancelled."""
        await self.sessions.reap_idle(self._release_reaped)

    def _release_reaped(self, session_id: str) -> None:
        self.batcher.forget(session_id)
        self.worker.submit(self.runtime.release, session_id)

    async def rank_failed(self, exc: RankFailureError) -> None:
        """The target is gone for good: health NOT_SERVING (once), so that probes restart the service."""
        if self.failure is not None:
            return
        self.failure = exc
        log.error("tensor-parallel target failed: %s; health NOT_SERVING, every model call is UNAVAILABLE", exc)
        if self.health is not None:
            for service in ("", SERVICE_NAME):
                await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _check_prompt(self, prompt_ids) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids: empty prompt (need >= 1 token)")
        for i, token in enumerate(prompt_ids):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"prompt_ids[{i}] = {token}: outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) >= self.context_limit:
            raise ValueError(f"prompt_ids: {len(prompt_ids)} tokens leave no room under the context limit "
                             f"of {self.context_limit} tokens")

    async def _claim_verify(self, session_id: str, tree_msg, field: str, deadline: float | None):
        """Check one verify request (session, then tree) and claim it: (session, tree to run), or
        (session, None) to replay the session's pending result."""
        if not session_id:
            raise ValueError(f"{field}session_id: empty")
        self.sessions.get(session_id)  # an unknown session fails before a malformed tree
        try:
            tree = tree_from_proto(tree_msg, self.vocab_size, self.config.max_tree_nodes)
        except MalformedTreeError as exc:
            raise MalformedTreeError(f"{field}tree.{exc}") from None
        key = tree_msg.SerializeToString(deterministic=True)
        return await self.sessions.claim_verify(session_id, tree, key, field, deadline)

    def _chunk_tokens(self, session_id: str, prompt_tokens: int) -> int:
        """The next prefill chunk's size: prefill_busy_chunk_tokens (riding in others' verify forwards, docs/serving.md
        "Limits") while others decode a packing runtime and the prompt exceeds one chunk, else prefill_chunk_tokens."""
        busy = self.config.prefill_busy_chunk_tokens
        rides = getattr(self.runtime, "batch_prefill_chunks", False) and getattr(self.runtime, "packed", False)
        long = prompt_tokens > self.config.prefill_chunk_tokens
        if busy is not None and rides and long and self.batcher.busy(session_id):
            return min(busy, self.config.prefill_chunk_tokens)
        return self.config.prefill_chunk_tokens

    @_rpc
    async def Prefill(self, request, context):
        deadline = deadline_of(context)
        if not request.session_id:
            raise ValueError("session_id: empty")
        prompt = list(request.prompt_ids)
        self._check_prompt(prompt)
        try:
            sampling = sampling_from_proto(request.sampling)
        except SamplingParamsError as exc:
            raise SamplingParamsError(f"sampling.{exc.field}", exc.detail) from None
        new = self.sessions.open(request.session_id, len(prompt))
        sid = request.session_id
        try:  # chunk by chunk: a cancelled call (abort, deadline, client gone) stops after the current chunk
            at = self._chunk_tokens(sid, len(prompt))
            await self.worker.run(self.runtime.start, sid, prompt[:at], sampling)
            while at < len(prompt):
                if self.sessions.sessions.get(sid) is not new:  # a Release came meanwhile
                    raise UnknownSessionError(f"session_id: {sid!r} was released during its prefill")
                size = self._chunk_tokens(sid, len(prompt))
                if size < self.config.prefill_chunk_tokens:  # others are decoding: ride in their next verify forward
                    await self.batcher.prefill_chunk(sid, prompt[at : at + size], deadline,
                                                     still_open=lambda: self.sessions.sessions.get(sid) is new)
                else:
                    await self.worker.run(self.runtime.extend, sid, prompt[at : at + size])
                at += size
        except BaseException:  # release after runtime.start (jobs run in order), unless a Release came meanwhile
            if self.sessions.sessions.get(request.session_id) is new:
                self.sessions.discard(request.session_id, new)
                self.worker.submit(self.runtime.release, request.session_id)
            raise
        new.set_busy(False)
        scored = () if sampling.prompt_logprobs is None else await self.worker.run(self.runtime.prompt_logprobs, sid)
        return target_pb2.PrefillResponse(cached_tokens=len(prompt) - 1, prompt_logprobs=logprobs_to_proto(scored))

    @_rpc
    async def Verify(self, request, context):
        arrived = time.perf_counter()
        response = await self._verify(request, context)
        response.service_ms = (time.perf_counter() - arrived) * 1000  # the front's link round trip takes it out
        return response

    async def _verify(self, request, context) -> target_pb2.VerifyResponse:
        deadline = deadline_of(context)
        s, tree = await self._claim_verify(request.session_id, request.tree, "", deadline)
        if tree is None:
            return _response(s.pending)
        with self._tracer.start_as_current_span("target.verify") as span:
            span.set_attribute("specdec.session_id", request.session_id)
            span.set_attribute("specdec.tree_nodes", tree.size)
            started = time.perf_counter()
            out: BatchedVerify = await self.batcher.verify(request.session_id, tree, deadline)
            span.set_attribute("specdec.batch_size", out.batch_size)
            span.set_attribute("specdec.verify_ms", out.verify_ms)
            span.set_attribute("specdec.queue_ms", max(0.0, (time.perf_counter() - started) * 1000 - out.verify_ms))
        return _response(out.result, out, self._mergeable())

    def _mergeable(self) -> int:
        return min(len(self.sessions), self.config.max_batch)

    @_rpc
    async def VerifyBatch(self, request, context):
        deadline = deadline_of(context)
        items = list(request.items)
        if len(items) > self.config.max_batch:  # before any item costs a check: a batch is one forward
            raise ValueError(f"items: {len(items)} items exceed target.max_batch ({self.config.max_batch})")
        ids = [item.session_id for item in items]
        first: dict[str, int] = {}
        for k, session_id in enumerate(ids):
            if first.setdefault(session_id, k) != k:
                raise ValueError(f"items[{k}].session_id: {session_id!r} repeats items[{first[session_id]}]")
        begun: list[tuple[SessionSlots, DraftTree | None]] = []
        try:
            for k, item in enumerate(items):
                begun.append(await self._claim_verify(item.session_id, item.tree, f"items[{k}].", deadline))
        except BaseException:
            self.sessions.undo_begin(begun)
            raise
        # A session claimed before a later item's await may since have been released: its claim is void.
        gone = {k for k, (s, tree) in enumerate(begun) if tree is not None and self.sessions.sessions.get(ids[k]) is not s}
        to_run = [(k, ids[k], tree) for k, (_, tree) in enumerate(begun) if tree is not None and k not in gone]
        outcomes = await self.batcher.verify_many([(sid, tree) for _, sid, tree in to_run], deadline)
        results = {k: outcome for (k, _, _), outcome in zip(to_run, outcomes)}
        for k in gone:
            results[k] = UnknownSessionError(f"items[{k}].session_id: {ids[k]!r} was released during this call")
        await self._abort_on_failed_item(results, context)
        response = target_pb2.VerifyBatchResponse()
        for k, (s, _) in enumerate(begun):
            out = results.get(k)
            response.results.append(_response(s.pending) if out is None
                                    else _response(out.result, out, self._mergeable()))
        return response

    async def _abort_on_failed_item(self, results: dict, context) -> None:
        """End the call with the status of the first item that failed in the forward (if any)."""
        for k, outcome in sorted(results.items()):
            if isinstance(outcome, RankFailureError):
                await self.rank_failed(outcome)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"items[{k}]: {_unavailable(outcome)}")
            if isinstance(outcome, Exception):
                # Items that did verify keep their pending results: resending the batch replays them.
                code, message = status_for(outcome, _CODES)
                await context.abort(code, f"items[{k}]: {message}")

    @_rpc
    async def Commit(self, request, context):
        deadline_of(context)
        if self.failure is not None:  # the ranks are gone: UNAVAILABLE as every model call
            raise self.failure
        s = self.sessions.begin_commit(request.session_id)
        try:  # checked here as TargetRuntime.commit does; the rollback runs later (target_service.commits)
            if s.pending is None:
                raise SessionStateError(f"session_id: {request.session_id!r} has no verify to commit")
            if not 1 <= request.num_tokens <= len(s.pending.tokens):
                raise ValueError(f"num_tokens: {request.num_tokens} outside [1, {len(s.pending.tokens)}]")
            self.runtime.defer(request.session_id, request.num_tokens)
        finally:
            s.set_busy(False)
        s.committed(request.num_tokens)
        return target_pb2.CommitResponse(cached_tokens=s.cached)

    @_rpc
    async def Release(self, request, context):
        s = self.sessions.release(request.session_id)
        self.batcher.forget(request.session_id)
        if s is not None:
            await self.worker.run(self.runtime.release, request.session_id)
        return target_pb2.ReleaseResponse(released=s is not None)

    @_rpc
    async def Info(self, request, context):
        return target_pb2.InfoResponse(
            model=self.model_name, vocab_size=self.vocab_size, context_limit=self.context_limit,
            eos_token_ids=self.eos_token_ids, sessions=len(self.sessions), cached_tokens=self.sessions.kv_held(),
            tensor_parallel=self.config.tp, batched_forwards=self.batcher.batched_forwards,
            max_tree_nodes=self.config.max_tree_nodes, max_kv_tokens=self.max_kv_tokens,
            host=self.placement.host, device=self.placement.device, cpus=list(self.placement.cpus),
        )


# -- process entry point ------------------------------------------------------------------------

async def serve_runtime(config: ServeConfig, runtime, *, context_limit: int, eos_token_ids=(), model_name: str = "",
                        worker: ModelWorker | None = None) -> int:
    """Serve ``runtime`` until SIGTERM/SIGINT, then drain. Returns the bound port. worker: the thread
    that loaded ``runtime`` (None = a new one; see ``specdec.model_worker``), closed at the end."""
    host = ServiceHost("target-service", config.grpc, client_auth=True)  # mutual TLS when grpc.tls_ca is set
    servicer = TargetServicer(runtime, context_limit=context_limit, eos_token_ids=eos_token_ids,
                              model_name=model_name, config=config.target, health=host.health, worker=worker)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, host.server)
    reaper = asyncio.create_task(servicer.reap_idle())
    try:
        return await host.serve(config.target.host, config.target.port, [SERVICE_NAME])
    finally:
        reaper.cancel()
        servicer.close()


def serve(config: ServeConfig) -> int:
    """Load the target model of ``config.models`` and serve it; returns the exit code (``serve_model``; 2 also
    for a bad device or ``target.tp``). Tensor-parallel ranks stop after the drain."""
    try:
        for device in config.target_devices:
            check_device(device, "target.device" if config.target.device else "models.device")
    except ValueError as exc:
        return fail(str(exc))
    return serve_model(config, "target", _load_target, serve_runtime)


def _load_target(config: ServeConfig):
    """(runtime, serve_runtime keywords): a TargetRuntime over the loaded model, or with ``target.tp`` > 1 a
    TensorParallelTarget whose ranks load it. Raises ModelError naming the field."""
    if config.target.tp > 1:
        runtime, loaded = _start_tensor_parallel(config)
    else:
        loaded = load_target(config.models_on(config.target_devices[0]), label="models.target")
        runtime = TargetRuntime(loaded.model, max_tree_nodes=config.target.max_tree_nodes)
    return runtime, {"context_limit": loaded.context_limit, "eos_token_ids": loaded.eos_token_ids,
                     "model_name": loaded.name}


def _start_tensor_parallel(config: ServeConfig):
    """(TensorParallelTarget, TargetInfo) for ``config.target.tp`` ranks; raises ModelError naming the field."""
    devices, tp = config.target_devices, config.target.tp
    models = config.models_on(devices[0])
    info = target_info(models, label="models.target")  # config + tokenizer only: the ranks load the weights
    try:
        runtime = build_target(info.name, tp=tp, dtype=resolve_dtype(models.dtype, models.device),
                               devices=devices, max_tree_nodes=config.target.max_tree_nodes,
                               threads_per_rank=models.threads)
    except Exception as exc:  # noqa: BLE001 - "tp: ..." / "device: ..." (ValueError) or a rank's loading error
        message = str(exc)
        if isinstance(exc, ValueError) and message.startswith(("tp:", "device:")):
            raise ModelError(f"target.{message}") from None
        detail = message if isinstance(exc, ValueError) else f"{type(exc).__name__}: {message}"
        raise ModelError(f"models.target: {tp} tensor-parallel ranks could not load {info.name}: {detail}") from None
    log.info("target-service: tensor-parallel ranks started: tp %d, backend %s, pids %s",
             runtime.tp, runtime.backend, runtime.pids)
    return runtime, info


def run(config_path: str | None = None, overrides: Mapping[str, object] | None = None) -> int:
    """``serve`` the config file with ``overrides`` (dotted fields, e.g. {"target.tp": 2}); the exit code."""
    return run_service(config_path, overrides, serve)
