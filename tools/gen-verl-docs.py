#!/usr/bin/env python3
"""Write the two generated tables of what verl's names are in Relay:
``configs/verl-keys.md`` (config keys, from ``relay.configs.verl_keys.TABLE``) and
``configs/verl-metrics.md`` (metric names, from ``relay.learner.metric_names.ALIASES``).

    python tools/gen-verl-docs.py [--check]

``--check`` writes nothing and exits 1 when a committed file differs from its table
(``tests/configs/test_verl_keys.py`` and ``tests/learner/test_metric_names.py`` check the
same).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from relay.configs import CONFIG_DIR
from relay.configs.verl_keys import markdown_table as keys_table
from relay.learner.metric_names import markdown_table as metrics_table

DOCS: dict[Path, Callable[[], str]] = {
    CONFIG_DIR / "verl-keys.md": keys_table,
    CONFIG_DIR / "verl-metrics.md": metrics_table,
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a committed file is out of date; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for doc, table in DOCS.items():
        text = table()
        if args.check:
            if not doc.is_file() or doc.read_text(encoding="utf-8") != text:
                stale.append(doc)
            continue
        doc.write_text(text, encoding="utf-8")
        print(f"wrote {doc}")
    for doc in stale:
        print(f"{doc} is out of date: run tools/gen-verl-docs.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
