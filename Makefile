# The two commands of the README. Each does its own set-up (idempotent, fast the second time).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test setup bench clean

demo: setup
	$(VENV)/bin/mctier demo

test:
	@MCTIER_WITH_ETCD=1 bash scripts/setup.sh
	$(PY) -m pytest tests --durations=25

setup:
	@bash scripts/setup.sh

# Benchmarks against the peers (tens of minutes; LMCache goes into its own .venv-lmcache).
# BENCH_ARGS=--quick for the reduced matrix.
bench: setup
	$(PY) -m bench.suite $(BENCH_ARGS)

clean:
	rm -rf .cache/test-logs .pytest_cache
