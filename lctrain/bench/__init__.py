"""Benchmarks: each module times or measures one part of training the way training runs it and writes a table and
JSON; `scripts/bench_<name>.py` is the command line of `lctrain.bench.<name>`. Never run as timed tests."""
