"""The benchmark machinery: the training loop and its engines, step timing, PyTorch's DDP
baseline hooks, the network cost model and the emulated cluster (``grace.bench.cluster``).

``scripts/`` holds the command-line entry points, which only parse arguments and call in
here. Nothing in this package is imported by ``import grace``.
"""
