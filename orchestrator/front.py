"""The public generation front: ``specdec.v1.GenerationService`` over the orchestrator.

``Generate`` tokenizes the prompt (chat template unless ``raw``), runs the request on an
orchestrator (in Ray actors by default, in-process with ``front.use_ray: false``) and streams
each round's tokens with their text delta, then the final statistics. ``Abort`` cancels a request
by id; a client that goes away cancels its request too; either frees the request's KV on both
services. Bad requests get INVALID_ARGUMENT naming the field; errors of the target service keep
their status code. Per-round records feed the Prometheus metrics and the global acceptance monitor.
With ``front.http_port`` set, the same front also serves the OpenAI-compatible HTTP API
(orchestrator.http_api), through the same ``parse`` and ``run``.

    specdec front --config deploy/specdec.yaml [--http-port 8000]
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from opentelemetry import propagate

from orchestrator.backends import LocalBackend, RayBackend, UpstreamError
from orchestrator.controller import GenerationRequest
from orchestrator.embedded import encode_prompt
from orchestrator.metrics import AcceptanceMonitor, SpecMetrics, start_metrics_server
from orchestrator.service import load_tokenizer, tokenizer_dir
from specdec.config import ServeConfig
from specdec.grpc_host import ServiceHost
from specdec.process_entry import configure_logging
from specdec.sampling import SamplingParamsError
from specdec.security import BearerAuth, load_auth_tokens
from specdec.stats import GenerationStats, RoundRecord
from specdec.telemetry import setup_tracing, shutdown_tracing
from specdec.tree_spec import TreeSpecError
from specdec.v1 import generation_pb2, generation_pb2_grpc
from specdec.wire import sampling_from_proto, spec_from_proto, stats_to_proto

log = logging.getLogger(__name__)

SERVICE_NAME = "specdec.v1.GenerationService"
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class TextDeltas:
    """Text of a growing token list as deltas that concatenate to the final decode.

    Holds back text while it ends in an incomplete UTF-8 sequence (U+FFFD); ``final`` flushes.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def push(self, tokens: list[int]) -> str:
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        return self._delta(text)

    def final(self) -> str:
        return self._delta(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _delta(self, text: str) -> str:
        """New text since the last delta. If decoding changed text already sent (tokenizers that
        clean up spaces), sent text cannot be taken back; the deltas then differ from the final decode
        where it changed (never for byte-level BPE tokenizers such as Qwen's)."""
        delta = text[len(self.sent):]  # on a divergence: best effort, the text past what was sent
        self.sent = text
        return delta


class RequestIdInUse(Exception):
    """A request with this id is already running on this front."""


@dataclass(frozen=True)
class StreamEvent:
    """One step of a request's stream (``GenerationServicer.run``): the tokens a round committed and
    their text delta, or the end, with the request's statistics (``stats`` set, ``tokens`` empty)."""

    tokens: list[int]
    text_delta: str
    stats: GenerationStats | None = None


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """specdec.v1.GenerationService over a backend (LocalBackend or RayBackend).

    ``parse`` and ``run`` are the one path of every request of this front: the gRPC ``Generate``
    here and the HTTP API (orchestrator.http_api) both call them.
    """

    def __init__(self, config: ServeConfig, backend, tokenizer, metrics=None, monitor=None):
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.monitor = monitor
        self.running: set[str] = set()  # request ids with a stream open

    def parse(self, msg: generation_pb2.GenerateRequest) -> GenerationRequest:
        """Validate and convert; raises ValueError / SamplingParamsError / TreeSpecError naming the field.
        A text prompt is tokenized here (seconds for megabytes): async callers run it in a thread."""
        front, info = self.config.front, self.backend.info
        if msg.prompt and msg.prompt_ids:
            raise ValueError("prompt: give either prompt (text) or prompt_ids, not both")
        if msg.prompt_ids:
            ids = list(msg.prompt_ids)
            bad = [t for t in ids if not 0 <= t < info.vocab_size]
            if bad:
                raise ValueError(f"prompt_ids: {bad[0]} outside the vocabulary [0, {info.vocab_size})")
        elif msg.prompt:
            ids = encode_prompt(self.tokenizer, msg.prompt, msg.raw)
        else:
            raise ValueError("prompt: empty prompt (set prompt or prompt_ids)")
        limit = min(front.max_prompt_tokens, info.context_limit - 1)
        if len(ids) > limit:
            raise ValueError(f"prompt: {len(ids)} tokens exceed the limit of {limit} tokens")
        if msg.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: must be >= 0 (0 = server default), got {msg.max_new_tokens}")
        if any(not s for s in msg.stop):
            raise ValueError("stop: an empty stop string would stop after the first token")
        if len(msg.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in msg.stop):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
        sampling = sampling_from_proto(msg.sampling)
        spec = None
        if not msg.no_spec and front.speculate:
            spec = spec_from_proto(msg.tree) if msg.HasField("tree") else front.tree
            limit = info.max_tree_nodes or spec.num_nodes
            if spec.num_nodes > limit:
                raise ValueError(f"tree: {spec.num_nodes} nodes exceed the target's limit of {limit} (target.max_tree_nodes)")
        return GenerationRequest(ids, msg.max_new_tokens or front.max_new_tokens, tuple(msg.stop), spec, sampling,
                                 ignore_eos=msg.ignore_eos)

    async def run(self, req: GenerationRequest, request_id: str, timeout_s: float | None = None,
                  carrier: dict | None = None) -> AsyncIterator[StreamEvent]:
        """Run a parsed request on the backend: a StreamEvent per round with tokens, then the final one.

        timeout_s: the client's time left (None = no deadline); carrier: W3C trace context of the
        caller (None = the current context). Rounds feed the metrics and the acceptance monitor.
        Raises RequestIdInUse, ValueError naming the field, or UpstreamError (a downstream service's
        status). Closing the iterator early (client gone) cancels the request and frees its KV.
        """
        if request_id in self.running:
            raise RequestIdInUse(f"request_id: {request_id!r} is already running")
        self.running.add(request_id)
        if carrier is None:
            carrier = {}
            propagate.inject(carrier)
        deltas = TextDeltas(self.tokenizer)
        started = time.perf_counter()
        stream = self.backend.stream(req, request_id, timeout_s, carrier)
        if self.metrics is not None:  # request latency, TTFT, inter-token latency, running / waiting
            stream = self.metrics.track_stream(stream)
        try:
            async for tokens, record, stats in stream:
                if record is not None:
                    self._observe(request_id, record)
                if tokens:
                    yield StreamEvent(tokens, deltas.push(tokens))
                if stats is not None:
                    if not stats.total_s:
                        stats = dataclasses.replace(stats, total_s=time.perf_counter() - started)
                    yield StreamEvent([], deltas.final(), stats)
        finally:
            self.running.discard(request_id)
            if self.monitor is not None:
                self.monitor.release(request_id)

    async def Generate(self, request, context):
        try:
            req = await asyncio.to_thread(self.parse, request)  # it tokenizes: off the event loop (the GIL is released)
        except (ValueError, SamplingParamsError, TreeSpecError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = request.request_id or f"gen-{uuid.uuid4().hex[:12]}"
        try:
            async for event in self.run(req, request_id, context.time_remaining()):
                if event.stats is None:
                    yield generation_pb2.GenerateResponse(request_id=request_id, token_ids=event.tokens,
                                                          text_delta=event.text_delta)
                else:
                    yield generation_pb2.GenerateResponse(request_id=request_id, text_delta=event.text_delta,
                                                          stats=stats_to_proto(event.stats, len(req.prompt_ids)))
        except RequestIdInUse as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except UpstreamError as exc:
            code = getattr(grpc.StatusCode, exc.code_name, grpc.StatusCode.INTERNAL)
            await context.abort(code, exc.details)

    def _observe(self, request_id: str, record: RoundRecord) -> None:
        if self.metrics is not None:
            self.metrics.observe_round(record)
            for phase, seconds in (("draft", record.draft_s), ("verify", record.verify_s), ("commit", record.commit_s)):
                if seconds is not None:
                    self.metrics.observe_phase(phase, seconds)
        if self.monitor is not None and record.proposed:
            self.monitor.record(request_id, record.proposed, record.accepted)

    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        return generation_pb2.AbortResponse(aborted=await self.backend.abort(request.request_id))


async def serve_front(config: ServeConfig) -> int:
    """Run the front until SIGTERM/SIGINT: the gRPC GenerationService and, when front.http_port is
    set, the OpenAI-compatible HTTP API (orchestrator.http_api) over the same servicer; both drain
    together. Returns the bound gRPC port."""
    setup_tracing("specdec-front")
    tok_dir = tokenizer_dir(config)
    tokenizer = load_tokenizer(tok_dir)
    backend = RayBackend(config, tok_dir) if config.front.use_ray else LocalBackend(config, tok_dir)
    await backend.start()
    metrics = SpecMetrics()
    monitor = AcceptanceMonitor(config.front.monitor, metrics=metrics)
    if config.front.metrics_port is not None:
        start_metrics_server(config.front.metrics_port, metrics)
    tokens = load_auth_tokens(config.front.auth_token_file)
    host = ServiceHost("generation-front", config.grpc, interceptors=[BearerAuth(tokens)] if tokens else [])
    servicer = GenerationServicer(config, backend, tokenizer, metrics, monitor)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, host.server)
    try:
        host.stop_on_signals()
        bound = await host.start(config.front.host, config.front.port, [SERVICE_NAME])
        http = None
        if config.front.http_port is not None:
            from orchestrator.http_api import start_http  # FastAPI and uvicorn only where HTTP is on

            http = await start_http(config, servicer, tok_dir, metrics.registry, host.draining)
        await host.wait_for_stop()
        # host.drain first: it sets host.draining at once, so new HTTP requests get 503 meanwhile
        await asyncio.gather(host.drain(), *([http.drain(config.grpc.shutdown_grace_s)] if http else []))
        return bound
    finally:
        await backend.close()
        shutdown_tracing()


def run_front(config: ServeConfig) -> int:
    configure_logging()
    return asyncio.run(serve_front(config))


def run(config_path: str | None = None, overrides: dict | None = None) -> int:
    """Load the config (YAML, then ``overrides``: dotted fields such as {"front.port": 0}, None = keep
    the file's value) and serve the front; returns the exit code. The command line is ``specdec
    front`` (orchestrator.cli; also ``python -m orchestrator front``)."""
    from specdec.config import ConfigError, load_config
    from specdec.process_entry import fail

    try:
        config = load_config(config_path, dict(overrides or {}))
        tokenizer_dir(config)  # fails early (exit 2) for an unknown model directory
        load_auth_tokens(config.front.auth_token_file)  # likewise for an unreadable token file
    except (ConfigError, ValueError) as exc:
        return fail(str(exc))
    try:
        run_front(config)
    except grpc.aio.AioRpcError as exc:
        return fail(f"front: cannot reach the target service at {config.front.target_address} ({exc.code().name})")
    except OSError as exc:  # a port that cannot be bound
        return fail(str(exc))
    return 0
