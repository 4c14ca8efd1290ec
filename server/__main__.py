"""`python -m server --model-repository DIR`: the same server as `kiln serve`."""

import sys

from server.cli import main

sys.exit(main())
