"""``python -m relay``: the ``relay`` command."""

import sys

from relay.cli import main

if __name__ == "__main__":
    sys.exit(main())
