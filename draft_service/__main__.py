"""``python -m draft_service [--config FILE] [flags]``: the same command as ``specdec draft-server``."""

import typer

from draft_service.cli import draft_server

if __name__ == "__main__":
    typer.run(draft_server)
