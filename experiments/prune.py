"""`python -m experiments.prune` from a checkout; the code is freeze.pipeline.prune."""

import sys

from freeze.pipeline.prune import main

if __name__ == "__main__":
    sys.exit(main())
