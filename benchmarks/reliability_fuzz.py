"""Fuzz every RPC of the three services with random and mutated messages, or with stateful sequences of calls
(docs/benchmarks.md; the properties: ``run_fuzz``).

    python benchmarks/reliability_fuzz.py --messages 10000 --out DIR          # tiny random models, spawned here
    python benchmarks/reliability_fuzz.py --stateful --messages 300 --out DIR  # 300 sequences
    python benchmarks/reliability_fuzz.py --front H:P --draft H:P --target H:P --messages 2000 --out DIR

Writes fuzz.json and fuzz.md (stateful: fuzz_stateful.*) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
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

from specdec.harness.report import machine, md_table, nested_table, write_record  # noqa: E402
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


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, hi, 0, 1, -1, 2, 255, 256, 300, 4096) if lo <= v <= hi})
    return st.one_of(st.integers(max(lo, -3), min(hi, 40)), st.sampled_from(edges), st.integers(lo, hi))


FD = FieldDescriptor
SCALARS = {  # field type -> its values, extremes included (the protos have no enum field)
    **dict.fromkeys((FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32), _ints(*INT32)),
    **dict.fromkeys((FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64), _ints(*INT64)),
    **dict.fromkeys((FD.TYPE_UINT32, FD.TYPE_FIXED32), _ints(0, 2**32 - 1)),
    **dict.fromkeys((FD.TYPE_UINT64, FD.TYPE_FIXED64), _ints(0, 2**64 - 1)),
    FD.TYPE_FLOAT: st.one_of(st.floats(width=32), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0])),
    FD.TYPE_DOUBLE: st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1.0, 1e308, 5e-324])),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: st.one_of(st.text(max_size=20), st.sampled_from(["", "fz-0", "x" * 70_000, "\u0000",
                                                                     "\ud7ff\U0010ffff"])),
    FD.TYPE_BYTES: st.binary(max_size=64),
}


def _value(fd: FieldDescriptor, depth: int) -> st.SearchStrategy:
    return message_strategy(fd.message_type, depth + 1) if fd.type == FD.TYPE_MESSAGE else SCALARS[fd.type]


def _repeated(fd: FieldDescriptor, depth: int) -> st.SearchStrategy[list]:
    """Short lists, or one value repeated many times at the top level (nested lists stay small)."""
    element = _value(fd, depth)
    small = st.lists(element, max_size=8)
    if fd.type == FD.TYPE_MESSAGE:
        sizes = [1_000, 10_000] if depth == 0 else [50]
    else:
        sizes = [129, 4_096, HUGE_REPEAT] if depth == 0 else [129]
    if fd.type in (FD.TYPE_STRING, FD.TYPE_BYTES):  # short values: 100,000 x 70 KB would be 7 GB
        element = st.text(max_size=8) if fd.type == FD.TYPE_STRING else st.binary(max_size=8)
    huge = st.builds(lambda v, n: [v] * n, element, st.sampled_from(sizes))
    return st.one_of(small, small, small, huge)


@st.composite
def message_strategy(draw, descriptor, depth: int = 0):
    """Random instances of the protobuf message ``descriptor``, nested messages down to depth 4."""
    chosen_oneofs = {o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in descriptor.oneofs
                     if not o.name.startswith("_")}  # "_seed": proto3 optional, drawn as a plain field
    values = {}
    for fd in descriptor.fields:
        oneof = fd.containing_oneof
        if oneof is not None and oneof.name in chosen_oneofs:
            if chosen_oneofs[oneof.name] != fd.name:
                continue
        elif not draw(st.booleans()):
            continue  # unset
        if depth <= 3 or fd.type != FD.TYPE_MESSAGE:
            values[fd.name] = draw(_repeated(fd, depth) if fd.is_repeated else _value(fd, depth))
    return message_factory.GetMessageClass(descriptor)(**values)


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
        bad = {"gamma": [0, -1, 65, INT32[1]], "tree_type": [2, -1, INT32[1]],
               "gamma_threshold": [math.nan, math.inf, -1.0, 2.0]}
        kind = draw(st.sampled_from(["gamma", "rows", "heads", "tree_type", "gamma_threshold", "k", "huge"]))
        if kind in bad:
            setattr(spec, kind, draw(st.sampled_from(bad[kind])))
        elif kind == "rows":
            spec.top_k_spec.append(tree_pb2.TopKRow(k=[1, 1]))
        elif kind == "heads":
            spec.top_head[0] = draw(st.sampled_from([0, 2, -1]))
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


# What ended a call on the client's side, not with the server's status. The server owed an answer to the
# last two: a fault. (grpc marks its client's own refusals "CLIENT: ..."; a passed deadline of ours is
# "Deadline Exceeded"; a server's own DEADLINE_EXCEEDED names its deadline.)
OWN_CANCEL, CLIENT_REFUSED, UNSENT_OVERSIZE, NO_ANSWER, TRANSPORT = (
    "own_cancel", "client_refused", "unsent_oversize", "no_answer", "transport")
CLIENT_FAULTS = {NO_ANSWER, TRANSPORT}


def origin(code: grpc.StatusCode, details: str, own_cancel: bool = False) -> str | None:
    """None when ``code`` is the server's answer; else what ended the call on the client's side."""
    if own_cancel and code is grpc.StatusCode.CANCELLED:
        return OWN_CANCEL
    if details.startswith("CLIENT:"):
        return CLIENT_REFUSED
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
        return NO_ANSWER
    if details.startswith(("Stream removed", "Socket closed", "failed to connect", "Connection reset")):
        return TRANSPORT
    return None


@dataclass
class Record:
    """Outcomes of the run so far: the servers' answers per RPC, the calls that ended on the client's side,
    and the faults with their inputs (a status not allowed, no answer, or, in the stateful mode, an answer
    other than the model's)."""

    codes: Counter = field(default_factory=Counter)  # (rpc, code name) -> the server's answers
    client_side: Counter = field(default_factory=Counter)  # (rpc, origin) -> calls the client side ended
    requests: int = 0  # request messages sent (a stream counts each of its messages)
    faults: list[dict] = field(default_factory=list)
    fault_count: int = 0
    violations: int = 0  # stateful mode: answers unlike the model's (counted in fault_count too)
    seconds: Counter = field(default_factory=Counter)  # rpc -> wall time of its calls (s)
    details: dict = field(default_factory=dict)  # (rpc, code name) -> the details of its first call

    def add(self, rpc: str, code: grpc.StatusCode, details: str, request, seconds: float = 0.0,
            own_cancel: bool = False) -> bool:
        """Count one call's end; True when it is the server's answer."""
        self.seconds[rpc] += seconds
        where = origin(code, details, own_cancel)
        if where is not None:
            self.client_side[(rpc, where)] += 1
            if where in CLIENT_FAULTS:
                self._fault(rpc, code.name, details, request)
            return False
        self.codes[(rpc, code.name)] += 1
        self.details.setdefault((rpc, code.name), details[:200])
        if code is not OK and code not in ALLOWED:
            self._fault(rpc, code.name, details, request)
        return True

    def answer(self, rpc: str, code: grpc.StatusCode, details: str, request, started: float, expect=None,
               own_cancel: bool = False) -> None:
        """Count one call sent at perf_counter ``started`` (a list: a stream's messages); with ``expect`` (stateful),
        a server's answer other than those is a violation."""
        self.requests += len(request) if isinstance(request, list) else 1
        answered = self.add(rpc, code, details, request, seconds=time.perf_counter() - started, own_cancel=own_cancel)
        if answered and expect is not None and code not in expect:
            self.violation(rpc, f"{code.name} where the model expects {sorted(c.name for c in expect)}: "
                                f"{details[:200]}", request)

    def violation(self, rpc: str, what: str, request) -> None:
        """An answer the stateful model did not expect (a status, or a value of the reply)."""
        self.violations += 1
        self._fault(rpc, "MODEL", what, request)

    def _fault(self, rpc: str, code: str, details: str, request) -> None:
        self.fault_count += 1
        text = "\n---\n".join(map(str, request)) if isinstance(request, list) else str(request)
        if len(self.faults) < MAX_FAULTS_KEPT:
            self.faults.append({"rpc": rpc, "code": code, "details": details[:500],
                                "request": text if len(text) <= 800 else text[:800] + f"... ({len(text)} chars)"})


class Fuzzer:
    """Sends the cases to one deployment (synchronous channels) and records their statuses."""

    def __init__(self, addresses: Addresses, shape: Shape, pool: list[str]):
        self.shape, self.pool = shape, pool
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

    def call(self, rpc: str, method, request, expect=None):
        """One unary call, recorded (``expect``: Record.answer, a violation when the server answers other than
        those): its reply, or None when it failed."""
        started = time.perf_counter()
        try:
            reply, code, details = method(request, timeout=CALL_TIMEOUT_S), OK, ""
        except grpc.RpcError as exc:
            reply, code, details = None, exc.code(), exc.details() or ""
        self.record.answer(rpc, code, details, request, started, expect)
        return reply

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
            self.record.client_side[(rpc, UNSENT_OVERSIZE)] += 1
            return
        if self.call(rpc, stub_call, request) is not None and rpc == "Prefill":
            self.opened.add(request.session_id)  # released at the end (the client's job), with the pool's

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

        def feed(send, sent) -> None:
            last_tree = None
            for planned in plan:
                msg = planned.resolve(last_tree, self.shape.vocab) if isinstance(planned, PlannedCommit) else planned
                reply = send(msg, answer=msg.WhichOneof("kind") in ("start", "propose"))
                last_tree = reply.tree.tree if reply is not None and reply.WhichOneof("kind") == "tree" else last_tree

        self.draft_session(feed)

    def draft_session(self, feed, expect=None) -> None:
        """One Session stream: ``feed(send, sent)`` sends its messages (``send(msg, answer)`` returns the reply to a
        start or propose; ``sent``: the messages so far), then the stream is read to its end and recorded as one call
        (``expect``: Record.answer)."""
        requests: queue.Queue = queue.Queue()
        started = time.perf_counter()
        replies = self.draft.Session(iter(requests.get, None), timeout=CALL_TIMEOUT_S)
        sent, code, details = [], OK, ""

        def send(msg, answer: bool):
            sent.append(msg)
            requests.put(msg)
            return next(replies) if answer else None

        try:
            feed(send, sent)
            requests.put(None)
            for _ in replies:
                pass
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        except StopIteration:  # the stream ended OK before answering a start / propose: an answer, but a wrong one
            self.record.violation("Session", "the stream ended without the reply of a start / propose", sent)
        finally:
            requests.put(None)
            replies.cancel()
        self.record.answer("Session", code, details, sent, started, expect)

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
        broken = st.sampled_from([None, None, "prompt", "max_new_tokens", "stop", "sampling", "tree", "request_id"])
        request = data.draw(message_strategy(generation_pb2.GenerateRequest.DESCRIPTOR) if random_message
                            else broken.flatmap(self._generate_request), label="generate request")
        wanted = data.draw(st.integers(1, 3), label="replies before the cancel")
        self.stream(self.front.Generate(request, timeout=CALL_TIMEOUT_S), request, cancel_after=wanted)

    def stream(self, call, request, first_only: bool = False, cancel_after: int = 0,
               expect=None) -> tuple[list[int], str, bool]:
        """Read a Generate stream: its first reply only, or to its end or its ``cancel_after``-th reply (then
        cancelled: CANCELLED, ours), recorded (``expect``: Record.answer): (tokens, stop_reason, ended)."""
        tokens, stop, code, details, own_cancel = [], "", OK, "", False
        started = time.perf_counter()
        try:
            for read, reply in enumerate(call, 1):
                tokens += reply.token_ids
                stop = reply.stats.stop_reason if reply.HasField("stats") else stop
                if first_only:
                    return tokens, stop, False
                if read == cancel_after:
                    call.cancel()
                    code, own_cancel = grpc.StatusCode.CANCELLED, True
                    break
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        self.record.answer("Generate", code, details, request, started, expect, own_cancel)
        return tokens, stop, True

    def _generate_request(self, broken: str | None) -> st.SearchStrategy:
        """A well-formed request (short greedy or sampled, prompt ids or text), field ``broken`` (or none) broken."""
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


GEN_TOKENS = 200  # a Generate the stateful mode aborts (ignore_eos: seconds of decoding, so it runs when aborted)
KNOWN_CHAIN = 4  # nodes of a tree built from a known greedy continuation (all must be accepted)
MISPLACED = [None, None, None, "start", "bad_commit"]  # a draft stream's misplaced message, if any


@dataclass
class Slot:
    """The model of one target session (greedy): open or not, its context (prompt + committed tokens; the last one
    is the root R) and the verify awaiting its commit (tree bytes, tokens answered, the tree)."""

    sid: str
    open: bool = False
    context: tuple = ()
    pending: tuple | None = None


class Stateful:
    """The stateful mode (docs/benchmarks.md): sequences of calls, every answer's status and values checked against
    this model of the services."""

    OPS = ("open", "verify", "commit", "release", "verify_batch", "generate_abort", "draft_stream")

    def __init__(self, fuzzer: Fuzzer):
        self.f, self.record, self.shape = fuzzer, fuzzer.record, fuzzer.shape
        self.prompts = [tuple(t % self.shape.vocab for t in p) for p in (GREEDY_PROMPT, [8, 8, 1])]
        self.known: dict[tuple, tuple] = {}  # context -> the target's greedy continuation seen so far
        self.drafts: dict[tuple, tuple] = {}  # (context, spec, depth) -> the draft's tree seen
        self.sequences, self.steps, self.ops = 0, 0, Counter()
        self.cross_checked = Counter()  # answers compared with an earlier one on the same context: "greedy", "draft"

    def sequence(self, data: st.DataObject) -> None:
        """One sequence of 2-12 calls on fresh ids, each step 3 times in 4 the one that takes a session a step
        further (open, verify, commit), else any; its sessions released at the end (the client's job)."""
        self.sequences += 1
        slots = [Slot(f"st-{self.sequences}-{i}") for i in range(2)]
        try:
            for _ in range(data.draw(st.integers(2, 12), label="steps")):
                if data.draw(st.integers(0, 3), label="any op") == 0:
                    op = data.draw(st.sampled_from(self.OPS), label="op")
                else:
                    slot = data.draw(st.sampled_from(slots), label="further")
                    op = "open" if not slot.open else "commit" if slot.pending else "verify"
                self.steps += 1
                self.ops[op] += 1
                getattr(self, f"_{op}")(data, slots)
        finally:
            for slot in slots:
                self._release_slot(slot)

    @staticmethod
    def _slot(data: st.DataObject, slots: list[Slot], prefer) -> Slot:
        """A slot; 3 times in 4 one that ``prefer`` accepts, if any (so sequences reach deep states)."""
        liked = [s for s in slots if prefer(s)]
        if liked and data.draw(st.integers(0, 3), label="prefer") > 0:
            return data.draw(st.sampled_from(liked), label="slot")
        return data.draw(st.sampled_from(slots), label="slot")

    def _check(self, ok: bool, rpc: str, what: str, request) -> None:
        if not ok:
            self.record.violation(rpc, what, request)

    def _learn(self, context: tuple, tokens, rpc: str, request) -> None:
        """``tokens`` continue ``context`` greedily: they must agree with what was seen there; keep the longer."""
        seen = self.known.get(context, ())
        self.cross_checked["greedy"] += bool(seen)
        agree = tuple(seen[:len(tokens)]) == tuple(tokens[:len(seen)])  # one a prefix of the other
        self._check(agree, rpc, f"greedy tokens {list(tokens)} after {len(context)} tokens, earlier {list(seen)}",
                    request)
        if len(tokens) > len(seen):
            self.known[context] = tuple(tokens)

    def _open(self, data: st.DataObject, slots: list[Slot]) -> None:
        """Prefill: OK on a closed id (opened, reused after a release), ALREADY_EXISTS on an open one,
        INVALID_ARGUMENT for a token outside the vocabulary (checked first)."""
        slot = self._slot(data, slots, lambda s: not s.open)
        prompt = list(data.draw(st.sampled_from(self.prompts), label="prompt"))
        broken = data.draw(st.integers(0, 4), label="broken prompt") == 0
        if broken:
            prompt[-1] = self.shape.vocab
        expect = {grpc.StatusCode.INVALID_ARGUMENT} if broken else {grpc.StatusCode.ALREADY_EXISTS} if slot.open else {OK}
        request = target_pb2.PrefillRequest(session_id=slot.sid, prompt_ids=prompt)
        reply = self.f.call("Prefill", self.f.target.Prefill, request, expect)
        if reply is not None and expect == {OK}:
            self._check(reply.cached_tokens == len(prompt) - 1, "Prefill", f"cached_tokens {reply.cached_tokens}", request)
            slot.open, slot.context, slot.pending = True, tuple(prompt), None

    def _tree(self, data: st.DataObject, slot: Slot) -> tuple[tree_pb2.TokenTree, int | None]:
        """A tree for ``slot``: its pending one again (a replay), a chain of its known continuation (all of it to be
        accepted: returns its length), a small fixed one, or one with a token outside the vocabulary."""
        known = self.known.get(slot.context, ())
        kind = data.draw(st.sampled_from(["replay", "known", "known", "empty", "small", "broken"]), label="tree")
        if kind == "replay" and slot.pending is not None:
            return slot.pending[2], None
        if kind == "known" and known:
            chain = known[:KNOWN_CHAIN]
            return tree_pb2.TokenTree(tokens=chain, parents=list(range(-1, len(chain) - 1))), len(chain)
        if kind == "broken":
            return tree_pb2.TokenTree(tokens=[self.shape.vocab], parents=[-1]), None
        if kind == "small":
            return tree_pb2.TokenTree(tokens=[1, 2, 3], parents=[-1, -1, 0]), None
        return tree_pb2.TokenTree(), None

    def _verify_expect(self, slot: Slot, tree: tree_pb2.TokenTree) -> grpc.StatusCode:
        """The target's order of checks: the session, the tree, a pending verify (the same tree replays), the context."""
        if not slot.open:
            return grpc.StatusCode.FAILED_PRECONDITION
        if any(not 0 <= t < self.shape.vocab for t in tree.tokens):
            return grpc.StatusCode.INVALID_ARGUMENT
        if slot.pending is not None:
            return OK if tree.SerializeToString(deterministic=True) == slot.pending[0] else grpc.StatusCode.FAILED_PRECONDITION
        depth = len(tree.tokens) and max(self._depths(tree.parents))
        return grpc.StatusCode.INVALID_ARGUMENT if len(slot.context) - 1 + depth >= self.shape.context_limit else OK

    @staticmethod
    def _depths(parents) -> list[int]:
        depths: list[int] = []
        for p in parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    def _verified(self, slot: Slot, tree, reply, chain: int | None, rpc: str, request) -> None:
        """Check one verify answer against the model and keep it pending (a replay must equal the first answer)."""
        tokens, nodes = tuple(reply.tokens), list(reply.accepted_nodes)
        if slot.pending is not None:
            self._check(tokens == slot.pending[1], rpc, f"replay answered {list(tokens)}, first {list(slot.pending[1])}", request)
            return
        parents = tree.parents  # nodes: a path from a root down, each the child of the one before
        path_ok = (len(tokens) == len(nodes) + 1 and all(
            0 <= n < len(parents) and parents[n] == (nodes[i - 1] if i else -1) and tokens[i] == tree.tokens[n]
            for i, n in enumerate(nodes)))
        self._check(path_ok, rpc, f"accepted {nodes} / tokens {list(tokens)} are no root path of the tree", request)
        self._check(chain is None or len(nodes) == chain, rpc, f"{len(nodes)} of a known greedy chain of {chain} accepted", request)
        self._learn(slot.context, tokens, rpc, request)
        slot.pending = (tree.SerializeToString(deterministic=True), tokens, tree)

    def _verify(self, data: st.DataObject, slots: list[Slot]) -> None:
        slot = self._slot(data, slots, lambda s: s.open)
        tree, chain = self._tree(data, slot)
        request = target_pb2.VerifyRequest(session_id=slot.sid, tree=tree)
        expect = self._verify_expect(slot, tree)
        reply = self.f.call("Verify", self.f.target.Verify, request, {expect})
        if reply is not None and expect is OK:
            self._verified(slot, tree, reply, chain, "Verify", request)

    def _verify_batch(self, data: st.DataObject, slots: list[Slot]) -> None:
        """VerifyBatch of 1-2 items (a session twice: INVALID_ARGUMENT); else the first failing item's status."""
        chosen = data.draw(st.lists(st.sampled_from(slots), min_size=1, max_size=2), label="items")
        trees = [self._tree(data, slot) for slot in chosen]
        request = target_pb2.VerifyBatchRequest(items=[target_pb2.VerifyRequest(session_id=s.sid, tree=t)
                                                       for s, (t, _) in zip(chosen, trees)])
        codes = [self._verify_expect(s, t) for s, (t, _) in zip(chosen, trees)]
        duplicate = len({s.sid for s in chosen}) < len(chosen)
        expect = grpc.StatusCode.INVALID_ARGUMENT if duplicate else next((c for c in codes if c is not OK), OK)
        reply = self.f.call("VerifyBatch", self.f.target.VerifyBatch, request, {expect})
        if reply is None or expect is not OK:
            return
        self._check(len(reply.results) == len(chosen), "VerifyBatch", f"{len(reply.results)} results", request)
        for slot, (tree, chain), result in zip(chosen, trees, reply.results):
            self._verified(slot, tree, result, chain, "VerifyBatch", request)

    def _commit(self, data: st.DataObject, slots: list[Slot]) -> None:
        """Commit: FAILED_PRECONDITION with no session or no pending verify, INVALID_ARGUMENT outside [1, tokens]."""
        slot = self._slot(data, slots, lambda s: s.pending is not None)
        answered = len(slot.pending[1]) if slot.pending else 1
        n = data.draw(st.sampled_from([answered, answered, 1, answered + 1, 0]), label="num_tokens")
        expect = (grpc.StatusCode.FAILED_PRECONDITION if not slot.open or slot.pending is None
                  else OK if 1 <= n <= answered else grpc.StatusCode.INVALID_ARGUMENT)
        request = target_pb2.CommitRequest(session_id=slot.sid, num_tokens=n)
        reply = self.f.call("Commit", self.f.target.Commit, request, {expect})
        if reply is not None and expect is OK:
            self._check(reply.cached_tokens == len(slot.context) - 1 + n, "Commit", f"cached_tokens {reply.cached_tokens} "
                        f"after {len(slot.context)} + {n}", request)
            tokens = slot.pending[1]
            slot.context, slot.pending = slot.context + tokens[:n], None
            if tokens[n:]:
                self._learn(slot.context, tokens[n:], "Commit", request)  # the rest still continues the new context

    def _release(self, data: st.DataObject, slots: list[Slot]) -> None:
        self._release_slot(data.draw(st.sampled_from(slots), label="slot"))

    def _release_slot(self, slot: Slot) -> None:
        """Release: OK, released = whether the session was open; the id is free again."""
        request = target_pb2.ReleaseRequest(session_id=slot.sid)
        reply = self.f.call("Release", self.f.target.Release, request, {OK})
        if reply is not None:
            self._check(reply.released == slot.open, "Release", f"released {reply.released}, open {slot.open}", request)
        slot.open, slot.pending = False, None

    def _generate_abort(self, data: st.DataObject, slots: list[Slot]) -> None:
        """A running Generate: its id again (ALREADY_EXISTS), Abort (the stream ends "aborted" if it answered
        true), Abort again (false), the id reused (OK); greedy tokens as the target's on the same prompt."""
        if self.f.front is None:
            return
        prompt = data.draw(st.sampled_from(self.prompts), label="prompt")
        rid = f"st-{self.sequences}-{self.steps}"
        request = generation_pb2.GenerateRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=GEN_TOKENS,
                                                 ignore_eos=True)
        call = self.f.front.Generate(request, timeout=CALL_TIMEOUT_S)
        tokens, stop, ended = self.f.stream(call, request, first_only=True, expect={OK})
        if ended:  # refused or failed: recorded (and a violation) already
            return
        again = generation_pb2.GenerateRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=2)
        self.f.stream(self.f.front.Generate(again, timeout=CALL_TIMEOUT_S), again,
                      expect={grpc.StatusCode.ALREADY_EXISTS})
        abort = generation_pb2.AbortRequest(request_id=rid)
        first = self.f.call("Abort", self.f.front.Abort, abort, {OK})
        more, stop, _ = self.f.stream(call, request, expect={OK})
        tokens += more
        if first is not None:
            done = "aborted" if first.aborted else "max_new_tokens"
            self._check(stop == done, "Generate", f"stop_reason {stop!r} after Abort answered {first.aborted}", request)
        second = self.f.call("Abort", self.f.front.Abort, abort, {OK})
        self._check(second is None or not second.aborted, "Abort", "a second Abort of an ended request answered true", abort)
        reuse = generation_pb2.GenerateRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=4, ignore_eos=True)
        again_tokens, _, _ = self.f.stream(self.f.front.Generate(reuse, timeout=CALL_TIMEOUT_S), reuse, expect={OK})
        self._learn(tuple(prompt), tokens, "Generate", request)
        self._learn(tuple(prompt), again_tokens, "Generate", reuse)

    def _draft_stream(self, data: st.DataObject, slots: list[Slot]) -> None:
        """A Session stream: start, 1-3 rounds of propose + commit (a root path of the tree + a bonus), maybe one
        misplaced message (a second start, a commit naming no node: INVALID_ARGUMENT, the stream ends); each tree
        well-formed and equal to the draft's earlier tree on the same context; a second stream reuses the id."""
        prompt = data.draw(st.sampled_from(self.prompts), label="prompt")
        rounds = [(data.draw(st.integers(1, 3), label="max_depth"), data.draw(st.integers(0, 50), label="leaf"),
                   data.draw(st.integers(0, self.shape.vocab - 1), label="bonus"))
                  for _ in range(data.draw(st.integers(1, 3), label="rounds"))]
        misplaced = data.draw(st.sampled_from(MISPLACED), label="misplaced")
        sid = f"st-{self.sequences}-draft"
        for _ in range(data.draw(st.integers(1, 2), label="streams on the id")):
            self._one_draft_stream(sid, prompt, rounds, misplaced)

    def _one_draft_stream(self, sid: str, prompt: tuple, rounds: list, misplaced: str | None) -> None:
        spec = tree_pb2.TreeSpec(gamma=2, top_k_spec=[tree_pb2.TopKRow(k=[2]), tree_pb2.TopKRow(k=[1])], top_head=[1, 1])
        start = draft_pb2.DraftRequest(start=draft_pb2.DraftStart(session_id=sid, prompt_ids=prompt))

        def feed(send, sent) -> None:
            context = tuple(prompt)
            send(start, answer=True)
            for i, (depth, leaf, bonus) in enumerate(rounds):
                propose = draft_pb2.DraftRequest(propose=draft_pb2.TreeRequest(spec=spec, max_depth=depth, round=i))
                tree = send(propose, answer=True).tree.tree
                self._draft_tree(context, depth, tree, sent)
                commit = PlannedCommit(leaf, bonus).resolve(tree, self.shape.vocab)
                if misplaced and i == len(rounds) - 1:  # the last round's commit is replaced
                    commit = start if misplaced == "start" else draft_pb2.DraftRequest(commit=draft_pb2.DraftCommit(
                        tokens=[1, 1], accepted_nodes=[len(tree.tokens) + 50]))
                send(commit, answer=False)
                context += tuple(commit.commit.tokens)

        self.f.draft_session(feed, {grpc.StatusCode.INVALID_ARGUMENT if misplaced else OK})

    def _draft_tree(self, context: tuple, depth: int, tree, sent) -> None:
        """A proposed tree: topological, ids in the vocabulary, no deeper than asked, equal to the tree proposed
        before on the same context and depth (greedy drafting, the draft's KV rolled back to its commits)."""
        parents, tokens = list(tree.parents), list(tree.tokens)
        well_formed = (len(parents) == len(tokens) and all(-1 <= p < i for i, p in enumerate(parents))
                       and all(0 <= t < self.shape.vocab for t in tokens)
                       and max(self._depths(parents), default=0) <= depth)
        self._check(well_formed, "Session", f"proposed tree {tokens} / {parents} is malformed (max depth {depth})", sent)
        self.cross_checked["draft"] += (context, depth) in self.drafts
        seen = self.drafts.setdefault((context, depth), (tuple(tokens), tuple(parents)))
        self._check(seen == (tuple(tokens), tuple(parents)), "Session",
                    f"tree {tokens} / {parents} after {len(context)} tokens, earlier {list(seen[0])} / {list(seen[1])}", sent)


def greedy_outputs(fuzzer: Fuzzer, session: str = "fz-greedy") -> dict[str, list[int]]:
    """GREEDY_TOKENS tokens of GREEDY_PROMPT: "target": plain decoding steps on the target alone (empty trees,
    temperature 0); "front" (if any): one greedy speculative Generate (ignore_eos)."""
    prompt, stub, tokens = [t % fuzzer.shape.vocab for t in GREEDY_PROMPT], fuzzer.target, []
    stub.Prefill(target_pb2.PrefillRequest(session_id=session, prompt_ids=prompt), timeout=CALL_TIMEOUT_S)
    try:
        for _ in range(GREEDY_TOKENS):
            tokens += stub.Verify(target_pb2.VerifyRequest(session_id=session), timeout=CALL_TIMEOUT_S).tokens[:1]
            stub.Commit(target_pb2.CommitRequest(session_id=session, num_tokens=1), timeout=CALL_TIMEOUT_S)
    finally:
        stub.Release(target_pb2.ReleaseRequest(session_id=session), timeout=CALL_TIMEOUT_S)
    out = {"target": tokens}
    if fuzzer.front:
        request = generation_pb2.GenerateRequest(prompt_ids=prompt, max_new_tokens=GREEDY_TOKENS, ignore_eos=True)
        out["front"] = [t for reply in fuzzer.front.Generate(request, timeout=CALL_TIMEOUT_S) for t in reply.token_ids]
    return out


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


def run_fuzz(addresses: Addresses, messages: int, seed: int = 0, alive=None, stateful: bool = False) -> dict:
    """Fuzz a deployment with ``messages`` hypothesis cases (stateful: sequences; seeded, no database, no shrinking);
    the figures and each property's verdict. Raises grpc.RpcError when the deployment does not answer the
    well-formed calls before the run."""
    info = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(addresses.target)).Info(
        target_pb2.InfoRequest(), timeout=CALL_TIMEOUT_S)
    shape = Shape(info.vocab_size, info.context_limit, info.max_tree_nodes or 128)
    fuzzer = Fuzzer(addresses, shape, pool=[f"fz-{seed}-{i}" for i in range(6)])
    machine = Stateful(fuzzer) if stateful else None

    @hypothesis_seed(seed)
    @settings(max_examples=messages, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(st.data())
    def case(data):
        (machine.sequence if machine else fuzzer.case)(data)

    try:
        before = greedy_outputs(fuzzer)
        started = time.perf_counter()
        case()
        elapsed_s = time.perf_counter() - started
        for sid in fuzzer.opened:  # the fuzzer's own sessions: releasing them is the client's job
            with contextlib.suppress(grpc.RpcError):
                fuzzer.target.Release(target_pb2.ReleaseRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
        processes = alive() if alive else {}
        held = open_sessions(fuzzer)
        after = greedy_outputs(fuzzer)
    finally:
        fuzzer.close()
    ran = machine.sequences if machine else sum(fuzzer.record.codes.values()) + sum(fuzzer.record.client_side.values())
    result = summarize(fuzzer.record, ran, elapsed_s, seed, held, before, after, processes)
    if machine:
        result.update(mode="stateful", sequences=machine.sequences, steps=machine.steps, ops=dict(sorted(machine.ops.items())),
                      known_contexts=len(machine.known), cross_checked=dict(machine.cross_checked),
                      violations=fuzzer.record.violations)
        result["checks"]["answers_as_modelled"] = fuzzer.record.violations == 0
        result["passed"] = all(result["checks"].values())
    return result


def summarize(record: Record, ran: int, elapsed_s: float, seed: int, held: dict, before: dict, after: dict,
              processes: dict) -> dict:
    def per_rpc(counts: Counter) -> dict[str, dict[str, int]]:
        nested: dict[str, dict[str, int]] = {}
        for (rpc, key), n in sorted(counts.items()):
            nested.setdefault(rpc, {})[key] = n
        return nested

    checks = {
        "only_allowed_codes": record.fault_count - record.violations == 0,
        "servers_alive": all(processes.values()),
        "no_sessions_leaked": not any(held.values()),
        "greedy_unchanged": before == after,
    }
    return {
        "mode": "random", "messages": ran, "requests": record.requests, "server_answers": sum(record.codes.values()),
        "client_side": sum(record.client_side.values()), "seed": seed, "elapsed_s": round(elapsed_s, 1),
        "messages_per_s": round(ran / elapsed_s, 1) if elapsed_s else None,
        "allowed_codes": sorted(c.name for c in ALLOWED),
        "codes_per_rpc": per_rpc(record.codes), "client_side_per_rpc": per_rpc(record.client_side),
        "seconds_per_rpc": {rpc: round(t, 2) for rpc, t in sorted(record.seconds.items())},
        "first_details": {f"{rpc} {code}": text for (rpc, code), text in sorted(record.details.items())},
        "faults": record.fault_count, "fault_examples": record.faults,
        "sessions_after": held, "greedy_before": before, "greedy_after": after, "processes_alive": processes,
        "checks": checks, "passed": all(checks.values()),
    }


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


def write_report(result: dict, out_dir) -> tuple[Path, Path]:
    """Write ``fuzz.json`` and ``fuzz.md`` (stateful: ``fuzz_stateful.*``) under ``out_dir``; returns their paths."""
    machine = result.get("machine", {})
    what = (f"{result['sequences']} sequences ({result['steps']} steps, {result['requests']} requests)"
            if result["mode"] == "stateful" else f"{result['messages']} messages ({result['requests']} requests)")
    lines = [f"# Fuzz ({result['mode']}): {what}, seed {result['seed']}", "",
             f"{result.get('deployment', 'a given deployment')}; commit {machine.get('commit', '?')}, "
             f"{machine.get('cpu_model', '?')} ({machine.get('cpus', '?')} CPUs); {result['elapsed_s']} s. Allowed: OK, "
             f"{', '.join(result['allowed_codes'])}. Server answers: {result['server_answers']}; ended on the client's "
             f"side: {result['client_side']} (not answers: counted apart).", ""]
    lines += md_table(["check", "result"], [[name, "pass" if ok else "FAIL"] for name, ok in result["checks"].items()])
    lines += ["", f"Faults: {result['faults']}. Sessions held after the run: {result['sessions_after']}.",
              f"Greedy tokens before = after: {result['greedy_before'] == result['greedy_after']} "
              f"({result['greedy_after']})."]
    if result["mode"] == "stateful":
        lines += ["", f"Steps by operation: {result['ops']}. Model violations: {result['violations']}. Answers compared "
                      f"with an earlier answer on the same context: {result['cross_checked']} (greedy tokens of the "
                      f"target and front; the draft's trees), over {result['known_contexts']} target contexts."]
    lines += ["", "Server answers:", ""] + nested_table("rpc", result["codes_per_rpc"])
    lines += ["", "Ended on the client's side:", ""] + nested_table("rpc", result["client_side_per_rpc"])
    for fault in result["fault_examples"][:10]:
        lines += ["", f"- {fault['rpc']} -> {fault['code']}: {fault['details']}", "", "```", fault["request"], "```"]
    name = "fuzz_stateful" if result["mode"] == "stateful" else "fuzz"
    return write_record(out_dir, name, result, "\n".join(lines) + "\n")


def _address(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return text


def main(argv=None) -> int:
    """Command line; exit code 0 when every property held, 1 otherwise. A spawned tiny deployment's result also
    holds each server's exit code and logged tracebacks."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000, help="cases to send (default 10000; stateful: sequences)")
    parser.add_argument("--stateful", action="store_true", help="sequences of calls checked against a model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="folder for fuzz.json and fuzz.md (fuzz_stateful.*)")
    for name in ("front", "draft", "target"):
        parser.add_argument(f"--{name}", type=_address, help=f"HOST:PORT of a running {name} (else spawned)")
    args = parser.parse_args(argv)
    if args.messages < 1:
        parser.error("--messages: must be >= 1")
    if args.draft or args.target:
        if not (args.draft and args.target):
            parser.error("--draft and --target: give both (and --front for the Generate / Abort cases)")
        result = run_fuzz(Addresses(args.draft, args.target, args.front), args.messages, args.seed, stateful=args.stateful)
    else:
        with tempfile.TemporaryDirectory(prefix="fuzz-") as root, spawned_services(Path(root)) as (addresses, services):
            result = run_fuzz(addresses, args.messages, args.seed, stateful=args.stateful,
                              alive=lambda: {name: s.returncode is None for name, s in services.items()})
        result.update(exit_codes={name: s.returncode for name, s in services.items()},
                      tracebacks={name: s.stderr.count("Traceback") for name, s in services.items()},
                      deployment="spawned: tiny random-weight models, float32 CPU, draft + target + front (use_ray "
                                 "false) on 127.0.0.1")
        result["checks"]["no_tracebacks_logged"] = not any(result["tracebacks"].values())
        result["checks"]["clean_exit"] = all(code == 0 for code in result["exit_codes"].values())
        result["passed"] = all(result["checks"].values())
    result["machine"] = machine()
    paths = write_report(result, args.out)
    print(f"{result['messages']} {'sequences' if args.stateful else 'messages'}, {result['faults']} faults, "
          f"passed={result['passed']}: " + ", ".join(map(str, paths)))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
