"""Every method on the 4-rank digits model (README's table): the command line of ``grace.bench.train_methods`` (``--help``)."""
from grace.bench.train_methods import main

if __name__ == "__main__":
    main()
