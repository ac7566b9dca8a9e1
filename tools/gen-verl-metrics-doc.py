#!/usr/bin/env python3
"""Write ``configs/verl-metrics.md``, the table of verl's metric names in Relay, from
``relay.learner.metric_names.ALIASES``.

    python tools/gen-verl-metrics-doc.py [--check]

``--check`` writes nothing and exits 1 when the committed file differs from the table
(``tests/learner/test_metric_names.py`` checks the same).
"""

from __future__ import annotations

import argparse
import sys

from relay.configs import CONFIG_DIR
from relay.learner.metric_names import markdown_table

DOC = CONFIG_DIR / "verl-metrics.md"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed file is out of date; write nothing")
    args = parser.parse_args(argv)
    text = markdown_table()
    if args.check:
        if not DOC.is_file() or DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is out of date: run tools/gen-verl-metrics-doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
