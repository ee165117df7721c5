"""The command line of `lctrain.bench.loss`: python scripts/bench_loss.py --help"""

from lctrain.bench.loss import main

if __name__ == "__main__":
    main()
