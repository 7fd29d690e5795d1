"""`python -m clover ...`: the `clover` command, for environments without the console script."""

import sys

from .cli import main

sys.exit(main())
