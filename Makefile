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

# Benchmarks against the peers (tens of minutes; LMCache goes into its own .venv-lmcache),
# then the router's (bench/router_bench.py), which runs even when the first one failed.
# BENCH_ARGS=--quick for the reduced matrix of both; ROUTER_BENCH_ARGS for the router's alone.
bench: setup
	@status=0; $(PY) -m bench.suite $(BENCH_ARGS) || status=$$?; \
	$(PY) -m bench.router_bench $(filter --quick,$(BENCH_ARGS)) $(ROUTER_BENCH_ARGS) || status=$$?; \
	exit $$status

clean:
	rm -rf .cache/test-logs .pytest_cache
