"""Bits per element each method sends, against its ideal: the command line of ``grace.bench.wire_sizes`` (``--help``)."""
from grace.bench.wire_sizes import main

if __name__ == "__main__":
    main()
