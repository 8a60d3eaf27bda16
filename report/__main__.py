"""`python -m report` from a checkout; the code is freeze.pipeline.report (also `freeze-report`)."""

import sys

from freeze.pipeline.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
