"""Process entry helpers shared by the three servers (draft, target, front): logging, the device
check before any model loads, and the one-line error exit.

The command lines themselves are the typer commands (``draft_service.cli``,
``target_service.cli``, ``orchestrator.cli``); each server's ``run(config_path, overrides)`` loads the
config with ``specdec.config.load_config`` and serves.
"""

from __future__ import annotations

import logging
import sys


def configure_logging() -> None:
    """INFO logs on stderr (stdout carries only the ready line)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def server_overrides(section: str, port: int | None = None, host: str | None = None, target: str | None = None,
                     draft: str | None = None, dtype: str | None = None, device: str | None = None,
                     tp: int | None = None) -> dict:
    """Command-line flags as dotted config overrides (None = keep the file's value). ``tp`` is the
    target section's ``tp`` (tensor-parallel ranks); only the target server passes it."""
    return {f"{section}.port": port, f"{section}.host": host, "models.target": target, "models.draft": draft,
            "models.dtype": dtype, "models.device": device, f"{section}.tp": tp}


def server_arg_parser(prog: str, description: str, *, device: bool = False, tp: bool = False):
    """The flags every server takes: --config FILE, --port N, --host H, --target, --draft, --dtype;
    with ``device`` also --device D (models.device), with ``tp`` also --tp N (target.tp)."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="service config YAML (default: built-in defaults)")
    parser.add_argument("--port", type=int, help="listen port (0 = ephemeral; overrides the config)")
    parser.add_argument("--host", help="listen address (overrides the config)")
    parser.add_argument("--target", help="target model directory or .gguf (models.target)")
    parser.add_argument("--draft", help="draft model directory or .gguf (models.draft)")
    parser.add_argument("--dtype", help="auto, float32, bfloat16 or float16 (models.dtype)")
    if device:
        parser.add_argument("--device", help="cpu, cuda or cuda:N (models.device)")
    if tp:
        parser.add_argument("--tp", type=int, help="tensor-parallel ranks of the target, >= 1 (target.tp)")
    return parser


def check_device(device: str) -> None:
    """Raise ValueError naming ``models.device`` for a device torch does not know or this machine
    lacks (e.g. cuda without a GPU), before any model is loaded."""
    import torch  # here, not at the top: ``specdec serve``'s launcher and the front use ``fail`` without torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"models.device: {device!r} is not a torch device ({exc})") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"models.device: {device!r} but CUDA is not available on this machine")


def fail(message: str) -> int:
    """Print ``error: message`` on stderr; returns exit code 2 (no traceback)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2
