# The two commands of the README. Each does its own set-up (idempotent, fast the second time).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-bench lint docs setup bench sim clean

demo: setup
	$(VENV)/bin/mctier demo

# The product's tests; the benchmark programs' own checks (marker bench_harness, ~15 minutes)
# are `make test-bench`, kept out of here for CI's time budget on the slower CPU class.
# The linter runs first (seconds): a finding fails the run before any engine starts.
test:
	@MCTIER_WITH_ETCD=1 bash scripts/setup.sh
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests -m "not bench_harness" --durations=25

test-bench:
	@bash scripts/setup.sh
	$(PY) -m pytest tests/test_bench.py -m bench_harness --durations=10

# ruff, configured in pyproject.toml ([tool.ruff]); `ruff check --fix .` sorts imports.
lint: setup
	$(VENV)/bin/ruff check .

# docs/configuration.md from the config structs and the router's flags (multi/configdoc.py);
# tests/test_configuration_doc.py fails while the committed file differs.
docs: setup
	$(PY) -m multi.configdoc > docs/configuration.md.tmp && mv docs/configuration.md.tmp docs/configuration.md \
		|| { rm -f docs/configuration.md.tmp; exit 1; }

setup:
	@bash scripts/setup.sh

# Benchmarks against the peers (tens of minutes; LMCache goes into its own virtualenv,
# ~/.cache/mctier/venv-lmcache), then the composite's decision quality (bench/tiered_bench.py), the router's
# (bench/router_bench.py), decode streams under arriving long prefills on one
# instance, two and 1P1D (bench/pd_load.py), store hits arriving while decode streams run, each
# load kind (bench/store_streams.py), store hits wherever a shared prefix ends, through the store
# tier and the composite (bench/store_divergence.py), then a scaled window of Mooncake's conversation
# trace through the real stack (bench/trace_replay.py) and the cluster simulator checked
# against it (bench/sim validate), then what each connector costs when nothing is reused
# (bench/no_reuse.py) and, quieter, what each adds to an engine's steps (bench/step_cost.py),
# the scheduling step's time in store lookups when many requests arrive at once
# (bench/lookup_stall.py) and what vLLM's hybrid KV cache allocator saves with
# the store tier (bench/hybrid_memory.py); each runs even when one before it failed.
# BENCH_ARGS=--quick for the reduced versions; ROUTER_BENCH_ARGS for the router's alone.
bench: setup
	@status=0; $(PY) -m bench.suite $(BENCH_ARGS) || status=$$?; \
	$(PY) -m bench.tiered_bench $(filter --quick,$(BENCH_ARGS)) || status=$$?; \
	$(PY) -m bench.router_bench $(filter --quick,$(BENCH_ARGS)) $(ROUTER_BENCH_ARGS) || status=$$?; \
	$(PY) -m bench.pd_load $(filter --quick,$(BENCH_ARGS)) || status=$$?; \
	$(PY) -m bench.store_streams $(filter --quick,$(BENCH_ARGS)) || status=$$?; \
	$(PY) -m bench.store_divergence $(filter --quick,$(BENCH_ARGS)) || status=$$?; \
	$(PY) -m bench.trace_replay $(filter --quick,$(BENCH_ARGS)) || status=$$?; \
	$(PY) -m bench.sim validate --replay bench/results/trace_replay || status=$$?; \
	$(PY) -m bench.no_reuse $(filter --quick,$(BENCH_ARGS)) || status=$$?; \
	$(PY) -m bench.step_cost $(filter --quick,$(BENCH_ARGS)) || status=$$?; \
	$(PY) -m bench.lookup_stall $(filter --quick,$(BENCH_ARGS)) || status=$$?; \
	$(PY) -m bench.hybrid_memory $(filter --quick,$(BENCH_ARGS)) || status=$$?; \
	exit $$status

# The cluster simulator on Mooncake's full conversation trace (a few minutes, no engines).
sim: setup
	$(PY) -m bench.sim cluster $(SIM_ARGS)

clean:
	rm -rf .cache/test-logs .pytest_cache
