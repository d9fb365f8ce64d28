"""gRPC clients of the draft and target services, with the worker methods the round loop awaits.
``DraftClient``: one bidirectional Session stream per request; any draft failure raises ``DraftUnavailableError``.
``TargetClient``: unary calls; errors propagate as ``grpc.aio.AioRpcError``. ``request_deadline`` (absolute
``time.monotonic()`` s) bounds every downstream call. Each measures its link's round trip (``LinkRtt``).
"""

from __future__ import annotations

import asyncio
import contextvars
import statistics
import time
from collections import deque

import grpc
from opentelemetry import trace

from orchestrator.loop.controller import DraftUnavailableError
from specdec.interfaces import AheadCandidate, DraftWorker, VerifyResult
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from specdec.tree_spec import TreeSpec
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.wire import logprobs_from_proto, sampling_to_proto, spec_to_proto, tree_from_proto, tree_to_proto

request_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_deadline", default=None)

DEFAULT_CALL_TIMEOUT_S = 120.0
VERIFY_RETRIES = 2  # Verify calls retried on UNAVAILABLE
PREFILL_S_PER_TOKEN = 0.1  # the Prefill call's timeout over DEFAULT_CALL_TIMEOUT_S, per prompt token (chunked)


def time_left(default: float | None = DEFAULT_CALL_TIMEOUT_S) -> float | None:
    """The request's time left, at most ``default`` s. Raises DeadlineExceeded (an AioRpcError) once past it."""
    deadline = request_deadline.get()
    if deadline is None:
        return default
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded()
    return left if default is None else min(default, left)


class DeadlineExceeded(grpc.aio.AioRpcError):
    def __init__(self):
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                         details="request deadline exceeded")


def channel_options(max_message_bytes: int, max_reconnect_backoff_ms: int = 1000) -> list[tuple[str, int]]:
    """Message size limits and a short reconnect backoff (gRPC's grows to 120 s)."""
    return [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", max_reconnect_backoff_ms)]


class LinkRtt:
    """A service link's round trip, seconds: the median of the last ``window`` samples, each a call's wall time at
    the front minus the time the service reports it spent (queue and compute), at least 0."""

    def __init__(self, window: int = 16):
        self.samples: deque[float] = deque(maxlen=window)

    def add(self, wall_s: float, service_s: float) -> None:
        self.samples.append(max(wall_s - service_s, 0.0))

    @property
    def value(self) -> float | None:  # None before the first sample
        return statistics.median(self.samples) if self.samples else None


class TargetClient:
    """TargetWorker over gRPC (unary calls). ``info()`` returns the target's InfoResponse."""

    def __init__(self, channel: grpc.aio.Channel):
        self.stub = target_pb2_grpc.TargetServiceStub(channel)
        self.rtt = LinkRtt()

    @property
    def link_rtt_s(self) -> float | None:
        return self.rtt.value

    async def info(self, timeout: float = 10.0) -> target_pb2.InfoResponse:
        return await self.stub.Info(target_pb2.InfoRequest(), timeout=timeout, wait_for_ready=True)

    async def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams) -> tuple:
        """Prefill, its timeout growing with the prompt; returns the TokenLogprobs of prompt_ids[1:] with
        sampling.prompt_logprobs, else ()."""
        timeout = time_left(DEFAULT_CALL_TIMEOUT_S + PREFILL_S_PER_TOKEN * len(prompt_ids))
        reply = await self.stub.Prefill(target_pb2.PrefillRequest(
            session_id=session_id, prompt_ids=prompt_ids, sampling=sampling_to_proto(sampling)), timeout=timeout)
        return logprobs_from_proto(reply.prompt_logprobs, prompt_ids[1:])

    async def verify(self, session_id: str, tree: DraftTree) -> VerifyResult:
        msg = tree_to_proto(tree)
        span = trace.get_current_span()
        span.set_attribute("tree.bytes", msg.ByteSize())
        request = target_pb2.VerifyRequest(session_id=session_id, tree=msg)
        for attempt in range(VERIFY_RETRIES + 1):
            try:
                sent = time.perf_counter()
                reply = await self.stub.Verify(request, timeout=time_left())
                wall_s = time.perf_counter() - sent
                break
            except grpc.aio.AioRpcError as exc:  # Verify is idempotent until Commit: one more try is safe
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == VERIFY_RETRIES:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
        if reply.service_ms > 0:  # 0: a target that does not report it
            self.rtt.add(wall_s, reply.service_ms / 1000)
        span.set_attributes({"target.verify_ms": reply.verify_ms, "target.batch_size": reply.batch_size,
                             "target.batch_rows": reply.batch_rows})
        # batch_size 0: a replayed pending result (no forward ran); the control then learns no cost from it
        return VerifyResult(tuple(reply.accepted_nodes), tuple(reply.tokens),
                            logprobs_from_proto(reply.logprobs, reply.tokens), batch_size=reply.batch_size,
                            batch_rows=reply.batch_rows, mergeable=reply.mergeable_sessions, forward_ms=reply.verify_ms)

    async def commit(self, session_id: str, num_tokens: int) -> None:
        await self.stub.Commit(target_pb2.CommitRequest(session_id=session_id, num_tokens=num_tokens), timeout=time_left())

    async def release(self, session_id: str) -> None:
        await self.stub.Release(target_pb2.ReleaseRequest(session_id=session_id), timeout=10.0)


class DraftClient(DraftWorker):
    """DraftWorker over gRPC: one bidirectional Session stream per session id. vocab_size: ids the target accepts
    (trees are checked on receipt). All failures raise DraftUnavailableError."""

    drafts_ahead = True

    def __init__(self, channel: grpc.aio.Channel, vocab_size: int, max_tree_nodes: int = 512):
        self.stub = draft_pb2_grpc.DraftServiceStub(channel)
        self.vocab_size = vocab_size
        self.max_tree_nodes = max_tree_nodes
        self.streams: dict[str, grpc.aio.StreamStreamCall] = {}
        self.rounds: dict[str, int] = {}
        self.reply_batch: dict[str, int] = {}  # session -> sessions that shared its last proposal's draft forwards
        self.reply_forward: dict[str, float] = {}  # session -> ms of the draft call that grew its last tree (0: unknown)
        self.rtt = LinkRtt()

    @property
    def link_rtt_s(self) -> float | None:
        return self.rtt.value

    async def info(self, timeout: float = 5.0) -> draft_pb2.DraftInfoResponse:  # grpc errors raised as they are
        return await self.stub.Info(draft_pb2.DraftInfoRequest(), timeout=timeout)

    async def _exchange(self, session_id: str, request: draft_pb2.DraftRequest, reply: bool):
        call = self.streams.get(session_id)
        if call is None:
            raise DraftUnavailableError(f"no open draft stream for session {session_id!r}")
        try:
            await call.write(request)
            if not reply:
                return None
            response = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._fail(session_id, f"draft service: {exc.code().name}: {exc.details()}") from exc
        except Exception as exc:  # noqa: BLE001 - a stream that already ended (UsageError, InvalidStateError, ...)
            raise self._fail(session_id, f"draft stream closed: {type(exc).__name__}: {exc}") from exc
        if response is grpc.aio.EOF:
            raise self._fail(session_id, f"draft stream ended ({(await call.code()).name}: {await call.details()})")
        return response

    def _fail(self, session_id: str, message: str) -> DraftUnavailableError:
        """Forget a broken stream and cancel it (the draft frees the session's KV when it ends); the error to raise."""
        call = self.streams.pop(session_id, None)
        if call is not None:
            call.cancel()
        return DraftUnavailableError(message)

    async def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams) -> int | None:
        """Open the session's stream; returns the draft's context limit (max positions) if it reports one."""
        try:
            # the stream lives for the whole request: it gets the request's time left as its deadline
            self.streams[session_id] = self.stub.Session(timeout=time_left(None) if request_deadline.get() else None)
        except Exception as exc:  # noqa: BLE001 - any failure to open the stream is a draft failure
            raise DraftUnavailableError(f"draft service: cannot open a session stream: {exc}") from exc
        self.rounds[session_id] = 0
        start = draft_pb2.DraftStart(session_id=session_id, prompt_ids=prompt_ids, sampling=sampling_to_proto(sampling))
        response = await self._exchange(session_id, draft_pb2.DraftRequest(start=start), reply=True)
        if not response.HasField("started"):
            raise DraftUnavailableError("draft service answered start with something else")
        return response.started.context_limit or None

    async def propose(self, session_id: str, spec: TreeSpec, max_depth: int) -> DraftTree:
        self.rounds[session_id] = self.rounds.get(session_id, 0) + 1
        request = draft_pb2.TreeRequest(spec=spec_to_proto(spec), max_depth=max_depth, round=self.rounds[session_id])
        sent = time.perf_counter()
        response = await self._exchange(session_id, draft_pb2.DraftRequest(propose=request), reply=True)
        if not response.HasField("tree") or response.tree.round != self.rounds[session_id]:
            raise self._fail(session_id, "draft service answered out of order")
        return self._tree(session_id, response.tree, time.perf_counter() - sent)

    def last_batch_size(self, session_id: str) -> int:
        """Sessions that shared this session's last proposal's draft forwards (1 = alone or not reported)."""
        return self.reply_batch.get(session_id, 1)

    def last_forward_ms(self, session_id: str) -> float:
        """ms of the draft call that grew this session's last tree, no queue or transport (0 = not reported)."""
        return self.reply_forward.get(session_id, 0.0)

    def _tree(self, session_id: str, reply: draft_pb2.DraftTreeReply, wall_s: float | None = None,
              tree=None) -> DraftTree:
        """The reply's tree (or ``tree``, one of its alternatives), checked (a malformed one is a draft failure);
        wall_s: the call's wall time (a link round trip sample)."""
        if wall_s is not None and reply.draft_ms > 0:
            self.rtt.add(wall_s, reply.draft_ms / 1000)
        trace.get_current_span().set_attributes({"tree.bytes": reply.tree.ByteSize(), "draft.draft_ms": reply.draft_ms,
                                                 "draft.batch_size": reply.batch_size,
                                                 "draft.forward_ms": reply.forward_ms})
        self.reply_batch[session_id] = max(reply.batch_size, 1)
        self.reply_forward[session_id] = max(reply.forward_ms, 0.0)
        try:
            return tree_from_proto(reply.tree if tree is None else tree, self.vocab_size, self.max_tree_nodes)
        except ValueError as exc:  # a malformed tree from the draft is a draft failure
            raise self._fail(session_id, f"draft sent a malformed tree: {exc}") from exc

    async def propose_ahead(self, session_id: str, path_nodes: list[int], spec: TreeSpec,
                            max_depth: int) -> tuple[int, DraftTree]:
        """The next round's tree drafted ahead (DraftRuntime.propose_ahead): returns (guess token, tree)."""
        return (await self.propose_candidates(session_id, [AheadCandidate(tuple(path_nodes), max_depth)], spec))[0]

    async def propose_candidates(self, session_id: str, candidates: list[AheadCandidate],
                                 spec: TreeSpec) -> list[tuple[int, DraftTree]]:
        """Pre-drafting (DraftRuntime.propose_candidates): [(token, tree)] per candidate, in one reply."""
        first = candidates[0]
        self.rounds[session_id] = self.rounds.get(session_id, 0) + 1
        others = [draft_pb2.AheadAlternative(path_nodes=c.path_nodes, exclude=c.exclude, max_depth=c.max_depth)
                  for c in candidates[1:]]
        request = draft_pb2.AheadRequest(path_nodes=first.path_nodes, spec=spec_to_proto(spec),
                                         max_depth=first.max_depth, round=self.rounds[session_id],
                                         alternatives=others, exclude=first.exclude)
        sent = time.perf_counter()
        response = await self._exchange(session_id, draft_pb2.DraftRequest(ahead=request), reply=True)
        wall_s = time.perf_counter() - sent
        if not response.HasField("tree") or not response.tree.ahead or response.tree.round != self.rounds[session_id]:
            raise self._fail(session_id, "draft service answered an ahead out of order")
        reply = response.tree
        if len(reply.alternatives) != len(others):
            raise self._fail(session_id, f"draft answered {len(reply.alternatives)} alternatives for {len(others)}")
        out = []
        for token, tree in [(reply.guess_token, reply.tree), *((a.token, a.tree) for a in reply.alternatives)]:
            if not 0 <= token < self.vocab_size:
                raise self._fail(session_id, f"draft sent token {token} outside the vocabulary")
            out.append((token, self._tree(session_id, reply, None if out else wall_s, tree)))
        return out

    async def resolve_ahead(self, session_id: str, adopt: bool, candidate: int = 0) -> None:
        resolve = draft_pb2.AheadResolve(adopt=adopt, candidate=candidate)
        await self._exchange(session_id, draft_pb2.DraftRequest(resolve=resolve), reply=False)

    async def commit(self, session_id: str, tokens: list[int], accepted_nodes: list[int]) -> None:
        commit = draft_pb2.DraftCommit(tokens=tokens, accepted_nodes=accepted_nodes)
        await self._exchange(session_id, draft_pb2.DraftRequest(commit=commit), reply=False)

    async def release(self, session_id: str) -> None:
        """Close the stream (the draft frees the session's KV when it ends)."""
        call = self.streams.pop(session_id, None)
        for per_session in (self.rounds, self.reply_batch, self.reply_forward):
            per_session.pop(session_id, None)
        if call is None:
            return
        try:
            await call.done_writing()
        except Exception:  # noqa: BLE001 - already broken; cancel below frees it
            pass
        call.cancel()
