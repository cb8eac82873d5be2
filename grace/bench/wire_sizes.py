"""Bits per element each method hands to Horovod, against its ideal (docs/methods.md).

    python scripts/wire_sizes.py --shape 1024 1024

The payload is measured on a standard-normal float32 tensor through a one-rank exchange.
"""
from __future__ import annotations

import argparse

import grace
from grace.core.wire import wire_report

# settings for methods that have no default for them
REQUIRED = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}, "dgc": {"ratio": 0.01},
            "threshold": {"threshold": 2.5}, "efsignsgd": {"lr": 0.1}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs="+", default=[1024, 1024])
    args = parser.parse_args(argv)
    print(f"{'method':12s} {'ideal b/elt':>12s} {'sent b/elt':>11s} {'payload excess':>15s} {'header B':>9s}")
    for name in grace.methods():
        report = wire_report(grace.create(name, **REQUIRED.get(name, {})), tuple(args.shape))
        print(f"{name:12s} {report.ideal_bits / report.numel:12.4f} {report.bits_per_element:11.4f} "
              f"{report.excess:15.4%} {report.header_bytes:9d}")


if __name__ == "__main__":
    main()
