#!/usr/bin/env python3
"""``relay sft`` as a script: supervised fine-tuning with verl's SFT keys (``relay.sft``)."""

import sys
from pathlib import Path

# Run by path, this folder comes first on sys.path, and its relay/ holds only the command's
# own modules: the package (the checkout's folders mapped by an install) is found without it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from relay.sft import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
