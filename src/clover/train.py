"""`python -m clover.train …`: the trainer's command line (see `clover.training.train`)."""

import sys

from clover.training.train import main, train_model  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
