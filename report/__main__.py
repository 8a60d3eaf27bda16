"""`python -m report` from a checkout; the code is freeze.pipeline.report (also `freeze-report`)."""

from freeze.pipeline.interrupts import exit_with
from freeze.pipeline.report.cli import main

if __name__ == "__main__":
    exit_with(main())
