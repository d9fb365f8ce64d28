"""Draft service gRPC server (protos/specdec/v1/draft.proto): one bidirectional Session stream per request
(the protocol: docs/serving.md "The services' calls"); concurrent proposes merge in ``propose_batch``.

    specdec draft-server --config deploy/specdec.yaml [--port 0] [--draft DIR] ...   (or python -m draft_service)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Mapping

import grpc

from draft_service.runtime import DraftRuntime, check_root_path
from specdec.batching import SessionBatcher
from specdec.config import DraftServerConfig, ServeConfig
from specdec.grpc_host import ServiceHost, abort_for, rpc_errors, run_service, serve_model
from specdec.interfaces import MAX_AHEAD_CANDIDATES, AheadCandidate
from specdec.kv_budget import service_budget
from specdec.placement import placement
from specdec.model_setup import load_draft, target_info
from specdec.model_worker import ModelWorker
from specdec.process_entry import check_device, fail
from specdec.sampling import SamplingParamsError
from specdec.service_errors import CapacityError
from specdec.telemetry import tracer
from specdec.tree import DraftTree
from specdec.tree_spec import MAX_TREE_NODES, TreeSpecError
from specdec.v1 import draft_pb2, draft_pb2_grpc
from specdec.wire import sampling_from_proto, spec_from_proto, tree_to_proto

log = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class SessionLimitError(RuntimeError):
    """The draft's context limit leaves no room for another tree (the caller should fall back)."""


_CODES = {SessionLimitError: grpc.StatusCode.FAILED_PRECONDITION}


@dataclass
class _Stream:
    key: str  # runtime session id
    session_id: str  # the caller's id (logs, traces)
    tokens: int  # committed tokens (prompt + generated)
    tree_size: int | None = None  # nodes of the last proposed tree (None: no propose since commit)
    parents: tuple[int, ...] = ()  # the last proposed tree's parents (ahead paths are checked against them)
    ahead: list[tuple[int, tuple[int, ...]]] | None = None  # unresolved: per candidate (tokens it adds, tree's parents)


class _ProposeBatcher(SessionBatcher):
    """Merged proposes; each caller gets (its tree, the sessions that shared the call, the call's ms)."""

    def answer(self, tree, ran, call_ms):
        return tree, len(ran), call_ms


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """gRPC DraftService over a ``DraftRuntime`` (on the servicer's worker thread only). context_limit: the
    draft's max positions; draining: set at shutdown. Create inside the running event loop; ``close()`` at the end."""

    def __init__(self, runtime: DraftRuntime, *, context_limit: int, config: DraftServerConfig = DraftServerConfig(),
                 draining: asyncio.Event | None = None, worker: ModelWorker | None = None):
        self.runtime = runtime
        self.context_limit = context_limit
        self.config = config
        self.draining = draining or asyncio.Event()
        self.worker = worker or ModelWorker("draft-runtime")
        self.placement = placement(str(runtime.model.device))
        batch_call = lambda pairs: runtime.propose_batch([(key, *args) for key, args in pairs])  # noqa: E731
        self.batcher = _ProposeBatcher(self.worker, batch_call, self._propose_solo,
                                       config.max_batch, config.batch_wait_ms, what="propose",
                                       gather=config.batch_gather)
        self.streams: dict[str, _Stream] = {}
        self._keys = itertools.count()
        self._tracer = tracer("draft_service")
        self.max_kv_tokens = service_budget("draft-service", config, runtime)

    def close(self) -> None:
        self.worker.close()

    def _propose_solo(self, key: str, args: tuple):
        """One session's propose (spec, max_depth) or ahead (spec, max_depth, AheadCandidates), alone."""
        if len(args) == 3:
            spec, _, candidates = args
            return self.runtime.propose_candidates(key, candidates, spec)
        return self.runtime.propose(key, *args)

    async def Session(self, request_iterator, context):
        """The stream's replies, in order (an async generator, as the OpenTelemetry interceptor needs)."""
        stream = None
        try:
            first = await self._next(context)
            if first is None:
                return
            if first.WhichOneof("kind") != "start":
                raise ValueError(f"kind: the first message must be start, got {first.WhichOneof('kind') or 'an empty message'}")
            stream, started = await self._start(first.start)
            yield draft_pb2.DraftResponse(started=started)
            while (msg := await self._next(context)) is not None:
                kind = msg.WhichOneof("kind")
                if kind == "propose":
                    yield draft_pb2.DraftResponse(tree=await self._propose(stream, msg.propose))
                elif kind == "commit":
                    await self._commit(stream, msg.commit)
                elif kind == "ahead":
                    yield draft_pb2.DraftResponse(tree=await self._ahead(stream, msg.ahead))
                elif kind == "resolve":
                    await self._resolve(stream, msg.resolve)
                elif kind == "start":
                    raise ValueError("start: the session is already started (one start per stream)")
                else:
                    raise ValueError("kind: empty message (set start, propose, commit, ahead or resolve)")
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the stream ends with the status; the server keeps serving
            await abort_for(context, exc, _CODES, where="Session")
        finally:
            if stream is not None:
                self.streams.pop(stream.key, None)
                self.batcher.forget(stream.key)  # not waited for by gathering any more
                self.worker.submit(self.runtime.release, stream.key)

    @rpc_errors()
    async def Info(self, request, context) -> draft_pb2.DraftInfoResponse:
        """Streams, runtime sessions and cached positions (read behind the queued jobs: leak checks), limits."""
        held = await self.worker.run(lambda: list(self.runtime.sessions.values()))
        return draft_pb2.DraftInfoResponse(sessions=len(self.streams), cached_sessions=len(held),
                                           context_limit=self.context_limit,
                                           cached_tokens=sum(s.cached_len for s in held),
                                           host=self.placement.host, device=self.placement.device,
                                           cpus=list(self.placement.cpus),
                                           batched_forwards=self.batcher.batched_forwards)

    async def _next(self, context):
        """The next request, or None at the end of the stream; aborts UNAVAILABLE when draining, DEADLINE_EXCEEDED
        after ``draft.session_idle_s`` without a message."""
        read = asyncio.ensure_future(context.read())
        drain = asyncio.ensure_future(self.draining.wait())
        try:
            await asyncio.wait({read, drain}, timeout=self.config.session_idle_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
            if not read.done():
                read.cancel()
        if read.done() and not read.cancelled():
            msg = read.result()
            return None if msg is grpc.aio.EOF else msg
        if not self.draining.is_set():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"draft.session_idle_s: no message for {self.config.session_idle_s:g} s; session released")
        await context.abort(grpc.StatusCode.UNAVAILABLE, "draft service is shutting down")

    async def _start(self, start) -> tuple[_Stream, draft_pb2.DraftStarted]:
        if not start.session_id:
            raise ValueError("start.session_id: empty")
        prompt = list(_token_ids(start.prompt_ids, "start.prompt_ids", limit=None))
        if not prompt:
            raise ValueError("start.prompt_ids: empty prompt (need >= 1 token)")
        if len(prompt) >= self.context_limit:
            raise ValueError(f"start.prompt_ids: {len(prompt)} tokens leave no room under the draft's context limit "
                             f"of {self.context_limit} tokens")
        try:
            sampling = sampling_from_proto(start.sampling)
        except SamplingParamsError as exc:
            raise SamplingParamsError(f"start.sampling.{exc.field}", exc.detail) from None
        if len(self.streams) >= self.config.max_sessions:
            raise CapacityError(f"draft.max_sessions: all {self.config.max_sessions} draft sessions are in use")
        self._reserve(len(prompt))
        stream = _Stream(f"{start.session_id}#{next(self._keys)}", start.session_id, len(prompt))
        self.streams[stream.key] = stream
        try:
            await self.worker.run(self.runtime.start, stream.key, prompt, sampling)
        except BaseException:  # runtime.start may still finish after a cancel: release after it (jobs run in order)
            self.streams.pop(stream.key, None)
            self.worker.submit(self.runtime.release, stream.key)
            raise
        self.worker.submit(self._prefill_chunk, stream.key)  # not awaited: it overlaps the target's (jobs run in order)
        cached = self.runtime.sessions[stream.key].cached_len
        return stream, draft_pb2.DraftStarted(cached_tokens=cached, context_limit=self.context_limit)

    def _prefill_chunk(self, key: str) -> None:
        """One chunk of a session's prefill (worker thread); the next one queues behind the jobs submitted meanwhile."""
        if self.runtime.prefill(key, self.config.prefill_chunk_tokens):
            self.worker.submit(self._prefill_chunk, key)

    def _tree_request(self, field: str, request, tokens: int) -> tuple:
        """The TreeSpec and depth cap after ``tokens`` committed tokens (a depth-d node sits at tokens - 1 + d <
        context_limit). Raises TreeSpecError / ValueError naming ``field``, SessionLimitError when no room is left."""
        try:
            spec = spec_from_proto(request.spec)
        except TreeSpecError as exc:
            raise TreeSpecError(f"{field}.spec: {exc}") from None
        if request.max_depth < 1:
            raise ValueError(f"{field}.max_depth: must be >= 1, got {request.max_depth}")
        room = self.context_limit - tokens
        if room < 1:
            raise SessionLimitError(f"context_limit: {tokens} committed tokens fill the draft's "
                                    f"{self.context_limit} positions")
        return spec, min(request.max_depth, room)

    async def _grow(self, stream: _Stream, request,
                    job: tuple) -> tuple[list[tuple[int, DraftTree]], draft_pb2.DraftTreeReply]:
        """A propose (job: spec, depth) or an ahead (+ candidates) through the batcher, traced: ([(token, tree)]
        per candidate, token 0 for a propose; the reply)."""
        ahead = len(job) == 3
        with self._tracer.start_as_current_span("draft.propose_ahead" if ahead else "draft.propose") as span:
            span.set_attribute("specdec.session_id", stream.session_id)
            started = time.perf_counter()
            out, batch_size, forward_ms = await self.batcher.submit(stream.key, job)
            draft_ms = (time.perf_counter() - started) * 1000
            trees = list(out) if ahead else [(0, out)]
            span.set_attribute("specdec.tree_nodes", trees[0][1].size)
            span.set_attribute("specdec.batch_size", batch_size)
        others = [draft_pb2.AlternativeTree(token=token, tree=tree_to_proto(tree)) for token, tree in trees[1:]]
        return trees, draft_pb2.DraftTreeReply(round=request.round, tree=tree_to_proto(trees[0][1]), draft_ms=draft_ms,
                                               batch_size=batch_size, forward_ms=forward_ms, ahead=ahead,
                                               guess_token=trees[0][0], alternatives=others)

    async def _propose(self, stream: _Stream, request) -> draft_pb2.DraftTreeReply:
        _no_ahead(stream, "propose")
        ((_, tree),), reply = await self._grow(stream, request, self._tree_request("propose", request, stream.tokens))
        stream.tree_size, stream.parents = tree.size, tuple(tree.parents)
        return reply

    async def _ahead(self, stream: _Stream, request) -> draft_pb2.DraftTreeReply:
        """An AheadRequest, checked (path against the last tree, room), grown through the proposes' batcher."""
        if stream.ahead is not None:
            raise ValueError("ahead: an earlier ahead is unresolved (send resolve first)")
        path = list(request.path_nodes)
        if path and stream.tree_size is None:
            raise ValueError("ahead.path_nodes: no proposed tree since the last commit")
        parents = stream.parents if stream.tree_size is not None else ()  # none: only empty paths (a plain round's)
        if path:
            check_root_path(parents, path, "ahead.path_nodes")
        spec, depth = self._tree_request("ahead", request, stream.tokens + len(path) + 1)  # path + guess committed
        candidates = [AheadCandidate(tuple(path), depth, _token_ids(request.exclude, "ahead.exclude")),
                      *self._alternatives(parents, stream.tokens, request)]
        trees, reply = await self._grow(stream, request, (spec, depth, tuple(candidates)))
        stream.ahead = [(len(c.path_nodes) + 1, tuple(tree.parents)) for c, (_, tree) in zip(candidates, trees)]
        return reply

    def _alternatives(self, parents: tuple[int, ...], tokens: int, request) -> list[AheadCandidate]:
        """The ahead's other candidates, checked against the last tree's ``parents``; each gets >= 1 position."""
        if len(request.alternatives) >= MAX_AHEAD_CANDIDATES:
            raise ValueError(f"ahead.alternatives: {len(request.alternatives)} given, "
                             f"at most {MAX_AHEAD_CANDIDATES - 1}")
        out = []
        for i, alt in enumerate(request.alternatives):
            field, path = f"ahead.alternatives[{i}]", list(alt.path_nodes)
            if path:
                check_root_path(parents, path, f"{field}.path_nodes")
            if alt.max_depth < 1:
                raise ValueError(f"{field}.max_depth: must be >= 1, got {alt.max_depth}")
            room = max(self.context_limit - tokens - len(path) - 1, 1)
            exclude = _token_ids(alt.exclude, f"{field}.exclude")
            out.append(AheadCandidate(tuple(path), min(alt.max_depth, room), exclude))
        return out

    async def _resolve(self, stream: _Stream, request) -> None:
        if stream.ahead is None:
            raise ValueError("resolve: no unresolved ahead on this stream")
        if request.adopt and not 0 <= request.candidate < len(stream.ahead):
            raise ValueError(f"resolve.candidate: {request.candidate} is not one of the {len(stream.ahead)} candidates")
        added, parents = stream.ahead[request.candidate if request.adopt else 0]
        stream.ahead = None
        await self.worker.run(self.runtime.resolve_ahead, stream.key, request.adopt, request.candidate)
        if request.adopt:  # the ahead's tree is now the last tree; the guessed round counts as committed
            stream.tokens += added
            stream.tree_size, stream.parents = len(parents), parents

    async def _commit(self, stream: _Stream, request) -> None:
        _no_ahead(stream, "commit")
        tokens, accepted = list(_token_ids(request.tokens, "commit.tokens", limit=None)), list(request.accepted_nodes)
        if not tokens:
            raise ValueError("commit.tokens: empty (a round commits >= 1 token)")
        if len(accepted) > len(tokens):
            raise ValueError(f"commit.accepted_nodes: {len(accepted)} nodes for {len(tokens)} tokens")
        size = stream.tree_size or 0
        for i, node in enumerate(accepted):
            if not 0 <= node < size:
                raise ValueError(f"commit.accepted_nodes[{i}] = {node}: not a node of the last proposed tree ({size} nodes)")
        self._reserve(len(tokens))
        await self.worker.run(self.runtime.commit, stream.key, tokens, accepted)
        stream.tokens += len(tokens)
        stream.tree_size = None

    def _reserve(self, slots: int) -> None:
        """Raise CapacityError naming draft.max_kv_tokens when ``slots`` more tokens would not fit beside every
        stream's tokens."""
        held = sum(s.tokens for s in self.streams.values())
        if held + slots > self.max_kv_tokens:
            raise CapacityError(f"draft.max_kv_tokens: {slots} more KV slots would exceed the limit of "
                                f"{self.max_kv_tokens} ({held} held by {len(self.streams)} sessions)")


def _token_ids(values, field: str, limit: int | None = MAX_TREE_NODES) -> tuple[int, ...]:
    """Token ids (>= 0; at most ``limit``: for excludes, a verified node's children), or ValueError naming ``field``."""
    if limit is not None and len(values) > limit:
        raise ValueError(f"{field}: {len(values)} token ids, at most {limit}")
    for i, token in enumerate(values):
        if token < 0:
            raise ValueError(f"{field}[{i}] = {token}: token ids are >= 0")
    return tuple(values)


def _no_ahead(stream: _Stream, field: str) -> None:
    if stream.ahead is not None:
        raise ValueError(f"{field}: an ahead is unresolved on this stream (send resolve first)")


# -- process entry point ------------------------------------------------------------------------

async def serve_runtime(config: ServeConfig, runtime, *, context_limit: int, worker: ModelWorker | None = None) -> int:
    """Serve ``runtime`` until SIGTERM/SIGINT, then drain. Returns the bound port. worker: the thread
    that loaded ``runtime`` (None = a new one; see ``specdec.model_worker``), closed at the end."""
    host = ServiceHost("draft-service", config.grpc, client_auth=True)  # mutual TLS when grpc.tls_ca is set
    servicer = DraftServicer(runtime, context_limit=context_limit, config=config.draft, draining=host.draining,
                             worker=worker)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, host.server)
    try:
        return await host.serve(config.draft.host, config.draft.port, [SERVICE_NAME])
    finally:
        servicer.close()


def serve(config: ServeConfig) -> int:
    """Load the draft model of ``config.models`` (checked against the target's tokenizer and config,
    without the target's weights) and serve it; returns the exit code (``serve_model``)."""
    try:
        check_device(config.draft_device, "draft.device" if config.draft.device else "models.device")
    except ValueError as exc:
        return fail(str(exc))
    return serve_model(config, "draft", _load_draft, serve_runtime)


def _load_draft(config: ServeConfig) -> tuple[DraftRuntime, dict]:
    """(runtime, {"context_limit"}) for ``config.models``' draft; raises ModelError naming the field."""
    models = config.models_on(config.draft_device)  # dtype auto: as on the draft's device (the target pod's may differ)
    loaded = load_draft(models, target_info(models, label="models.target"), label="models.draft")
    return DraftRuntime(loaded.model, vocab_size=loaded.vocab_size), {"context_limit": loaded.context_limit}


def run(config_path: str | None = None, overrides: Mapping[str, object] | None = None) -> int:
    """``serve`` the config file with ``overrides`` (dotted fields, e.g. {"draft.port": 0}); the exit code."""
    return run_service(config_path, overrides, serve)
