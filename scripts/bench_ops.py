"""Native kernels against the tensor-op fallback, per method and size: the command line of ``grace.bench.bench_ops`` (``--help``)."""
from grace.bench.bench_ops import main

if __name__ == "__main__":
    raise SystemExit(main())
