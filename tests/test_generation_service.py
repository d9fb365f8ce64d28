"""Issue 4 end to end: draft, target and generation front as real server processes on loopback.

Tiny seeded models in float32. Greedy output over gRPC must equal embedded mode and target-only
greedy (HF generate) token for token; streamed text deltas must concatenate to the final text; a
request's trace must hold spans of all three processes under one trace id; bad requests get
INVALID_ARGUMENT naming the field; deadlines and a target stopped mid-request give their status
codes without hanging. The front runs requests in-process here (``--no-ray``); the Ray path has its
own tests (test_orchestrator_ray.py).
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.embedded import build_pipeline
from specdec.harness.otlp import OtlpReceiver
from specdec.harness.servers import launch_service, stop_service, wait_ready
from specdec.tree_spec import DEFAULT_SPEC, SEED_SPEC, TreeSpec
from specdec.v1 import generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc, tree_pb2
from specdec.wire import spec_to_proto
from tests.conftest import hf_greedy
from specdec.harness.tiny_pair import save_tiny_pair, write_config

SPECS = [DEFAULT_SPEC, SEED_SPEC, TreeSpec.chain(4),
         TreeSpec(gamma=2, topKSpec=[[2], [2, 1]], topHead=[1, 2])]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"), max_pos=1024, noise=0.03)  # a draft close enough to accept often


@pytest.fixture(scope="module")
def otlp():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def stack(pair, tmp_path_factory, otlp):
    """Draft, target and front processes (front without Ray); yields (config, draft, target, front)."""
    # one draft session at a time: a session leaked by an earlier request would push later ones into fallback;
    # the draft is used every round (no cost-aware shaping: its mechanics are what these tests check;
    # test_cost_aware_front_is_exact runs the default control)
    config = write_config(tmp_path_factory.mktemp("cfg") / "serve.yaml", pair, draft={"max_sessions": 1},
                          front={"port": 0, "cost_aware": {"enabled": False}}, target={"max_tree_nodes": 64})
    env = otlp.env()
    draft = launch_service("draft", config, env={**env, "OTEL_SERVICE_NAME": "specdec-draft"})
    target = launch_service("target", config, env={**env, "OTEL_SERVICE_NAME": "specdec-target"})
    wait_ready(draft), wait_ready(target)
    front = wait_ready(launch_service("front", config, env={**env, "OTEL_SERVICE_NAME": "specdec-front"},
                                      draft_address=draft.address, target_address=target.address, no_ray=True))
    yield config, draft, target, front
    for service in (front, draft, target):
        stop_service(service)


@pytest.fixture(scope="module")
def embedded(pair):
    return build_pipeline(str(pair.target), str(pair.draft), dtype="float32", draft_quant="none")


@pytest.fixture(scope="module")
def target_model(pair):
    return AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()


def generate(address, timeout=60.0, **fields):
    """One Generate call: (token ids, concatenated text deltas, final stats, messages)."""

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            tokens, text, stats, messages = [], "", None, 0
            async for reply in stub.Generate(generation_pb2.GenerateRequest(**fields), timeout=timeout):
                messages += 1
                tokens += reply.token_ids
                text += reply.text_delta
                if reply.HasField("stats"):
                    stats = reply.stats
            return tokens, text, stats, messages

    return asyncio.run(run())


def prompt_ids(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (length,), generator=gen).tolist()


@pytest.mark.parametrize("spec", SPECS, ids=["default", "seed", "chain4", "small"])
def test_greedy_over_grpc_equals_embedded_and_target_only(stack, embedded, target_model, spec):
    front = stack[3]
    accepted = 0
    for seed in range(3):
        ids = prompt_ids(seed, 5 + 7 * seed)
        reference = hf_greedy(target_model, ids, 24)
        local = embedded.engine.generate(GenerationRequest(ids, 24, spec=spec)).tokens
        tokens, _, stats, _ = generate(front.address, prompt_ids=ids, max_new_tokens=24, tree=spec_to_proto(spec))
        assert local == reference[: len(local)]
        assert tokens == local, f"prompt {seed}: gRPC output differs from embedded mode"
        assert stats.new_tokens == len(tokens) and stats.stop_reason in ("max_new_tokens", "eos")
        accepted += len(tokens) - stats.rounds
    assert accepted > 0, "no round accepted a draft token: speculation did not run"


def test_stream_deltas_concatenate_to_the_final_text(stack, pair):
    front = stack[3]
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    tokens, text, stats, messages = generate(front.address, prompt="def add(a, b):", raw=True, max_new_tokens=40)
    assert messages >= 3  # streamed round by round, not in one final message
    assert len(tokens) == stats.new_tokens
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert stats.prompt_tokens == len(tokenizer("def add(a, b):")["input_ids"])


def test_no_spec_and_sampling_requests(stack, target_model):
    front = stack[3]
    ids = prompt_ids(7, 9)
    plain, _, stats, _ = generate(front.address, prompt_ids=ids, max_new_tokens=16, no_spec=True)
    assert plain == hf_greedy(target_model, ids, 16) and stats.acceptance_rate == 0.0
    sampling = tree_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    first = generate(front.address, prompt_ids=ids, max_new_tokens=16, sampling=sampling)[0]
    again = generate(front.address, prompt_ids=ids, max_new_tokens=16, sampling=sampling)[0]
    assert first == again, "a seeded sampled request must reproduce its tokens"
    other = generate(front.address, prompt_ids=ids, max_new_tokens=16,
                     sampling=tree_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=12))[0]
    assert other != first


def test_min_tokens_stop_token_ids_and_special_tokens_over_grpc(stack):
    """vLLM's options in GenerateRequest: min_tokens runs past an EOS (as ignore_eos when it is max_new_tokens), a
    stop token ends generation (kept; stop_reason stop_token), skip_special_tokens false keeps EOS in the text."""
    front = stack[3]
    ids = next(ids for seed in range(100) if 2 <= len(generate(front.address, prompt_ids=(ids := prompt_ids(seed, 6)),
                                                               max_new_tokens=8, no_spec=True)[0]) < 8)
    tokens, text, stats, _ = generate(front.address, prompt_ids=ids, max_new_tokens=8, ignore_eos=True)
    assert generate(front.address, prompt_ids=ids, max_new_tokens=8, min_tokens=8)[:2] == (tokens, text)
    assert 0 in tokens and "<eos>" not in text
    assert "<eos>" in generate(front.address, prompt_ids=ids, max_new_tokens=8, ignore_eos=True,
                               skip_special_tokens=False)[1]
    k = max(i for i, t in enumerate(tokens) if tokens.index(t) == i)  # the last first occurrence
    cut, _, stats, _ = generate(front.address, prompt_ids=ids, max_new_tokens=8, ignore_eos=True,
                                stop_token_ids=[tokens[k]])
    assert cut == tokens[:k + 1] and stats.stop_reason == "stop_token"


def test_front_reports_each_service_links_round_trip(stack):
    """FinalStats carries the front's measured round trip to the draft and to the target: above 0 and below the
    request's wall time."""
    _, _, stats, _ = generate(stack[3].address, prompt_ids=prompt_ids(3, 9), max_new_tokens=16)
    assert stats.proposed_tokens > 0
    for field in ("draft_link_rtt_ms", "target_link_rtt_ms"):
        assert stats.HasField(field), field
        assert 0 < getattr(stats, field) < stats.total_s * 1000, field


def test_clients_measure_their_links_round_trip(stack):
    """DraftClient and TargetClient on the real services: no round trip before a call, then one above 0 and below
    the call's wall time (the service's own time, reported in the reply, taken out)."""
    from orchestrator.loop.clients import DraftClient, TargetClient
    from specdec.sampling import GREEDY

    _, draft, target, front = stack
    ids = prompt_ids(31, 12)

    async def run():
        async with grpc.aio.insecure_channel(target.address) as t_channel, \
                grpc.aio.insecure_channel(draft.address) as d_channel:
            t = TargetClient(t_channel)
            info = await t.info()
            d = DraftClient(d_channel, info.vocab_size, info.max_tree_nodes)
            assert t.link_rtt_s is None and d.link_rtt_s is None
            await t.start("rtt", ids, GREEDY)
            await d.start("rtt", ids, GREEDY)
            try:
                started = time.perf_counter()
                tree = await d.propose("rtt", TreeSpec.chain(3), 3)
                draft_wall = time.perf_counter() - started
                started = time.perf_counter()
                await t.verify("rtt", tree)
                target_wall = time.perf_counter() - started
            finally:
                await d.release("rtt")
                await t.release("rtt")
            return d.link_rtt_s, draft_wall, t.link_rtt_s, target_wall

    draft_rtt, draft_wall, target_rtt, target_wall = asyncio.run(run())
    assert 0 < draft_rtt < draft_wall and 0 < target_rtt < target_wall
    assert_draft_session_free(front.address)


def test_front_health_and_reflection(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    front = stack[3]
    with grpc.insecure_channel(front.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specdec.v1.GenerationService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "specdec.v1.GenerationService" in services and "grpc.health.v1.Health" in services


BAD_REQUESTS = [
    (dict(), "prompt"),
    (dict(prompt="hi", prompt_ids=[1, 2]), "prompt"),
    (dict(prompt_ids=[1, 100000]), "prompt_ids"),
    (dict(prompt_ids=[1] * 1100), "prompt"),  # over the 1024-token context
    (dict(prompt_ids=[1, 2], max_new_tokens=-1), "max_new_tokens"),
    (dict(prompt_ids=[1, 2], stop=[""]), "stop"),
    (dict(prompt_ids=[1, 2], max_new_tokens=4, min_tokens=5), "min_tokens"),
    (dict(prompt_ids=[1, 2], stop_token_ids=[100000]), "stop_token_ids"),
    (dict(prompt_ids=[1, 2], sampling=tree_pb2.SamplingParams(temperature=-1)), "temperature"),
    (dict(prompt_ids=[1, 2], sampling=tree_pb2.SamplingParams(temperature=1, top_p=1.5)), "top_p"),
    (dict(prompt_ids=[1, 2], sampling=tree_pb2.SamplingParams(temperature=1, top_k=-2)), "top_k"),
    (dict(prompt_ids=[1, 2], tree=tree_pb2.TreeSpec(gamma=2, top_k_spec=[tree_pb2.TopKRow(k=[1])], top_head=[1, 1])), "topKSpec"),
    (dict(prompt_ids=[1, 2], tree=tree_pb2.TreeSpec(gamma=1, top_k_spec=[tree_pb2.TopKRow(k=[0])], top_head=[1])), "topKSpec[0][0]"),
]


@pytest.mark.parametrize("fields,field", BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_bad_requests_are_invalid_argument_naming_the_field(stack, target_model, fields, field):
    front = stack[3]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        generate(front.address, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    ids = prompt_ids(3, 6)  # the front keeps serving
    assert generate(front.address, prompt_ids=ids, max_new_tokens=8)[0] == hf_greedy(target_model, ids, 8)


def target_sessions(address) -> int:
    return target_info(address).sessions


def wait_sessions(address, expected: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := target_sessions(address)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def assert_draft_session_free(front_address, timeout: float = 10.0) -> None:
    """The draft admits one session (max_sessions 1): a request that speculates without any fallback
    round proves the previous request's draft session (and KV) was released."""
    deadline = time.monotonic() + timeout
    while True:
        _, _, stats, _ = generate(front_address, prompt_ids=prompt_ids(77, 6), max_new_tokens=10)
        if stats.fallback_rounds == 0 and stats.proposed_tokens > 0:
            return
        assert time.monotonic() < deadline, "the draft session of an ended request was never released"
        time.sleep(0.2)


def test_deadline_exceeded_frees_the_request(stack):
    _, _, target, front = stack
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        generate(front.address, timeout=0.3, prompt_ids=prompt_ids(1, 8), max_new_tokens=200,
                 tree=spec_to_proto(SEED_SPEC), sampling=tree_pb2.SamplingParams(temperature=1.0, seed=1))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    assert wait_sessions(target.address, 0) == 0, "the expired request's target session was not released"
    assert_draft_session_free(front.address)


def test_abort_ends_the_stream_and_frees_kv(stack):
    _, _, target, front = stack

    async def run():
        async with grpc.aio.insecure_channel(front.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            call = stub.Generate(generation_pb2.GenerateRequest(
                request_id="abort-me", prompt_ids=prompt_ids(2, 8), max_new_tokens=1000,
                sampling=tree_pb2.SamplingParams(temperature=1.0, seed=3), ignore_eos=True), timeout=60)
            first = await call.read()
            assert target_sessions(target.address) == 1
            assert (await stub.Abort(generation_pb2.AbortRequest(request_id="abort-me"))).aborted
            last = first
            while (reply := await call.read()) is not grpc.aio.EOF:
                last = reply
            return first, last

    first, last = asyncio.run(run())
    assert first.token_ids and last.stats.stop_reason == "aborted"
    assert 0 < last.stats.new_tokens < 1000 and last.stats.rounds >= 1 and last.stats.total_s > 0
    assert wait_sessions(target.address, 0) == 0
    assert_draft_session_free(front.address)


def test_trace_spans_from_all_three_processes(stack, otlp):
    front = stack[3]
    generate(front.address, prompt_ids=prompt_ids(5, 7), max_new_tokens=12, request_id="traced")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        spans = otlp.spans()
        roots = [s for s in spans if s.name == "generate" and s.attributes.get("request.id", "").startswith("traced~")]
        if roots:
            trace_id = roots[0].trace_id
            services = {s.service for s in spans if s.trace_id == trace_id}
            if {"specdec-front", "specdec-draft", "specdec-target"} <= services:
                break
        time.sleep(0.2)
    assert roots, "no generate span arrived"
    in_trace = [s for s in otlp.spans() if s.trace_id == trace_id]
    assert {"specdec-front", "specdec-draft", "specdec-target"} <= {s.service for s in in_trace}
    names = {s.name for s in in_trace}
    assert {"round", "draft", "verify", "commit"} <= names
    rounds = [s for s in in_trace if s.name == "round"]
    assert all("tree.nodes" in s.attributes and "accepted_length" in s.attributes and "gamma" in s.attributes for s in rounds)
    verifies = [s for s in in_trace if s.name == "verify" and s.service == "specdec-front"]
    assert any(s.attributes.get("tree.bytes", 0) > 0 for s in verifies)
    # the server side of the calls is in the same trace (context propagated over gRPC)
    assert any(s.service == "specdec-target" and "Verify" in s.name for s in in_trace)
    assert any(s.service == "specdec-draft" and "Session" in s.name for s in in_trace)


def test_target_stopped_mid_request_gives_unavailable(pair, tmp_path):
    config = write_config(tmp_path / "serve.yaml", pair, front={"port": 0}, grpc={"shutdown_grace_s": 0.5})
    draft, target = launch_service("draft", config), launch_service("target", config)
    wait_ready(draft), wait_ready(target)
    front = wait_ready(launch_service("front", config, draft_address=draft.address, target_address=target.address, no_ray=True))
    try:
        async def run():
            async with grpc.aio.insecure_channel(front.address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                call = stub.Generate(generation_pb2.GenerateRequest(
                    prompt_ids=prompt_ids(4, 8), max_new_tokens=1000,
                    sampling=tree_pb2.SamplingParams(temperature=1.0, seed=5)), timeout=60)
                await call.read()
                stop_service(target)
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                return info.value.code(), time.monotonic() - started

        code, waited = asyncio.run(run())
        assert code == grpc.StatusCode.UNAVAILABLE
        assert waited < 10
    finally:
        for service in (front, draft, target):
            stop_service(service)


def test_requests_cancelled_before_their_first_token_free_their_kv(stack):
    _, _, target, front = stack

    async def run():
        async with grpc.aio.insecure_channel(front.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            for i in range(4):  # Abort right after Generate, before any token
                call = stub.Generate(generation_pb2.GenerateRequest(request_id=f"early-{i}", prompt_ids=prompt_ids(i, 30),
                                                                    max_new_tokens=100), timeout=30)
                await asyncio.sleep(0.005 * i)
                await stub.Abort(generation_pb2.AbortRequest(request_id=f"early-{i}"))
                while await call.read() is not grpc.aio.EOF:
                    pass
            for i in range(4):  # the client goes away before any token
                call = stub.Generate(generation_pb2.GenerateRequest(prompt_ids=prompt_ids(10 + i, 30), max_new_tokens=100), timeout=30)
                await asyncio.sleep(0.005 * i)
                call.cancel()

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while (info := target_info(target.address)).sessions and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (info.sessions, info.cached_tokens) == (0, 0)
    assert_draft_session_free(front.address)


def target_info(address):
    with grpc.insecure_channel(address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.InfoRequest(), timeout=10)


def test_a_running_request_id_cannot_be_reused(stack, target_model):
    front = stack[3]
    ids = prompt_ids(21, 9)

    async def run():
        async with grpc.aio.insecure_channel(front.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            first = stub.Generate(generation_pb2.GenerateRequest(request_id="dup", prompt_ids=ids, max_new_tokens=60), timeout=60)
            tokens = list((await first.read()).token_ids)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(generation_pb2.GenerateRequest(request_id="dup", prompt_ids=[1, 2], max_new_tokens=5)):
                    pass
            while (reply := await first.read()) is not grpc.aio.EOF:
                tokens += reply.token_ids
            return tokens, info.value

    tokens, error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in error.details()
    assert tokens == hf_greedy(target_model, ids, 60)[: len(tokens)] and len(tokens) > 1


def test_tree_over_the_targets_node_limit_is_refused(stack):
    front = stack[3]
    assert target_info(stack[2].address).max_tree_nodes == 64
    with pytest.raises(grpc.aio.AioRpcError) as info:
        generate(front.address, prompt_ids=[1, 2, 3], max_new_tokens=4,
                 tree=tree_pb2.TreeSpec(gamma=1, top_k_spec=[tree_pb2.TopKRow(k=[65])], top_head=[1]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tree" in info.value.details() and "target.max_tree_nodes" in info.value.details()
    # at the limit it runs
    assert generate(front.address, prompt_ids=[1, 2, 3], max_new_tokens=4,
                    tree=tree_pb2.TreeSpec(gamma=1, top_k_spec=[tree_pb2.TopKRow(k=[64])], top_head=[1]))[2].new_tokens == 4
    with pytest.raises(grpc.aio.AioRpcError) as info:
        generate(front.address, prompt_ids=[1, -4, 3], max_new_tokens=4)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_ids" in info.value.details()


def test_prefill_of_an_open_session_is_already_exists(stack):
    target = stack[2]
    with grpc.insecure_channel(target.address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        stub.Prefill(target_pb2.PrefillRequest(session_id="twice", prompt_ids=[1, 2, 3]), timeout=10)
        try:
            with pytest.raises(grpc.RpcError) as info:
                stub.Prefill(target_pb2.PrefillRequest(session_id="twice", prompt_ids=[4, 5]), timeout=10)
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert stub.Info(target_pb2.InfoRequest()).cached_tokens == 2  # the first session is untouched
        finally:
            stub.Release(target_pb2.ReleaseRequest(session_id="twice"), timeout=10)


def test_cost_aware_front_is_exact(pair, tmp_path, target_model):
    """The default control over gRPC (cost-aware trees, context branches, the first round without the
    draft): greedy output equals target-only, and FinalStats carries the control's decisions. Before
    any request the front's metrics show the cost model it measured through the services; after them, both
    links' round trips."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    config = write_config(tmp_path / "serve.yaml", pair, front={"port": 0, "metrics_port": metrics_port})
    draft, target = launch_service("draft", config), launch_service("target", config)
    try:
        wait_ready(draft), wait_ready(target)
        front = wait_ready(launch_service("front", config, draft_address=draft.address,
                                          target_address=target.address, no_ray=True))
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            gauges = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
                      if line.startswith("specdec_cost_")}
            assert set(gauges) == {*(f'specdec_cost_verify_ms{{rows="{n}"}}' for n in (1, 4, 8, 16, 32)),
                                   *(f'specdec_cost_draft_step_ms{{parents="{p}"}}' for p in (1, 2, 4, 8))}, gauges
            assert all(ms > 0 for ms in gauges.values())
            assert "cost model measured through the services" in front.stderr
            drafted = 0
            for seed in range(4):
                base = prompt_ids(200 + seed, 5)
                ids = base + base  # a repeat: the context branch has something to propose
                tokens, _, stats, _ = generate(front.address, prompt_ids=ids, max_new_tokens=24)
                reference = hf_greedy(target_model, ids, 24)
                assert tokens == reference[: len(tokens)]  # up to the tokenizer's EOS, where the front stops
                assert len(tokens) == 24 or stats.stop_reason == "eos"
                assert stats.cost_plain_rounds >= 1  # the first round never drafts
                assert stats.proposed_tokens >= stats.context_proposed_tokens
                drafted += stats.drafted_tokens
            assert drafted > 0
            body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            links = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
                     if line.startswith("specdec_link_rtt_seconds{")}
            assert set(links) == {'specdec_link_rtt_seconds{link="draft"}', 'specdec_link_rtt_seconds{link="target"}'}
            assert all(0 < seconds < 1 for seconds in links.values()), links  # loopback
        finally:
            stop_service(front)
    finally:
        stop_service(draft), stop_service(target)


def test_health_watch_and_reflection_work_with_tracing_on(stack):
    """Every service of the three processes runs with the OpenTelemetry server interceptor on (the
    stack exports spans): Health/Watch streams SERVING (it ended UNKNOWN when the interceptor wrapped
    grpc's read/write-style Watch) and reflection lists the services."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    _, draft, target, front = stack
    for service, name in ((draft, "specdec.v1.DraftService"), (target, "specdec.v1.TargetService"),
                          (front, "specdec.v1.GenerationService")):
        with grpc.insecure_channel(service.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING, service.kind
            watch.cancel()
            assert name in ProtoReflectionDescriptorDatabase(channel).get_services()
