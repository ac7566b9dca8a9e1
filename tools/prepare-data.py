#!/usr/bin/env python3
"""``relay prepare-data`` under the script name older docs and scripts use (``relay.prepare_data``)."""

import sys

from relay.prepare_data import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
