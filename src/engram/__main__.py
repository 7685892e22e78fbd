"""`python -m engram ...` (and `torchrun ... -m engram train --distributed ...`): the `engram` command."""

import sys

from engram.cli import main

if __name__ == "__main__":
    sys.exit(main())
