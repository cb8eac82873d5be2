#!/usr/bin/env python3
"""An emulated cluster on one machine: N worker hosts as Linux network namespaces (needs root).

    emulated_cluster.py up --preset 100mbit -n 4          # prints the prefix; stays up
    emulated_cluster.py verify --prefix gr1234            # measure throughput and latency
    emulated_cluster.py run --prefix gr1234 -- python bench.py      # mpirun, 1 rank per host
    emulated_cluster.py down --prefix gr1234              # or --all: every leftover cluster
    emulated_cluster.py list

The command line of grace.bench.cluster (its cli.py); `--help` says the rest, and
scripts/cluster/README.md the design.
"""
import sys

from grace.bench.cluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
