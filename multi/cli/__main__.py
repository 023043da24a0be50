"""``python -m multi.cli ARGS`` is ``mctier ARGS`` (the tests, benchmarks and scripts start it so)."""

import sys

from multi.cli import main

sys.exit(main())
