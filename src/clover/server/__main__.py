"""`python -m clover.server --model PATH --port N`: the same as `clover serve`."""

import sys

from .cli import main

sys.exit(main())
