"""Unit tests of the gRPC clients' error handling (fake stubs: no server)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

import time

from orchestrator.loop.clients import LinkRtt, TargetClient
from specdec.tree import DraftTree
from specdec.v1 import target_pb2


def rpc_error(code):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="scripted")


class ScriptedStub:
    """Verify raises the scripted errors in order, then answers."""

    def __init__(self, errors, took_s: float = 0.0, service_ms: float = 0.0):
        self.errors = list(errors)
        self.calls = []
        self.took_s, self.service_ms = took_s, service_ms

    async def Verify(self, request, timeout=None):
        self.calls.append(request)
        if self.errors:
            raise self.errors.pop(0)
        await asyncio.sleep(self.took_s)
        return target_pb2.VerifyResponse(accepted_nodes=[0], tokens=[5, 6], service_ms=self.service_ms)


def client_with(stub) -> TargetClient:
    client = TargetClient.__new__(TargetClient)
    client.stub, client.rtt = stub, LinkRtt()
    return client


def test_link_rtt_is_the_median_of_recent_wall_minus_service_times():
    rtt = LinkRtt(window=3)
    assert rtt.value is None
    rtt.add(0.050, 0.030)
    assert rtt.value == pytest.approx(0.020)
    rtt.add(0.100, 0.020)
    assert rtt.value == pytest.approx(0.050)  # median of 0.02 and 0.08
    rtt.add(0.030, 0.040)  # the service's time above the wall time (clocks): counts as 0
    assert rtt.value == pytest.approx(0.020)  # median of 0.02, 0.08, 0
    rtt.add(0.300, 0.010)  # the window holds 3: 0.08, 0, 0.29
    rtt.add(0.300, 0.020)  # 0, 0.29, 0.28
    assert rtt.value == pytest.approx(0.280)


def test_verify_measures_the_links_round_trip_from_service_ms():
    """A 50 ms call of which the target says it spent 30: a round trip of about 20 ms. A reply without
    service_ms (an older target) adds no sample; the replies of retried attempts that failed add none either."""
    client = client_with(ScriptedStub([], took_s=0.0))
    asyncio.run(client.verify("s", DraftTree((5,), (-1,))))
    assert client.link_rtt_s is None
    client = client_with(ScriptedStub([rpc_error(grpc.StatusCode.UNAVAILABLE)], took_s=0.05, service_ms=30.0))
    started = time.perf_counter()
    asyncio.run(client.verify("s", DraftTree((5,), (-1,))))
    wall = time.perf_counter() - started
    assert 0.020 <= client.link_rtt_s < wall - 0.2  # the 0.2 s retry pause is no part of the sample


def test_verify_is_retried_on_unavailable_with_the_same_tree():
    stub = ScriptedStub([rpc_error(grpc.StatusCode.UNAVAILABLE), rpc_error(grpc.StatusCode.UNAVAILABLE)])
    result = asyncio.run(client_with(stub).verify("s", DraftTree((5,), (-1,))))
    assert result.tokens == (5, 6) and result.accepted_nodes == (0,)
    assert len(stub.calls) == 3 and stub.calls[0] == stub.calls[2]


def test_verify_gives_up_after_the_retries_and_never_retries_other_codes():
    stub = ScriptedStub([rpc_error(grpc.StatusCode.UNAVAILABLE)] * 3)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(client_with(stub).verify("s", DraftTree((), ())))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and len(stub.calls) == 3
    stub = ScriptedStub([rpc_error(grpc.StatusCode.FAILED_PRECONDITION)])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(client_with(stub).verify("s", DraftTree((), ())))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and len(stub.calls) == 1


class SwallowsOneCancel:
    """A round controller (fake) whose rounds take 10 ms and whose first cancel is lost, as Python
    3.11's ``asyncio.wait_for`` (the draft deadline) loses a cancel arriving as its call completes."""

    def __init__(self):
        self.rounds = 0
        self.closed = False

    def check(self, request):
        pass

    async def generate(self, request, session_id=None, on_round=None):
        from orchestrator.loop.controller import GenerationResult
        from specdec.stats import GenerationStats, RoundRecord

        swallowed = False
        try:
            while self.rounds < 1000:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed = True  # lost: the loop goes on
                self.rounds += 1
                on_round(RoundRecord((7,), 0, 0, 0, None, 0, None, 0.01, 0.0))
        finally:
            self.closed = True
        return GenerationResult([7] * self.rounds, GenerationStats(stop_reason="max_new_tokens"))


def test_abort_ends_a_request_whose_cancel_was_swallowed():
    """Orchestrator.abort: a request whose task lost the cancel still ends at its next round with
    stop reason "aborted" and its sessions closed (before: it ran all 1000 rounds while abort
    waited, then reported max_new_tokens)."""
    from orchestrator.loop.controller import GenerationRequest
    from orchestrator.loop.service import Orchestrator

    orchestrator = Orchestrator(front=None, grpc_cfg=None)
    orchestrator.controller = fake = SwallowsOneCancel()

    async def main():
        stream = orchestrator.stream(GenerationRequest([1, 2], 1000), "r1")
        first = await stream.__anext__()
        aborted = await orchestrator.abort("r1")
        chunks = [chunk async for chunk in stream]
        return first, aborted, chunks

    first, aborted, chunks = asyncio.run(main())
    assert first.tokens == [7] and aborted
    assert chunks[-1].stats.stop_reason == "aborted" and fake.closed
    assert fake.rounds < 20, f"the request ran on for {fake.rounds} rounds after its abort"
    assert not orchestrator.stopping and not orchestrator.tasks
