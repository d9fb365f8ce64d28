"""Round spans in-process, with the OpenTelemetry SDK's in-memory exporter: one ``round`` span per
round with ``draft``, ``verify`` and ``commit`` children and the round's attributes (tree nodes,
accepted length, gamma), under the caller's span."""

from __future__ import annotations

import asyncio

from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from draft_service.runtime import DraftRuntime
from orchestrator.loop.controller import GenerationRequest, RoundController, sync_worker
from specdec.telemetry import setup_tracing
from specdec.tree_spec import DEFAULT_SPEC
from target_service.runtime import TargetRuntime
from tests.conftest import perturbed_copy, random_prompt, tiny_model


def test_round_spans_with_phases_and_attributes():
    exporter = InMemorySpanExporter()
    setup_tracing("specdec-test", exporter=exporter, simple=True)
    target = tiny_model(seed=0)
    ctl = RoundController(sync_worker(TargetRuntime(target)), sync_worker(DraftRuntime(perturbed_copy(target, 1, 0.02))),
                          [], 10_000)
    records = []

    async def go():
        with trace.get_tracer("test").start_as_current_span("request") as parent:
            result = await ctl.generate(GenerationRequest(random_prompt(0, 8), 20, spec=DEFAULT_SPEC), on_round=records.append)
            return result, parent.get_span_context().trace_id

    result, trace_id = asyncio.run(go())
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
    rounds = [s for s in spans if s.name == "round"]
    assert len(rounds) == result.stats.rounds == len(records)
    by_id = {s.context.span_id: s for s in spans}
    for phase in ("draft", "verify", "commit"):
        children = [s for s in spans if s.name == phase]
        assert children and all(by_id[s.parent.span_id].name == "round" for s in children)
    assert sum(1 for s in spans if s.name == "verify") == len(rounds)
    for span, record in zip(sorted(rounds, key=lambda s: s.start_time), records):
        assert span.attributes["tree.nodes"] == record.proposed
        assert span.attributes["committed"] == len(record.tokens)
        assert span.attributes["accepted_length"] >= record.accepted
        assert span.attributes["gamma"] == DEFAULT_SPEC.gamma
    assert all(by_id[s.parent.span_id].name == "request" for s in rounds)


def test_channels_between_services_keep_client_spans_and_statuses_and_pass_cancels_on():
    """``aio_channel`` under the gRPC instrumentation: a failed call raises its own status and leaves
    an ERROR client span, a good one returns its response, and cancelling the caller cancels the
    handler at the server (without ``CancelThrough`` it ran on until the server stopped)."""
    import grpc
    from opentelemetry.trace import SpanKind, StatusCode

    from specdec.config import GrpcConfig
    from specdec.security import aio_channel

    exporter = InMemorySpanExporter()
    setup_tracing("specdec-test", exporter=exporter, simple=True)
    steps: list[int] = []

    async def slow(request, context):
        for step in range(40):
            steps.append(step)
            await asyncio.sleep(0.05)
        return b"late"

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids: empty")

    async def echo(request, context):
        return request + b"!"

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Probe", {
            name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in
            (("Slow", slow), ("Refuse", refuse), ("Echo", echo))}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio_channel(f"127.0.0.1:{port}", GrpcConfig()) as channel:
                assert await channel.unary_unary("/t.Probe/Echo")(b"hi", timeout=10) == b"hi!"
                try:
                    await channel.unary_unary("/t.Probe/Refuse")(b"", timeout=10)
                except grpc.aio.AioRpcError as exc:
                    refused = exc
                waiter = asyncio.ensure_future(channel.unary_unary("/t.Probe/Slow")(b"", timeout=30))
                await asyncio.sleep(0.3)
                waiter.cancel()
                await asyncio.sleep(0.5)  # ten more steps if the handler ran on
                return refused
        finally:
            await server.stop(None)

    refused = asyncio.run(main())
    assert (refused.code(), refused.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids: empty")
    client = {s.name: s for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT}
    assert client["/t.Probe/Refuse"].status.status_code == StatusCode.ERROR
    assert client["/t.Probe/Echo"].status.status_code != StatusCode.ERROR
    assert len(steps) <= 12, f"the cancelled call ran on at the server ({len(steps)} of 40 steps)"
