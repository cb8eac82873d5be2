"""Training throughput, bytes on the wire and quality on the emulated cluster: the command line of ``grace.bench.bench_train`` (``--help``)."""
from grace.bench.bench_train import main

if __name__ == "__main__":
    main()
