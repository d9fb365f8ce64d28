"""``specdec generate --server ADDR``: a client of the generation front (specdec.v1.GenerationService)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import grpc

from specdec.sampling import SamplingParams
from specdec.security import load_auth_tokens
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
                    tls_ca: str | None = None, token: str | None = None) -> SimpleNamespace:
    """Run one request on the front at ``address``, text deltas to stdout; spec None = the server's tree; tls_ca None
    = plaintext. Returns the FinalStats fields (and ``tokens``) as a namespace. Raises RemoteError."""
    request = generation_pb2.GenerateRequest(prompt=prompt, raw=raw, max_new_tokens=max_new_tokens, stop=list(stop),
                                             sampling=sampling_to_proto(sampling), no_spec=no_spec,
                                             tree=spec_to_proto(spec) if spec is not None else None)
    tokens: list[int] = []
    final = None
    try:
        with _channel(address, tls_ca) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            metadata = [("authorization", f"Bearer {token}")] if token else None
            for reply in stub.Generate(request, wait_for_ready=False, metadata=metadata):
                tokens += reply.token_ids
                if reply.text_delta:
                    print(reply.text_delta, end="", flush=True)
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


def _channel(address: str, tls_ca: str | None) -> grpc.Channel:
    if tls_ca is None:
        return grpc.insecure_channel(address)
    try:
        ca = Path(tls_ca).read_bytes()
    except OSError as exc:
        raise RemoteError(grpc.StatusCode.INVALID_ARGUMENT, f"--tls-ca: cannot read {tls_ca}: {exc.strerror or exc}") from None
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca))


def client_token(token_file: str | None) -> str | None:
    """$SPECDEC_TOKEN, else the first line of ``token_file`` (None = none); ValueError names --auth-token-file."""
    if os.environ.get("SPECDEC_TOKEN"):
        return os.environ["SPECDEC_TOKEN"].strip()
    if token_file is None:
        return None
    return load_auth_tokens(token_file, "--auth-token-file")[0]
