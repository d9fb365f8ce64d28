"""Issue 5 end to end: the front on a local Ray (num_cpus=2) with real draft and target services.

Tiny seeded models in float32. Criteria: 16 concurrent greedy requests (different prompt lengths,
max_new_tokens and tree specs) each equal their solo target-only output, and the target merged
verify calls of different requests into one forward; seeded sampled requests mixed into the same
batches reproduce their tokens while greedy ones stay exact; Abort frees the request's KV (target
sessions and cached tokens back to baseline); the draft service killed in the middle of 8 running
requests: all finish with unchanged greedy output, the fallback shows in the front's Prometheus
metrics, and a restarted draft brings speculation back. The draft-kill test runs last (it restarts
the shared draft).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import threading
import time
import urllib.request

import grpc
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.harness.servers import launch_service, stop_service, wait_ready
from specdec.tree_spec import DEFAULT_SPEC, SEED_SPEC, TreeSpec
from specdec.v1 import generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc, tree_pb2
from specdec.wire import spec_to_proto
from tests.conftest import hf_greedy
from specdec.harness.tiny_pair import save_tiny_pair, write_config

EOS = 0  # the tiny models' eos_token_id
SPECS = [DEFAULT_SPEC, SEED_SPEC, TreeSpec.chain(2), TreeSpec(gamma=2, topKSpec=[[2], [2, 1]], topHead=[1, 2])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"), max_pos=1024, noise=0.03)


@pytest.fixture(scope="module")
def target_model(pair):
    return AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stack(pair, tmp_path_factory):
    """Draft, target and a Ray front (2 orchestrator actors); yields a dict of services and ports."""
    metrics_port = free_port()
    config = write_config(
        tmp_path_factory.mktemp("cfg") / "serve.yaml", pair,
        target={"max_batch": 16, "batch_wait_ms": 5.0},
        front={"port": 0, "workers": 2, "ray_num_cpus": 2, "metrics_port": metrics_port,
               "cost_aware": {"enabled": False},  # the draft every round: these tests check its failures and batching
               "fallback": {"reconnect_s": 0.5, "draft_deadline_ms": 5000.0}},
    )
    draft, target = launch_service("draft", config), launch_service("target", config)
    wait_ready(draft), wait_ready(target)
    front = wait_ready(launch_service("front", config, draft_address=draft.address, target_address=target.address),
                       timeout_s=180)
    services = {"config": config, "draft": draft, "target": target, "front": front, "metrics_port": metrics_port}
    yield services
    for name in ("front", "draft", "target"):
        stop_service(services[name])


def prompt_ids(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (length,), generator=gen).tolist()


async def generate(stub, **fields):
    tokens, stats = [], None
    async for reply in stub.Generate(generation_pb2.GenerateRequest(**fields), timeout=120):
        tokens += reply.token_ids
        if reply.HasField("stats"):
            stats = reply.stats
    return tokens, stats


def run_concurrently(address, requests: list[dict]):
    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            return await asyncio.gather(*[generate(stub, **r) for r in requests])

    return asyncio.run(run())


def target_info(address) -> target_pb2.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.InfoRequest(), timeout=10)


def expected_greedy(model, ids, n) -> list[int]:
    """Target-only greedy continuation, cut after EOS like the services do."""
    out = hf_greedy(model, ids, n)
    return out[: out.index(EOS) + 1] if EOS in out else out


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not exported")


def test_16_concurrent_greedy_requests_equal_their_solo_runs_and_share_forwards(stack, target_model):
    before = target_info(stack["target"].address).batched_forwards
    requests = []
    for i in range(16):
        requests.append(dict(prompt_ids=prompt_ids(100 + i, 3 + 5 * (i % 8)), max_new_tokens=8 + 4 * (i % 6),
                             tree=spec_to_proto(SPECS[i % len(SPECS)]), request_id=f"greedy-{i}"))
    results = run_concurrently(stack["front"].address, requests)
    speculated = 0
    for request, (tokens, stats) in zip(requests, results):
        assert tokens == expected_greedy(target_model, list(request["prompt_ids"]), request["max_new_tokens"]), request["request_id"]
        assert stats.new_tokens == len(tokens)
        speculated += len(tokens) - stats.rounds
    assert speculated > 0, "no draft token was accepted in any request"
    merged = target_info(stack["target"].address).batched_forwards - before
    assert merged > 0, "the target never verified trees of several requests in one forward"


def test_sampled_and_greedy_requests_in_the_same_batches(stack, target_model):
    greedy = [dict(prompt_ids=prompt_ids(200 + i, 6 + 3 * i), max_new_tokens=20) for i in range(4)]
    sampled = [dict(prompt_ids=prompt_ids(300 + i, 5 + 2 * i), max_new_tokens=20,
                    sampling=tree_pb2.SamplingParams(temperature=0.9, top_k=50, seed=40 + i),
                    tree=spec_to_proto(TreeSpec(gamma=2, topKSpec=[[2], [1, 1]], topHead=[1, 2], treeType=i % 2)))
               for i in range(4)]
    first = run_concurrently(stack["front"].address, greedy + sampled)
    second = run_concurrently(stack["front"].address, sampled[::-1] + greedy[::-1])  # other batch partners
    for request, (tokens, _) in zip(greedy, first[:4]):
        assert tokens == expected_greedy(target_model, list(request["prompt_ids"]), 20)
    for (a, _), (b, _) in zip(first[4:], second[:4][::-1]):
        assert a == b, "a seeded sampled request did not reproduce its tokens"
    assert any(a != expected_greedy(target_model, list(r["prompt_ids"]), 20) for r, (a, _) in zip(sampled, first[4:]))


def test_abort_frees_the_requests_kv(stack):
    target = stack["target"].address
    deadline = time.monotonic() + 10
    while (base := target_info(target)).sessions and time.monotonic() < deadline:  # earlier requests' releases land
        time.sleep(0.1)
    assert (base.sessions, base.cached_tokens) == (0, 0)

    async def run():
        async with grpc.aio.insecure_channel(stack["front"].address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            call = stub.Generate(generation_pb2.GenerateRequest(
                request_id="to-abort", prompt_ids=prompt_ids(9, 10), max_new_tokens=1000,
                sampling=tree_pb2.SamplingParams(temperature=1.0, seed=9), ignore_eos=True), timeout=60)
            first = await call.read()
            during = target_info(target)
            aborted = (await stub.Abort(generation_pb2.AbortRequest(request_id="to-abort"))).aborted
            last = first
            while (reply := await call.read()) is not grpc.aio.EOF:
                last = reply
            return during, aborted, last

    during, aborted, last = asyncio.run(run())
    assert during.sessions == base.sessions + 1 and during.cached_tokens > base.cached_tokens
    assert aborted and last.stats.stop_reason == "aborted" and last.stats.new_tokens < 1000
    deadline = time.monotonic() + 10
    while (info := target_info(target)).sessions != base.sessions and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (info.sessions, info.cached_tokens) == (base.sessions, base.cached_tokens)


def test_the_fronts_own_ray_head_authenticates_its_callers(stack):
    """Issue 57: the Ray head a front starts runs with token authentication (Ray >= 2.59's default for a local
    head), as Ray itself reports it in the front's process."""
    assert "ray: token authentication on" in stack["front"].stderr
    assert "ray: token authentication off" not in stack["front"].stderr


def test_a_ray_front_measures_the_services_once_for_its_actors(stack):
    """The cost-aware control's start through Ray: the front's probe times the services when it
    connects and its actors start from those figures ("configured": none measured on its own)."""
    import ray

    from orchestrator.serving.actors import RayBackend
    from specdec.config import ServeConfig

    config = ServeConfig.model_validate({"front": {
        "draft_address": stack["draft"].address, "target_address": stack["target"].address,
        "workers": 2, "ray_num_cpus": 2}})
    backend = RayBackend(config.front, config.grpc, None)

    async def main():
        await backend.start()
        try:
            return await asyncio.gather(*[actor.cost.remote() for actor in backend.actors])
        finally:
            await backend.close()

    try:
        costs = asyncio.run(main())
    finally:
        ray.shutdown()
    assert [c["source"] for c in costs] == ["configured", "configured"]
    assert set(costs[0]["verify_ms"]) == {1, 4, 8, 16, 32} and set(costs[0]["draft_step_ms"]) == {1, 2, 4, 8}
    assert costs[0]["verify_ms"] == costs[1]["verify_ms"] and costs[0]["draft_step_ms"] == costs[1]["draft_step_ms"]
    probe = backend.cost()  # what the probe measured, which the front's metrics show at start-up
    assert probe["source"] == "measured" and probe["verify_ms"] == costs[0]["verify_ms"]
    assert probe["draft_step_ms"] == costs[0]["draft_step_ms"]


def test_a_killed_orchestrator_actor_is_restarted_and_serves_again(stack, target_model):
    """SIGKILL one of the 2 actors: requests keep succeeding (one that meets the dead or restarting
    actor before its first token is sent to the other); once Ray has restarted it, the restarted
    actor serves again (no request of the last batch needs a second actor)."""
    import os
    import signal

    def actor_pids():  # this front's actors only (its local Ray runs under it), not another test worker's
        found = []
        for child in psutil.Process(stack["front"].proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "ray::OrchestratorActor" in " ".join(child.cmdline()):
                    found.append(child.pid)
        return sorted(found)

    pids = actor_pids()
    assert len(pids) == 2, pids  # front.workers = 2
    os.kill(pids[0], signal.SIGKILL)
    requests = [dict(prompt_ids=prompt_ids(600 + i, 7), max_new_tokens=12) for i in range(4)]
    for request in requests:
        [(tokens, _)] = run_concurrently(stack["front"].address, [request])
        assert tokens == expected_greedy(target_model, list(request["prompt_ids"]), 12)
    deadline = time.monotonic() + 120
    while not (len(now := actor_pids()) == 2 and pids[0] not in now) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(now) == 2 and pids[0] not in now, f"the killed actor was not restarted: {now}"
    time.sleep(3)  # the front's probe (every 0.5 s) has seen the restarted actor answer
    before = stack["front"].stderr.count("continuing on another actor")
    results = run_concurrently(stack["front"].address, requests)  # least-loaded: both actors get requests
    for request, (tokens, _) in zip(requests, results):
        assert tokens == expected_greedy(target_model, list(request["prompt_ids"]), 12)
    assert stack["front"].stderr.count("continuing on another actor") == before, "the restarted actor did not serve"


def test_draft_killed_mid_requests_falls_back_then_recovers(stack, target_model):
    front, draft = stack["front"], stack["draft"]
    fallback_before = metric(stack["metrics_port"], 'specdec_fallback_rounds_total{reason="draft_unavailable"}')
    requests = [dict(prompt_ids=prompt_ids(400 + i, 4 + 2 * i), max_new_tokens=200, request_id=f"kill-{i}")
                for i in range(8)]

    async def run():
        async with grpc.aio.insecure_channel(front.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            calls = [stub.Generate(generation_pb2.GenerateRequest(**r), timeout=120) for r in requests]
            outputs = [[] for _ in calls]
            for out, call in zip(outputs, calls):  # every request is running
                out += (await call.read()).token_ids
            draft.proc.kill()
            stats = []
            for out, call in zip(outputs, calls):
                last = None
                while (reply := await call.read()) is not grpc.aio.EOF:
                    out += reply.token_ids
                    last = reply
                stats.append(last.stats)
            return outputs, stats

    outputs, stats = asyncio.run(run())
    for request, tokens in zip(requests, outputs):
        assert tokens == expected_greedy(target_model, list(request["prompt_ids"]), 200), request["request_id"]
    assert sum(s.fallback_rounds for s in stats) > 0
    assert metric(stack["metrics_port"], 'specdec_fallback_rounds_total{reason="draft_unavailable"}') > fallback_before

    # restart the draft on the same address: speculation comes back
    restarted = wait_ready(launch_service("draft", stack["config"], port=draft.port))
    stack["draft"] = restarted
    deadline = time.monotonic() + 20  # reconnect_s 0.5 s + the channel's reconnect backoff (<= 1 s)
    for attempt in range(100):
        ids = prompt_ids(500 + attempt, 12)
        [(tokens, final)] = run_concurrently(front.address, [dict(prompt_ids=ids, max_new_tokens=40)])
        assert tokens == expected_greedy(target_model, ids, 40)
        if final.fallback_rounds == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert final.fallback_rounds == 0 and final.acceptance_rate > 0, "speculation did not come back after the restart"


def test_front_attaches_to_an_existing_ray_cluster(stack, target_model, tmp_path):
    """front.ray_address: the orchestrator actors run on a cluster started beforehand (ray start); a
    front that could not attach exits instead of serving."""
    import os
    import shutil
    import subprocess

    ray_cli = shutil.which("ray")
    assert ray_cli, "the ray command line comes with the ray package"
    import tempfile

    import yaml

    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    config = yaml.safe_load(stack["config"].read_text())
    config["front"]["metrics_port"] = None  # the module's front holds that port
    config_path = tmp_path / "attach.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # --block: the head lives as long as this process; terminating it stops that cluster alone (``ray stop`` would
    # end every Ray on the machine, another test worker's included)
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                             "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={temp_dir}",
                             "--disable-usage-stats"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})  # the front's ray.init uses no token
    said: queue.Queue = queue.Queue()  # its output, drained all along by a thread
    threading.Thread(target=lambda: [said.put(line) for line in head.stdout], daemon=True).start()
    log, deadline = "", time.monotonic() + 180
    while "Ray runtime started" not in log and head.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            log += said.get(timeout=1)
    assert "Ray runtime started" in log and head.poll() is None, log[-2000:]
    front = None
    try:
        # RAY_AUTH_MODE as the cluster's: an in-process ray.init earlier in this pytest process (e.g.
        # test_failover) leaves RAY_AUTH_MODE=token in os.environ, which the front would inherit
        front = wait_ready(launch_service("front", config_path, env={"RAY_AUTH_MODE": "disabled"},
                                          draft_address=stack["draft"].address,
                                          target_address=stack["target"].address, ray_address=f"127.0.0.1:{port}"),
                           timeout_s=180)
        ids = prompt_ids(700, 9)
        [(tokens, stats)] = run_concurrently(front.address, [dict(prompt_ids=ids, max_new_tokens=16)])
        assert tokens == expected_greedy(target_model, ids, 16) and stats.new_tokens == len(tokens)
    finally:
        if front is not None:
            stop_service(front)
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
