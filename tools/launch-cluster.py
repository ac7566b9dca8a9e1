#!/usr/bin/env python3
"""``relay launch`` under the script name older docs and scripts use (``relay.launch``)."""

import sys

from relay.launch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
