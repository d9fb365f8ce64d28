"""The gRPC host shared by the services (grpc.aio), the draft and target process entry, and the mapping of exceptions to
status codes (docs/serving.md "Errors")."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
import time
from typing import Callable, Mapping, Sequence

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.config import ConfigError, GrpcConfig, ServeConfig, load_config
from specdec.interfaces import UnknownSessionError
from specdec.model_worker import ModelWorker
from specdec.models import ModelError
from specdec.placement import usable_cpus
from specdec.process_entry import configure_logging, fail
from specdec.sampling import SamplingParamsError
from specdec.security import (
    check_client_auth, keepalive_options, refusing_handler, server_credentials, warn_plaintext,
)
from specdec.telemetry import setup_tracing, shutdown_tracing
from specdec.service_errors import CapacityError, DeadlineExpiredError, ShuttingDownError
from specdec.tree import MalformedTreeError
from specdec.tree_spec import TreeSpecError

log = logging.getLogger(__name__)


_DEFAULT_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownSessionError, grpc.StatusCode.FAILED_PRECONDITION),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExpiredError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (MalformedTreeError, grpc.StatusCode.INVALID_ARGUMENT),
    (SamplingParamsError, grpc.StatusCode.INVALID_ARGUMENT),
    (TreeSpecError, grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


# Longest status message sent: gRPC clients refuse trailers past 16 KiB, and a message may quote a caller's value.
MAX_STATUS_CHARS = 1024


def short_status(text: str) -> str:
    """``text`` cut to MAX_STATUS_CHARS, with the full length said at the end."""
    if len(text) <= MAX_STATUS_CHARS:
        return text
    return f"{text[:MAX_STATUS_CHARS]}... ({len(text)} characters)"


def error_message(exc: BaseException) -> str:
    """The exception's message (a KeyError's without the repr quotes), cut to MAX_STATUS_CHARS."""
    if isinstance(exc, KeyError) and exc.args:
        return short_status(str(exc.args[0]))
    return short_status(str(exc) or type(exc).__name__)


def status_for(exc: BaseException, extra: Mapping[type[BaseException], grpc.StatusCode] | None = None) -> tuple[grpc.StatusCode, str]:
    """(status code, message) for an exception; extra: service-specific classes, checked first; else INTERNAL."""
    for cls, code in (*(extra or {}).items(), *_DEFAULT_CODES):
        if isinstance(exc, cls):
            return code, error_message(exc)
    return grpc.StatusCode.INTERNAL, short_status(f"internal error: {type(exc).__name__}: {exc}")


async def abort_for(context: grpc.aio.ServicerContext, exc: BaseException,
                    extra: Mapping[type[BaseException], grpc.StatusCode] | None = None, where: str = "") -> None:
    """End the call with the status of ``exc`` (raises grpc.aio.AbortError, as context.abort does)."""
    code, message = status_for(exc, extra)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", where or "call", exc_info=exc)
    await context.abort(code, message)


def rpc_errors(extra: Mapping[type[BaseException], grpc.StatusCode] | None = None):
    """Decorator for async unary handlers ``(self, request, context)``: exceptions -> status codes."""
    def wrap(handler):
        @functools.wraps(handler)
        async def guarded(self, request, context):
            try:
                return await handler(self, request, context)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status, the server keeps serving
                await abort_for(context, exc, extra, where=handler.__name__)
        return guarded
    return wrap


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on ``time.monotonic()`` (None = none). Raises DeadlineExpiredError if passed."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    if remaining <= 0:
        raise DeadlineExpiredError("deadline: expired before the call started")
    return time.monotonic() + remaining


_ALWAYS_OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class _DrainingGate(grpc.aio.ServerInterceptor):
    """Refuses new calls with UNAVAILABLE once the host drains (health and reflection stay open)."""

    def __init__(self, host: "ServiceHost"):
        self.host = host

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self.host.draining.is_set() or handler_call_details.method.startswith(_ALWAYS_OPEN):
            return handler
        return refusing_handler(handler, grpc.StatusCode.UNAVAILABLE, f"{self.host.name} is shutting down")


class ServiceHost:
    """One gRPC server process. Create it inside the running event loop, register servicers on
    ``host.server``, then ``await host.serve(...)``, which returns after SIGTERM/SIGINT once drained.

    name: in the ready line ``<name> ready on <host>:<port>``; config: the grpc section; client_auth:
    mutual TLS with tls_ca; interceptors: after the draining gate. ``health_server`` (with
    ``config.health_port``) prints ``health ready on <host>:<port>`` and stops after the main server."""

    def __init__(self, name: str, config: GrpcConfig, client_auth: bool = False, interceptors: Sequence = ()):
        self.name = name
        self.config = config
        self.client_auth = client_auth
        self.draining = asyncio.Event()  # set when shutdown starts; streams watch it
        self._stop = asyncio.Event()
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            interceptors=[_DrainingGate(self), *interceptors],
            options=[
                ("grpc.max_send_message_length", config.max_message_bytes),
                ("grpc.max_receive_message_length", config.max_message_bytes),
                *keepalive_options(config, server=True),
            ],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health_server: grpc.aio.Server | None = None
        if config.health_port is not None:
            self.health_server = grpc.aio.server()  # health only: no reflection, no draining gate (nothing else to refuse)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)

    async def start(self, host: str, port: int, service_names: Sequence[str]) -> int:
        """Bind host:port (0 = ephemeral) and the health port, mark SERVING, start; returns the bound port.
        Raises OSError when an address cannot be bound."""
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        credentials = server_credentials(self.config, self.client_auth)
        warn_plaintext(self.name, host, self.config)
        bound = _bind(self.server, host, port, credentials)
        health_bound = None
        if self.health_server is not None:
            health_bound = _bind(self.health_server, host, self.config.health_port, None)
        for service in ("", *service_names):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        print(f"{self.name} ready on {host}:{bound}", flush=True)
        if health_bound is not None:
            print(f"health ready on {host}:{health_bound}", flush=True)
        return bound

    def stop_on_signals(self) -> None:
        """SIGTERM/SIGINT begin the graceful shutdown."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)

    async def wait_for_stop(self) -> None:
        """Return once SIGTERM/SIGINT asked for the shutdown."""
        await self._stop.wait()

    async def serve(self, host: str, port: int, service_names: Sequence[str]) -> int:
        """Start, wait for SIGTERM/SIGINT, drain, stop. Returns the port that was bound."""
        self.stop_on_signals()
        bound = await self.start(host, port, service_names)
        await self.wait_for_stop()
        await self.drain()
        return bound

    async def drain(self) -> None:
        """NOT_SERVING, refuse new calls (UNAVAILABLE), end streams, give in-flight calls the grace."""
        log.info("%s draining (grace %.1f s)", self.name, self.config.shutdown_grace_s)
        self.draining.set()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=self.config.shutdown_grace_s)
        if self.health_server is not None:  # after the service: probes read NOT_SERVING until the end
            await self.health_server.stop(grace=None)
        log.info("%s stopped", self.name)


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Add host:port to ``server`` (TLS with ``credentials``); returns the bound port. Raises OSError."""
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from None
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return bound


class _Terminated(BaseException):
    """SIGTERM while the model loads (before the server's own handler is installed)."""


def _terminate(signum, frame):
    raise _Terminated()


def serve_model(config: ServeConfig, role: str, load: Callable, serve_runtime: Callable) -> int:
    """A draft or target service process (``role``: "draft" | "target"): the model's whole life (threads,
    ``load(config)`` -> (runtime, serve_runtime keywords), every forward) on one ModelWorker thread, then
    ``serve_runtime(config, runtime, worker=..., **keywords)`` until drained; a runtime with ``close`` is
    closed after. Returns the exit code: 0 (also for a SIGTERM while loading), or 2 with a message on stderr
    naming the field (a bad model, an unusable ``<role>.host`` / ``<role>.port``, TLS without a client CA)."""
    configure_logging()
    try:
        check_client_auth(config.grpc, f"{role} service")
    except ValueError as exc:
        return fail(str(exc))
    setup_tracing(f"{role}-service")
    previous = signal.signal(signal.SIGTERM, _terminate)
    runtime, stopped_loading = None, False
    worker = ModelWorker(f"{role}-runtime")
    try:
        # unset: the CPUs this process can keep busy (affinity and cgroup quota), not the host's count
        worker.call(torch.set_num_threads, config.models.threads or usable_cpus())
        runtime, keywords = worker.call(load, config)
        asyncio.run(serve_runtime(config, runtime, worker=worker, **keywords))
    except ModelError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"{role}.host / {role}.port: {exc}")
    except _Terminated:
        log.info("%s-service: SIGTERM while loading; stopped", role)
        stopped_loading = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        worker.close(wait=False)  # the servicer has closed it after serving; else the process is exiting
        if hasattr(runtime, "close"):
            runtime.close()  # tensor-parallel ranks stop after the drain (after a rank failure they are gone)
        shutdown_tracing()
    if stopped_loading and worker.busy():
        # SIGTERM during the (native) load: end the process here; interpreter shutdown may abort mid-call
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def run_service(config_path: str | None, overrides: Mapping[str, object] | None,
                serve: Callable[[ServeConfig], int]) -> int:
    """Load the config (YAML, then ``overrides``: dotted fields such as {"target.tp": 2}, None = keep the
    file's value) and ``serve`` it; returns the exit code (2 with a message for a bad config)."""
    try:
        config = load_config(config_path, dict(overrides or {}))
    except ConfigError as exc:
        return fail(str(exc))
    return serve(config)
