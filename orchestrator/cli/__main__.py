"""``python -m orchestrator.cli <command>``: the ``specdec`` command line."""

from orchestrator.cli.main import main

if __name__ == "__main__":
    main()
