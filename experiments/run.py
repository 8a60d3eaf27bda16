"""`python -m experiments.run` from a checkout; the code is freeze.pipeline.run (also `freeze-run`)."""

import sys

from freeze.pipeline.run import main

if __name__ == "__main__":
    sys.exit(main())
