"""The command line of `lctrain.bench.attention`: python scripts/bench_attention.py --help"""

from lctrain.bench.attention import main

if __name__ == "__main__":
    main()
