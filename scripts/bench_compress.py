"""Compress and decompress latency per method and tensor size: the command line of ``grace.bench.bench_compress`` (``--help``)."""
from grace.bench.bench_compress import main

if __name__ == "__main__":
    raise SystemExit(main())
