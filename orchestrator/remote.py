"""``specdec generate --server ADDR``: a client of the generation front (specdec.v1.GenerationService).

Streams the text deltas to stdout as they arrive and returns the final statistics. gRPC errors are
turned into RemoteError with the status code name and the server's message (the CLI prints it and
exits non-zero).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import grpc

from specdec.sampling import SamplingParams
from specdec.tree_spec import TreeSpec
from specdec.v1 import generation_pb2, generation_pb2_grpc
from specdec.wire import sampling_to_proto, spec_to_proto


class RemoteError(RuntimeError):
    """A failed call to the front; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code


def generate_remote(address: str, prompt: str, *, max_new_tokens: int, sampling: SamplingParams,
                    spec: TreeSpec | None, no_spec: bool, raw: bool, stop: tuple[str, ...] = (),
                    timeout_s: float | None = None, out=sys.stdout) -> SimpleNamespace:
    """Run one request on the front at ``address``; writes text deltas to ``out``.

    spec None = the server's configured tree. Returns the final stats as a namespace with the
    fields of specdec.v1.FinalStats (and ``tokens``). Raises RemoteError.
    """
    request = generation_pb2.GenerateRequest(
        prompt=prompt, raw=raw, max_new_tokens=max_new_tokens, stop=list(stop),
        sampling=sampling_to_proto(sampling), no_spec=no_spec,
    )
    if spec is not None:
        request.tree.CopyFrom(spec_to_proto(spec))
    tokens: list[int] = []
    final = None
    try:
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            for reply in stub.Generate(request, timeout=timeout_s, wait_for_ready=False):
                tokens += reply.token_ids
                if reply.text_delta:
                    out.write(reply.text_delta)
                    out.flush()
                if reply.HasField("stats"):
                    final = reply.stats
    except grpc.RpcError as exc:
        raise RemoteError(exc.code(), exc.details() or "") from None
    if final is None:
        raise RemoteError(grpc.StatusCode.UNKNOWN, "the stream ended without final statistics")
    stats = SimpleNamespace(**{f.name: getattr(final, f.name) for f in final.DESCRIPTOR.fields})
    stats.tokens = tokens
    stats.tokens_per_s = stats.new_tokens / stats.total_s if stats.total_s else 0.0
    return stats
