#!/usr/bin/env python3
"""``relay replay`` under the script name older docs and scripts use (``relay.replay``)."""

import sys

from relay.replay import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
