"""``python -m freeze.pipeline.sweep``."""

import sys

from freeze.pipeline.sweep.cli import main

sys.exit(main())
