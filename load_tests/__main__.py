"""`python -m load_tests` is `python -m load_tests.perf`."""

import sys

from load_tests.perf import main

sys.exit(main())
