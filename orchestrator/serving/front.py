"""The public generation front: ``specdec.v1.GenerationService`` over the orchestrator (status codes:
docs/serving.md); with ``front.http_port`` the same RequestRunner also serves the OpenAI-compatible HTTP API.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import grpc

from orchestrator.serving.admission import RETRY_AFTER_S, AdmissionRefused, peer_host
from orchestrator.serving.backends import LocalBackend, UpstreamError
from orchestrator.serving.requests import GenerateCall, RequestIdInUse, StreamEvent
from orchestrator.serving.runner import RequestRunner
from orchestrator.loop.metrics import AcceptanceMonitor, SpecMetrics, start_metrics_server
from orchestrator.loop.service import load_tokenizer, tokenizer_dir
from specdec.config import ConfigError, ServeConfig, load_config
from specdec.grpc_host import ServiceHost, error_message, short_status
from specdec.process_entry import configure_logging, fail
from specdec.security import BearerAuth, load_auth_tokens
from specdec.telemetry import setup_tracing, shutdown_tracing
from specdec.v1 import generation_pb2, generation_pb2_grpc
from specdec.wire import logprobs_to_proto, sampling_from_proto, spec_from_proto, stats_to_proto

SERVICE_NAME = "specdec.v1.GenerationService"


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """specdec.v1.GenerationService over a RequestRunner: protobuf <-> GenerateCall / StreamEvent, errors -> codes."""

    def __init__(self, runner: RequestRunner):
        self.runner = runner

    def call_of(self, msg: generation_pb2.GenerateRequest, context) -> GenerateCall:
        """The call of a GenerateRequest (tree read only where it speculates); raises ValueError naming the field."""
        tree = None
        if msg.HasField("tree") and not msg.no_spec and self.runner.front.speculate:
            tree = spec_from_proto(msg.tree)
        return GenerateCall(
            request_id=msg.request_id or f"gen-{uuid.uuid4().hex[:12]}", prompt=msg.prompt,
            prompt_ids=tuple(msg.prompt_ids), raw=msg.raw, max_new_tokens=msg.max_new_tokens, stop=tuple(msg.stop),
            sampling=sampling_from_proto(msg.sampling), tree=tree, no_spec=msg.no_spec, ignore_eos=msg.ignore_eos,
            min_tokens=msg.min_tokens, stop_token_ids=tuple(msg.stop_token_ids),
            skip_special_tokens=not msg.HasField("skip_special_tokens") or msg.skip_special_tokens,
            timeout_s=context.time_remaining(), client=self.client(context))

    def client(self, context) -> str:  # the caller's admission key
        metadata = dict(context.invocation_metadata() or ())
        return self.runner.client_of(metadata.get("authorization", ""), peer_host(context.peer()))

    async def Generate(self, request, context):
        try:
            call = self.call_of(request, context)
            events = self.runner.run(call)
            async with contextlib.aclosing(events):  # a call that ends early frees its slot at once, not at GC
                async for event in events:
                    yield response_of(call.request_id, event)
        except RequestIdInUse as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, error_message(exc))
        except AdmissionRefused as exc:  # gRPC's retry policies honour the pushback trailer
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, error_message(exc),
                                (("grpc-retry-pushback-ms", str(RETRY_AFTER_S * 1000)),))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error_message(exc))
        except UpstreamError as exc:
            code = grpc.StatusCode.__members__.get(exc.code_name, grpc.StatusCode.INTERNAL)
            await context.abort(code, short_status(exc.details))

    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        return generation_pb2.AbortResponse(aborted=await self.runner.abort(self.client(context), request.request_id))


def response_of(request_id: str, event: StreamEvent) -> generation_pb2.GenerateResponse:
    stats = None if event.stats is None else stats_to_proto(event.stats, event.prompt_tokens)
    return generation_pb2.GenerateResponse(request_id=request_id, token_ids=event.tokens, text_delta=event.text_delta,
                                           stats=stats, logprobs=logprobs_to_proto(event.logprobs),
                                           prompt_logprobs=logprobs_to_proto(event.prompt_logprobs))


async def serve_front(config: ServeConfig) -> int:
    """Run the front (gRPC, and HTTP with front.http_port) until SIGTERM/SIGINT; returns the bound gRPC port."""
    setup_tracing("specdec-front")
    front = config.front
    tok_dir = tokenizer_dir(front, config.models)
    tokenizer = load_tokenizer(tok_dir)
    if front.use_ray:
        from orchestrator.serving.actors import RayBackend  # Ray (a slow import) only where the front uses it

        backend = RayBackend(front, config.grpc, tok_dir)
    else:
        backend = LocalBackend(front, config.grpc, tok_dir)
    await backend.start()
    metrics = SpecMetrics()
    metrics.observe_costs(backend.cost())  # what the cost model starts from, before any round
    monitor = AcceptanceMonitor(front.monitor, metrics=metrics)
    tokens = load_auth_tokens(front.auth_token_file)
    runner = RequestRunner(front, backend, tokenizer, metrics, monitor, tokens)
    if front.metrics_port is not None:
        start_metrics_server(front.metrics_port, metrics, addr=front.host,
                             tokens=runner.auth_tokens if front.metrics_auth else ())
    host = ServiceHost("generation-front", config.grpc, interceptors=[BearerAuth(tokens)] if tokens else [])
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(runner), host.server)
    try:
        host.stop_on_signals()
        bound = await host.start(front.host, front.port, [SERVICE_NAME])
        http = None
        if front.http_port is not None:
            from orchestrator.serving.http_api import start_http  # FastAPI and uvicorn only where HTTP is on

            http = await start_http(front, config.grpc, runner, tok_dir, metrics.registry, host.draining)
        await host.wait_for_stop()
        # host.drain first: it sets host.draining at once, so new HTTP requests get 503 meanwhile
        await asyncio.gather(host.drain(), *([http.drain(config.grpc.shutdown_grace_s)] if http else []))
        return bound
    finally:
        await backend.close()
        shutdown_tracing()


def run(config_path: str | None = None, overrides: dict | None = None) -> int:
    """``specdec front``: load the config (YAML, then dotted ``overrides``; None = the file's) and serve; returns the
    exit code."""
    try:
        config = load_config(config_path, dict(overrides or {}))
        tokenizer_dir(config.front, config.models)  # fails early (exit 2) for an unknown model directory
        load_auth_tokens(config.front.auth_token_file)  # likewise for an unreadable token file
    except (ConfigError, ValueError) as exc:
        return fail(str(exc))
    configure_logging()
    try:
        asyncio.run(serve_front(config))
    except grpc.aio.AioRpcError as exc:
        return fail(f"front: cannot reach the target service at {config.front.target_address} ({exc.code().name})")
    except OSError as exc:  # a port that cannot be bound
        return fail(str(exc))
    return 0
