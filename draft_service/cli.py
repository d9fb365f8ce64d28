"""The draft service's command line (typer), shared by ``specdec draft-server`` and ``python -m draft_service``;
each flag overrides one config field, then ``draft_service.server.run(config_path, overrides)``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specdec.process_entry import CONFIG_HELP, HEALTH_PORT_HELP, TLS_CA_HELP, TLS_CERT_HELP, TLS_KEY_HELP, tls_overrides


def draft_server(
    config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
    port: Optional[int] = typer.Option(None, help="Listen port (0 = ephemeral); overrides draft.port."),
    host: Optional[str] = typer.Option(None, help="Listen address; overrides draft.host."),
    target: Optional[str] = typer.Option(None, help="Target model (its tokenizer and config only); overrides models.target."),
    draft: Optional[str] = typer.Option(None, help="Draft model; overrides models.draft."),
    dtype: Optional[str] = typer.Option(None, help="auto, float32, bfloat16 or float16; overrides models.dtype."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N; overrides draft.device."),
    tls_cert: Optional[str] = typer.Option(None, help=TLS_CERT_HELP),
    tls_key: Optional[str] = typer.Option(None, help=TLS_KEY_HELP),
    tls_ca: Optional[str] = typer.Option(None, help=TLS_CA_HELP),
    health_port: Optional[int] = typer.Option(None, help=HEALTH_PORT_HELP),
) -> None:
    """Serve the draft model over gRPC (DraftService, health, reflection) until SIGTERM."""
    from draft_service.server import run  # here: grpc, torch and the models load only when serving

    overrides = {"draft.port": port, "draft.host": host, "models.target": target, "models.draft": draft,
                 "models.dtype": dtype, "draft.device": device, **tls_overrides(tls_cert, tls_key, tls_ca),
                 "grpc.health_port": health_port}
    raise typer.Exit(run(str(config) if config else None, overrides))

