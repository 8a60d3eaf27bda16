"""`python -m experiments.sweep` from a checkout; the code is freeze.pipeline.sweep (also `freeze-sweep`)."""

import sys

from freeze.pipeline.sweep import main

if __name__ == "__main__":
    sys.exit(main())
