"""The command line of `lctrain.bench.train`: python scripts/bench_train.py --help"""

from lctrain.bench.train import main

if __name__ == "__main__":
    main()
