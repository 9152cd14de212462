"""``python -m maintainer.mutation``: the command line (maintainer/mutation/cli.py)."""

import sys

from maintainer.mutation.cli import main

if __name__ == "__main__":
    sys.exit(main())
