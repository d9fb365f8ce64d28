"""Process entry helpers shared by the three servers (draft, target, front): logging, the device
check before any model loads, and the one-line error exit.

The command lines themselves are the typer commands (``draft_service.cli``,
``target_service.cli``, ``orchestrator.cli``); each server's ``run(config_path, overrides)`` loads the
config with ``specdec.config.load_config`` and serves.
"""

from __future__ import annotations

import logging
import sys

CONFIG_HELP = "Service config YAML (default: built-in defaults)."  # the --config flag of every server command


def configure_logging() -> None:
    """INFO logs on stderr (stdout carries only the ready line)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")


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
