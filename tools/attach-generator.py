#!/usr/bin/env python3
"""``relay attach`` under the script name older docs and scripts use (``relay.attach``)."""

import sys

from relay.attach import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
