#!/usr/bin/env python3
"""Create the CURVE keys folder a topology with ``[security] curve = true`` points at.

    python tools/make-curve-keys.py KEYS_DIR

Writes ``server.key``/``server.key_secret`` (for every process that binds),
``client.key``/``client.key_secret`` (for every process that connects) and
``authorized/client.key`` (the public keys servers accept). Copy the folder to every host
of the run; keep the ``*.key_secret`` files private.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from transport.security import create_keypair


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("keys_dir", type=Path)
    parser.add_argument("--force", action="store_true", help="replace existing keys")
    args = parser.parse_args(argv)
    if (args.keys_dir / "server.key_secret").exists() and not args.force:
        print(f"make-curve-keys: {args.keys_dir} already holds keys (--force replaces them)",
              file=sys.stderr)
        return 1
    create_keypair(args.keys_dir, "server")
    create_keypair(args.keys_dir, "client")
    authorized = args.keys_dir / "authorized"
    authorized.mkdir(exist_ok=True)
    shutil.copy(args.keys_dir / "client.key", authorized / "client.key")
    print(f"make-curve-keys: wrote server, client and authorized/ keys to {args.keys_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
