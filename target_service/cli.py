"""The target service's command line (typer), shared by ``specdec target-server`` and ``python -m target_service``;
each flag overrides one config field, then ``target_service.server.run(config_path, overrides)``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specdec.process_entry import (
    CONFIG_HELP, DEVICE_HELP, HEALTH_PORT_HELP, TLS_CA_HELP, TLS_CERT_HELP, TLS_KEY_HELP, device_option, tls_overrides,
)


def target_server(
    config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
    port: Optional[int] = typer.Option(None, help="Listen port (0 = ephemeral); overrides target.port."),
    host: Optional[str] = typer.Option(None, help="Listen address; overrides target.host."),
    target: Optional[str] = typer.Option(None, help="Target model; overrides models.target."),
    dtype: Optional[str] = typer.Option(None, help="auto, float32, bfloat16 or float16; overrides models.dtype."),
    device: Optional[str] = typer.Option(None, help=DEVICE_HELP),
    tp: Optional[int] = typer.Option(None, help="Tensor-parallel ranks (processes) serving the target, >= 1; overrides target.tp."),
    tls_cert: Optional[str] = typer.Option(None, help=TLS_CERT_HELP),
    tls_key: Optional[str] = typer.Option(None, help=TLS_KEY_HELP),
    tls_ca: Optional[str] = typer.Option(None, help=TLS_CA_HELP),
    health_port: Optional[int] = typer.Option(None, help=HEALTH_PORT_HELP),
) -> None:
    """Serve the target model over gRPC (TargetService, health, reflection) until SIGTERM; with
    --tp N > 1 over N tensor-parallel rank processes."""
    from target_service.server import run  # here: grpc, torch and the model load only when serving

    overrides = {"target.port": port, "target.host": host, "models.target": target, "models.dtype": dtype,
                 "target.device": device_option(device), "target.tp": tp, **tls_overrides(tls_cert, tls_key, tls_ca),
                 "grpc.health_port": health_port}
    raise typer.Exit(run(str(config) if config else None, overrides))

