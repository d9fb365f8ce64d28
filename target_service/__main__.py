"""``python -m target_service [--config FILE] [flags]``: the same command as ``specdec target-server``.

The guard matters: tensor-parallel ranks are spawned processes, which import this module again
(as ``__mp_main__``) and must not serve.
"""

import typer

from target_service.cli import target_server

if __name__ == "__main__":
    typer.run(target_server)
