"""The public generation front: ``specdec.v1.GenerationService`` over the orchestrator.

``Generate`` tokenizes the prompt (chat template unless ``raw``), runs the request on an
orchestrator (in Ray actors by default, in-process with ``front.use_ray: false``) and streams
each round's tokens with their text delta, then the final statistics. ``Abort`` cancels a request
by id; a client that goes away cancels its request too; either frees the request's KV on both
services. Bad requests get INVALID_ARGUMENT naming the field; errors of the target service keep
their status code. Per-round records feed the Prometheus metrics and the global acceptance monitor.

    specdec front --config deploy/specdec.yaml
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import grpc
from opentelemetry import propagate

from orchestrator.controller import GenerationRequest
from orchestrator.service import Orchestrator, stats_dict
from specdec.config import ServeConfig
from specdec.grpc_host import ServiceHost
from specdec.process_entry import configure_logging
from specdec.sampling import SamplingParamsError
from specdec.tree_spec import TreeSpecError
from specdec.v1 import generation_pb2, generation_pb2_grpc
from specdec.wire import sampling_from_proto, spec_from_proto

log = logging.getLogger(__name__)

SERVICE_NAME = "specdec.v1.GenerationService"
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class UpstreamError(RuntimeError):
    """A downstream service failed a request; carries its gRPC status (picklable across Ray)."""

    def __init__(self, code_name: str, details: str):
        super().__init__(f"{code_name}: {details}")
        self.code_name = code_name
        self.details = details


def tokenizer_dir(config: ServeConfig) -> str:
    """Where the front's tokenizer comes from: front.tokenizer, else models.target, else the default target."""
    if config.front.tokenizer:
        return config.front.tokenizer
    from specdec.models import DEFAULT_TARGET, resolve_model_dir

    return str(resolve_model_dir(config.models.target, DEFAULT_TARGET, "models.target"))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def control_factory(config: ServeConfig):
    """(TreeSpec, max_nodes) -> per-request control policy from front.dynamic_gamma / front.fallback;
    max_nodes: the target's tree limit (dynamic gamma never grows a tree past it)."""
    from orchestrator.policy import RequestControl
    from specdec.tree_spec import MAX_TREE_NODES

    front = config.front
    return lambda spec, max_nodes=MAX_TREE_NODES: RequestControl(spec, front.dynamic_gamma, front.fallback, max_nodes=max_nodes)


def build_orchestrator(config: ServeConfig, tok_dir: str | None) -> Orchestrator:
    """An Orchestrator for this config (tokenizer for stop strings, control policies)."""
    tokenizer = load_tokenizer(tok_dir) if tok_dir else None
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer is not None else None
    return Orchestrator(config.front, config.grpc, decode, control=control_factory(config))


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
                yield chunk.tokens, chunk.round, stats_dict(chunk.stats) if chunk.stats is not None else None
        except grpc.aio.AioRpcError as exc:
            raise UpstreamError(exc.code().name, exc.details() or "") from exc

    async def abort(self, request_id: str) -> bool:
        return await self.orchestrator.abort(request_id)

    async def close(self) -> None:
        await self.orchestrator.close()


class RayBackend:
    """Requests run in ``front.workers`` Ray async actors (orchestrator.actors), least-loaded first.

    Starts a local Ray (``front.ray_address`` unset) or attaches to a cluster (``auto`` or an
    address).
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

        from orchestrator.actors import request_to_dict

        payload = request_to_dict(request)
        for attempt in range(len(self.actors) + 1):
            index = self._pick()
            actor = self.actors[index]
            self.inflight[index] += 1
            self.owner[request_id] = actor  # the front refuses a second running request with this id
            gen = actor.stream.options(num_returns="streaming").remote(payload, request_id, timeout_s, carrier)
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


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """specdec.v1.GenerationService over a backend (LocalBackend or RayBackend)."""

    def __init__(self, config: ServeConfig, backend, tokenizer, metrics=None, monitor=None):
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.monitor = monitor
        self.running: set[str] = set()  # request ids with a stream open

    def _request(self, msg: generation_pb2.GenerateRequest) -> GenerationRequest:
        """Validate and convert; raises ValueError / SamplingParamsError / TreeSpecError naming the field."""
        front, info = self.config.front, self.backend.info
        if msg.prompt and msg.prompt_ids:
            raise ValueError("prompt: give either prompt (text) or prompt_ids, not both")
        if msg.prompt_ids:
            ids = list(msg.prompt_ids)
            bad = [t for t in ids if not 0 <= t < info.vocab_size]
            if bad:
                raise ValueError(f"prompt_ids: {bad[0]} outside the vocabulary [0, {info.vocab_size})")
        elif msg.prompt:
            from orchestrator.embedded import encode_prompt

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
        return GenerationRequest(ids, msg.max_new_tokens or front.max_new_tokens, tuple(msg.stop), spec, sampling)

    async def Generate(self, request, context):
        try:
            req = self._request(request)
        except (ValueError, SamplingParamsError, TreeSpecError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = request.request_id or f"gen-{uuid.uuid4().hex[:12]}"
        if request_id in self.running:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already running")
        self.running.add(request_id)
        carrier: dict = {}
        propagate.inject(carrier)
        deltas = TextDeltas(self.tokenizer)
        started = time.perf_counter()
        try:
            async for tokens, record, stats in self.backend.stream(req, request_id, context.time_remaining(), carrier):
                if record is not None:
                    self._observe(request_id, record)
                if tokens:
                    yield generation_pb2.GenerateResponse(request_id=request_id, token_ids=tokens, text_delta=deltas.push(tokens))
                if stats is not None:
                    yield generation_pb2.GenerateResponse(request_id=request_id, text_delta=deltas.final(), stats=generation_pb2.FinalStats(
                        new_tokens=stats["new_tokens"], prompt_tokens=len(req.prompt_ids), rounds=stats["rounds"],
                        acceptance_rate=stats["acceptance_rate"], mean_accepted_length=stats["mean_accepted_length"],
                        ttft_ms=stats["ttft_ms"], total_s=stats["total_s"] or time.perf_counter() - started,
                        stop_reason=stats["stop_reason"] or "", fallback_rounds=stats["fallback_rounds"],
                        final_gamma=stats["final_gamma"], proposed_tokens=stats["proposed_tokens"],
                        accepted_tokens=stats["accepted_tokens"]))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except UpstreamError as exc:
            code = getattr(grpc.StatusCode, exc.code_name, grpc.StatusCode.INTERNAL)
            await context.abort(code, exc.details)
        finally:
            self.running.discard(request_id)
            if self.monitor is not None:
                self.monitor.finish(request_id)

    def _observe(self, request_id: str, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.observe_round(record)
            for phase in ("draft", "verify", "commit"):
                if record.get(f"{phase}_s") is not None:
                    self.metrics.observe_phase(phase, record[f"{phase}_s"])
        if self.monitor is not None and record["proposed"]:
            self.monitor.record(request_id, record["proposed"], record["accepted"])

    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        return generation_pb2.AbortResponse(aborted=await self.backend.abort(request.request_id))


async def serve_front(config: ServeConfig) -> int:
    """Run the front until SIGTERM/SIGINT. Returns the bound port."""
    from specdec.telemetry import setup_tracing, shutdown_tracing

    setup_tracing("specdec-front")
    tok_dir = tokenizer_dir(config)
    tokenizer = load_tokenizer(tok_dir)
    backend = RayBackend(config, tok_dir) if config.front.use_ray else LocalBackend(config, tok_dir)
    await backend.start()
    metrics = monitor = None
    try:
        from orchestrator.metrics import SpecMetrics, start_metrics_server
        from orchestrator.policy import AcceptanceMonitor

        metrics = SpecMetrics()
        monitor = AcceptanceMonitor(config.front.monitor, metrics=metrics)
        if config.front.metrics_port is not None:
            start_metrics_server(config.front.metrics_port, metrics)
    except ImportError:  # pragma: no cover - policy/metrics modules are part of the package
        pass
    host = ServiceHost("generation-front", config.grpc)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(
        GenerationServicer(config, backend, tokenizer, metrics, monitor), host.server)
    try:
        return await host.serve(config.front.host, config.front.port, [SERVICE_NAME])
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
    except (ConfigError, ValueError) as exc:
        return fail(str(exc))
    try:
        run_front(config)
    except grpc.aio.AioRpcError as exc:
        return fail(f"front: cannot reach the target service at {config.front.target_address} ({exc.code().name})")
    return 0
