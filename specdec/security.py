"""Transport security and authentication: grpcio's own TLS credentials and a bearer-token interceptor (docs/deploy.md
"TLS and bearer tokens"). Tokens are compared in constant time and never logged."""

from __future__ import annotations

import hmac
import ipaddress
import logging
from pathlib import Path
from typing import Sequence

import grpc

from specdec.config import GrpcConfig
from specdec.telemetry import CancelThrough

log = logging.getLogger(__name__)

PROTECTED_PREFIX = "/specdec.v1.GenerationService/"


def refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends every call with ``code`` and ``message``."""
    async def refuse(_request, context):
        await context.abort(code, message)

    async def refuse_stream(_request, context):  # an async generator, like the handlers it replaces
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse_stream if handler.response_streaming else refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def load_auth_tokens(path: str | None, field: str = "front.auth_token_file") -> tuple[str, ...]:
    """Bearer tokens of ``path``, one a line (None = no auth). Raises ValueError naming ``field`` if none."""
    if path is None:
        return ()
    try:
        tokens = tuple(line.strip() for line in Path(path).read_text().splitlines() if line.strip())
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc.strerror or exc}") from None
    if not tokens:
        raise ValueError(f"{field}: {path} holds no token")
    return tokens


def token_index(accepted: Sequence[bytes], header: str) -> int | None:
    """The index in ``accepted`` of the token of an ``authorization`` value ``Bearer <token>`` (the
    first, if listed twice); None when it names none of them (constant time per token)."""
    scheme, _, token = header.partition(" ")
    given = token.strip().encode()
    found = None
    for index, candidate in enumerate(accepted):  # every token compared, so the time does not tell which one matched
        if hmac.compare_digest(candidate, given) and found is None:
            found = index
    return found if scheme.lower() == "bearer" else None


def token_accepted(accepted: Sequence[bytes], header: str) -> bool:
    """Whether an ``authorization`` value is ``Bearer <one of accepted>`` (constant time per token)."""
    return token_index(accepted, header) is not None


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def check_client_auth(config: GrpcConfig, name: str) -> None:
    """Before a draft or target service (``name``) loads anything: TLS without ``tls_ca`` would serve any client
    that can reach the port. Raises ValueError naming grpc.tls_ca unless ``tls_client_auth`` is false (then warns)."""
    if config.tls_cert is None or config.tls_ca is not None:
        return
    if config.tls_client_auth:
        raise ValueError(f"grpc.tls_ca: the {name} serves TLS (grpc.tls_cert) and needs the CA of its clients' "
                         "certificates to refuse the others; set grpc.tls_client_auth: false to serve any TLS client")
    log.warning("%s serves TLS without client certificates (grpc.tls_client_auth: false): any client that reaches "
                "the port can open sessions and run the model", name)


def server_credentials(config: GrpcConfig, client_auth: bool) -> grpc.ServerCredentials | None:
    """TLS credentials of a server port (None = no tls_cert); client_auth: mutual TLS against ``tls_ca``
    (``check_client_auth`` refused a service without one at its start)."""
    if config.tls_cert is None:
        return None
    pair = [(_read(config.tls_key), _read(config.tls_cert))]
    ca = _read(config.tls_ca)
    return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=client_auth and ca is not None)


def channel_credentials(config: GrpcConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials of a client channel (None = plaintext: neither tls_ca nor tls_cert). Verifies
    the server against tls_ca (the system roots when unset) and presents tls_cert when set."""
    if config.tls_ca is None and config.tls_cert is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(config.tls_ca), private_key=_read(config.tls_key),
                                        certificate_chain=_read(config.tls_cert))


def aio_channel(address: str, config: GrpcConfig, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to another service: TLS when configured (``channel_credentials``); a
    cancelled call is cancelled at the server too, traced or not (``telemetry.CancelThrough``)."""
    credentials = channel_credentials(config)
    interceptors = [CancelThrough()]
    options = [*keepalive_options(config, server=False), *options]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=list(options), interceptors=interceptors)


def keepalive_options(config: GrpcConfig, server: bool) -> list[tuple[str, int]]:
    """gRPC channel arguments of ``grpc.keepalive_s`` (gRPC's keepalive guide: the server must permit the
    client's ping rate, or it answers GOAWAY too_many_pings)."""
    ms = int(config.keepalive_s * 1000)
    timeout = max(ms // 3, 100)
    common = [("grpc.keepalive_timeout_ms", timeout), ("grpc.http2.ping_timeout_ms", timeout),
              ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    if server:
        return [("grpc.keepalive_time_ms", 2 * ms), ("grpc.http2.min_recv_ping_interval_without_data_ms", ms // 2),
                *common]
    return [("grpc.keepalive_time_ms", ms), *common]


def is_loopback(host: str) -> bool:
    """Whether a bind address is loopback only ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_plaintext(name: str, host: str, config: GrpcConfig) -> None:
    """Log a warning when ``host`` is not a loopback address and the port serves no TLS."""
    if config.tls_cert is None and not is_loopback(host):
        log.warning("%s listens on %s without TLS: anyone who reaches the port can call it "
                    "(set grpc.tls_cert / tls_key / tls_ca, README 'Security')", name, host)


class BearerAuth(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for GenerationService calls without an accepted bearer token (health and
    reflection, and the draft and target services' own RPCs, pass). tokens: the accepted ones."""

    def __init__(self, tokens: Sequence[str]):
        self.tokens = tuple(t.encode() for t in tokens)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return handler
        header = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if token_accepted(self.tokens, header if isinstance(header, str) else header.decode(errors="replace")):
            return handler
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid bearer token (metadata authorization: Bearer ...)")
