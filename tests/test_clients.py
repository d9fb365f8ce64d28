"""Unit tests of the gRPC clients' error handling (fake stubs: no server)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orchestrator.clients import TargetClient
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
