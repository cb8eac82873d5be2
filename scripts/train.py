"""Data-parallel training on scikit-learn's digits with a grace method (the main job): the command line of ``grace.bench.train`` (``--help``)."""
from grace.bench.train import main

if __name__ == "__main__":
    main()
