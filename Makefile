# The two commands: `make run` and `make test`. Everything else is what they are made of.
PYTHON ?= python3
VENV   := .venv
BIN    := $(abspath $(VENV))/bin
PY     := $(BIN)/python
export PATH := $(BIN):$(PATH)

RUNTIME_STAMP := $(VENV)/.runtime
DEV_STAMP     := $(VENV)/.dev
GEN_DIR       := service/context_engine/v1
GEN_STAMP     := $(GEN_DIR)/.generated
PROTOS        := $(wildcard proto/context_engine/v1/*.proto)
PIP           := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: all run test lint lint-types gen gen-client contract-release bootstrap bootstrap-dev prereqs \
	prereqs-test bench load load-replicas mutants clean

## all (the default): bootstrap the runtime set and generate the service's code
all: gen

## prereqs: what `make run` needs that the Makefile cannot install (Python 3.11+ with venv)
prereqs:
	@scripts/check-prereqs run $(PYTHON)

## prereqs-test: what `make test` needs beyond it (Node.js 20+ and npm; kubectl; promtool and
## prometheus, and pgbouncer, which scripts/ensure-promtool and scripts/ensure-pgbouncer install
## as root with apt-get)
prereqs-test:
	@scripts/check-prereqs test $(PYTHON)

## bootstrap: .venv with the runtime set and the code generators (requirements/gen.txt), and the
## service installed in it (editable). This is all `make run` installs.
$(RUNTIME_STAMP): requirements/runtime.txt requirements/gen.txt pyproject.toml
	@scripts/check-prereqs run $(PYTHON)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements/gen.txt
	$(PIP) --no-deps --no-build-isolation -e .
	@touch $@

bootstrap: $(RUNTIME_STAMP)

## bootstrap-dev: the development set on top (lint, types, tests, bench baselines) and the
## Python client (editable). `make test` installs it.
$(DEV_STAMP): $(RUNTIME_STAMP) requirements/dev.txt clients/python/pyproject.toml
	$(PIP) -r requirements/dev.txt
	$(PIP) --no-deps --no-build-isolation -e clients/python
	@touch $@

bootstrap-dev: $(DEV_STAMP)

## gen: generate the service's Python code of the contract (never committed, never linted)
$(GEN_STAMP): $(RUNTIME_STAMP) $(PROTOS)
	rm -rf $(GEN_DIR) && mkdir -p $(GEN_DIR)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=service --grpc_python_out=service \
		--mypy_out=service --mypy_grpc_out=service $(PROTOS)
	@touch $(GEN_DIR)/__init__.py $@

gen: $(GEN_STAMP)

## gen-client: regenerate the Python client's copy of the contract. It is committed (so that
## `pip install clients/python` needs no build step); a test fails when it differs from proto/.
gen-client: $(RUNTIME_STAMP)
	$(PY) scripts/gen_python_client.py

## contract-release: record proto/ as the released contract of its package version
## (contract/<package>.binpb), which `make lint` holds every later change to
contract-release: $(DEV_STAMP)
	$(BIN)/buf build --exclude-source-info -o contract/context_engine.v1.binpb

## run: serve on 127.0.0.1:50051 in dev mode (no credentials; loopback only), metrics on
## 127.0.0.1:9464, embedded PostgreSQL under .data/
run: $(GEN_STAMP)
	$(BIN)/context-engine serve --dev

## lint: ruff, mypy --strict, buf lint, and buf breaking against the released contract
lint: $(DEV_STAMP) $(GEN_STAMP)
	$(BIN)/ruff check service tests clients/python scripts
	@$(MAKE) --no-print-directory lint-types

## lint-types: lint's slower half (mypy --strict, buf lint, buf breaking)
lint-types: $(DEV_STAMP) $(GEN_STAMP)
	$(BIN)/mypy service
	cd clients/python && $(BIN)/mypy
	$(BIN)/buf lint
	scripts/check-contract $(BIN)/buf

## test: the prerequisites, lint, promtool and pgbouncer (installed if missing), then the whole
## suite against a throwaway database behind PgBouncer in transaction pooling mode. In
## TEST_WORKERS processes (pytest-xdist: each its own database and pooler, one test file per
## process at a time, the longest files first: tests/conftest.py LONGEST_FIRST), three by
## default (on two cores: a third keeps the CPU busy while the others wait on servers,
## processes and databases); in one with TEST_WORKERS=0, and always in
## one against CE_TEST_DATABASE_URL (one database, which the processes would share). ruff runs
## first; lint's slower half (lint-types: mypy, buf; single-threaded, about 25 s) runs beside
## the suite, its output printed after it, and either failing fails the target (Ctrl-C stops
## it too: SIGTERM to its make, its output printed).
TEST_WORKERS ?= 3
PYTEST_WORKERS = $(if $(CE_TEST_DATABASE_URL),0,$(TEST_WORKERS))
test: prereqs-test $(DEV_STAMP) $(GEN_STAMP)
	$(BIN)/ruff check service tests clients/python scripts
	scripts/ensure-promtool
	scripts/ensure-pgbouncer
	@log=$$(mktemp); \
	$(MAKE) --no-print-directory lint-types >"$$log" 2>&1 & types=$$!; \
	trap 'kill $$types 2>/dev/null; wait $$types; cat "$$log"; rm -f "$$log"; exit 130' INT TERM; \
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder; suite=$$?; \
	wait $$types; linted=$$?; cat "$$log"; rm -f "$$log"; \
	if [ $$linted -ne 0 ]; then echo "make test: lint-types failed (above)" >&2; exit 1; fi; \
	exit $$suite

## bench: Build over loopback gRPC on seeded 200/1,000/3,000-item conversations, like with like:
## cold Build beside uncached langchain-core trim_messages and one raw pass of the service's own
## counter (bpe-openai); warm Build beside trim_messages with a memoized counter and the wire floor
## (protobuf serialize + parse, a gRPC echo of the same bytes); incremental warm Build (a base
## held, two items appended) beside the wire floor of its own request and delta response; bytes
## per turn, full and incremental; ratios of medians, each target printed as holds or FAILS (a
## report: failing ones do not fail the run), all samples in tests/bench/results.md (about four
## minutes). Then the cached prefix ratio and cached input share beside a naive assembly. Not in
## `make test`.
bench: $(DEV_STAMP) $(GEN_STAMP)
	$(PY) -m tests.bench.build_bench
	$(PY) -m tests.bench.cache_bench

## load: 100 simulated runtimes x 50 turns against `serve --workers 2` on loopback (throughput,
## p50/p95/p99 per RPC, errors, epochs per session, lost plans), Building incrementally through
## the Python client's core, then the same load with whole Builds, side by side: bytes on the wire
## and server CPU per Build, BUILD_BASE_UNKNOWN fallbacks; then the incremental load with a
## SIGTERM 8 s in (in-flight calls finish, health NOT_SERVING first, no broken response).
## Bounded: each run stops by itself within 15 minutes. Not in `make test`.
load: $(DEV_STAMP) $(GEN_STAMP)
	$(PY) -m tests.load.run --runtimes 100 --turns 50 --workers 2 --build-mode both
	$(PY) -m tests.load.run --runtimes 100 --turns 50 --workers 2 --sigterm-after 8

## load-replicas: three separate `serve` processes (--workers 1 each, their own loopback ports)
## sharing one embedded PostgreSQL through PgBouncer in transaction pooling mode; 100 simulated
## runtimes x 25 turns against one of them, then balanced over the three (round_robin), then
## again with one SIGKILLed mid-load (the clients' retry policy carries the runtimes through the
## others): errors, retries, epochs per session, lost plans, usage counted once, calls per
## process, throughput 1 vs 3; tests/load/results-replicas.md. Bounded: it stops by itself
## within 10 minutes. Not in `make test`.
load-replicas: $(DEV_STAMP) $(GEN_STAMP)
	$(PY) -m tests.load.replicas --runtimes 100 --turns 25 --results tests/load/results-replicas.md

## mutants: apply each deliberate bug under tests/mutants/ to a copy of the tree, one at a time,
## run the tests each one names, and fail if any survives. Not in `make test`.
mutants: $(DEV_STAMP) $(GEN_STAMP)
	$(PY) -m tests.mutants.run

clean:
	rm -rf $(VENV) $(GEN_DIR) .mypy_cache .ruff_cache .pytest_cache .hypothesis
