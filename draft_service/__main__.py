"""``python -m draft_service [--config FILE] [flags]``: the same command as ``specdec draft-server``."""

from draft_service.cli import main

if __name__ == "__main__":
    main()
