"""The command line of `lctrain.bench.prepare`: python scripts/bench_prepare.py --help"""

from lctrain.bench.prepare import main

if __name__ == "__main__":
    main()
