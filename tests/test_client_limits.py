"""Issue 14, item 2: per-client limits of the front (``front.limits``, orchestrator/serving/admission.py).

The admission controller alone (asyncio, no servers): running caps per client and overall, the
FIFO queue and its bounds, abort and cancel of waiting requests, slots freed on every exit path,
client keys. Then real draft, target and two fronts on loopback ports (tiny seeded models, float32,
no Ray, HTTP on):
"tokens": bearer tokens, 1 running request per client, 2 overall, no queue, 3500 KV tokens per request;
"queue": no auth (every test client is 127.0.0.1: one client), 1 running request, 2 waiting.
A running request is held by a "holder": 3000 plain tokens with EOS ignored (seconds of rounds),
cancelled by the test once it has served.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from orchestrator.serving.admission import Admission, AdmissionRefused, client_key, peer_host
from specdec.config import ClientLimitsConfig, ConfigError, load_config
from specdec.harness.servers import launch_service, stop_service, wait_address, wait_ready
from specdec.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import hf_greedy
from specdec.harness.tiny_pair import save_tiny_pair, write_config

TOKENS = ("alpha-tok-5f1c9e", "beta-tok-77c2d0", "gamma-tok-90ad3b")
KV_CAP = 3500
BODY_CAP = 65536
HOLD_TOKENS = 3000
HOLD_PROMPT = [5, 6, 7, 8]
EOS = 0  # the tiny models' EOS id (specdec/harness/tiny_pair.py)


# --------------------------------------------------------------------------- the controller alone


def limits(**fields) -> ClientLimitsConfig:
    return ClientLimitsConfig(**fields)


def test_per_client_running_cap_refuses_that_client_only():
    async def scenario():
        admission = Admission(limits(max_running=4, max_running_per_client=1, max_waiting_per_client=0))
        first = admission.enter("token 1", "a")
        assert first.granted.result() is True
        with pytest.raises(AdmissionRefused) as info:
            admission.enter("token 1", "b")
        assert str(info.value).startswith("front.limits.max_running_per_client: 1 requests of this client are running")
        other = admission.enter("token 2", "c")  # another client still runs
        assert other.granted.result() is True and admission.running == 2 and admission.waiting == 0

    asyncio.run(scenario())


def test_queue_is_fifo_bounded_and_not_blocked_by_one_clients_cap():
    async def scenario():
        admission = Admission(limits(max_running=2, max_waiting=2, max_running_per_client=1))
        a1 = admission.enter("a", "a1")
        a2 = admission.enter("a", "a2")            # held back by its client's cap: waits
        b1 = admission.enter("b", "b1")            # a's waiter does not hold b up
        c1 = admission.enter("c", "c1")            # overall full: waits behind a2
        assert [t.granted.done() for t in (a1, a2, b1, c1)] == [True, False, True, False]
        with pytest.raises(AdmissionRefused) as info:
            admission.enter("d", "d1")
        assert str(info.value).startswith("front.limits.max_waiting: 2 requests are waiting for a slot "
                                          "(front.limits.max_running: 2 running)")
        admission.leave(b1)                        # a2 is first but may not run (a1 runs): c1 gets the slot
        assert c1.granted.result() is True and not a2.granted.done()
        admission.leave(a1)
        assert a2.granted.result() is True
        assert (admission.running, admission.waiting) == (2, 0)

    asyncio.run(scenario())


def test_per_client_queue_bound_names_its_field():
    async def scenario():
        admission = Admission(limits(max_running=1, max_waiting=5, max_waiting_per_client=1))
        admission.enter("a", "1"), admission.enter("a", "2")
        with pytest.raises(AdmissionRefused) as info:
            admission.enter("a", "3")
        assert str(info.value).startswith("front.limits.max_waiting_per_client: 1 requests of this client are waiting")
        assert not admission.enter("b", "4").granted.done()  # another client may still queue

    asyncio.run(scenario())


def test_abort_and_cancel_of_waiting_requests_free_their_places():
    async def scenario():
        admission = Admission(limits(max_running=1, max_waiting=1))
        running = admission.enter("a", "r")
        waiting = admission.enter("a", "w")
        assert admission.abort("w") is True and waiting.granted.result() is False
        assert admission.abort("w") is False and admission.abort("r") is False  # gone / running: the backend's
        admission.leave(waiting)

        async def wait_for_slot():
            ticket = admission.enter("a", "x")
            try:
                await ticket.granted
            finally:
                admission.leave(ticket)

        task = asyncio.create_task(wait_for_slot())  # the queue place aborting freed
        await asyncio.sleep(0)
        assert admission.waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert admission.waiting == 0
        admission.leave(running)
        assert admission.enter("a", "y").granted.result() is True  # nothing leaked
        assert (admission.running, admission.waiting) == (1, 0)

    asyncio.run(scenario())


def test_slot_granted_to_a_task_cancelled_before_it_resumed_is_released():
    async def scenario():
        admission = Admission(limits(max_running=1, max_waiting=1))
        holder = admission.enter("a", "h")
        ran = []

        async def request():
            ticket = admission.enter("a", "w")
            try:
                await ticket.granted
                ran.append(True)
            finally:
                admission.leave(ticket)
                admission.leave(ticket)  # idempotent

        task = asyncio.create_task(request())
        await asyncio.sleep(0)
        admission.leave(holder)  # grants the waiter's slot ...
        task.cancel()            # ... but it is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ran == [] and (admission.running, admission.waiting) == (0, 0)

    asyncio.run(scenario())


def test_client_keys_name_the_token_line_or_the_host_never_the_token():
    tokens = tuple(t.encode() for t in TOKENS)
    assert client_key(tokens, f"Bearer {TOKENS[1]}", "10.0.0.7") == "token 2"
    assert client_key((), f"Bearer {TOKENS[1]}", "10.0.0.7") == "peer 10.0.0.7"  # no auth: a token proves nothing
    assert client_key(tokens, f"Basic {TOKENS[1]}", "10.0.0.7") == "peer 10.0.0.7"  # not a bearer token
    assert peer_host("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert peer_host("ipv6:[::1]:40000") == "::1"
    assert peer_host("unix:/tmp/front.sock") == "unix:/tmp/front.sock"


@pytest.mark.parametrize("field,value", [("max_running", 0), ("max_waiting", -1), ("max_running_per_client", 0),
                                         ("max_waiting_per_client", -1), ("max_kv_tokens_per_request", 1)])
def test_bad_limits_name_their_field(field, value):
    with pytest.raises(ConfigError) as info:
        load_config(None, {f"front.limits.{field}": value})
    assert f"front.limits.{field}:" in str(info.value)


def test_default_limits_give_one_client_half_the_slots_and_half_the_queue():
    """Issue 57: unlimited per-client caps let one client take every slot and queue place."""
    front = load_config(None).front.limits
    assert front.max_running >= 64 and front.max_waiting >= 64
    assert front.max_running_per_client is None and front.max_waiting_per_client is None
    assert front.max_kv_tokens_per_request is None

    async def scenario():
        admission = Admission(limits(max_running=4, max_waiting=5))
        tickets = [admission.enter("a", f"a{i}") for i in range(5)]  # 2 run, 3 wait: half of each, rounded up
        assert [t.granted.done() for t in tickets] == [True, True, False, False, False]
        with pytest.raises(AdmissionRefused) as info:
            admission.enter("a", "a5")
        assert str(info.value).startswith("front.limits.max_waiting_per_client: 3 requests of this client")
        assert admission.enter("b", "b0").granted.result() is True  # the other half is the others'

    asyncio.run(scenario())


def test_a_freed_slot_goes_to_the_waiting_client_with_the_fewest_running():
    """Issue 57: a client with many queued requests cannot hold the others back (first come among equals)."""
    async def scenario():
        admission = Admission(limits(max_running=2, max_waiting=8, max_waiting_per_client=8))
        running = [admission.enter("a", "a0"), admission.enter("a", "a1")]
        queued_a = [admission.enter("a", f"a{i}") for i in range(2, 5)]
        b = admission.enter("b", "b0")
        c = admission.enter("c", "c0")
        admission.leave(running[0])
        assert b.granted.result() is True and not c.granted.done()  # b came before c; a already runs one
        admission.leave(running[1])  # a and c run none: equals, so the first come, a2
        assert queued_a[0].granted.result() is True and not c.granted.done()
        admission.leave(b)  # a runs one, c none: c, though a3 and a4 came first
        assert c.granted.result() is True and not any(t.granted.done() for t in queued_a[1:])

    asyncio.run(scenario())


# --------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"), max_pos=4096)


@pytest.fixture(scope="module")
def fronts(pair, tmp_path_factory):
    """{"tokens": front, "queue": front} over one draft and one target; each front has .http set."""
    root = tmp_path_factory.mktemp("cfg")
    (root / "tokens.txt").write_text("\n".join(TOKENS) + "\n")
    base = write_config(root / "serve.yaml", pair)
    tokens_config = write_config(root / "tokens.yaml", pair, front={
        "port": 0, "http_port": 0, "use_ray": False, "auth_token_file": str(root / "tokens.txt"),
        "limits": {"max_running": 2, "max_waiting": 0, "max_running_per_client": 1, "max_waiting_per_client": 0,
                   "max_kv_tokens_per_request": KV_CAP, "max_body_bytes": BODY_CAP}})
    queue_config = write_config(root / "queue.yaml", pair, front={
        "port": 0, "http_port": 0, "use_ray": False,
        "limits": {"max_running": 1, "max_waiting": 2, "max_waiting_per_client": 2}})
    draft, target = launch_service("draft", base), launch_service("target", base)
    wait_ready(draft), wait_ready(target)
    started = {name: launch_service("front", config, draft_address=draft.address, target_address=target.address,
                                    no_ray=True)
               for name, config in (("tokens", tokens_config), ("queue", queue_config))}
    for front in started.values():
        wait_ready(front)
        front.http = wait_address(front, "http")
    yield started
    for service in (*started.values(), draft, target):
        stop_service(service)


@pytest.fixture(scope="module")
def target_model(pair):
    return AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()


def auth(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


async def generate(stub, token=None, timeout=60.0, **fields):
    """One Generate call to its end: (token ids, final stats)."""
    tokens, stats = [], None
    async for reply in stub.Generate(generation_pb2.GenerateRequest(**fields), metadata=auth(token), timeout=timeout):
        tokens += reply.token_ids
        stats = reply.stats if reply.HasField("stats") else stats
    return tokens, stats


async def admitted(make, timeout_s: float = 10.0):
    """await make(), again while it ends RESOURCE_EXHAUSTED: the slot of a call the test cancelled is
    freed asynchronously on the server. A slot that is never freed fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await make()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def hold(stub, token=None, request_id=""):
    """A running request: a holder call (3000 plain tokens, EOS ignored) once its first tokens came."""
    async def start():
        call = stub.Generate(generation_pb2.GenerateRequest(
            prompt_ids=HOLD_PROMPT, max_new_tokens=HOLD_TOKENS, no_spec=True, ignore_eos=True, request_id=request_id),
            metadata=auth(token), timeout=120)
        reply = await call.read()
        assert reply.token_ids, "the holder ended before it generated"
        return call

    return await admitted(start)


async def rest(call):
    """The replies of a call already read with ``read()`` (grpc.aio allows no ``async for`` after it)."""
    while (reply := await call.read()) is not grpc.aio.EOF:
        yield reply


async def refused(stub, token=None, **fields) -> str:
    """The details of a call that must end RESOURCE_EXHAUSTED."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, token, prompt_ids=[1, 2, 3], max_new_tokens=4, **fields)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert dict(info.value.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "1000"  # a retry hint
    return info.value.details()


def on(front, scenario):
    """Run scenario(stub) on a channel to the front."""
    async def run():
        async with grpc.aio.insecure_channel(front.address) as channel:
            return await scenario(generation_pb2_grpc.GenerationServiceStub(channel))
    return asyncio.run(run())


def metric(http: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


async def until_metric(http: str, name: str, value: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := await asyncio.to_thread(metric, http, name)) != value:
        assert time.monotonic() < deadline, f"{name} stayed {seen}, expected {value}"
        await asyncio.sleep(0.05)


def post(http: str, path: str, body: dict, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(f"http://{http}{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# "tokens" front: 1 running request per client, 2 overall, nothing waits


def test_client_over_its_running_cap_is_refused_while_another_client_runs(fronts):
    async def scenario(stub):
        holder = await hold(stub, TOKENS[0])
        try:
            details = await refused(stub, TOKENS[0])
            assert details.startswith("front.limits.max_running_per_client: 1 requests of this client are running")
            tokens, stats = await admitted(lambda: generate(stub, TOKENS[1], prompt_ids=[1, 2, 3], max_new_tokens=6,
                                                            ignore_eos=True))
            assert len(tokens) == stats.new_tokens == 6  # token 2 is another client: it runs
        finally:
            holder.cancel()

    on(fronts["tokens"], scenario)


def test_overall_running_cap_refuses_every_client(fronts):
    async def scenario(stub):
        holders = [await hold(stub, TOKENS[0]), await hold(stub, TOKENS[1])]
        try:
            details = await refused(stub, TOKENS[2])  # a client with nothing running
            assert details.startswith("front.limits.max_running: 2 requests are running")
            assert "front.limits.max_waiting is 0" in details
        finally:
            for holder in holders:
                holder.cancel()

    on(fronts["tokens"], scenario)


def test_http_over_the_cap_is_429_with_the_error_object(fronts):
    front = fronts["tokens"]
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}

    async def scenario(stub):
        holder = await hold(stub, TOKENS[0])  # over gRPC: the same client on HTTP
        try:
            status, error = await asyncio.to_thread(post, front.http, "/v1/completions", body, TOKENS[0])
            assert status == 429, error
            assert error["error"]["type"] == "rate_limit_error" and error["error"]["code"] == "rate_limit_exceeded"
            assert error["error"]["message"].startswith("front.limits.max_running_per_client: 1 requests")
            assert not any(token in json.dumps(error) for token in TOKENS)
            request = urllib.request.Request(f"http://{front.http}/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json", "Authorization": f"Bearer {TOKENS[0]}"})
            with pytest.raises(urllib.error.HTTPError) as info:
                await asyncio.to_thread(urllib.request.urlopen, request, timeout=30)
            assert info.value.code == 429 and info.value.headers["Retry-After"] == "1"  # a retry hint
            deadline = time.monotonic() + 10
            while (status := (answer := await asyncio.to_thread(post, front.http, "/v1/completions", body,
                                                                   TOKENS[1]))[0]) == 429:
                assert time.monotonic() < deadline, answer  # an earlier test's holder of token 2 is being freed
                await asyncio.sleep(0.05)
            assert status == 200 and answer[1]["usage"]["completion_tokens"] >= 1
        finally:
            holder.cancel()

    on(front, scenario)


def test_kv_share_per_request_is_invalid_argument_naming_the_field(fronts):
    front = fronts["tokens"]

    async def scenario(stub):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, TOKENS[0], prompt_ids=[1] * 10, max_new_tokens=KV_CAP - 9)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("max_new_tokens: 10 prompt tokens + 3491 new tokens exceed "
                                               f"front.limits.max_kv_tokens_per_request ({KV_CAP} tokens)")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, TOKENS[0], prompt_ids=[1] * KV_CAP, max_new_tokens=1)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("prompt: ")
        # the server default (front.max_new_tokens 256) shrinks to what the cap leaves: 5 tokens
        tokens, stats = await admitted(lambda: generate(stub, TOKENS[0], prompt_ids=[1] * (KV_CAP - 5),
                                                        ignore_eos=True))
        assert len(tokens) == stats.new_tokens == 5

    on(front, scenario)
    status, error = post(front.http, "/v1/completions", {"prompt": [1] * 10, "max_tokens": KV_CAP}, TOKENS[0])
    assert status == 400 and error["error"]["param"] == "max_tokens"
    assert "front.limits.max_kv_tokens_per_request" in error["error"]["message"]


def test_slots_are_released_after_deadlines_cancels_aborts_and_refusals(fronts):
    """Token 1 may run one request: every request below must get (and then free) that one slot."""
    async def scenario(stub):
        for attempt in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as info:  # admitted, then past its deadline
                await admitted(lambda: generate(stub, TOKENS[0], timeout=1.0, prompt_ids=HOLD_PROMPT,
                                                max_new_tokens=HOLD_TOKENS, no_spec=True, ignore_eos=True))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            (await hold(stub, TOKENS[0])).cancel()  # the client goes away
            holder = await hold(stub, TOKENS[0], request_id=f"abort-{attempt}")
            await refused(stub, TOKENS[0])  # a refused request takes nothing
            with pytest.raises(grpc.aio.AioRpcError) as info:  # nor does a bad one (refused before admission)
                await generate(stub, TOKENS[0], prompt_ids=[1] * 10, max_new_tokens=KV_CAP)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (await stub.Abort(generation_pb2.AbortRequest(request_id=f"abort-{attempt}"),
                                     metadata=auth(TOKENS[0]))).aborted  # aborted by id
            replies = [reply async for reply in rest(holder)]
            assert replies[-1].stats.stop_reason == "aborted"
        holders = [await hold(stub, TOKENS[0]), await hold(stub, TOKENS[1])]  # both slots are free again ...
        try:
            assert (await refused(stub, TOKENS[2])).startswith("front.limits.max_running: 2")  # ... and still capped
        finally:
            for holder in holders:
                holder.cancel()

    on(fronts["tokens"], scenario)


def test_refusals_log_the_client_by_its_token_line_never_the_token(fronts):
    front = fronts["tokens"]

    async def scenario(stub):
        holder = await hold(stub, TOKENS[2])
        try:
            details = await refused(stub, TOKENS[2])
            assert details.startswith("front.limits.max_running_per_client") and not any(t in details for t in TOKENS)
        finally:
            holder.cancel()

    on(front, scenario)
    deadline = time.monotonic() + 10
    while "refused a request of client token 3" not in front.stderr:
        assert time.monotonic() < deadline, "the refusal was not logged"
        time.sleep(0.05)
    assert not any(token in front.stderr for token in TOKENS)


# "queue" front: one running request, two waiting (all test clients are one host)


def test_waiting_requests_run_in_turn_with_unchanged_output(fronts, target_model):
    front = fronts["queue"]
    prompts = [[11, 12, 13, 14], [21, 22, 23]]
    expected = [hf_greedy(target_model, ids, 16) for ids in prompts]
    expected = [out[: out.index(EOS) + 1] if EOS in out else out for out in expected]

    async def scenario(stub):
        holder = await hold(stub)
        ended = {}

        async def waiter(i):
            result = await generate(stub, prompt_ids=prompts[i], max_new_tokens=16)
            ended[i] = time.monotonic()
            return result

        first = asyncio.create_task(waiter(0))
        await until_metric(front.http, "specdec_requests_waiting", 1)  # queued (the holder has its tokens)
        second = asyncio.create_task(waiter(1))
        await until_metric(front.http, "specdec_requests_waiting", 2)
        details = await refused(stub)
        assert details.startswith("front.limits.max_waiting: 2 requests are waiting for a slot "
                                  "(front.limits.max_running: 1 running)")
        assert not first.done() and not second.done()
        holder.cancel()
        outputs = await asyncio.gather(first, second)
        assert [tokens for tokens, _ in outputs] == expected  # greedy output unchanged by the wait
        assert ended[0] < ended[1]  # first come, first served (one slot: the second ran after the first)

    on(front, scenario)


def test_abort_or_cancel_of_a_waiting_request_frees_its_place(fronts):
    front = fronts["queue"]

    async def scenario(stub):
        holder = await hold(stub)
        calls = []
        try:
            aborted = stub.Generate(generation_pb2.GenerateRequest(request_id="queued-1", prompt_ids=[1, 2],
                                                                   max_new_tokens=8), timeout=60)
            await until_metric(front.http, "specdec_requests_waiting", 1)
            assert (await stub.Abort(generation_pb2.AbortRequest(request_id="queued-1"))).aborted
            replies = [reply async for reply in aborted]
            assert len(replies) == 1 and not replies[0].token_ids and replies[0].stats.stop_reason == "aborted"
            await until_metric(front.http, "specdec_requests_waiting", 0)
            for _ in range(2):  # both places are free: two requests wait, no refusal
                calls.append(stub.Generate(generation_pb2.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=8),
                                           timeout=60))
                await until_metric(front.http, "specdec_requests_waiting", len(calls))
            await refused(stub)
            calls.pop().cancel()  # a client that gives up frees its place too
            await until_metric(front.http, "specdec_requests_waiting", 1)
            calls.append(stub.Generate(generation_pb2.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=8), timeout=60))
            await until_metric(front.http, "specdec_requests_waiting", 2)
        finally:
            for call in (holder, *calls):
                call.cancel()
        await until_metric(front.http, "specdec_requests_waiting", 0)
        await until_metric(front.http, "specdec_requests_running", 0)

    on(front, scenario)


def test_http_client_that_disconnects_while_waiting_frees_its_place(fronts):
    front = fronts["queue"]
    host, port = front.http.rsplit(":", 1)

    async def scenario(stub):
        holder = await hold(stub)
        calls = []
        try:
            connection = http.client.HTTPConnection(host, int(port), timeout=10)
            connection.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2], "max_tokens": 4}),
                               {"Content-Type": "application/json"})
            await until_metric(front.http, "specdec_requests_waiting", 1)
            connection.close()  # gone before its turn
            await until_metric(front.http, "specdec_requests_waiting", 0)
            for _ in range(2):  # its place is free again: two wait, the third is refused
                calls.append(stub.Generate(generation_pb2.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=8),
                                           timeout=60))
                await until_metric(front.http, "specdec_requests_waiting", len(calls))
            await refused(stub)
        finally:
            for call in (holder, *calls):
                call.cancel()
        await until_metric(front.http, "specdec_requests_waiting", 0)

    on(front, scenario)


# issue 57: clients apart, bounds before cost (unit tests of the same: tests/test_front_bounds.py)


def test_another_tokens_abort_neither_touches_nor_reveals_a_request(fronts):
    """Token 2's Abort("job-1") answers false and token 1's job-1 streams on; token 2 may run a job-1 of its own."""
    async def scenario(stub):
        first = await hold(stub, TOKENS[0], request_id="job-1")
        try:
            abort = generation_pb2.AbortRequest(request_id="job-1")
            assert not (await stub.Abort(abort, metadata=auth(TOKENS[1]))).aborted
            second = await hold(stub, TOKENS[1], request_id="job-1")  # the same id, another client: its own request
            assert (await stub.Abort(abort, metadata=auth(TOKENS[1]))).aborted  # ends token 2's job-1 ...
            assert [r async for r in rest(second)][-1].stats.stop_reason == "aborted"
            assert (await first.read()).token_ids  # ... and not token 1's
            assert (await stub.Abort(abort, metadata=auth(TOKENS[0]))).aborted
            assert [r async for r in rest(first)][-1].stats.stop_reason == "aborted"
        finally:
            first.cancel()

    on(fronts["tokens"], scenario)


def test_bad_ids_and_sizes_are_refused_naming_the_field(fronts):
    async def scenario(stub):
        answers = []
        for fields in ({"request_id": "a" * 129}, {"request_id": "job\n1"},
                       {"prompt": "x" * ((1 << 20) + 1), "raw": True}, {"max_new_tokens": 10**6}):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stub, **({"prompt_ids": [1, 2]} if "prompt" not in fields else {}), **fields)
            answers.append((info.value.code(), info.value.details().split(":")[0]))
        return answers

    assert on(fronts["queue"], scenario) == [(grpc.StatusCode.INVALID_ARGUMENT, field) for field in
                                             ("request_id", "request_id", "prompt", "max_new_tokens")]


def raw_post(http: str, headers: dict[str, str], body_chunks=()) -> tuple[int, dict, float]:
    """POST /v1/completions over a bare socket: the headers, then as much of the chunked body as the server takes
    before it answers. (status, error object, seconds to the answer)."""
    host, port = http.rsplit(":", 1)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {http}\r\nContent-Type: application/json\r\n{head}\r\n"
                     .encode())
        with contextlib.suppress(OSError):  # the server may answer and close while chunks are still going out
            for chunk in body_chunks:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        response = http_response(sock)
    return response.status, json.loads(response.read()), time.monotonic() - start


def http_response(sock) -> http.client.HTTPResponse:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response


def test_http_checks_token_and_size_before_reading_the_body(fronts):
    """A 300 MB body is announced and never sent: the answer must come without reading it (the old front read the
    whole body before its 401 and never answered here)."""
    http_ = fronts["tokens"].http
    huge = {"Content-Length": str(300 << 20)}
    status, body, seconds = raw_post(http_, huge)
    assert (status, body["error"]["code"]) == (401, "invalid_api_key") and seconds < 5
    status, body, seconds = raw_post(http_, huge | {"Authorization": f"Bearer {TOKENS[0]}"})
    assert status == 413 and body["error"]["message"].startswith("request body: over front.limits.max_body_bytes")
    chunked = {"Authorization": f"Bearer {TOKENS[0]}", "Transfer-Encoding": "chunked"}
    status, body, _ = raw_post(http_, chunked, [b"x" * 16384] * 64)  # 1 MiB, unannounced
    assert status == 413
    status, body = post(http_, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "specdec": {"ignore_eos": True}},
                        TOKENS[0])
    assert status == 200 and body["usage"]["completion_tokens"] == 2  # a body under the cap is served

