"""The command line of `lctrain.bench.memory`: python scripts/bench_memory.py --help"""

from lctrain.bench.memory import main

if __name__ == "__main__":
    main()
