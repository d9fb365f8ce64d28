"""The public generation front: ``specdec.v1.GenerationService`` over the orchestrator.

``Generate`` tokenizes the prompt (chat template unless ``raw``), runs the request on an
orchestrator (in Ray actors by default, in-process with ``front.use_ray: false``) and streams
each round's tokens with their text delta, then the final statistics. ``Abort`` cancels a request
by id; a client that goes away cancels its request too; either frees the request's KV on both
services. Requests are admitted under ``front.limits`` (orchestrator.serving.admission): past the running
slots they wait in a FIFO queue, past the queue they get RESOURCE_EXHAUSTED naming the limit; a
request whose prompt + max_new_tokens exceeds ``max_kv_tokens_per_request`` gets INVALID_ARGUMENT.
Bad requests get INVALID_ARGUMENT naming the field; errors of the target service keep
their status code. Per-round records feed the Prometheus metrics and the global acceptance monitor.
With ``front.http_port`` set, the same front also serves the OpenAI-compatible HTTP API
(orchestrator.serving.http_api), through the same ``parse`` and ``run``.

    specdec front --config deploy/specdec.yaml [--http-port 8000]
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
from opentelemetry import propagate

from orchestrator.serving.admission import Admission, AdmissionRefused, Ticket, client_key, peer_host
from orchestrator.serving.backends import LocalBackend, RayBackend, UpstreamError
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.embedded import encode_prompt
from orchestrator.loop.metrics import AcceptanceMonitor, SpecMetrics, start_metrics_server
from orchestrator.loop.service import load_tokenizer, tokenizer_dir
from specdec.config import ServeConfig
from specdec.grpc_host import ServiceHost, error_message, short_status
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
    here and the HTTP API (orchestrator.serving.http_api) both call them. auth_tokens: the accepted bearer
    tokens (``front.auth_token_file``; empty = no auth), which name the clients of the admission
    limits (``client_of``).
    """

    def __init__(self, config: ServeConfig, backend, tokenizer, metrics=None, monitor=None,
                 auth_tokens: Sequence[str] = ()):
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.monitor = monitor
        self.auth_tokens = tuple(t.encode() for t in auth_tokens)
        self.admission = Admission(config.front.limits)
        self.running: set[str] = set()  # request ids with a stream open (waiting for a slot or running)

    def client_of(self, authorization: str, host: str) -> str:
        """The admission key of a caller (orchestrator.serving.admission.client_key): its bearer token's line
        when auth is on, else its host. authorization: the header's value ("" when absent)."""
        return client_key(self.auth_tokens, authorization, host)

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
        return GenerationRequest(ids, self._max_new_tokens(msg.max_new_tokens, len(ids)), tuple(msg.stop), spec,
                                 sampling, ignore_eos=msg.ignore_eos)

    def _max_new_tokens(self, asked: int, prompt_tokens: int) -> int:
        """The request's max_new_tokens (asked: 0 = front.max_new_tokens) under
        front.limits.max_kv_tokens_per_request: prompt + max_new_tokens target KV slots at most (a
        round's tree nodes come on top until its verify). The server default shrinks to fit; an
        explicit value that does not fit raises ValueError naming max_new_tokens (the prompt, when
        it alone fills the cap)."""
        max_new = asked or self.config.front.max_new_tokens
        cap = self.config.front.limits.max_kv_tokens_per_request
        if cap is None or prompt_tokens + max_new <= cap:
            return max_new
        if prompt_tokens >= cap:
            raise ValueError(f"prompt: {prompt_tokens} tokens leave no room for new tokens under "
                             f"front.limits.max_kv_tokens_per_request ({cap} tokens)")
        if not asked:
            return cap - prompt_tokens
        raise ValueError(f"max_new_tokens: {prompt_tokens} prompt tokens + {max_new} new tokens exceed "
                         f"front.limits.max_kv_tokens_per_request ({cap} tokens)")

    async def run(self, req: GenerationRequest, request_id: str, timeout_s: float | None = None,
                  carrier: dict | None = None, client: str = "local") -> AsyncIterator[StreamEvent]:
        """Run a parsed request on the backend: a StreamEvent per round with tokens, then the final one.

        timeout_s: the client's time left (None = no deadline); carrier: W3C trace context of the
        caller (None = the current context); client: its admission key (``client_of``). The request
        first waits for a running slot (``front.limits``); aborted meanwhile, it ends at once with
        stop reason "aborted". Rounds feed the metrics and the acceptance monitor.
        Raises RequestIdInUse, AdmissionRefused (over front.limits), ValueError naming the field, or
        UpstreamError (a downstream service's status). Closing the iterator early (client gone)
        cancels the request and frees its KV and its slot or queue place.
        """
        if request_id in self.running:
            raise RequestIdInUse(f"request_id: {request_id!r} is already running")
        if carrier is None:
            carrier = {}
            propagate.inject(carrier)
        deltas = TextDeltas(self.tokenizer)
        started = time.perf_counter()
        ticket = self.admission.enter(client, request_id)  # raises AdmissionRefused
        self.running.add(request_id)
        stream = self._admitted(ticket, req, request_id, timeout_s, carrier)
        if self.metrics is not None:  # request latency, TTFT, inter-token latency, running / waiting (queued too)
            stream = self.metrics.track_stream(stream)
        try:
            async for tokens, record, stats in stream:
                if record is not None:
                    self._observe(request_id, record)
                if tokens:
                    yield StreamEvent(tokens, deltas.push(tokens))
                if stats is not None:
                    if self.metrics is not None and stats.failovers:
                        self.metrics.failovers.inc(stats.failovers)
                    if not stats.total_s:
                        stats = dataclasses.replace(stats, total_s=time.perf_counter() - started)
                    yield StreamEvent([], deltas.final(), stats)
        finally:
            try:
                await stream.aclose()  # ended early: the backend's stream ends first (its KV freed), then the slot
            finally:  # a second cancel or an error while closing must not keep the slot or the id
                self.admission.leave(ticket)
                self.running.discard(request_id)
                if self.monitor is not None:
                    self.monitor.release(request_id)

    async def _admitted(self, ticket: Ticket, req: GenerationRequest, request_id: str, timeout_s: float | None,
                        carrier: dict):
        """The backend's stream of (tokens, record, stats) once the request holds a running slot;
        aborted while waiting, one final chunk with stop reason "aborted". The deadline left to the
        backend is what the wait did not use."""
        queued_at = time.monotonic()
        if not await ticket.granted:
            yield [], None, GenerationStats(stop_reason="aborted")
            return
        if timeout_s is not None:
            timeout_s = max(timeout_s - (time.monotonic() - queued_at), 0.0)
        stream = self.backend.stream(req, request_id, timeout_s, carrier)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def Generate(self, request, context):
        try:
            req = await asyncio.to_thread(self.parse, request)  # it tokenizes: off the event loop (the GIL is released)
        except (ValueError, SamplingParamsError, TreeSpecError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error_message(exc))
        request_id = request.request_id or f"gen-{uuid.uuid4().hex[:12]}"
        metadata = dict(context.invocation_metadata() or ())
        client = self.client_of(metadata.get("authorization", ""), peer_host(context.peer()))
        try:
            events = self.run(req, request_id, context.time_remaining(), client=client)
            async with contextlib.aclosing(events):  # a call that ends early frees its slot at once, not at GC
                async for event in events:
                    if event.stats is None:
                        yield generation_pb2.GenerateResponse(request_id=request_id, token_ids=event.tokens,
                                                              text_delta=event.text_delta)
                    else:
                        yield generation_pb2.GenerateResponse(request_id=request_id, text_delta=event.text_delta,
                                                              stats=stats_to_proto(event.stats, len(req.prompt_ids)))
        except RequestIdInUse as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, error_message(exc))
        except AdmissionRefused as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, error_message(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error_message(exc))
        except UpstreamError as exc:
            code = getattr(grpc.StatusCode, exc.code_name, grpc.StatusCode.INTERNAL)
            await context.abort(code, short_status(exc.details))

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
        aborted = self.admission.abort(request.request_id) or await self.backend.abort(request.request_id)
        return generation_pb2.AbortResponse(aborted=aborted)


async def serve_front(config: ServeConfig) -> int:
    """Run the front until SIGTERM/SIGINT: the gRPC GenerationService and, when front.http_port is
    set, the OpenAI-compatible HTTP API (orchestrator.serving.http_api) over the same servicer; both drain
    together. Returns the bound gRPC port."""
    setup_tracing("specdec-front")
    tok_dir = tokenizer_dir(config)
    tokenizer = load_tokenizer(tok_dir)
    backend = RayBackend(config, tok_dir) if config.front.use_ray else LocalBackend(config, tok_dir)
    await backend.start()
    metrics = SpecMetrics()
    metrics.observe_costs(backend.cost())  # what the cost model starts from, before any round
    monitor = AcceptanceMonitor(config.front.monitor, metrics=metrics)
    if config.front.metrics_port is not None:
        start_metrics_server(config.front.metrics_port, metrics)
    tokens = load_auth_tokens(config.front.auth_token_file)
    host = ServiceHost("generation-front", config.grpc, interceptors=[BearerAuth(tokens)] if tokens else [])
    servicer = GenerationServicer(config, backend, tokenizer, metrics, monitor, tokens)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, host.server)
    try:
        host.stop_on_signals()
        bound = await host.start(config.front.host, config.front.port, [SERVICE_NAME])
        http = None
        if config.front.http_port is not None:
            from orchestrator.serving.http_api import start_http  # FastAPI and uvicorn only where HTTP is on

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
    front`` (orchestrator.cli.main; also ``python -m orchestrator front``)."""
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
