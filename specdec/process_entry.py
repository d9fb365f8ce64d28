"""Process entry helpers shared by the three servers (draft, target, front): logging, the device check before any model
loads, and the one-line error exit."""

from __future__ import annotations

import logging
import sys

CONFIG_HELP = "Service config YAML (default: built-in defaults)."  # the --config flag of every server command


def configure_logging() -> None:
    """INFO logs on stderr (stdout carries only the ready line)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def check_device(device: str, key: str = "models.device") -> None:
    """Raise ValueError naming ``key`` for a device torch does not know or this machine lacks (e.g. cuda
    without a GPU, or cuda:3 on two), before any model is loaded. Opens no CUDA context."""
    import torch  # here, not at the top: ``specdec serve``'s launcher and the front use ``fail`` without torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{key}: {device!r} is not a torch device ({exc})") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key}: {device!r} but CUDA is not available on this machine")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{key}: {device!r} but this machine has {torch.cuda.device_count()} CUDA devices")


DEVICE_HELP = ("The target's device: cpu, cuda or cuda:N (with --tp N: ranks on cuda:N, cuda:N+1, ...) or one per "
               "rank, comma-separated (cuda:0,cuda:2); overrides target.device.")


def device_option(value: str | None) -> str | list[str] | None:
    """A --device flag's value as target.device: "cuda:0,cuda:2" -> a list (one per rank), else as given."""
    return value.split(",") if value and "," in value else value


def fail(message: str) -> int:
    """Print ``error: message`` on stderr; returns exit code 2 (no traceback)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


# Transport security flags of every server command (specdec.security); each overrides the YAML field.
TLS_CERT_HELP = "PEM server certificate (TLS on every port; mutual TLS between services with --tls-ca); overrides grpc.tls_cert."
TLS_KEY_HELP = "PEM private key of --tls-cert; overrides grpc.tls_key."
TLS_CA_HELP = "PEM CA bundle that verifies peers (with --tls-cert/--tls-key: mutual TLS between the services); overrides grpc.tls_ca."
HEALTH_PORT_HELP = ("Also serve the gRPC health service alone, in plaintext, on this port of the listen address "
                    "(for kubelet's gRPC probes when the service port is TLS; 0 = ephemeral); overrides grpc.health_port.")
AUTH_TOKEN_FILE_HELP = ("File of accepted bearer tokens, one a line (GenerationService and HTTP /v1/*; never pass a "
                        "token on the command line); overrides front.auth_token_file.")


def tls_overrides(tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> dict[str, str | None]:
    """The config overrides of the --tls-* flags (None = keep the YAML's value)."""
    return {"grpc.tls_cert": tls_cert, "grpc.tls_key": tls_key, "grpc.tls_ca": tls_ca}


def tls_flags(tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> list[str]:
    """The --tls-* flags again, for child processes (``specdec serve``)."""
    pairs = (("--tls-cert", tls_cert), ("--tls-key", tls_key), ("--tls-ca", tls_ca))
    return [part for flag, value in pairs if value is not None for part in (flag, value)]
