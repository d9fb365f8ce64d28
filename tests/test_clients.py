"""Unit tests of the gRPC clients' error handling (fake stubs: no server)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orchestrator.loop.clients import TargetClient
from specdec.tree import DraftTree
from specdec.v1 import target_pb2


def rpc_error(code):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="scripted")


class ScriptedStub:
    """Verify raises the scripted errors in order, then answers."""

    def __init__(self, errors):
        self.errors = list(errors)
        self.calls = []

    async def Verify(self, request, timeout=None):
        self.calls.append(request)
        if self.errors:
            raise self.errors.pop(0)
        return target_pb2.VerifyResponse(accepted_nodes=[0], tokens=[5, 6])


def client_with(stub) -> TargetClient:
    client = TargetClient.__new__(TargetClient)
    client.stub = stub
    return client


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
