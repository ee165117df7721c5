PY ?= python3
PIP = $(PY) -m pip

.PHONY: install test test-all demo bench

# torch first, pinned: any other torch spec pulls the CUDA wheels; constraints.txt keeps it from being replaced.
install:
	$(PIP) install torch==2.13.0
	$(PIP) install -c constraints.txt -e ".[test]"

test:
	$(PY) -m pytest -q

test-all:
	$(PY) -m pytest -q -m "slow or not slow"

demo:
	lctrain prepare && lctrain train && lctrain eval runs/tiny_anchor
