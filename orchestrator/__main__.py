"""``python -m orchestrator <command> [flags]``: the ``specdec`` command line (orchestrator.cli.main), e.g.
``python -m orchestrator front --config deploy/specdec.yaml``."""

from orchestrator.cli.main import main

if __name__ == "__main__":
    main()
