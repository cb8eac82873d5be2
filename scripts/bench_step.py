"""What compression costs per training step on real models' gradients: the command line of ``grace.bench.bench_step`` (``--help``)."""
from grace.bench.bench_step import main

if __name__ == "__main__":
    main()
