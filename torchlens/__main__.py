"""`python -m torchlens`: the command line for saved traces (`torchlens/cli.py`)."""

import sys

from .cli import main

if __name__ == "__main__":  # (imported, as a test of every module does, it runs nothing)
    sys.exit(main())
