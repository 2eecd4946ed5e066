"""``python -m dpserve.cli``: how ``dpserve serve`` and the benchmarks start each process."""

import sys

from dpserve.cli import main

sys.exit(main())
