"""Bits per element each method sends, against its ideal (docs/methods.md); with ``--world``,
the bits each rank receives per element in worlds of those sizes, by communicator.

    python scripts/wire_sizes.py --shape 1024 1024
    python scripts/wire_sizes.py --world 2 4 8 16 64 512

The payload is measured on a standard-normal float32 tensor through a one-rank exchange. The
traffic is the ring model of grace.core.traffic: dense and fp16 are Horovod's own ring
allreduce; 'allgather' every other rank's frame; 'alltoall' the two phases; 'auto' the way
communicator='auto' takes per bucket (here one bucket of the tensor: by default a full bucket
of the default 25 MB, as a model's buckets are but its last): a fixed-length method's cheapest,
a variable-length method's two phases from 3 ranks on.
"""
from __future__ import annotations

import math

import grace
from grace.bench.common import help_parser
from grace.core import traffic
from grace.core.compression import DEFAULT_BUCKET_MB, GradientCompression
from grace.core.wire import wire_report

# settings for methods that have no default for them
REQUIRED = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}, "dgc": {"ratio": 0.01},
            "threshold": {"threshold": 2.5}, "efsignsgd": {"lr": 0.1}}


# what one bucket of grace's default size holds: the traffic is per bucket
DEFAULT_BUCKET_ELEMENTS = int(DEFAULT_BUCKET_MB * 2**20) // 4


def method(name: str) -> GradientCompression:
    return grace.create(name, **REQUIRED.get(name, {}))


def sizes(shape) -> None:
    print(f"{'method':12s} {'ideal b/elt':>12s} {'sent b/elt':>11s} {'payload excess':>15s} {'header B':>9s}")
    for name in grace.methods():
        report = wire_report(method(name), tuple(shape))
        print(f"{name:12s} {report.ideal_bits / report.numel:12.4f} {report.bits_per_element:11.4f} "
              f"{report.excess:15.4%} {report.header_bytes:9d}")


def received_table(numel: int, worlds) -> dict:
    """{method: {ranks: {way: bits received per element}}}, 'auto' the way communicator='auto' takes."""
    table = {}
    for name in grace.methods():
        compression = method(name)
        if compression.compressor.traits.multi_round:
            continue  # (PowerSGD's rounds: sums of factors, by allreduce)
        table[name] = {}
        for ranks in worlds:
            costs = traffic.received(compression, numel, ranks)
            costs["auto"] = costs[traffic.chosen(compression, costs, ranks)]
            table[name][ranks] = {way: 8 * nbytes / numel for way, nbytes in costs.items()}
    return table


def traffic_report(numel: int, worlds) -> None:
    table = received_table(numel, worlds)
    header = f"{'':12s}" + "".join(f"{f'N={n}':>10s}" for n in worlds)
    print(f"bits received per rank per element, one bucket of {numel} float32 elements (ring model)\n")
    for way in ("allgather", "alltoall", "auto"):
        print(f"{way}\n{header}")
        for name, row in table.items():
            own = way if way in row[worlds[0]] else ("allreduce" if "allreduce" in row[worlds[0]] else None)
            if own is None:  # (a multi-round method keeps its rounds)
                continue
            cells = "".join(f"{row[n][own]:10.3f}" for n in worlds)
            print(f"{name:12s}{cells}" + ("   (its own allreduce)" if own != way else ""))
        print()
    for label, bytes_per in (("dense fp32", 4), ("fp16 ring", 2)):
        print(f"{label:12s}" + "".join(f"{2 * (n - 1) / n * 8 * bytes_per:10.3f}" for n in worlds))
    over = [(name, n) for name, row in table.items() for n in worlds if row[n]["auto"] > row[n]["dense"] + 1e-9]
    print(f"\nauto above dense fp32: {over or 'none'}")
    if 4 in worlds and 512 in worlds:
        growth = {name: row[512]["alltoall"] / row[4]["alltoall"] for name, row in table.items()
                  if "alltoall" in row[4] and row[4]["alltoall"] > 0}
        worst = max(growth, key=growth.get)
        print(f"alltoall bits at 512 ranks over 4 ranks: at most {growth[worst]:.3f}x ({worst}); "
              f"the (N-1)/N factor alone is {(511 / 512) / (3 / 4):.3f}x")
        above = ", ".join(f"{name} {ratio:.3f}x" for name, ratio in sorted(growth.items()) if ratio > 1.35)
        print(f"  above 1.35x: {above or 'none'}")


def main(argv=None):
    parser = help_parser(__doc__)
    parser.add_argument("--shape", type=int, nargs="+",
                        help="the tensor measured (default: 1024 1024; with --world, one full bucket of the "
                             f"default bucket_mb={DEFAULT_BUCKET_MB:g}: {DEFAULT_BUCKET_ELEMENTS} float32 elements)")
    parser.add_argument("--world", type=int, nargs="+", metavar="N",
                        help="print the bits each rank receives per element in worlds of N ranks instead")
    args = parser.parse_args(argv)
    if args.world:
        traffic_report(math.prod(args.shape or [DEFAULT_BUCKET_ELEMENTS]), sorted(args.world))
    else:
        sizes(args.shape or [1024, 1024])


if __name__ == "__main__":
    main()
