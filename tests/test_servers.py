"""The draft and target gRPC servers: real server subprocesses on 127.0.0.1 ephemeral ports, tiny
saved models (float32), driven by a small synchronous test client; plus the verify batcher alone.

Server layout (module fixture ``servers``, all four started at once):
- ``target`` / ``draft``: the main pair (batch_wait_ms 50, max_tree_nodes 128, 2 draft sessions);
- ``small_target``: tight limits (max_kv_tokens 40, 4 KiB messages).
The SIGTERM test starts its own draft server.
"""

from __future__ import annotations

import asyncio
import math
import os
import queue
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from draft_service.runtime import DraftRuntime
from orchestrator.planning.cost_model import PRIOR_VERIFY_MS, CostModel
from specdec.grpc_host import MAX_STATUS_CHARS
from specdec.harness.servers import launch_service, start_service, stop_service, wait_for_exit, wait_ready
from specdec.interfaces import SessionStateError, UnknownSessionError
from specdec.model_worker import ModelWorker
from specdec.sampling import GREEDY, SamplingParams
from specdec.service_errors import DeadlineExpiredError
from specdec.tree import DraftTree
from specdec.tree_spec import DEFAULT_SPEC, SEED_SPEC, TreeSpec
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc, tree_pb2
from specdec.wire import sampling_to_proto, spec_to_proto
from target_service.batcher import VerifyBatcher
from target_service.runtime import TargetRuntime
from tests.conftest import causal_logits, hf_greedy, perturbed_copy, random_prompt, tiny_model
from specdec.harness.tiny_pair import save_tiny_pair, write_config

TARGET_SERVICE = "specdec.v1.TargetService"
DRAFT_SERVICE = "specdec.v1.DraftService"


# ----------------------------------------------------------------------------------------------
# The verify batcher alone (no gRPC): one merged runtime call, results equal to solo verifies
# ----------------------------------------------------------------------------------------------

class RecordingRuntime:
    """A TargetRuntime whose verify_batch calls are recorded (session ids per call)."""

    def __init__(self, runtime: TargetRuntime):
        self.inner = runtime
        self.vocab_size = runtime.vocab_size
        self.packed = getattr(runtime, "packed", False)
        self.calls: list[list[str]] = []

    def verify_batch(self, items):
        self.calls.append([sid for sid, _ in items])
        if hasattr(self.inner, "verify_batch"):
            return self.inner.verify_batch(items)
        out = []
        for sid, tree in items:
            try:
                out.append(self.inner.verify(sid, tree))
            except Exception as exc:  # noqa: BLE001
                out.append(exc)
        return out


def _batcher_setup(n_sessions: int = 3, packed: bool | None = None):
    """Target runtime with n sessions (distinct prompts) and one draft tree per session."""
    target = tiny_model("qwen2", seed=0)
    draft = DraftRuntime(perturbed_copy(target, seed=5, scale=0.05))
    runtime = TargetRuntime(target, packed=packed)
    prompts = [random_prompt(20 + i, length=4 + 2 * i) for i in range(n_sessions)]
    trees = {}
    for i, prompt in enumerate(prompts):
        sid = f"s{i}"
        runtime.start(sid, prompt)
        draft.start(sid, prompt)
        trees[sid] = draft.propose(sid, SEED_SPEC, max_depth=3)
    return target, runtime, prompts, trees


def _solo_results(target, prompts, trees):
    solo = TargetRuntime(target)
    out = {}
    for i, prompt in enumerate(prompts):
        solo.start(f"s{i}", prompt)
        out[f"s{i}"] = solo.verify(f"s{i}", trees[f"s{i}"])
    return out


async def _verify_all_at_once(runtime, trees):
    """(batcher, outcomes) of every session's tree verified at once through a VerifyBatcher that
    waits 200 ms for company."""
    worker = ModelWorker("test")
    batcher = VerifyBatcher(runtime, worker, max_batch=8, wait_ms=200)
    try:
        return batcher, await asyncio.gather(*(batcher.verify(sid, tree) for sid, tree in trees.items()))
    finally:
        worker.close()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_batcher_merges_concurrent_verifies_into_one_call_with_solo_results(packed):
    target, runtime, prompts, trees = _batcher_setup(3, packed)
    trees["s2"] = DraftTree((), ())  # a plain step beside two trees: padded, its row is padded to theirs
    recording = RecordingRuntime(runtime)
    expected = _solo_results(target, prompts, trees)

    batcher, outs = asyncio.run(_verify_all_at_once(recording, trees))
    assert recording.calls == [["s0", "s1", "s2"]]
    assert batcher.batched_forwards == 1
    assert [o.batch_size for o in outs] == [3, 3, 3]
    # what the forward's latency depends on: packed, each session's own rows; padded, 3 rows
    # padded to the largest tree's nodes + 1
    own = sum(tree.size + 1 for tree in trees.values())
    rows = own if packed else 3 * max(tree.size + 1 for tree in trees.values())
    assert [o.batch_rows for o in outs] == [rows] * 3 and (rows > own) is not packed
    assert [o.result for o in outs] == [expected[sid] for sid in trees]
    assert all(len(o.result.tokens) >= 1 for o in outs)


def test_batcher_per_item_errors_deadlines_and_batch_limit():
    target, runtime, prompts, trees = _batcher_setup(3)
    recording = RecordingRuntime(runtime)
    expected = _solo_results(target, prompts, trees)

    async def main():
        worker = ModelWorker("test")
        batcher = VerifyBatcher(recording, worker, max_batch=2, wait_ms=100)
        try:
            expired = time.monotonic() - 1.0
            outs = await asyncio.gather(
                batcher.verify("s0", trees["s0"]),
                batcher.verify("nope", DraftTree((), ())),
                batcher.verify("s1", trees["s1"], deadline=expired),
                batcher.verify("s2", trees["s2"]),
                return_exceptions=True,
            )
            retry = await batcher.verify("s1", trees["s1"])  # the expired verify never touched s1
        finally:
            worker.close()
        return outs, retry

    outs, retry = asyncio.run(main())
    # max_batch 2: [s0, nope] then [s1 (expired, dropped), s2] -> the second call holds s2 only.
    assert recording.calls == [["s0", "nope"], ["s2"], ["s1"]]
    assert outs[0].result == expected["s0"] and outs[0].batch_size == 2
    assert isinstance(outs[1], UnknownSessionError)
    assert isinstance(outs[2], DeadlineExpiredError)
    assert outs[3].result == expected["s2"] and outs[3].batch_size == 1
    assert retry.result == expected["s1"]


def test_batcher_reports_each_item_alone_when_the_runtime_cannot_batch():
    """A runtime without verify_batch (e.g. tensor-parallel) runs queued verifies one by one: each
    caller gets batch size 1 and its own rows and time, not the queue's (the load-aware control
    would otherwise price V at rows that never shared a forward), and no merged forward is counted."""
    target, runtime, prompts, trees = _batcher_setup(3)
    expected = _solo_results(target, prompts, trees)

    class OneAtATime:  # only verify: the batcher's solo path
        vocab_size = runtime.vocab_size

        def verify(self, session_id, tree):
            return runtime.verify(session_id, tree)

    batcher, outs = asyncio.run(_verify_all_at_once(OneAtATime(), trees))
    assert [o.result for o in outs] == [expected[sid] for sid in trees]
    assert [(o.batch_size, o.batch_rows) for o in outs] == [(1, tree.size + 1) for tree in trees.values()]
    assert batcher.calls == 1 and batcher.batched_forwards == 0
    assert all(o.verify_ms > 0 for o in outs) and len({o.verify_ms for o in outs}) == 3  # each its own time


def test_batcher_keeps_a_sessions_second_verify_for_the_next_call():
    _, runtime, _, trees = _batcher_setup(2)
    recording = RecordingRuntime(runtime)

    async def main():
        worker = ModelWorker("test")
        batcher = VerifyBatcher(recording, worker, max_batch=8, wait_ms=50)
        try:
            return await asyncio.gather(batcher.verify("s0", trees["s0"]), batcher.verify("s0", trees["s0"]),
                                        batcher.verify("s1", trees["s1"]), return_exceptions=True)
        finally:
            worker.close()

    first, second, other = asyncio.run(main())
    assert recording.calls == [["s0", "s1"], ["s0"]]
    assert first.batch_size == 2 and other.batch_size == 2
    assert "uncommitted verify" in str(second)  # the runtime's own rule, not a merged forward


# ----------------------------------------------------------------------------------------------
# Servers and a small synchronous client
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def configs(pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    return {
        "main": write_config(root / "main.yaml", pair, target={"batch_wait_ms": 50, "max_tree_nodes": 128},
                             draft={"max_sessions": 2}),
        "small": write_config(root / "small.yaml", pair, target={"max_kv_tokens": 40, "max_tree_nodes": 128},
                              grpc={"max_message_bytes": 4096}),
    }


@pytest.fixture(scope="module")
def servers(configs):
    launched = {
        "target": launch_service("target", configs["main"]),
        "draft": launch_service("draft", configs["main"]),
        "small_target": launch_service("target", configs["small"]),
    }
    try:
        for service in launched.values():
            wait_ready(service)
        yield launched
    finally:
        codes = {name: stop_service(service) for name, service in launched.items()}
    assert codes == dict.fromkeys(launched, 0), {n: s.stderr[-2000:] for n, s in launched.items()}
    for name, service in launched.items():  # every bad call was answered with a status, none crashed
        assert "Traceback" not in service.stderr, (name, service.stderr[-4000:])


@pytest.fixture(scope="module")
def reference(pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target(servers):
    with grpc.insecure_channel(servers["target"].address) as channel:
        yield target_pb2_grpc.TargetServiceStub(channel)


@pytest.fixture(scope="module")
def small_target(servers):
    with grpc.insecure_channel(servers["small_target"].address) as channel:
        yield target_pb2_grpc.TargetServiceStub(channel)


@pytest.fixture(scope="module")
def info(target):
    return target.Info(target_pb2.InfoRequest(), timeout=10)


def greedy_reference(model, prompt, n, eos=()) -> list[int]:
    """The target alone: argmax of a plain causal forward, token by token (stops after an EOS)."""
    ids, out = list(prompt), []
    for _ in range(n):
        token = int(causal_logits(model, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out


class DraftSession:
    """Client of one DraftService.Session stream (requests through a queue, replies in order)."""

    def __init__(self, channel, timeout: float = 60.0):
        self._requests: queue.Queue = queue.Queue()
        self._replies = draft_pb2_grpc.DraftServiceStub(channel).Session(iter(self._requests.get, None), timeout=timeout)

    def send(self, **kind) -> None:
        self._requests.put(draft_pb2.DraftRequest(**kind))

    def reply(self) -> draft_pb2.DraftResponse:
        return next(self._replies)

    def start(self, session_id, prompt, sampling=GREEDY) -> draft_pb2.DraftStarted:
        self.send(start=draft_pb2.DraftStart(session_id=session_id, prompt_ids=prompt, sampling=sampling_to_proto(sampling)))
        return self.reply().started

    def propose(self, spec: TreeSpec, max_depth: int, round_: int = 0) -> draft_pb2.DraftTreeReply:
        self.send(propose=draft_pb2.TreeRequest(spec=spec_to_proto(spec), max_depth=max_depth, round=round_))
        return self.reply().tree

    def commit(self, tokens, accepted_nodes) -> None:
        self.send(commit=draft_pb2.DraftCommit(tokens=tokens, accepted_nodes=accepted_nodes))

    def close(self) -> None:
        self._requests.put(None)
        for _ in self._replies:
            pass


def generate(target, draft_channel, session_id, prompt, n, spec, sampling=GREEDY, eos=()) -> tuple[list[int], int]:
    """A full generation over gRPC (the engine's round loop): returns (new tokens, rounds)."""
    target.Prefill(target_pb2.PrefillRequest(session_id=session_id, prompt_ids=prompt,
                                             sampling=sampling_to_proto(sampling)), timeout=30)
    draft = DraftSession(draft_channel)
    draft.start(session_id, prompt, sampling)
    out, rounds = [], 0
    while len(out) < n and not (out and out[-1] in eos):
        max_depth = n - len(out) - 1
        tree = draft.propose(spec, max_depth, rounds).tree if max_depth >= 1 else tree_pb2.TokenTree()
        result = target.Verify(target_pb2.VerifyRequest(session_id=session_id, tree=tree), timeout=30)
        committed = []
        for token in result.tokens:
            committed.append(token)
            if len(out) + len(committed) == n or token in eos:
                break
        target.Commit(target_pb2.CommitRequest(session_id=session_id, num_tokens=len(committed)), timeout=30)
        draft.commit(committed, list(result.accepted_nodes)[: len(committed)])
        out += committed
        rounds += 1
    assert target.Release(target_pb2.ReleaseRequest(session_id=session_id), timeout=10).released
    draft.close()
    return out, rounds


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def prefill(stub, session_id, prompt, **sampling):
    return stub.Prefill(target_pb2.PrefillRequest(session_id=session_id, prompt_ids=prompt,
                                                  sampling=tree_pb2.SamplingParams(**sampling)), timeout=30)


def verify(stub, session_id, tree=None, **kwargs):
    return stub.Verify(target_pb2.VerifyRequest(session_id=session_id, tree=tree or tree_pb2.TokenTree()),
                       timeout=kwargs.pop("timeout", 30), **kwargs)


# ----------------------------------------------------------------------------------------------
# Generation over gRPC equals the target alone
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [DEFAULT_SPEC, SEED_SPEC, TreeSpec.chain(4)], ids=["default", "seed", "chain4"])
def test_greedy_generation_over_grpc_equals_target_alone(servers, target, reference, info, spec):
    eos = set(info.eos_token_ids)
    total_rounds = total_tokens = 0
    with grpc.insecure_channel(servers["draft"].address) as draft_channel:
        for seed in range(3):
            prompt = random_prompt(100 + seed, length=5 + 3 * seed, vocab=info.vocab_size)
            out, rounds = generate(target, draft_channel, f"greedy-{spec.gamma}-{seed}", prompt, 24, spec, eos=eos)
            assert out == greedy_reference(reference, prompt, 24, eos), f"prompt {prompt}"
            total_rounds += rounds
            total_tokens += len(out)
    assert total_rounds < total_tokens  # the draft's trees were accepted in part (> 1 token per round)


def test_sampled_generation_over_grpc_equals_embedded_mode(servers, target, pair, info):
    from orchestrator.loop.controller import GenerationRequest
    from orchestrator.loop.embedded import build_pipeline

    spec = TreeSpec(gamma=2, topKSpec=[[2], [1, 1]], topHead=[1, 2], treeType=1)
    sampling = SamplingParams(temperature=0.8, top_k=40, seed=11)
    pipe = build_pipeline(str(pair.target), str(pair.draft), dtype="float32", draft_quant="none")
    prompt = random_prompt(7, length=6, vocab=info.vocab_size)
    embedded = pipe.engine.generate(GenerationRequest(prompt, 20, spec=spec, sampling=sampling)).tokens
    with grpc.insecure_channel(servers["draft"].address) as draft_channel:
        out, _ = generate(target, draft_channel, "sampled", prompt, 20, spec, sampling, eos=set(info.eos_token_ids))
    assert out == embedded


def test_concurrent_verifies_are_batched_and_equal_solo(servers, target, reference, info):
    prompts = {f"batch-{i}": random_prompt(200 + i, length=4 + i, vocab=info.vocab_size) for i in range(3)}
    for sid, prompt in prompts.items():
        prefill(target, sid, prompt)
    before = target.Info(target_pb2.InfoRequest(), timeout=10).batched_forwards
    with ThreadPoolExecutor(3) as pool:
        replies = dict(zip(prompts, pool.map(lambda sid: verify(target, sid), prompts)))
    after = target.Info(target_pb2.InfoRequest(), timeout=10).batched_forwards
    for sid, prompt in prompts.items():
        assert list(replies[sid].tokens) == greedy_reference(reference, prompt, 1)
        target.Release(target_pb2.ReleaseRequest(session_id=sid), timeout=10)
    assert max(r.batch_size for r in replies.values()) > 1
    # the three sessions were open when each answered (others' sessions may add to it), up to target.max_batch
    from specdec.config import TargetServerConfig
    cap = TargetServerConfig().max_batch
    assert all(3 <= r.mergeable_sessions <= cap for r in replies.values()), [r.mergeable_sessions for r in replies.values()]
    assert after > before
    assert "verify batch of" in servers["target"].stderr


def test_verify_batch_rpc_results_in_order(target, reference, info):
    prompts = {f"vb-{i}": random_prompt(300 + i, length=3 + i, vocab=info.vocab_size) for i in range(3)}
    for sid, prompt in prompts.items():
        prefill(target, sid, prompt)
    items = [target_pb2.VerifyRequest(session_id=sid) for sid in prompts]
    bad = rpc_error(target.VerifyBatch, target_pb2.VerifyBatchRequest(items=[
        items[0], target_pb2.VerifyRequest(session_id="vb-1", tree=tree_pb2.TokenTree(tokens=[1], parents=[3]))]), timeout=30)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "items[1].tree.parents[0]" in bad.details()
    dup = rpc_error(target.VerifyBatch, target_pb2.VerifyBatchRequest(items=[items[0], items[0]]), timeout=30)
    assert dup.code() == grpc.StatusCode.INVALID_ARGUMENT and "items[1].session_id" in dup.details()
    # issue 57: 100,000 unknown sessions (1.7 MB) once held the event loop for minutes; a batch is one forward
    many = [target_pb2.VerifyRequest(session_id=f"nope-{i}") for i in range(100_000)]
    started = time.monotonic()
    over = rpc_error(target.VerifyBatch, target_pb2.VerifyBatchRequest(items=many), timeout=30)
    assert over.code() == grpc.StatusCode.INVALID_ARGUMENT and over.details() == "items: 100000 items exceed target.max_batch (16)"
    assert time.monotonic() - started < 5
    reply = target.VerifyBatch(target_pb2.VerifyBatchRequest(items=items), timeout=30)
    assert [list(r.tokens) for r in reply.results] == [greedy_reference(reference, p, 1) for p in prompts.values()]
    assert [r.batch_size for r in reply.results] == [3, 3, 3]
    assert [r.batch_rows for r in reply.results] == [3, 3, 3]  # empty trees: one row each
    for sid in prompts:
        target.Release(target_pb2.ReleaseRequest(session_id=sid), timeout=10)


# ----------------------------------------------------------------------------------------------
# Health and reflection
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, service", [("target", TARGET_SERVICE), ("draft", DRAFT_SERVICE)])
def test_health_serving_and_reflection_lists_services(servers, kind, service):
    with grpc.insecure_channel(servers[kind].address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", service):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        assert rpc_error(health.Check, health_pb2.HealthCheckRequest(service="no.Such"), timeout=10).code() == \
            grpc.StatusCode.NOT_FOUND
        db = ProtoReflectionDescriptorDatabase(channel)
        assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(db.get_services())
        methods = {m.name for m in DescriptorPool(db).FindServiceByName(service).methods}
    assert methods == ({"Session", "Info"} if kind == "draft" else
                       {"Prefill", "Verify", "VerifyBatch", "Commit", "Release", "Info"})


def test_info(info, pair, reference):
    assert info.vocab_size == reference.config.vocab_size
    assert info.context_limit == 256 and list(info.eos_token_ids) == [0]
    assert info.model == str(pair.target) and info.tensor_parallel == 1
    # placement (specdec.placement): the server process inherits this process's CPU affinity
    assert (info.host, info.device, set(info.cpus)) == (socket.gethostname(), "cpu", os.sched_getaffinity(0))


def connected_state(config):
    """The SharedState of the cost-aware control of an Orchestrator after ``connect`` (closed again)."""
    from orchestrator.loop.service import Orchestrator, control_factory

    async def main():
        orchestrator = Orchestrator(config.front, config.grpc, None, control_factory=control_factory(config.front))
        await orchestrator.connect()
        try:
            return orchestrator.control_factory.shared
        finally:
            await orchestrator.close()

    return asyncio.run(main())


@pytest.mark.parametrize("setting, expected", [("auto", True), (False, False)])
def test_the_orchestrator_finds_the_draft_on_the_targets_cpus(servers, setting, expected):
    """Both services report their placement in Info; on one host and CPU set the front prices
    draft steps as shared compute (front.cost_aware.shared_compute "auto"); an explicit setting wins."""
    from specdec.config import ServeConfig

    config = ServeConfig.model_validate({"front": {
        "draft_address": servers["draft"].address, "target_address": servers["target"].address,
        "cost_aware": {"shared_compute": setting, "measure_at_start": False}}})

    assert connected_state(config).shared_compute is expected


@pytest.mark.parametrize("cost_aware, source", [({}, "measured"), ({"measure_at_start": False}, "prior"),
                                                 ({"verify_ms": {1: 50, 8: 90}, "draft_step_ms": {1: 9, 4: 12}}, "configured")])
def test_the_orchestrator_measures_the_services_costs_when_it_connects(servers, target, cost_aware, source):
    """The cost-aware control starts from V(n) and D(p) timed through the two services (their
    sessions released after), unless told not to or given figures (which it keeps as given)."""
    from specdec.config import ServeConfig

    config = ServeConfig.model_validate({"front": {
        "draft_address": servers["draft"].address, "target_address": servers["target"].address,
        "cost_aware": cost_aware}})
    channel = grpc.insecure_channel(servers["draft"].address)
    draft = draft_pb2_grpc.DraftServiceStub(channel)

    def held():  # (target sessions, draft sessions and their cached tokens)
        d = draft.Info(draft_pb2.DraftInfoRequest(), timeout=10)
        return target.Info(target_pb2.InfoRequest(), timeout=10).sessions, d.sessions, d.cached_sessions, d.cached_tokens

    before = held()

    cost = connected_state(config).cost
    assert cost.source == source
    if source == "measured":
        assert set(cost.verify.points) == {1, 4, 8, 16, 32} and set(cost.draft_step.points) == {1, 2, 4, 8}
        assert all(ms > 0 for ms in [*cost.verify.points.values(), *cost.draft_step.points.values()])
    elif source == "configured":
        assert cost.verify.points == {1: 50.0, 8: 90.0} and cost.draft_step.points == {1: 9.0, 4: 12.0}
    else:
        assert cost.verify.points == PRIOR_VERIFY_MS
    deadline = time.monotonic() + 10
    while (after := held()) != before:  # the draft releases a closed stream's session when it gets to it
        assert time.monotonic() < deadline, f"sessions left: {after} against {before} before"
        time.sleep(0.05)
    channel.close()


def test_a_measurement_that_fails_leaves_the_priors_with_a_warning(servers, caplog):
    """The draft unreachable when the front connects: the front still starts, from the prior figures,
    and says why; the target's measurement session is released."""
    from specdec.config import ServeConfig

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    config = ServeConfig.model_validate({"front": {"draft_address": dead, "target_address": servers["target"].address}})
    before = target_sessions(servers)

    with caplog.at_level("WARNING", logger="orchestrator.loop.service"):
        cost = connected_state(config).cost
    assert cost.source == "prior" and cost.verify.points == PRIOR_VERIFY_MS
    assert "measuring through the services failed" in caplog.text and "prior figures" in caplog.text
    assert target_sessions(servers) == before


def target_sessions(servers) -> int:
    with grpc.insecure_channel(servers["target"].address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.InfoRequest(), timeout=10).sessions


def test_a_ray_front_measures_once_and_its_actors_start_from_its_figures():
    """``StartCosts``: the probe's measured points travel to the actors as a value."""
    import pickle

    from orchestrator.loop.service import StartCosts, build_orchestrator, control_factory
    from specdec.config import FrontConfig, GrpcConfig

    measured = CostModel({1: 40.0, 8: 70.0}, {1: 6.0, 4: 8.0}, source="measured")
    measured.verify.observe(1, 80.0)  # learnt scale does not travel: the points do
    start = pickle.loads(pickle.dumps(StartCosts.of(measured)))  # as an actor gets it
    cost = control_factory(FrontConfig(), start).shared.cost
    assert cost.source == "configured" and cost.verify.points == {1: 40.0, 8: 70.0}
    assert cost.draft_step.points == {1: 6.0, 4: 8.0} and cost.verify.scale == 1.0
    # an actor given starting costs never measures on its own; the front's own orchestrator does
    assert build_orchestrator(FrontConfig(), GrpcConfig(), None, start).may_measure is False
    assert build_orchestrator(FrontConfig(), GrpcConfig(), None).may_measure is True
    # a probe whose measurement failed: its actors keep the priors and do not measure each on its own
    failed = StartCosts.of(CostModel())
    assert failed.verify_ms is None and control_factory(FrontConfig(), failed).shared.cost.source == "prior"
    assert build_orchestrator(FrontConfig(), GrpcConfig(), None, failed).may_measure is False


# ----------------------------------------------------------------------------------------------
# Bad input: clear status, the session stays usable
# ----------------------------------------------------------------------------------------------

def _malformed_trees(vocab: int):
    P = tree_pb2.Proposal
    return {
        "parents out of range": (tree_pb2.TokenTree(tokens=[1, 2], parents=[-1, 5]), "tree.parents[1]"),
        "non-topological": (tree_pb2.TokenTree(tokens=[1, 2], parents=[1, -1]), "tree.parents[0]"),
        "token id >= vocab": (tree_pb2.TokenTree(tokens=[1, vocab], parents=[-1, 0]), "tree.tokens[1]"),
        "negative token id": (tree_pb2.TokenTree(tokens=[-3], parents=[-1]), "tree.tokens[0]"),
        "too many nodes": (tree_pb2.TokenTree(tokens=[1] * 129, parents=[-1] * 129), "tree.tokens: 129 nodes"),
        "too deep": (tree_pb2.TokenTree(tokens=[1] * 65, parents=list(range(-1, 64))), "tree.parents: tree depth 65"),
        "parents length": (tree_pb2.TokenTree(tokens=[1, 2], parents=[-1]), "tree.parents: length"),
        "draft_logprobs length": (tree_pb2.TokenTree(tokens=[1, 2], parents=[-1, 0], draft_logprobs=[-0.1]),
                                  "tree.draft_logprobs: length"),
        "expanded length": (tree_pb2.TokenTree(tokens=[1], parents=[-1], expanded=[True, False]), "tree.expanded: length"),
        "NaN draft logprob": (tree_pb2.TokenTree(tokens=[1], parents=[-1], draft_logprobs=[math.nan]),
                              "tree.draft_logprobs[0]"),
        "proposal probs do not sum to 1": (tree_pb2.TokenTree(tokens=[1], parents=[-1], proposals=[
            P(parent=-1, token_ids=[1, 2], probs=[0.5, 0.6])]), "tree.proposals[0].probs"),
        "proposal probs length": (tree_pb2.TokenTree(tokens=[1], parents=[-1], proposals=[
            P(parent=-1, token_ids=[1, 2], probs=[1.0])]), "tree.proposals[0].probs"),
        "proposal id outside vocab": (tree_pb2.TokenTree(tokens=[1], parents=[-1], proposals=[
            P(parent=-1, token_ids=[vocab], probs=[1.0])]), "tree.proposals[0].token_ids"),
        "proposal parent out of range": (tree_pb2.TokenTree(tokens=[1], parents=[-1], proposals=[
            P(parent=4, token_ids=[1], probs=[1.0])]), "tree.proposals[0].parent"),
    }


@pytest.mark.parametrize("rpc", ["Commit", "Verify"])
def test_a_huge_session_id_gets_the_status_not_a_transport_error(target, rpc):
    """Found by benchmarks/reliability_fuzz.py: a 70,000-character session id was echoed into the status
    message, past the client's 16 KiB metadata limit, so the caller got RESOURCE_EXHAUSTED "Stream
    removed" instead of the server's status."""
    sid = "x" * 70_000
    if rpc == "Commit":
        err = rpc_error(target.Commit, target_pb2.CommitRequest(session_id=sid, num_tokens=1), timeout=10)
    else:
        err = rpc_error(verify, target, sid)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert err.details().startswith("session_id: unknown target session 'xxx")
    assert len(err.details()) <= MAX_STATUS_CHARS + 40 and err.details().endswith("(70037 characters)")


def test_each_malformed_tree_is_invalid_argument_and_the_session_still_verifies(target, reference, info):
    prompt = random_prompt(400, length=7, vocab=info.vocab_size)
    prefill(target, "malformed", prompt)
    held = target.Info(target_pb2.InfoRequest(), timeout=10).cached_tokens
    for kind, (tree, field) in _malformed_trees(info.vocab_size).items():
        err = rpc_error(verify, target, "malformed", tree)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, kind
        assert field in err.details(), (kind, err.details())
    assert target.Info(target_pb2.InfoRequest(), timeout=10).cached_tokens == held  # nothing reserved
    # The session is unchanged: a plain step, then a tree whose first node is the target's argmax.
    first = greedy_reference(reference, prompt, 2)
    assert list(verify(target, "malformed").tokens) == first[:1]
    assert target.Commit(target_pb2.CommitRequest(session_id="malformed", num_tokens=1), timeout=10).cached_tokens == 7
    result = verify(target, "malformed", tree_pb2.TokenTree(tokens=[first[1]], parents=[-1]))
    assert list(result.accepted_nodes) == [0] and list(result.tokens) == greedy_reference(reference, prompt, 3)[1:]
    assert target.Info(target_pb2.InfoRequest(), timeout=10).cached_tokens == held + 1 + 2  # + 1 committed, R + 1 node
    target.Release(target_pb2.ReleaseRequest(session_id="malformed"), timeout=10)


def test_unknown_session_is_failed_precondition(target):
    for call, request in [
        (target.Verify, target_pb2.VerifyRequest(session_id="nobody")),
        (target.Commit, target_pb2.CommitRequest(session_id="nobody", num_tokens=1)),
    ]:
        err = rpc_error(call, request, timeout=10)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "nobody" in err.details()
    assert not target.Release(target_pb2.ReleaseRequest(session_id="nobody"), timeout=10).released


def test_calls_out_of_order_and_verify_retry(target, reference, info):
    prompt = random_prompt(500, length=4, vocab=info.vocab_size)
    prefill(target, "order", prompt)
    err = rpc_error(target.Commit, target_pb2.CommitRequest(session_id="order", num_tokens=1), timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "no verify to commit" in err.details()
    first = verify(target, "order")
    again = verify(target, "order")  # a retry of the same tree replays the pending result, no second forward
    assert list(again.tokens) == list(first.tokens) == greedy_reference(reference, prompt, 1) and again.batch_size == 0
    other = rpc_error(verify, target, "order", tree_pb2.TokenTree(tokens=[1], parents=[-1]))
    assert other.code() == grpc.StatusCode.FAILED_PRECONDITION and "uncommitted verify" in other.details()
    bad = rpc_error(target.Commit, target_pb2.CommitRequest(session_id="order", num_tokens=5), timeout=10)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_tokens" in bad.details()
    target.Commit(target_pb2.CommitRequest(session_id="order", num_tokens=1), timeout=10)
    target.Release(target_pb2.ReleaseRequest(session_id="order"), timeout=10)


@pytest.mark.parametrize("sampling, field", [
    ({"temperature": -1.0}, "sampling.temperature"),
    ({"temperature": 0.7, "top_p": 1.5}, "sampling.top_p"),
    ({"temperature": 0.7, "top_k": -2}, "sampling.top_k"),
])
def test_bad_sampling_params_are_invalid_argument_naming_the_field(servers, target, sampling, field):
    err = rpc_error(prefill, target, "bad-sampling", [1, 2, 3], **sampling)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details(), err.details()
    with grpc.insecure_channel(servers["draft"].address) as channel:
        draft = DraftSession(channel)
        draft.send(start=draft_pb2.DraftStart(session_id="bad", prompt_ids=[1, 2], sampling=tree_pb2.SamplingParams(**sampling)))
        err = rpc_error(draft.reply)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and f"start.{field}" in err.details(), err.details()


def test_bad_prefill_input(target, info):
    for prompt, field in [([], "prompt_ids: empty"), ([1, info.vocab_size], "prompt_ids[1]"),
                          ([1] * info.context_limit, "context limit")]:
        err = rpc_error(prefill, target, "bad-prompt", prompt)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details(), err.details()
    err = rpc_error(prefill, target, "", [1, 2])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in err.details()


def test_draft_stream_errors(servers):
    with grpc.insecure_channel(servers["draft"].address) as channel:
        draft = DraftSession(channel)
        draft.send(propose=draft_pb2.TreeRequest(spec=spec_to_proto(DEFAULT_SPEC), max_depth=2))
        err = rpc_error(draft.reply)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "first message must be start" in err.details()

        draft = DraftSession(channel)
        assert draft.start("errs", [1, 2, 3]).context_limit == 256
        draft.send(propose=draft_pb2.TreeRequest(spec=tree_pb2.TreeSpec(gamma=2, top_k_spec=[tree_pb2.TopKRow(k=[2])],
                                                                        top_head=[1]), max_depth=2))
        err = rpc_error(draft.reply)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "propose.spec" in err.details()

        draft = DraftSession(channel)
        draft.start("errs2", [1, 2, 3])
        tree = draft.propose(DEFAULT_SPEC, 3).tree
        draft.commit([5], [len(tree.tokens)])  # not a node of that tree
        draft.send(propose=draft_pb2.TreeRequest(spec=spec_to_proto(DEFAULT_SPEC), max_depth=3))
        err = rpc_error(draft.reply)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "commit.accepted_nodes[0]" in err.details()


# ----------------------------------------------------------------------------------------------
# Limits: KV slots, sessions, message size, deadlines
# ----------------------------------------------------------------------------------------------

def test_kv_limit_is_resource_exhausted(small_target):
    prefill(small_target, "kv-a", list(range(1, 31)))  # 29 slots of 40
    err = rpc_error(prefill, small_target, "kv-b", list(range(1, 21)))  # + 19 > 40
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_kv_tokens" in err.details()
    wide = tree_pb2.TokenTree(tokens=[1] * 11, parents=[-1] * 11)  # + 12 slots > 40
    err = rpc_error(verify, small_target, "kv-a", wide)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_kv_tokens" in err.details()
    assert len(verify(small_target, "kv-a", tree_pb2.TokenTree(tokens=[1] * 5, parents=[-1] * 5)).tokens) >= 1  # 35 fits
    assert small_target.Info(target_pb2.InfoRequest(), timeout=10).cached_tokens == 35
    small_target.Release(target_pb2.ReleaseRequest(session_id="kv-a"), timeout=10)
    prefill(small_target, "kv-b", list(range(1, 21)))  # fits once kv-a is gone
    small_target.Release(target_pb2.ReleaseRequest(session_id="kv-b"), timeout=10)


def test_draft_max_sessions_is_resource_exhausted(servers):
    with grpc.insecure_channel(servers["draft"].address) as channel:
        open_ = [DraftSession(channel) for _ in range(2)]
        for i, draft in enumerate(open_):
            draft.start(f"cap-{i}", [1, 2, 3])
        third = DraftSession(channel)
        third.send(start=draft_pb2.DraftStart(session_id="cap-2", prompt_ids=[1, 2, 3]))
        err = rpc_error(third.reply)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "draft.max_sessions" in err.details()
        open_[0].close()  # closing a stream frees its slot
        deadline = time.monotonic() + 10
        while True:
            again = DraftSession(channel)
            try:
                assert again.start("cap-3", [1, 2, 3]).context_limit == 256
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the closed stream's session was never released"
                time.sleep(0.1)
        again.close()
        open_[1].close()


def test_draft_info_counts_open_sessions_and_their_kv_until_released(servers):
    with grpc.insecure_channel(servers["draft"].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        base = stub.Info(draft_pb2.DraftInfoRequest(), timeout=10)
        assert (base.sessions, base.cached_sessions, base.cached_tokens, base.context_limit) == (0, 0, 0, 256)
        assert (base.host, base.device, set(base.cpus)) == (socket.gethostname(), "cpu", os.sched_getaffinity(0))
        session = DraftSession(channel)
        session.start("info", [1, 2, 3, 4, 5, 6])
        session.propose(TreeSpec.chain(2), max_depth=2)  # runs after the queued prefill: 5 tokens cached
        during = stub.Info(draft_pb2.DraftInfoRequest(), timeout=10)
        assert (during.sessions, during.cached_sessions) == (1, 1) and during.cached_tokens >= 5
        session.close()
        deadline = time.monotonic() + 10
        while (info := stub.Info(draft_pb2.DraftInfoRequest(), timeout=10)).cached_sessions or info.sessions:
            assert time.monotonic() < deadline, "the closed stream's session was never released"
            time.sleep(0.05)
        assert info.cached_tokens == 0


def test_oversize_request_is_resource_exhausted(small_target):
    prefill(small_target, "big", [1, 2, 3])
    huge = tree_pb2.TokenTree(tokens=[1] * 3000, parents=[-1] * 3000)  # ~ 9 KB > 4 KiB
    err = rpc_error(verify, small_target, "big", huge)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(verify(small_target, "big").tokens) == 1  # the server and the session are fine
    small_target.Release(target_pb2.ReleaseRequest(session_id="big"), timeout=10)


def test_tiny_deadline_is_deadline_exceeded_without_hanging(target, reference, info):
    prompt = random_prompt(600, length=5, vocab=info.vocab_size)
    prefill(target, "deadline", prompt)
    started = time.monotonic()
    err = rpc_error(verify, target, "deadline", timeout=0.0005)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 2.0
    # The verify did not run (or, if it did, its pending result is replayed): the session goes on.
    assert list(verify(target, "deadline").tokens) == greedy_reference(reference, prompt, 1)
    target.Release(target_pb2.ReleaseRequest(session_id="deadline"), timeout=10)


# ----------------------------------------------------------------------------------------------
# Shutdown
# ----------------------------------------------------------------------------------------------

def test_sigterm_mid_stream_ends_the_stream_promptly_and_exits_zero(configs):
    service = start_service("draft", configs["main"])
    with grpc.insecure_channel(service.address) as channel:
        draft = DraftSession(channel)
        draft.start("term", [1, 2, 3, 4])
        assert len(draft.propose(DEFAULT_SPEC, 3).tree.tokens) > 0
        service.proc.terminate()  # SIGTERM
        started = time.monotonic()
        draft.send(propose=draft_pb2.TreeRequest(spec=spec_to_proto(DEFAULT_SPEC), max_depth=3))
        try:
            while True:
                draft.reply()  # a propose that raced ahead of the drain may still be answered
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err
        assert time.monotonic() - started < 3.0
        code, waited = wait_for_exit(service, timeout_s=5.0 + 5.0)  # grace 5 s + interpreter exit
    assert code == 0, service.stderr[-2000:]
    assert "draft-service draining" in service.stderr and "Traceback" not in service.stderr


# ----------------------------------------------------------------------------------------------
# Entry points: bad config -> message naming the field, exit 2, no traceback
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["draft", "target"])
def test_bad_config_and_unknown_model_exit_2(kind, tmp_path, pair):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"{kind}:\n  port: 70000\n")
    proc = subprocess.run([sys.executable, "-m", f"{kind}_service", "--config", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{kind}.port" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    config = write_config(tmp_path / "ok.yaml", pair)
    proc = subprocess.run([sys.executable, "-m", f"{kind}_service", "--config", str(config),
                           f"--{kind}", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"models.{kind}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------------
# In-process host: draining gate, health during a forward (model compute off the event loop)
# ----------------------------------------------------------------------------------------------

def test_host_answers_health_during_a_forward_and_refuses_calls_while_draining():
    from specdec.config import GrpcConfig
    from specdec.grpc_host import ServiceHost
    from target_service.server import SERVICE_NAME, TargetServicer

    class SlowRuntime(TargetRuntime):
        def start(self, session_id, prompt_ids, sampling=GREEDY):
            time.sleep(1.0)  # a long prefill forward, on the worker thread
            super().start(session_id, prompt_ids, sampling)

    async def main():
        host = ServiceHost("test-target", GrpcConfig(shutdown_grace_s=1.0))
        servicer = TargetServicer(SlowRuntime(tiny_model("qwen2", seed=0)), context_limit=512)
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, host.server)
        port = await host.start("127.0.0.1", 0, [SERVICE_NAME])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                slow = asyncio.ensure_future(stub.Prefill(target_pb2.PrefillRequest(session_id="s", prompt_ids=[1, 2, 3])))
                await asyncio.sleep(0.2)  # the prefill is now running
                started = time.monotonic()
                status = (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)).status
                health_s = time.monotonic() - started
                running = not slow.done()
                assert (await slow).cached_tokens == 2
                host.draining.set()
                await host.health.enter_graceful_shutdown()
                refused = None
                try:
                    await stub.Info(target_pb2.InfoRequest(), timeout=5)
                except grpc.aio.AioRpcError as err:
                    refused = err
                drained = (await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status
        finally:
            await host.server.stop(None)
            servicer.close()
        return status, health_s, running, refused, drained

    status, health_s, running, refused, drained = asyncio.run(main())
    assert running and status == health_pb2.HealthCheckResponse.SERVING and health_s < 0.5
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
    assert drained == health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_verify_batch_item_whose_session_is_released_during_the_call_never_runs():
    """VerifyBatch claims its items one by one, and a claim may wait (for a verify of the same tree in
    flight). A session claimed before such a wait, released and opened again under its id meanwhile:
    its old tree must not run on the new session. That item fails the call (FAILED_PRECONDITION naming
    it), the other item's result stays pending, and the new session verifies as a fresh one."""
    from specdec.config import GrpcConfig
    from specdec.grpc_host import ServiceHost
    from target_service.server import SERVICE_NAME, TargetServicer

    ran: list[str] = []

    class Recording(TargetRuntime):
        def verify(self, session_id, tree):
            ran.append(session_id)
            return super().verify(session_id, tree)

        def verify_batch(self, items):
            ran.extend(sid for sid, _ in items)
            return super().verify_batch(items)

    model = tiny_model("qwen2", seed=0)
    chain = tree_pb2.TokenTree(tokens=[5, 6], parents=[-1, 0])

    async def main():
        host = ServiceHost("test-target", GrpcConfig(shutdown_grace_s=1.0))
        servicer = TargetServicer(Recording(model), context_limit=512)
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, host.server)
        port = await host.start("127.0.0.1", 0, [SERVICE_NAME])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                for sid, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("fresh", [7, 8, 9, 10])):
                    await stub.Prefill(target_pb2.PrefillRequest(session_id=sid, prompt_ids=prompt), timeout=10)
                claim = servicer._claim_verify

                async def claim_then_reopen(session_id, tree_msg, field, deadline):
                    if session_id == "b":  # a is claimed; before the batch is queued, a is released and reopened
                        await stub.Release(target_pb2.ReleaseRequest(session_id="a"), timeout=10)
                        await stub.Prefill(target_pb2.PrefillRequest(session_id="a", prompt_ids=[7, 8, 9, 10]), timeout=10)
                    return await claim(session_id, tree_msg, field, deadline)

                servicer._claim_verify = claim_then_reopen
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.VerifyBatch(target_pb2.VerifyBatchRequest(items=[
                        target_pb2.VerifyRequest(session_id=sid, tree=chain) for sid in ("a", "b")]), timeout=10)
                servicer._claim_verify = claim
                old_ran = list(ran)
                b = await stub.Verify(target_pb2.VerifyRequest(session_id="b", tree=chain), timeout=10)  # replayed
                mine = await stub.Verify(target_pb2.VerifyRequest(session_id="a", tree=chain), timeout=10)
                fresh = await stub.Verify(target_pb2.VerifyRequest(session_id="fresh", tree=chain), timeout=10)
        finally:
            await host.server.stop(None)
            servicer.close()
        return failed.value, old_ran, b, mine, fresh

    failed, old_ran, b, mine, fresh = asyncio.run(main())
    assert failed.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "items[0].session_id: 'a' was released during this call" in failed.details()
    assert "a" not in old_ran and "b" in old_ran  # a's old tree never ran
    assert b.batch_size == 0  # b's result was pending: replayed, not run again
    assert (list(mine.accepted_nodes), list(mine.tokens)) == (list(fresh.accepted_nodes), list(fresh.tokens))


def test_idle_sessions_are_released_after_session_idle_s(tmp_path):
    """A session whose client died without Release (e.g. a killed orchestrator actor) is released
    after target.session_idle_s; its KV slots return to the pool."""

    pair = save_tiny_pair(tmp_path / "models")
    config = write_config(tmp_path / "idle.yaml", pair, target={"session_idle_s": 0.6})
    service = start_service("target", config)
    try:
        with grpc.insecure_channel(service.address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            stub.Prefill(target_pb2.PrefillRequest(session_id="orphan", prompt_ids=[1, 2, 3, 4]), timeout=10)
            assert stub.Info(target_pb2.InfoRequest(), timeout=10).sessions == 1
            deadline = time.monotonic() + 10
            while (info := stub.Info(target_pb2.InfoRequest(), timeout=10)).sessions and time.monotonic() < deadline:
                time.sleep(0.1)
            assert (info.sessions, info.cached_tokens) == (0, 0)
            with pytest.raises(grpc.RpcError) as exc:
                stub.Commit(target_pb2.CommitRequest(session_id="orphan", num_tokens=1), timeout=10)
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        stop_service(service)
    assert "released session 'orphan': idle" in service.stderr


def test_the_draft_bounds_its_kv_and_ends_idle_streams(tmp_path):
    """Issue 57: the draft had no KV budget, and a front cut off mid-request left its draft stream open for good.
    Now prompts and commits past draft.max_kv_tokens get RESOURCE_EXHAUSTED, and a stream without a message for
    draft.session_idle_s ends DEADLINE_EXCEEDED with its KV released."""
    pair = save_tiny_pair(tmp_path / "models")
    config = write_config(tmp_path / "idle.yaml", pair, draft={"session_idle_s": 5.0, "max_kv_tokens": 12})
    service = start_service("draft", config)
    try:
        with grpc.insecure_channel(service.address) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            first = DraftSession(channel)
            first.start("a", [1, 2, 3, 4, 5, 6, 7, 8])
            over = DraftSession(channel)
            over.send(start=draft_pb2.DraftStart(session_id="b", prompt_ids=[1, 2, 3, 4, 5]))
            err = rpc_error(over.reply)  # 8 + 5 > 12
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.details().startswith("draft.max_kv_tokens: 5 more KV slots would exceed the limit of 12")
            third = DraftSession(channel)  # held: a dropped DraftSession cancels its stream
            third.start("c", [1, 2, 3, 4])  # 8 + 4 fits
            first.commit([9], [])
            err = rpc_error(first.reply)  # the commit's token does not fit: the stream ends
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "draft.max_kv_tokens: 1 more" in err.details()
            started = time.monotonic()
            idle = DraftSession(channel)
            idle.start("idle", [1])
            err = rpc_error(idle.reply)  # nothing sent: the server ends the stream, and "c"'s too
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "draft.session_idle_s" in err.details()
            assert 4.8 < time.monotonic() - started < 15
            deadline = time.monotonic() + 10
            while (info := stub.Info(draft_pb2.DraftInfoRequest(), timeout=10)).cached_sessions and time.monotonic() < deadline:
                time.sleep(0.1)
            assert (info.sessions, info.cached_sessions, info.cached_tokens) == (0, 0, 0)
    finally:
        stop_service(service)


class FreezingRelay:
    """A TCP relay to ``target`` ("host:port") that can stop carrying bytes while keeping its connections open:
    a network partition as the endpoints see it (no FIN, no RST, no answer)."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.frozen = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            if self.frozen.is_set() or not select.select([src], [], [], 0.05)[0]:
                time.sleep(0.01)
                continue
            try:
                data = src.recv(65536)
                if not data:
                    return
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()


def test_keepalive_ends_the_draft_stream_of_a_partitioned_front(tmp_path):
    """Issue 57: a front cut off by a partition left its draft stream (and KV) open until the idle reaper.
    With grpc.keepalive_s 1 the draft pings every 2 s; the unanswered ping ends the connection and the
    stream within seconds, though draft.session_idle_s (600 s) is far off."""
    pair = save_tiny_pair(tmp_path / "models")
    service = start_service("draft", write_config(tmp_path / "ka.yaml", pair, grpc={"keepalive_s": 1.0}))
    relay = FreezingRelay(service.address)
    try:
        with grpc.insecure_channel(relay.address) as far, grpc.insecure_channel(service.address) as near:
            session = DraftSession(far)
            session.start("cut-off", [1, 2, 3, 4])
            stub = draft_pb2_grpc.DraftServiceStub(near)
            assert stub.Info(draft_pb2.DraftInfoRequest(), timeout=10).sessions == 1
            relay.frozen.set()
            started = time.monotonic()
            while (info := stub.Info(draft_pb2.DraftInfoRequest(), timeout=10)).sessions and time.monotonic() - started < 15:
                time.sleep(0.2)
            assert info.sessions == 0, "the partitioned stream is still open"
            assert time.monotonic() - started < 15
    finally:
        relay.close()
        stop_service(service)


# ----------------------------------------------------------------------------------------------
# Chunked prefill: an aborted prompt stops between chunks; other sessions get in between
# ----------------------------------------------------------------------------------------------

def test_chunked_prefill_equals_one_forward_and_generation_is_unchanged():
    """start(first chunk) + extend(rest) leaves R's logits and the whole greedy run of one start(prompt)."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(4, 23)
    whole, chunked = TargetRuntime(model), TargetRuntime(model)
    whole.start("s", prompt)
    chunked.start("s", prompt[:5])
    for at in range(5, 23, 5):
        chunked.extend("s", prompt[at : at + 5])
    a, b = whole.sessions["s"], chunked.sessions["s"]
    assert (b.cache_len, b.root) == (a.cache_len, a.root) == (22, prompt[-1])
    torch.testing.assert_close(b.root_logits, a.root_logits, rtol=1e-5, atol=1e-5)
    outputs = []
    for runtime in (whole, chunked):
        for _ in range(6):  # plain decoding steps (empty trees) on each
            token = runtime.verify("s", DraftTree((), ())).tokens[0]
            runtime.commit("s", 1)
            outputs.append(token)
    assert outputs[:6] == outputs[6:]
    with pytest.raises(Exception, match="past its prefill"):
        chunked.extend("s", [1])


def test_draft_prefill_in_chunks_feeds_all_but_the_last_token():
    model = tiny_model("qwen2", seed=1)
    runtime = DraftRuntime(model)
    runtime.start("d", random_prompt(2, 11))
    assert [runtime.prefill("d", 4), runtime.prefill("d", 4), runtime.prefill("d", 4)] == [True, True, False]
    assert runtime.sessions["d"].cached_len == 10 and not runtime.prefill("d", 4)


class _SlowChunks(TargetRuntime):
    """0.1 s per 10 prompt tokens fed, on the worker thread; ``chunks`` logs whose chunk ran."""

    def __init__(self, model, chunks: list[str]):
        super().__init__(model)
        self.chunks = chunks

    def start(self, session_id, prompt_ids, sampling=GREEDY):
        self.chunks.append(session_id)
        time.sleep(0.1 * math.ceil(len(prompt_ids) / 10))
        super().start(session_id, prompt_ids, sampling)

    def extend(self, session_id, prompt_ids):
        self.chunks.append(session_id)
        time.sleep(0.1 * math.ceil(len(prompt_ids) / 10))
        super().extend(session_id, prompt_ids)


async def _with_slow_target(chunks: list[str], body):
    """Serve ``_SlowChunks`` (10-token prefill chunks) on a loopback port and run ``body(stub)``
    against it over the front's own channel (``aio_channel``)."""
    from specdec.config import TargetServerConfig
    from target_service.server import TargetServicer

    return await _serve_target(lambda: TargetServicer(_SlowChunks(tiny_model("qwen2", seed=0), chunks),
                                                      context_limit=512, config=TargetServerConfig(prefill_chunk_tokens=10)),
                               lambda stub, servicer: body(stub))


async def _serve_target(make_servicer, body):
    """Serve ``make_servicer()`` (a TargetServicer, made inside the running loop) on a loopback port
    and return ``await body(stub, servicer)``, the stub on the front's own channel (``aio_channel``);
    the servicer is closed afterwards."""
    from specdec.config import GrpcConfig
    from specdec.grpc_host import ServiceHost
    from specdec.security import aio_channel
    from target_service.server import SERVICE_NAME

    host = ServiceHost("test-target", GrpcConfig(shutdown_grace_s=1.0))
    servicer = make_servicer()
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, host.server)
    port = await host.start("127.0.0.1", 0, [SERVICE_NAME])
    try:
        async with aio_channel(f"127.0.0.1:{port}", GrpcConfig()) as channel:
            return await body(target_pb2_grpc.TargetServiceStub(channel), servicer)
    finally:
        await host.server.stop(None)
        servicer.close()


async def _info_once_settled(stub, sessions: int) -> target_pb2.InfoResponse:
    """Info once at most ``sessions`` remain (the release runs after the chunk in progress; up to 5 s)."""
    deadline = time.monotonic() + 5
    while (info := await stub.Info(target_pb2.InfoRequest(), timeout=5)).sessions > sessions \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return info


def test_an_aborted_prefill_stops_between_chunks_and_does_not_delay_others():
    """A 40-chunk prefill (0.1 s a chunk) is cancelled after 0.35 s: it stops long before its end, its
    session is released, and a 3-token prefill sent right after it answers within a chunk or two
    (with one forward for the whole prompt it waited the full 4 s).

    The call goes through the front's own channel with the gRPC instrumentation on, as in a traced
    deployment: the instrumentation's client interceptor alone swallowed the cancel
    (open-telemetry/opentelemetry-python-contrib#3271) and all 40 chunks ran."""
    from specdec.telemetry import setup_tracing

    setup_tracing("test-target")  # instruments grpc.aio channels and servers (once per process)
    chunks: list[str] = []

    async def body(stub):
        async def prefill_long():  # the front awaits the call in a task, and an abort cancels the task
            await stub.Prefill(target_pb2.PrefillRequest(session_id="long", prompt_ids=random_prompt(1, 400)))

        long = asyncio.ensure_future(prefill_long())
        await asyncio.sleep(0.35)
        long.cancel()
        started = time.monotonic()
        await stub.Prefill(target_pb2.PrefillRequest(session_id="short", prompt_ids=[1, 2, 3]), timeout=10)
        return time.monotonic() - started, await _info_once_settled(stub, 1)

    short_s, info = asyncio.run(_with_slow_target(chunks, body))
    # one forward for the whole prompt made it wait the full 4 s; margins allow a loaded machine
    assert short_s < 2.0, f"the short prefill waited {short_s:.2f} s behind the cancelled one"
    assert chunks.count("long") <= 20, "the cancelled prefill ran on (40 chunks in all)"
    assert (info.sessions, info.cached_tokens) == (1, 2)  # only the short session holds KV (L = T - 1)


def test_a_verify_completes_while_a_long_prompt_prefills():
    """Chunked prefill (issue 12): a session's Verify sent while another session's 40-chunk prefill
    (4 s) runs is answered between two chunks, long before that prefill ends, and equals the same
    verify without the long prefill (the target's greedy next token)."""
    chunks: list[str] = []

    async def body(stub):
        prompt = random_prompt(5, 12)
        await stub.Prefill(target_pb2.PrefillRequest(session_id="short", prompt_ids=prompt), timeout=10)
        long = asyncio.ensure_future(
            stub.Prefill(target_pb2.PrefillRequest(session_id="long", prompt_ids=random_prompt(1, 400)), timeout=30))
        await asyncio.sleep(0.35)
        started = time.monotonic()
        reply = await stub.Verify(target_pb2.VerifyRequest(session_id="short"), timeout=10)
        verify_s = time.monotonic() - started
        during = len(chunks)
        await long
        return prompt, list(reply.tokens), verify_s, during

    prompt, tokens, verify_s, during = asyncio.run(_with_slow_target(chunks, body))
    model = tiny_model("qwen2", seed=0)
    assert tokens == [int(causal_logits(model, prompt)[-1].argmax())]
    assert verify_s < 2.0, f"the verify waited {verify_s:.2f} s behind the long prefill"
    assert chunks.count("long") == 40 and during < 30, (during, chunks.count("long"))


def test_deferred_commits_apply_in_order_before_the_sessions_next_call():
    """target_service.commits.DeferredCommits over a scripted runtime: recorded commits run in order
    right before the session's next verify (or verify_batch item), never for other sessions; a
    commit that raises is never run again (the session's KV may be half rolled back), the session's
    later calls raise, and it fails only its own item of a batch; release and a new start under the same id drop them."""
    from target_service.commits import DeferredCommits
    from target_service.tp import RankFailureError

    class Scripted:
        def __init__(self):
            self.calls, self.fail = [], set()

        def start(self, sid, prompt):
            self.calls.append(("start", sid))

        def commit(self, sid, n):
            if (sid, n) == ("e", 7):
                raise RankFailureError("rank 1 exited")
            if (sid, n) in self.fail:
                raise SessionStateError(f"session_id: {sid!r} has no verify to commit")
            self.calls.append(("commit", sid, n))

        def verify(self, sid, tree):
            self.calls.append(("verify", sid))
            return sid

        def verify_batch(self, items):
            self.calls.append(("batch", [sid for sid, _ in items]))
            return [sid for sid, _ in items]

        def release(self, sid):
            self.calls.append(("release", sid))

    inner = Scripted()
    runtime = DeferredCommits(inner)
    runtime.defer("a", 2)
    runtime.defer("a", 3)
    runtime.defer("b", 1)
    assert inner.calls == []  # nothing ran at commit time
    assert runtime.verify("a", None) == "a"
    assert inner.calls == [("commit", "a", 2), ("commit", "a", 3), ("verify", "a")]
    inner.calls.clear()
    inner.fail.add(("c", 4))
    runtime.defer("c", 4)
    runtime.defer("c", 5)
    out = runtime.verify_batch([("b", None), ("c", None)])
    assert out[0] == "b" and isinstance(out[1], SessionStateError) and "KV rollback failed" in str(out[1])
    assert inner.calls == [("commit", "b", 1), ("batch", ["b"])]
    inner.fail.clear()  # the next try would succeed, but c's KV may be half rolled back: never retried
    out = runtime.verify_batch([("c", None)])  # e.g. the batcher's one-by-one retry of a failed batch
    with pytest.raises(SessionStateError, match="'c': its KV rollback failed .commit of 4 tokens"):
        runtime.verify("c", None)
    assert isinstance(out[0], SessionStateError) and inner.calls == [("commit", "b", 1), ("batch", ["b"])]
    runtime.release("c")
    assert runtime.failed == {}
    runtime.defer("e", 7)
    with pytest.raises(RankFailureError, match="rank 1 exited"):  # UNAVAILABLE for every call, as itself
        runtime.verify("e", None)
    assert runtime.failed == {}
    runtime.defer("d", 1)
    runtime.start("d", [1, 2])  # an id reused (its Release never reached the worker)
    assert runtime.deferred == {}
    assert not hasattr(DeferredCommits(object()), "verify_batch")  # batching only where the runtime has it


class _SlowVerifies(TargetRuntime):
    """Verify forwards of the sessions in ``slow`` take 1.5 s more, on the worker thread; ``calls``
    logs (method, session ids) in the order the worker ran them."""

    def __init__(self, model, slow: set[str]):
        super().__init__(model)
        self.slow, self.calls = slow, []

    def verify_batch(self, items):
        self.calls.append(("verify", [sid for sid, _ in items]))
        if self.slow & {sid for sid, _ in items}:
            time.sleep(1.5)
        return super().verify_batch(items)

    def commit(self, session_id, num_tokens):
        self.calls.append(("commit", [session_id]))
        super().commit(session_id, num_tokens)


def test_a_commit_does_not_wait_behind_another_sessions_forward():
    """target_service.commits (issue 12): session a's Commit, sent while session b's verify forward
    (1.5 s) runs on the worker thread, is answered at once (it used to queue behind that forward);
    the rollback runs on the worker before a's next verify, so a's tokens over three rounds of
    trees that are partly accepted equal the target's greedy continuation, and a second Commit
    without a verify is still FAILED_PRECONDITION, a num_tokens past the result INVALID_ARGUMENT."""
    model = tiny_model("qwen2", seed=0)
    prompt_a, prompt_b = random_prompt(61, 8), random_prompt(62, 8)
    expected = hf_greedy(model, prompt_a, 12)
    runtime = _SlowVerifies(model, {"b"})

    async def body(stub, servicer):
        for sid, prompt in (("a", prompt_a), ("b", prompt_b)):
            await stub.Prefill(target_pb2.PrefillRequest(session_id=sid, prompt_ids=prompt), timeout=10)
        out, commit_s = [], []
        for round_ in range(3):
            # a chain whose first node is the target's next token and whose second is wrong:
            # 2 tokens committed of 3 proposed (partial acceptance, rollback of the rest)
            k = len(out)
            tree = tree_pb2.TokenTree(tokens=[expected[k], (expected[k + 1] + 1) % 64, 5], parents=[-1, 0, 1])
            reply = await stub.Verify(target_pb2.VerifyRequest(session_id="a", tree=tree), timeout=10)
            assert list(reply.tokens) == expected[k:k + 2], (round_, list(reply.tokens))
            slow = asyncio.ensure_future(stub.Verify(target_pb2.VerifyRequest(session_id="b"), timeout=10))
            await asyncio.sleep(0.3)  # b's forward is running on the worker thread
            started = time.monotonic()
            await stub.Commit(target_pb2.CommitRequest(session_id="a", num_tokens=2), timeout=10)
            commit_s.append(time.monotonic() - started)
            out += list(reply.tokens)
            await slow
            await stub.Commit(target_pb2.CommitRequest(session_id="b", num_tokens=1), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Commit(target_pb2.CommitRequest(session_id="a", num_tokens=1), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        reply = await stub.Verify(target_pb2.VerifyRequest(session_id="a"), timeout=10)
        assert list(reply.tokens) == expected[6:7]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Commit(target_pb2.CommitRequest(session_id="a", num_tokens=2), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_tokens" in err.value.details()
        from target_service.tp import RankFailureError

        servicer.failure = RankFailureError("rank 1 exited")  # a lost tensor-parallel rank: every model call
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Commit(target_pb2.CommitRequest(session_id="a", num_tokens=1), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        return out, commit_s

    from target_service.server import TargetServicer

    out, commit_s = asyncio.run(_serve_target(lambda: TargetServicer(runtime, context_limit=512), body))
    assert out == expected[:6]
    assert max(commit_s) < 0.75, f"a commit waited {max(commit_s):.2f} s behind the other session's forward"
    # each commit ran on the worker right before a's next verify
    assert [kind for kind, sids in runtime.calls if "a" in sids] == ["verify", "commit"] * 3 + ["verify"]


def test_a_release_during_prefill_stops_it_between_chunks():
    """Release of a session whose 40-chunk prefill is running (the call itself not cancelled): the
    prefill stops at the next chunk with FAILED_PRECONDITION (the code for an unknown session) naming
    session_id, and nothing stays held."""
    chunks: list[str] = []

    async def body(stub):
        long = asyncio.ensure_future(
            stub.Prefill(target_pb2.PrefillRequest(session_id="long", prompt_ids=random_prompt(1, 400)), timeout=20))
        await asyncio.sleep(0.35)
        released = await stub.Release(target_pb2.ReleaseRequest(session_id="long"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await long
        return released, failed.value, await _info_once_settled(stub, 0)

    released, error, info = asyncio.run(_with_slow_target(chunks, body))
    assert released.released
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "session_id" in error.details(), error
    assert chunks.count("long") <= 20, "the released prefill ran on (40 chunks in all)"
    assert (info.sessions, info.cached_tokens) == (0, 0)


# ----------------------------------------------------------------------------------------------
# Batched drafting: concurrent streams' proposes share draft forwards
# ----------------------------------------------------------------------------------------------

def test_concurrent_draft_streams_share_forwards_and_get_their_solo_trees():
    """Six Session streams (prompt lengths 3..40, different TreeSpecs, greedy and seeded sampled)
    propose at once, three rounds with partial acceptance: each tree equals the one a solo
    DraftRuntime grows for that session, the replies report shared forwards (batch_size > 1), and
    the service counts merged forwards."""
    from specdec.config import DraftServerConfig, GrpcConfig
    from specdec.grpc_host import ServiceHost
    from draft_service.server import SERVICE_NAME as DRAFT_SERVICE, DraftServicer

    model = tiny_model("qwen2", seed=4)
    specs = [DEFAULT_SPEC, TreeSpec.chain(3), TreeSpec(gamma=2, topKSpec=[[3], [2, 1]], topHead=[1, 2], treeType=1),
             SEED_SPEC, TreeSpec(gamma=3, topKSpec=[[2], [1, 1], [1]], topHead=[1, 2, 1]), TreeSpec.chain(2)]
    samplings = [GREEDY, GREEDY, SamplingParams(0.8, seed=3), SamplingParams(1.0, top_k=20, seed=4), GREEDY,
                 SamplingParams(0.7, top_p=0.9, seed=5)]
    prompts = [random_prompt(seed=300 + i, length=n) for i, n in enumerate((3, 17, 40, 9, 25, 5))]
    solo = DraftRuntime(model)
    for i, (prompt, sampling) in enumerate(zip(prompts, samplings)):
        solo.start(f"d{i}", prompt, sampling)

    async def main():
        host = ServiceHost("test-draft", GrpcConfig(shutdown_grace_s=1.0))
        servicer = DraftServicer(DraftRuntime(model), context_limit=256,
                                 config=DraftServerConfig(max_batch=8, batch_wait_ms=100))
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, host.server)
        port = await host.start("127.0.0.1", 0, [DRAFT_SERVICE])
        rounds = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = draft_pb2_grpc.DraftServiceStub(channel)
                streams = [stub.Session() for _ in prompts]
                for i, call in enumerate(streams):
                    await call.write(draft_pb2.DraftRequest(start=draft_pb2.DraftStart(
                        session_id=f"d{i}", prompt_ids=prompts[i], sampling=sampling_to_proto(samplings[i]))))
                    await call.read()

                async def propose(i, call):
                    await call.write(draft_pb2.DraftRequest(propose=draft_pb2.TreeRequest(spec=spec_to_proto(specs[i]), max_depth=4)))
                    return (await call.read()).tree

                for round_ in range(3):
                    replies = await asyncio.gather(*(propose(i, call) for i, call in enumerate(streams)))
                    rounds.append(replies)
                    for i, (call, reply) in enumerate(zip(streams, replies)):
                        accepted = [0] if (round_ + i) % 2 and reply.tree.tokens else []
                        tokens = [reply.tree.tokens[n] for n in accepted] + [11 + i]
                        await call.write(draft_pb2.DraftRequest(commit=draft_pb2.DraftCommit(tokens=tokens, accepted_nodes=accepted)))
                for call in streams:
                    await call.done_writing()
            return rounds, servicer.batcher.batched_forwards
        finally:
            await host.server.stop(None)
            servicer.close()

    rounds, merged = asyncio.run(main())
    for round_, replies in enumerate(rounds):
        for i, reply in enumerate(replies):
            alone = solo.propose(f"d{i}", specs[i], 4)
            assert (list(reply.tree.tokens), list(reply.tree.parents)) == (list(alone.tokens), list(alone.parents)), i
            accepted = [0] if (round_ + i) % 2 and alone.tokens else []
            solo.commit(f"d{i}", [alone.tokens[n] for n in accepted] + [11 + i], accepted)
    assert merged > 0 and max(reply.batch_size for replies in rounds for reply in replies) > 1
    # each reply reports its draft call's own time (forward_ms), within its time from arrival (draft_ms)
    assert all(0 < reply.forward_ms <= reply.draft_ms for replies in rounds for reply in replies)


def test_the_draft_service_gathers_proposals_of_sessions_expected_back():
    """draft.batch_gather reaches the draft's propose batcher (specdec.batching gathering, as the
    target's verifies): requests whose verifies merged come back to propose together and share the
    draft's forwards. Default 0.25 of the mean propose time; 0 turns it off; outside [0, 1] the config
    names the field."""
    from draft_service.server import DraftServicer
    from specdec.config import DraftServerConfig

    model = tiny_model("qwen2", seed=4)

    async def gathers(config):
        servicer = DraftServicer(DraftRuntime(model), context_limit=256, config=config)
        try:
            return servicer.batcher.gather
        finally:
            servicer.close()

    assert asyncio.run(gathers(DraftServerConfig())) == 0.25
    assert asyncio.run(gathers(DraftServerConfig(batch_gather=0.0))) == 0.0
    with pytest.raises(ValueError, match="batch_gather"):
        DraftServerConfig(batch_gather=1.5)


# ----------------------------------------------------------------------------------------------
# Chunked prefill mixed into other sessions' verify forwards
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_a_prefill_chunk_in_a_verify_batch_leaves_the_session_as_extend_does(packed):
    """verify_batch with (session, PrefillChunk) items beside another session's plain steps: the
    prefilling session ends as after ``start`` of its whole prompt (same R and length, its logits
    and KV equal up to float32 round-off of the differently shaped forward), both sessions then
    decode the target's greedy tokens, and the decoding session's steps equal its solo steps."""
    from target_service.runtime import CHUNK_FED, PrefillChunk

    model = tiny_model("qwen2", seed=0)
    mixed, solo = TargetRuntime(model, packed=packed), TargetRuntime(model)
    other, long = random_prompt(3, 20), random_prompt(4, 61)
    for rt in (mixed, solo):
        rt.start("o", other)
    mixed.start("L", long[:13])
    solo.start("L", long)
    empty = DraftTree((), ())
    at, steps = 13, 0
    while at < len(long):
        out = mixed.verify_batch([("o", empty), ("L", PrefillChunk(tuple(long[at : at + 8])))])
        assert out[1] is CHUNK_FED and out[0] == solo.verify("o", empty)
        mixed.commit("o", 1)
        solo.commit("o", 1)
        at, steps = at + 8, steps + 1
    assert steps == 6  # 48 tokens in chunks of 8, the last one shorter
    got, want = mixed.sessions["L"], solo.sessions["L"]
    assert (got.cache_len, got.root) == (want.cache_len, want.root) == (len(long) - 1, long[-1])
    torch.testing.assert_close(got.root_logits, want.root_logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(got.cache.layers, want.cache.layers):
        torch.testing.assert_close(a.keys[..., : got.cache_len + 1, :], b.keys[..., : want.cache_len + 1, :],
                                   rtol=1e-4, atol=1e-4)
    tokens = []
    for _ in range(5):
        (res,) = mixed.verify_batch([("L", empty)])
        mixed.commit("L", 1)
        tokens.append(res.tokens[-1])
    assert tokens == greedy_reference(model, long, 5)
    # a chunk is refused once the session has verified, and for ids outside the vocabulary
    mixed.start("n", [1, 2, 3])
    past, bad = mixed.verify_batch([("L", PrefillChunk((1, 2))), ("n", PrefillChunk((10 ** 9,)))])
    assert isinstance(past, SessionStateError) and "past its prefill" in str(past)
    assert "prefill chunk token 0" in str(bad)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_a_riding_chunk_of_a_released_session_and_a_failed_shared_forward(packed):
    """A chunk whose session was released before the forward (``still_open`` False) is refused
    (UnknownSessionError) and feeds nothing; when the shared forward itself fails, a prefilling
    session keeps R's KV slot and logits, so the batcher's solo retry (``extend``) still works and the
    session ends as after ``start`` of the whole prompt."""
    from specdec.kv_cache import cache_length
    from target_service.runtime import CHUNK_FED, PrefillChunk

    model = tiny_model("qwen2", seed=0)
    rt, solo = TargetRuntime(model, packed=packed), TargetRuntime(model)
    prompt = random_prompt(8, 30)
    rt.start("o", random_prompt(9, 10))
    rt.start("L", prompt[:10])
    solo.start("L", prompt)
    before = rt.sessions["L"].cache_len
    gone, _ = rt.verify_batch([("L", PrefillChunk(tuple(prompt[10:20]), still_open=lambda: False)),
                               ("o", DraftTree((), ()))])
    assert isinstance(gone, UnknownSessionError) and "released during its prefill" in str(gone)
    assert rt.sessions["L"].cache_len == before
    rt.commit("o", 1)

    def broken(*args, **kwargs):  # after layer 0 has run (packed: its KV is in both sessions' caches)
        raise RuntimeError("out of memory (simulated)")

    hook = model.model.layers[1].register_forward_pre_hook(broken)
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            rt.verify_batch([("L", PrefillChunk(tuple(prompt[10:20]))), ("o", DraftTree((), ()))])
    finally:
        hook.remove()
    assert [cache_length(rt.sessions[sid].cache) for sid in "oL"] == [rt.sessions["o"].cache_len, before + 1]
    (fed,) = rt.verify_batch([("L", PrefillChunk(tuple(prompt[10:20])))])  # the solo retry: extend
    assert fed is CHUNK_FED
    rt.extend("L", prompt[20:])
    got, want = rt.sessions["L"], solo.sessions["L"]
    assert (got.cache_len, got.root) == (want.cache_len, want.root)
    torch.testing.assert_close(got.root_logits, want.root_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_a_long_prompt_rides_in_a_decoding_sessions_verify_forwards(packed):
    """While session "d" decodes (plain verifies back to back), a 70-token prompt arrives (longer
    than one 32-token prefill chunk): its chunks (prefill_busy_chunk_tokens 16) are fed inside d's
    verify forwards instead of forwards of their own, and both sessions' tokens are the target's
    greedy ones. A 20-token prompt (one chunk) keeps its forward of its own. A padded runtime does
    not take riders (a chunk would pad every row): the long prompt's chunks run on their own."""
    from specdec.config import TargetServerConfig
    from target_service.server import TargetServicer

    model = tiny_model("qwen2", seed=0)
    short, long = random_prompt(5, 12), random_prompt(6, 70)
    config = TargetServerConfig(prefill_chunk_tokens=32, prefill_busy_chunk_tokens=16)

    async def body(stub, servicer):
        await stub.Prefill(target_pb2.PrefillRequest(session_id="d", prompt_ids=short), timeout=10)
        decoded: list[int] = []
        done = asyncio.Event()

        async def decode():
            while not done.is_set() or len(decoded) < 3:
                reply = await stub.Verify(target_pb2.VerifyRequest(session_id="d"), timeout=10)
                await stub.Commit(target_pb2.CommitRequest(session_id="d", num_tokens=1), timeout=10)
                decoded.append(reply.tokens[-1])

        decoding = asyncio.ensure_future(decode())
        while len(decoded) < 2:
            await asyncio.sleep(0.01)
        merged_before = servicer.batcher.batched_forwards
        await stub.Prefill(target_pb2.PrefillRequest(session_id="L", prompt_ids=long), timeout=30)
        merged = servicer.batcher.batched_forwards - merged_before
        merged_before = servicer.batcher.batched_forwards
        await stub.Prefill(target_pb2.PrefillRequest(session_id="S", prompt_ids=long[:20]), timeout=30)
        merged_short = servicer.batcher.batched_forwards - merged_before
        first = await stub.Verify(target_pb2.VerifyRequest(session_id="L"), timeout=10)
        done.set()
        await decoding
        return decoded, merged, merged_short, list(first.tokens)

    decoded, merged, merged_short, first = asyncio.run(
        _serve_target(lambda: TargetServicer(TargetRuntime(model, packed=packed), context_limit=512, config=config), body))
    assert first == greedy_reference(model, long, 1)
    assert decoded == greedy_reference(model, short, len(decoded))
    if packed:
        assert merged >= 3, merged  # the first chunk starts the session (a forward of its own); 3 more rode along
    else:
        assert merged == 0, merged
    assert merged_short == 0, merged_short
