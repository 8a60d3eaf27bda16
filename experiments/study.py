"""`python -m experiments.study` from a checkout; the code is freeze.pipeline.study (also `freeze-study`)."""

import sys

from freeze.pipeline.study import main

if __name__ == "__main__":
    sys.exit(main())
