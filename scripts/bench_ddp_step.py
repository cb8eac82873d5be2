"""Whole DDP training steps per communication hook (PyTorch's and grace's): the command line of ``grace.bench.bench_ddp_step`` (``--help``)."""
from grace.bench.bench_ddp_step import main

if __name__ == "__main__":
    main()
