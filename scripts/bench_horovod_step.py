"""Training steps through hvd.DistributedOptimizer, Horovod alone against grace: the command line of ``grace.bench.bench_horovod_step`` (``--help``)."""
from grace.bench.bench_horovod_step import main

if __name__ == "__main__":
    main()
