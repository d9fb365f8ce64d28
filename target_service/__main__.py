"""``python -m target_service [--config FILE] [flags]`` (``specdec target-server``). The guard matters: spawned
tensor-parallel ranks import this module again (as ``__mp_main__``) and must not serve."""

import typer

from target_service.cli import target_server

if __name__ == "__main__":
    typer.run(target_server)
