"""``relay bench NAME [ARGS ...]``: run one of a source checkout's benchmarks.

The benchmarks (``tools/bench-NAME.py``) compare Relay with its peers side by side (TRL,
vLLM, verl's code paths) and need what a checkout has: their helper modules, the ``bench``
extra, sometimes vLLM's CPU build. This command finds them beside the installed ``relay``
package (an editable install of a checkout) and runs one; a wheel install has none, and says so.
A benchmark whose measurements the tests also run keeps them beside this module, as
``relay.bench_NAME`` (``bench_engine``, ``bench_transport``), out of the runtime packages.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

TOOLS_DIR = Path(__file__).resolve().parent.parent  # tools/ of a checkout: tools/relay/..


def benchmarks(tools_dir: Path = TOOLS_DIR) -> dict[str, Path]:
    """``{name: tools/bench-NAME.py}`` of the checkout, empty where there is none."""
    return {path.stem.removeprefix("bench-"): path
            for path in sorted(tools_dir.glob("bench-*.py"))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    found = benchmarks(TOOLS_DIR)
    if not found:
        print("relay bench: the benchmarks come with a source checkout (tools/bench-*.py), "
              "and this installation has none: clone the repository and `pip install -e .` "
              "it to run them", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in found:
        stream = sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr
        if argv and argv[0] not in ("-h", "--help"):
            print(f"relay bench: no benchmark named {argv[0]!r}", file=stream)
        print("usage: relay bench NAME [ARGS ...]; NAME is one of: " + ", ".join(found)
              + "\n`relay bench NAME --help` says what each measures", file=stream)
        return 0 if stream is sys.stdout else 2
    script = found[argv[0]]
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.parent))  # its helper modules (bench_model, ...) sit beside it
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    return 0
