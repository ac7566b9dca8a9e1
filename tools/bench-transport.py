"""Benchmark Relay's wire against bare ZeroMQ on loopback tcp; prints medians and ratios.

    tools/with-venv python tools/bench-transport.py [--repeats 5] [--messages 2000] [--megabytes 64]

The measurements live in ``relay.bench_transport``.
"""

from __future__ import annotations

import argparse

from relay.bench_transport import Comparison, codec_only, large_tensor, small_messages


def row(comparison: Comparison) -> str:
    return (
        f"{comparison.what:<44} relay {comparison.relay:>10,.0f} {comparison.unit:<6}"
        f" raw {comparison.raw:>10,.0f} {comparison.unit:<6} relay/raw {comparison.ratio:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--messages", type=int, default=2000, help="small messages per repeat")
    parser.add_argument("--megabytes", type=int, default=64, help="size of the large tensor")
    args = parser.parse_args()
    print(row(small_messages(messages=args.messages, repeats=args.repeats)))
    codec = codec_only(messages=args.messages, repeats=args.repeats)
    print(f"{'  of which the codec alone (encode+decode)':<44} {codec:>16,.0f} msg/s")
    tensor, memcpy = large_tensor(megabytes=args.megabytes, repeats=args.repeats)
    print(row(tensor))
    print(f"{'in-memory copy of the same bytes (ceiling)':<44} {memcpy:>16,.0f} MB/s")


if __name__ == "__main__":
    main()
