"""Fuzz every RPC of the three services with random and mutated messages.

    python benchmarks/reliability_fuzz.py --messages 10000 --out DIR          # tiny random models, spawned here
    python benchmarks/reliability_fuzz.py --front H:P --draft H:P --target H:P --messages 2000 --out DIR

A message is one call: a unary request, one DraftService.Session stream or one Generate stream
(cancelled after a few replies). Half are built field by field from the proto descriptors
(``message_strategy``: extreme integers, NaN / inf, huge strings and repeats, nested messages), half
are well-formed messages with one field broken (``mutations``: bad trees, sampling parameters and
specs, unknown session ids, calls out of order). Generation is hypothesis with a fixed seed (the
``test`` extra).

Properties (``run_fuzz`` returns them, ``write_report`` writes fuzz.json + fuzz.md): every status is
OK or one of ALLOWED (CANCELLED only for the fuzzer's own cancel), anything else is a fault kept with
its input; the servers never exit or log a traceback; no session leaks once the fuzzer releases its
ids; a well-formed greedy request gets the same tokens after the run as before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import queue
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings, strategies as st

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from specdec.harness.servers import launch_service, stop_service, wait_ready  # noqa: E402
from specdec.v1 import (draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc,  # noqa: E402
                        target_pb2, target_pb2_grpc, tree_pb2)

OK = grpc.StatusCode.OK
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS}
CALL_TIMEOUT_S = 30.0
INT32 = (-2**31, 2**31 - 1)
INT64 = (-2**63, 2**63 - 1)
HUGE_REPEAT = 100_000  # elements of a "huge" repeated field (~0.5 MB of int32: under the 4 MiB message limit)
# Drawn messages past this size are not sent (``Record.unsent_oversize``): nested huge repeats reach
# hundreds of MB, which the client cannot stream within CALL_TIMEOUT_S.
MAX_SENT_BYTES = 16 << 20
MAX_FAULTS_KEPT = 50
GREEDY_PROMPT = [5, 17, 42, 9, 3, 77]  # ids < the tiny models' ~300-token vocabulary
GREEDY_TOKENS = 12


@dataclass(frozen=True)
class Addresses:
    """"host:port" of each service (front may be None: the Generate / Abort cases are skipped)."""

    draft: str
    target: str
    front: str | None = None


@dataclass(frozen=True)
class Shape:
    """What a well-formed message must respect, from the target's Info."""

    vocab: int
    context_limit: int
    max_tree_nodes: int


# ------------------------------------------------------------- random messages from the proto descriptors

def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, hi, 0, 1, -1, 2, 255, 256, 300, 4096) if lo <= v <= hi})
    return st.one_of(st.integers(max(lo, -3), min(hi, 40)), st.sampled_from(edges), st.integers(lo, hi))


def _scalar(fd: FieldDescriptor) -> st.SearchStrategy:
    t = fd.type
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return _ints(*INT32)
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return _ints(*INT64)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _ints(0, 2**32 - 1)
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return _ints(0, 2**64 - 1)
    if t == FieldDescriptor.TYPE_FLOAT:
        return st.one_of(st.floats(width=32), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0]))
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1.0, 1e308, 5e-324]))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(max_size=20), st.sampled_from(["", "fz-0", "x" * 70_000, "\u0000", "\ud7ff\U0010ffff"]))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in fd.enum_type.values] + [999])
    raise TypeError(f"{fd.full_name}: unhandled field type {t}")


def _value(fd: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return message_strategy(fd.message_type, depth + 1)
    return _scalar(fd)


def _repeated(fd: FieldDescriptor, depth: int) -> st.SearchStrategy[list]:
    """Short lists, or one value repeated many times at the top level (nested lists stay small)."""
    element = _value(fd, depth)
    small = st.lists(element, max_size=8)
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        sizes = [1_000, 10_000] if depth == 0 else [50]
    else:
        sizes = [129, 4_096, HUGE_REPEAT] if depth == 0 else [129]
    if fd.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):  # short values: 100,000 x 70 KB would be 7 GB
        element = st.text(max_size=8) if fd.type == FieldDescriptor.TYPE_STRING else st.binary(max_size=8)
    huge = st.builds(lambda v, n: [v] * n, element, st.sampled_from(sizes))
    return st.one_of(small, small, small, huge)


@st.composite
def _message(draw, descriptor, depth: int):
    cls = _message_class(descriptor)
    msg = cls()
    chosen_oneofs = {o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in descriptor.oneofs
                     if not o.name.startswith("_")}  # "_seed": proto3 optional, drawn as a plain field
    for fd in descriptor.fields:
        oneof = fd.containing_oneof
        if oneof is not None and oneof.name in chosen_oneofs and chosen_oneofs[oneof.name] != fd.name:
            continue
        if oneof is None or oneof.name not in chosen_oneofs:
            if not draw(st.booleans()):
                continue  # unset
        if depth > 3 and fd.type == FieldDescriptor.TYPE_MESSAGE:
            continue
        _set_field(msg, fd, draw(_repeated(fd, depth) if _is_repeated(fd) else _value(fd, depth)))
    return msg


def _is_repeated(fd: FieldDescriptor) -> bool:
    """protobuf 6+ has ``is_repeated`` (``label`` deprecated); older ones only ``label``."""
    return fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == FieldDescriptor.LABEL_REPEATED


def _set_field(msg, fd: FieldDescriptor, value) -> None:
    if _is_repeated(fd):
        getattr(msg, fd.name).extend(value)
    elif fd.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(msg, fd.name).CopyFrom(value)
    else:
        setattr(msg, fd.name, value)


_CLASSES: dict[str, type] = {}


def _message_class(descriptor) -> type:
    if descriptor.full_name not in _CLASSES:
        _CLASSES[descriptor.full_name] = message_factory.GetMessageClass(descriptor)
    return _CLASSES[descriptor.full_name]


def message_strategy(descriptor, depth: int = 0) -> st.SearchStrategy:
    """Random instances of the protobuf message ``descriptor``, nested messages down to depth 4."""
    return _message(descriptor, depth)


# ------------------------------------------------------------- well-formed messages and their mutations

@st.composite
def valid_tree(draw, shape: Shape, max_nodes: int = 12) -> tree_pb2.TokenTree:
    """A well-formed TokenTree: N nodes in topological order, ids in the vocabulary, log-probs <= 0."""
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, shape.vocab - 1), min_size=n, max_size=n))
    tree = tree_pb2.TokenTree(tokens=tokens, parents=parents)
    if draw(st.booleans()):
        tree.draft_logprobs.extend(draw(st.lists(st.floats(-20.0, 0.0, width=32), min_size=n, max_size=n)))
    if draw(st.booleans()):
        tree.expanded.extend(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return tree


def _break_tree(draw, tree: tree_pb2.TokenTree, shape: Shape) -> tree_pb2.TokenTree:
    """One field of ``tree`` broken (parents, ids, depth, size, log-probs, lengths, proposals)."""
    n = len(tree.tokens)
    kind = draw(st.sampled_from(["parent", "token", "logprob", "length", "deep", "wide", "proposal", "source"]))
    if kind == "parent" and n:
        i = draw(st.integers(0, n - 1))
        tree.parents[i] = draw(st.sampled_from([i, i + 1, n + 5, -2, INT32[0], INT32[1]]))  # self / forward / cycle
    elif kind == "token" and n:
        tree.tokens[draw(st.integers(0, n - 1))] = draw(st.sampled_from([shape.vocab, -1, INT32[1], INT32[0]]))
    elif kind == "logprob" and n:
        del tree.draft_logprobs[:]
        tree.draft_logprobs.extend([draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.5, -1.0])) for _ in range(n)])
    elif kind == "length":
        target = draw(st.sampled_from(["parents", "draft_logprobs", "expanded", "sources"]))
        getattr(tree, target).append(draw(st.sampled_from([0, 1, -1])) if target != "expanded" else True)
    elif kind == "deep":  # one chain past the depth limit or the context
        depth = draw(st.sampled_from([shape.context_limit, 65, shape.max_tree_nodes + 1]))
        tree = tree_pb2.TokenTree(tokens=[1] * depth, parents=list(range(-1, depth - 1)))
    elif kind == "wide":  # past max_tree_nodes, or a huge repeat
        width = draw(st.sampled_from([shape.max_tree_nodes + 1, HUGE_REPEAT]))
        tree = tree_pb2.TokenTree(tokens=[1] * width, parents=[-1] * width)
    elif kind == "proposal":
        tree.proposals.append(tree_pb2.Proposal(
            parent=draw(st.sampled_from([-1, 0, n, -5])), token_ids=draw(st.lists(st.integers(-1, shape.vocab), max_size=4)),
            probs=draw(st.lists(st.sampled_from([0.5, 1.0, math.nan, -0.1, math.inf]), max_size=4))))
    else:
        tree.sources.extend([draw(st.sampled_from([0, 1, 2, -1]))] * max(n, 1))
    return tree


@st.composite
def token_tree(draw, shape: Shape) -> tree_pb2.TokenTree:
    """A well-formed tree (one in three) or one with a broken field."""
    tree = draw(valid_tree(shape))
    return tree if draw(st.integers(0, 2)) == 0 else _break_tree(draw, tree, shape)


@st.composite
def sampling_params(draw, broken: bool | None = None) -> tree_pb2.SamplingParams:
    """Well-formed or with one bad value (NaN, inf, negative, huge); broken None: either, drawn."""
    msg = tree_pb2.SamplingParams(temperature=draw(st.sampled_from([0.0, 0.7, 1.0])), top_p=draw(st.sampled_from([0.0, 0.9, 1.0])),
                                  top_k=draw(st.sampled_from([0, 1, 40])))
    if draw(st.booleans()):
        msg.seed = draw(st.sampled_from([0, 7, INT64[1]]))
    if draw(st.booleans()) if broken is None else broken:
        name = draw(st.sampled_from(["temperature", "top_p", "top_k", "seed"]))
        bad = {"top_k": [-1, INT32[0], INT32[1]], "seed": [-1, INT64[0]]}.get(name, [math.nan, math.inf, -math.inf, -1.0, 1e308, 2.0])
        setattr(msg, name, draw(st.sampled_from(bad)))
    return msg


@st.composite
def tree_spec(draw, broken: bool | None = None) -> tree_pb2.TreeSpec:
    """A top-k root over a chain, or one with a bad field; broken None: either, drawn."""
    gamma = draw(st.integers(1, 4))
    spec = tree_pb2.TreeSpec(gamma=gamma, top_k_spec=[tree_pb2.TopKRow(k=[draw(st.integers(1, 3))])] +
                             [tree_pb2.TopKRow(k=[1]) for _ in range(gamma - 1)], top_head=[1] * gamma)
    if draw(st.booleans()) if broken is None else broken:
        kind = draw(st.sampled_from(["gamma", "rows", "heads", "type", "threshold", "k", "huge"]))
        if kind == "gamma":
            spec.gamma = draw(st.sampled_from([0, -1, 65, INT32[1]]))
        elif kind == "rows":
            spec.top_k_spec.append(tree_pb2.TopKRow(k=[1, 1]))
        elif kind == "heads":
            spec.top_head[0] = draw(st.sampled_from([0, 2, -1]))
        elif kind == "type":
            spec.tree_type = draw(st.sampled_from([2, -1, INT32[1]]))
        elif kind == "threshold":
            spec.gamma_threshold = draw(st.sampled_from([math.nan, math.inf, -1.0, 2.0]))
        elif kind == "k":
            spec.top_k_spec[0].k[0] = draw(st.sampled_from([0, -1, 10_000, INT32[1]]))
        else:
            spec.top_k_spec[0].k.extend([1] * 4096)
    return spec


@st.composite
def prompt_ids(draw, shape: Shape, broken: bool | None = None) -> list[int]:
    """A valid prompt, or an empty / out-of-vocabulary / too long one; broken None: either, drawn."""
    ids = draw(st.lists(st.integers(0, shape.vocab - 1), min_size=1, max_size=min(24, shape.context_limit - 2)))
    bad = ["empty", "bad_id", "long", "huge"]
    kind = draw(st.sampled_from(["ok"] * 4 + bad if broken is None else bad if broken else ["ok"]))
    if kind == "empty":
        return []
    if kind == "bad_id":
        ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from([-1, shape.vocab, INT32[1], INT32[0]]))
    elif kind == "long":
        ids = ids + [1] * shape.context_limit
    elif kind == "huge":
        ids = [1] * HUGE_REPEAT
    return ids


@dataclass(frozen=True)
class PlannedCommit:
    """A draft commit drawn before its stream opens: path to node ``leaf % N`` of the last tree, or ``broken``."""

    leaf: int
    bonus: int
    broken: draft_pb2.DraftCommit | None = None

    def resolve(self, tree, vocab: int) -> draft_pb2.DraftRequest:
        if self.broken is not None:
            return draft_pb2.DraftRequest(commit=self.broken)
        path: list[int] = []
        node = self.leaf % len(tree.tokens) if tree is not None and len(tree.tokens) and self.leaf >= 0 else -1
        while node >= 0:
            path.insert(0, node)
            node = tree.parents[node]
        tokens = [tree.tokens[j] for j in path] + [self.bonus % vocab]
        return draft_pb2.DraftRequest(commit=draft_pb2.DraftCommit(tokens=tokens, accepted_nodes=path))


def session_id(pool: list[str]) -> st.SearchStrategy[str]:
    """Mostly one of the shared pool (calls out of order), else a random, empty or huge id."""
    return st.one_of(st.sampled_from(pool), st.sampled_from(pool), st.sampled_from(pool),
                     st.sampled_from(["", "never-opened", "x" * 70_000]), st.text(max_size=12))


# ------------------------------------------------------------- the cases: one message each, recorded as (rpc, status)

@dataclass
class Record:
    """Outcomes of the run so far: status counts per RPC, and the faults with their inputs."""

    codes: Counter = field(default_factory=Counter)  # (rpc, code name) -> calls
    requests: int = 0  # request messages sent (a stream counts each of its messages)
    faults: list[dict] = field(default_factory=list)
    fault_count: int = 0
    seconds: Counter = field(default_factory=Counter)  # rpc -> wall time of its calls (s)
    details: dict = field(default_factory=dict)  # (rpc, code name) -> the details of its first call
    unsent_oversize: int = 0  # drawn unary requests over MAX_SENT_BYTES, not sent

    def add(self, rpc: str, code: grpc.StatusCode, details: str, request, allowed=ALLOWED, seconds: float = 0.0) -> None:
        self.codes[(rpc, code.name)] += 1
        self.seconds[rpc] += seconds
        self.details.setdefault((rpc, code.name), details[:200])
        # "Stream removed": the client's transport ended the call, not the server, whatever the code
        if code is OK or (code in allowed and not details.startswith("Stream removed")):
            return
        self.fault_count += 1
        if len(self.faults) < MAX_FAULTS_KEPT:
            self.faults.append({"rpc": rpc, "code": code.name, "details": details[:500], "request": _short(request)})


def _short(request, limit: int = 800) -> str:
    text = str(request) if not isinstance(request, list) else "\n---\n".join(map(str, request))
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _status(call):
    """Run ``call()``: (reply or None, code, details)."""
    try:
        return call(), OK, ""
    except grpc.RpcError as exc:
        return None, exc.code(), exc.details() or ""


class Fuzzer:
    """Sends the cases to one deployment (synchronous channels) and records their statuses."""

    def __init__(self, addresses: Addresses, shape: Shape, pool: list[str]):
        self.addresses, self.shape, self.pool = addresses, shape, pool
        self.channels = {name: grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)])
                         for name, addr in vars(addresses).items() if addr}
        self.target = target_pb2_grpc.TargetServiceStub(self.channels["target"])
        self.draft = draft_pb2_grpc.DraftServiceStub(self.channels["draft"])
        self.front = generation_pb2_grpc.GenerationServiceStub(self.channels["front"]) if addresses.front else None
        self.record = Record()
        self.opened: set[str] = set(pool)  # session ids the fuzzer may have opened on the target

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()

    def case(self, data: st.DataObject) -> None:
        """One message: an RPC, then a random (from the descriptor) or a mutated well-formed request."""
        rpcs = ["Prefill", "Verify", "Verify", "VerifyBatch", "Commit", "Release", "TargetInfo", "DraftInfo",
                "Session", "Session"] + (["Generate", "Generate", "Abort"] if self.front else [])
        rpc = data.draw(st.sampled_from(rpcs), label="rpc")
        random_message = data.draw(st.booleans(), label="from descriptor")
        if rpc == "Session":
            return self._session(data, random_message)
        if rpc == "Generate":
            return self._generate(data, random_message)
        stub_call, request_type, mutated = self._unary(rpc)
        request = data.draw(message_strategy(request_type.DESCRIPTOR) if random_message or mutated is None
                            else mutated, label="request")
        if request.ByteSize() > MAX_SENT_BYTES:
            self.record.unsent_oversize += 1
            return
        started = time.perf_counter()
        _, code, details = _status(lambda: stub_call(request, timeout=CALL_TIMEOUT_S))
        if rpc == "Prefill" and code is OK:
            self.opened.add(request.session_id)  # released at the end (the client's job), with the pool's
        self.record.requests += 1
        self.record.add(rpc, code, details, request, seconds=time.perf_counter() - started)

    def _unary(self, rpc: str):
        """(stub method, request class, strategy of mutated well-formed requests or None)."""
        sid, shape = session_id(self.pool), self.shape
        verify = st.builds(lambda s, t: target_pb2.VerifyRequest(session_id=s, tree=t), sid, token_tree(shape))
        table = {
            "Prefill": (self.target.Prefill, target_pb2.PrefillRequest, st.sampled_from([None, None, "prompt", "sampling"]).flatmap(
                lambda broken: st.builds(lambda s, p, q: target_pb2.PrefillRequest(session_id=s, prompt_ids=p, sampling=q),
                                         sid, prompt_ids(shape, broken == "prompt"), sampling_params(broken == "sampling")))),
            "Verify": (self.target.Verify, target_pb2.VerifyRequest, verify),
            "VerifyBatch": (self.target.VerifyBatch, target_pb2.VerifyBatchRequest, st.builds(
                lambda items: target_pb2.VerifyBatchRequest(items=items), st.lists(verify, max_size=4))),
            "Commit": (self.target.Commit, target_pb2.CommitRequest, st.builds(
                lambda s, n: target_pb2.CommitRequest(session_id=s, num_tokens=n), sid,
                st.sampled_from([-1, 0, 1, 2, 3, 100, INT32[0], INT32[1]]))),
            "Release": (self.target.Release, target_pb2.ReleaseRequest, st.builds(
                lambda s: target_pb2.ReleaseRequest(session_id=s), sid)),
            "TargetInfo": (self.target.Info, target_pb2.InfoRequest, None),
            "DraftInfo": (self.draft.Info, draft_pb2.DraftInfoRequest, None),
        }
        if self.front:
            table["Abort"] = (self.front.Abort, generation_pb2.AbortRequest, st.builds(
                lambda r: generation_pb2.AbortRequest(request_id=r), st.sampled_from(["", "fz-req", "x" * 70_000])))
        return table[rpc]

    def _session(self, data: st.DataObject, random_message: bool) -> None:
        """One DraftService.Session stream of 1-6 requests, drawn before it opens (hypothesis needs that)."""
        one = message_strategy(draft_pb2.DraftRequest.DESCRIPTOR) if random_message else None
        plan = [data.draw(one if one is not None else self._draft_request(i), label="draft request")
                for i in range(data.draw(st.integers(1, 6), label="stream length"))]
        requests: queue.Queue = queue.Queue()
        started = time.perf_counter()
        replies = self.draft.Session(iter(requests.get, None), timeout=CALL_TIMEOUT_S)
        sent, last_tree, code, details = [], None, OK, ""
        try:
            for planned in plan:
                msg = planned.resolve(last_tree, self.shape.vocab) if isinstance(planned, PlannedCommit) else planned
                sent.append(msg)
                requests.put(msg)
                if msg.WhichOneof("kind") in ("start", "propose"):
                    reply = next(replies)
                    last_tree = reply.tree.tree if reply.WhichOneof("kind") == "tree" else last_tree
            requests.put(None)
            for _ in replies:
                pass
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        except StopIteration:  # the stream ended OK before answering a start / propose
            code, details = grpc.StatusCode.UNKNOWN, "the stream ended without the reply of a start / propose"
        finally:
            requests.put(None)
            replies.cancel()
        self.record.requests += len(sent)
        self.record.add("Session", code, details, sent, seconds=time.perf_counter() - started)

    def _draft_request(self, i: int) -> st.SearchStrategy:
        """A start first (mostly), then proposes, commits and now and then a second start."""
        kinds = ["start"] * 6 + ["propose", "commit"] if i == 0 else ["propose", "propose", "commit", "commit", "start"]
        start = st.builds(lambda s, p, q: draft_pb2.DraftRequest(start=draft_pb2.DraftStart(
            session_id=s, prompt_ids=p, sampling=q)), session_id(self.pool), prompt_ids(self.shape), sampling_params())
        propose = st.builds(lambda spec, d, r: draft_pb2.DraftRequest(propose=draft_pb2.TreeRequest(
            spec=spec, max_depth=d, round=r)), tree_spec(), st.sampled_from([1, 2, 3, 4, 0, -1, INT32[1]]),
            st.sampled_from([0, 1, 2**64 - 1]))
        bad = st.sampled_from([draft_pb2.DraftCommit(), draft_pb2.DraftCommit(tokens=[-1]),
                               draft_pb2.DraftCommit(tokens=[1], accepted_nodes=[0, 1]),
                               draft_pb2.DraftCommit(tokens=[1, 2], accepted_nodes=[INT32[1]]),
                               draft_pb2.DraftCommit(tokens=[1] * HUGE_REPEAT)])
        commit = st.builds(PlannedCommit, st.integers(-1, 1000), st.integers(0, self.shape.vocab - 1),
                           st.one_of(st.none(), st.none(), bad))
        return st.sampled_from(kinds).flatmap(lambda kind: {"start": start, "propose": propose, "commit": commit}[kind])

    def _generate(self, data: st.DataObject, random_message: bool) -> None:
        """One Generate stream: read 1-3 replies, then cancel it if it has not ended (CANCELLED, ours)."""
        request = data.draw(message_strategy(generation_pb2.GenerateRequest.DESCRIPTOR) if random_message
                            else self._generate_request(), label="generate request")
        wanted = data.draw(st.integers(1, 3), label="replies before the cancel")
        started = time.perf_counter()
        call = self.front.Generate(request, timeout=CALL_TIMEOUT_S)
        code, details, allowed, read = OK, "", ALLOWED, 0
        try:
            for _ in call:
                read += 1
                if read >= wanted:
                    call.cancel()
                    code, allowed = grpc.StatusCode.CANCELLED, ALLOWED | {grpc.StatusCode.CANCELLED}
                    break
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        self.record.requests += 1
        self.record.add("Generate", code, details, request, allowed, time.perf_counter() - started)

    def _generate_request(self) -> st.SearchStrategy:
        """A well-formed request (short greedy or sampled, prompt ids or text) with at most one field broken."""
        return st.sampled_from([None, None, "prompt", "max_new_tokens", "stop", "sampling", "tree", "request_id"]).flatmap(
            self._generate_broken)

    def _generate_broken(self, broken: str | None) -> st.SearchStrategy:
        ids = st.builds(lambda p: {"prompt_ids": p}, prompt_ids(self.shape, broken == "prompt"))
        text = st.builds(lambda t, raw: {"prompt": t, "raw": raw}, st.text(max_size=40), st.booleans())
        bad_stop = st.sampled_from([["x" * 300], ["a"] * 40, [""]])
        return st.builds(
            lambda rid, p, n, stop, q, t, flags: generation_pb2.GenerateRequest(
                request_id=rid, max_new_tokens=n, stop=stop, sampling=q, no_spec=flags[0], ignore_eos=flags[1], **p, **t),
            st.sampled_from(["x" * 70_000, "\u0000"] if broken == "request_id" else ["", "", "fz-req"]),
            ids if broken == "prompt" else st.one_of(ids, text),
            st.sampled_from([-1, INT32[0], INT32[1]] if broken == "max_new_tokens" else [1, 2, 4, 8, 0]),
            bad_stop if broken == "stop" else st.lists(st.text(max_size=4), max_size=3),
            sampling_params(broken == "sampling"),
            st.builds(lambda t: {"tree": t}, tree_spec(True)) if broken == "tree"
            else st.one_of(st.just({}), st.builds(lambda t: {"tree": t}, tree_spec(False))),
            st.tuples(st.booleans(), st.booleans()))


# ------------------------------------------------------------- the run: greedy reference, messages, checks

def greedy_on_target(stub, vocab: int, session: str = "fz-greedy") -> list[int]:
    """GREEDY_TOKENS plain decoding steps on the target alone (empty trees, temperature 0)."""
    prompt = [t % vocab for t in GREEDY_PROMPT]
    stub.Prefill(target_pb2.PrefillRequest(session_id=session, prompt_ids=prompt), timeout=CALL_TIMEOUT_S)
    out = []
    try:
        for _ in range(GREEDY_TOKENS):
            out += stub.Verify(target_pb2.VerifyRequest(session_id=session), timeout=CALL_TIMEOUT_S).tokens[:1]
            stub.Commit(target_pb2.CommitRequest(session_id=session, num_tokens=1), timeout=CALL_TIMEOUT_S)
    finally:
        stub.Release(target_pb2.ReleaseRequest(session_id=session), timeout=CALL_TIMEOUT_S)
    return out


def greedy_through_front(stub, vocab: int) -> list[int]:
    """GREEDY_TOKENS tokens of one greedy speculative Generate (ignore_eos)."""
    request = generation_pb2.GenerateRequest(prompt_ids=[t % vocab for t in GREEDY_PROMPT], max_new_tokens=GREEDY_TOKENS,
                                             ignore_eos=True)
    return [t for reply in stub.Generate(request, timeout=CALL_TIMEOUT_S) for t in reply.token_ids]


def greedy_outputs(fuzzer: Fuzzer) -> dict[str, list[int]]:
    out = {"target": greedy_on_target(fuzzer.target, fuzzer.shape.vocab)}
    if fuzzer.front:
        out["front"] = greedy_through_front(fuzzer.front, fuzzer.shape.vocab)
    return out


def drive(fuzzer: Fuzzer, messages: int, seed: int) -> int:
    """Run ``messages`` hypothesis cases (seeded, no database); returns the count run, unsent oversize included."""

    @hypothesis_seed(seed)
    @settings(max_examples=messages, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(st.data())
    def one(data):
        fuzzer.case(data)

    one()
    return sum(fuzzer.record.codes.values()) + fuzzer.record.unsent_oversize


def open_sessions(fuzzer: Fuzzer, settle_s: float = 20.0) -> dict[str, int]:
    """Sessions the services still hold, once 0 or after ``settle_s`` (cancelled requests release late)."""
    deadline = time.monotonic() + settle_s
    while True:
        t = fuzzer.target.Info(target_pb2.InfoRequest(), timeout=CALL_TIMEOUT_S)
        d = fuzzer.draft.Info(draft_pb2.DraftInfoRequest(), timeout=CALL_TIMEOUT_S)
        held = {"target_sessions": t.sessions, "target_cached_tokens": t.cached_tokens,
                "draft_sessions": d.sessions, "draft_cached_sessions": d.cached_sessions}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def run_fuzz(addresses: Addresses, messages: int, seed: int = 0, alive=None) -> dict:
    """Fuzz a deployment with ``messages`` cases; returns the figures and each property's verdict.
    Raises grpc.RpcError when the deployment does not answer the well-formed calls before the run."""
    info = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(addresses.target)).Info(
        target_pb2.InfoRequest(), timeout=CALL_TIMEOUT_S)
    shape = Shape(info.vocab_size, info.context_limit, info.max_tree_nodes or 128)
    fuzzer = Fuzzer(addresses, shape, pool=[f"fz-{seed}-{i}" for i in range(6)])
    try:
        before = greedy_outputs(fuzzer)
        started = time.perf_counter()
        ran = drive(fuzzer, messages, seed)
        elapsed_s = time.perf_counter() - started
        for sid in fuzzer.opened:  # the fuzzer's own sessions: releasing them is the client's job
            _status(lambda: fuzzer.target.Release(target_pb2.ReleaseRequest(session_id=sid), timeout=CALL_TIMEOUT_S))
        processes = alive() if alive else {}
        held = open_sessions(fuzzer)
        after = greedy_outputs(fuzzer)
    finally:
        fuzzer.close()
    return summarize(fuzzer.record, ran, elapsed_s, seed, held, before, after, processes)


def summarize(record: Record, ran: int, elapsed_s: float, seed: int, held: dict, before: dict, after: dict,
              processes: dict) -> dict:
    per_rpc: dict[str, dict[str, int]] = {}
    for (rpc, code), n in sorted(record.codes.items()):
        per_rpc.setdefault(rpc, {})[code] = n
    checks = {
        "only_allowed_codes": record.fault_count == 0,
        "servers_alive": all(processes.values()) if processes else True,
        "no_sessions_leaked": not any(held.values()),
        "greedy_unchanged": before == after,
    }
    return {
        "messages": ran, "requests": record.requests, "unsent_oversize": record.unsent_oversize, "seed": seed, "elapsed_s": round(elapsed_s, 1),
        "messages_per_s": round(ran / elapsed_s, 1) if elapsed_s else None,
        "allowed_codes": sorted(c.name for c in ALLOWED) + ["CANCELLED (the fuzzer's own cancel of a Generate)"],
        "codes_per_rpc": per_rpc, "seconds_per_rpc": {rpc: round(t, 2) for rpc, t in sorted(record.seconds.items())},
        "first_details": {f"{rpc} {code}": text for (rpc, code), text in sorted(record.details.items())},
        "faults": record.fault_count, "fault_examples": record.faults,
        "sessions_after": held, "greedy_before": before, "greedy_after": after, "processes_alive": processes,
        "checks": checks, "passed": all(checks.values()),
    }


# ------------------------------------------------------------- spawned tiny deployment, report, command line

@contextlib.contextmanager
def spawned_services(root: Path):
    """Draft, target and front (no Ray) on tiny models under ``root``; yields (Addresses, {name: Service})."""
    from specdec.harness.tiny_pair import save_tiny_pair, write_config  # torch and transformers: spawned servers only

    config = write_config(root / "serve.yaml", save_tiny_pair(root / "models"), draft={"max_sessions": 8},
                          target={"max_tree_nodes": 64, "max_kv_tokens": 20_000}, front={"port": 0})
    services = {"draft": launch_service("draft", config), "target": launch_service("target", config)}
    try:
        wait_ready(services["draft"]), wait_ready(services["target"])
        services["front"] = wait_ready(launch_service("front", config, draft_address=services["draft"].address,
                                                      target_address=services["target"].address, no_ray=True))
        yield Addresses(services["draft"].address, services["target"].address, services["front"].address), services
    finally:
        for service in services.values():
            stop_service(service)


def fuzz_spawned(messages: int, seed: int = 0, workdir: Path | None = None) -> dict:
    """Fuzz a spawned tiny deployment; adds each server's exit code and logged tracebacks to the result."""
    with spawned_services(Path(workdir or tempfile.mkdtemp(prefix="fuzz-"))) as (addresses, services):
        result = run_fuzz(addresses, messages, seed,
                          alive=lambda: {name: s.returncode is None for name, s in services.items()})
    exit_codes = {name: s.returncode for name, s in services.items()}
    tracebacks = {name: s.stderr.count("Traceback") for name, s in services.items()}
    result.update(exit_codes=exit_codes, tracebacks=tracebacks, deployment="spawned: tiny random-weight models, "
                  "float32 CPU, draft + target + front (use_ray false) on 127.0.0.1")
    result["checks"]["no_tracebacks_logged"] = not any(tracebacks.values())
    result["checks"]["clean_exit"] = all(code == 0 for code in exit_codes.values())
    result["passed"] = all(result["checks"].values())
    return result


def write_report(result: dict, out_dir) -> tuple[Path, Path]:
    """Write ``fuzz.json`` and ``fuzz.md`` under ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    codes = sorted({c for per in result["codes_per_rpc"].values() for c in per})
    lines = [f"# Fuzz: {result['messages']} messages ({result['requests']} requests), seed {result['seed']}", "",
             f"{result.get('deployment', 'a given deployment')}; {result['elapsed_s']} s, "
             f"{result['messages_per_s']} messages/s. Allowed: OK, {', '.join(result['allowed_codes'])}.", "",
             "| check | result |", "|---|---|"]
    lines += [f"| {name} | {'pass' if ok else 'FAIL'} |" for name, ok in result["checks"].items()]
    lines += ["", f"Faults: {result['faults']}. Sessions held after the run: {result['sessions_after']}.",
              f"Greedy tokens before = after: {result['greedy_before'] == result['greedy_after']} "
              f"({result['greedy_after']}).", "", "| rpc | " + " | ".join(codes) + " |", "|---" * (len(codes) + 1) + "|"]
    lines += [f"| {rpc} | " + " | ".join(str(per.get(c, 0)) for c in codes) + " |"
              for rpc, per in result["codes_per_rpc"].items()]
    for fault in result["fault_examples"][:10]:
        lines += ["", f"- {fault['rpc']} -> {fault['code']}: {fault['details']}", "", "```", fault["request"], "```"]
    (out / "fuzz.md").write_text("\n".join(lines) + "\n")
    return out / "fuzz.json", out / "fuzz.md"


def _address(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return text


def main(argv=None) -> int:
    """Command line; exit code 0 when every property held, 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000, help="cases to send (default 10000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="folder for fuzz.json and fuzz.md")
    for name in ("front", "draft", "target"):
        parser.add_argument(f"--{name}", type=_address, help=f"HOST:PORT of a running {name} (else spawned)")
    args = parser.parse_args(argv)
    if args.messages < 1:
        parser.error("--messages: must be >= 1")
    if args.draft or args.target:
        if not (args.draft and args.target):
            parser.error("--draft and --target: give both (and --front for the Generate / Abort cases)")
        result = run_fuzz(Addresses(args.draft, args.target, args.front), args.messages, args.seed)
    else:
        result = fuzz_spawned(args.messages, args.seed)
    paths = write_report(result, args.out)
    print(f"{result['messages']} messages, {result['faults']} faults, passed={result['passed']}: "
          + ", ".join(map(str, paths)))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
