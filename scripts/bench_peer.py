"""The command line of `lctrain.bench.peer`: python scripts/bench_peer.py --help"""

from lctrain.bench.peer import main

if __name__ == "__main__":
    main()
