# The two commands of the README. Each does its own set-up (idempotent, fast the second time).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test setup bench clean

demo: setup
	$(VENV)/bin/mctier demo

test: setup
	$(PY) -m pytest tests

setup:
	@bash scripts/setup.sh

bench: setup
	$(VENV)/bin/pip install -q -e ".[bench]"  # not the cpu extra again: it would bring back CUDA torchvision
	$(PY) bench/tiered_bench.py

clean:
	rm -rf .cache/test-logs .pytest_cache
