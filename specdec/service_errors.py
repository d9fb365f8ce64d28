"""Errors the draft and target services raise while serving a call, free of gRPC (``specdec.grpc_host.status_for`` maps
each to its status code)."""

from __future__ import annotations


class CapacityError(RuntimeError):
    """A server-wide limit (sessions, KV slots) would be exceeded; maps to RESOURCE_EXHAUSTED."""


class DeadlineExpiredError(TimeoutError):
    """The caller's deadline passed before the work started; maps to DEADLINE_EXCEEDED."""


class ShuttingDownError(RuntimeError):
    """The server is stopping and takes no more model work; maps to UNAVAILABLE."""
