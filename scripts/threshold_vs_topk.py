"""Hard threshold against top-k at the same communication volume: the command line of ``grace.bench.threshold_vs_topk`` (``--help``)."""
from grace.bench.threshold_vs_topk import main

if __name__ == "__main__":
    main()
