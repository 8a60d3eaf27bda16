"""`python -m experiments.substrate` from a checkout; the code is freeze.pipeline.substrate.cli."""

import sys

from freeze.pipeline.substrate.cli import main

if __name__ == "__main__":
    sys.exit(main())
