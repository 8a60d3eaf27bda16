"""`python -m experiments.bench`; the command is experiments.bench.cli."""

import sys

from experiments.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
