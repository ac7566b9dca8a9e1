"""Create per-role CURVE key folders for a topology with ``[security] curve = true``.

    python tools/make-curve-keys.py KEYS_DIR

Writes three folders, each laid out as ``[security] keys_dir`` expects:

- ``KEYS_DIR/control/`` for the hosts of the buffer, the learner and the launcher (they
  bind): the server key pair (``server.key``, ``server.key_secret``), the learner's key pair
  as ``client.key`` / ``client.key_secret``, and ``authorized/`` with the public keys the
  servers accept, named by role (``learner.key``, ``generator.key``, ``evaluator.key``);
- ``KEYS_DIR/generator/`` for generator hosts: the server's public key (``server.key``) and
  the generator key pair as ``client.key`` / ``client.key_secret``;
- ``KEYS_DIR/evaluator/`` for the evaluator's host, laid out as ``generator/`` with the
  evaluator key pair.

Put ``control/`` at the topology's ``keys_dir`` on the control hosts, ``evaluator/`` on the
evaluator's host and ``generator/`` at the same path on every other host; a run on one
machine uses ``KEYS_DIR/control``. Servers tell roles apart by key (``relay.transport.roles``):
the generator key may lease and send rollouts but never act as the learner, ask for
evaluations or report metrics; the evaluator key only evaluates; and no generator or
evaluator host holds the server's, the learner's or the other's secret key. Every folder
is made 0700 and every file 0600 (an existing folder is tightened to 0700); a
``*.key_secret`` file that its group or others may read is refused when a process loads it
(``relay.transport.security``), so keep them so when you copy them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from relay.transport.security import create_keypair, private_dir

CONTROL, GENERATOR, EVALUATOR = "control", "generator", "evaluator"


def make_keys(keys_dir: Path) -> None:
    """Write the three folders (module docstring) under ``keys_dir``."""
    control = keys_dir / CONTROL
    create_keypair(control, "server")
    create_keypair(control, "client")  # the learner's
    authorized = private_dir(control / "authorized")
    shutil.copy(control / "client.key", authorized / "learner.key")
    for role in (GENERATOR, EVALUATOR):
        create_keypair(keys_dir / role, "client")
        shutil.copy(control / "server.key", keys_dir / role / "server.key")
        shutil.copy(keys_dir / role / "client.key", authorized / f"{role}.key")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("keys_dir", type=Path)
    parser.add_argument("--force", action="store_true", help="replace existing keys")
    args = parser.parse_args(argv)
    if (args.keys_dir / CONTROL / "server.key_secret").exists() and not args.force:
        print(f"relay keys: {args.keys_dir} already holds keys (--force replaces them)",
              file=sys.stderr)
        return 1
    make_keys(args.keys_dir)
    print(f"relay keys: wrote {args.keys_dir / CONTROL} (buffer, learner and launcher "
          f"hosts), {args.keys_dir / GENERATOR} (generator hosts) and "
          f"{args.keys_dir / EVALUATOR} (the evaluator's host): no secret key there but "
          "their own")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
