#!/usr/bin/env python3
"""``relay keys`` under the script name older docs and scripts use (``relay.keys``)."""

import sys

from relay.keys import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
