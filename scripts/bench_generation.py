"""The command line of `lctrain.bench.generation`: python scripts/bench_generation.py --help"""

from lctrain.bench.generation import main

if __name__ == "__main__":
    main()
