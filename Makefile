# The two commands: `make run` and `make test`. Everything else is what they are made of.
PYTHON ?= python3
VENV   := .venv
BIN    := $(abspath $(VENV))/bin
PY     := $(BIN)/python
export PATH := $(BIN):$(PATH)

STAMP     := $(VENV)/.bootstrapped
GEN_DIR   := service/context_engine/v1
GEN_STAMP := $(GEN_DIR)/.generated
PROTOS    := $(wildcard proto/context_engine/v1/*.proto)
CLIENT_PB    := clients/python/src/context_engine_client/_pb
CLIENT_STAMP := $(CLIENT_PB)/.generated
PIP       := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: all run test lint gen bootstrap bench load mutants clean

## all (the default): bootstrap and generate the code of the service and the Python client
all: gen

## bootstrap: create .venv and install the pinned dependencies and the package
$(STAMP): requirements/runtime.txt requirements/dev.txt pyproject.toml clients/python/pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements/dev.txt
	$(PIP) --no-deps --no-build-isolation -e .
	$(PIP) --no-deps --no-build-isolation -e clients/python
	@touch $@

bootstrap: $(STAMP)

## gen: generate the Python code of the contract (never committed, never linted)
$(GEN_STAMP): $(STAMP) $(PROTOS)
	rm -rf $(GEN_DIR) && mkdir -p $(GEN_DIR)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=service --grpc_python_out=service \
		--mypy_out=service --mypy_grpc_out=service $(PROTOS)
	@touch $(GEN_DIR)/__init__.py $@

# The Python client's own copy of the messages (same proto file name, so both share one
# descriptor in a process that imports both).
$(CLIENT_STAMP): $(STAMP) $(PROTOS)
	rm -rf $(CLIENT_PB) && mkdir -p $(CLIENT_PB)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$(CLIENT_PB) --mypy_out=$(CLIENT_PB) $(PROTOS)
	@touch $(CLIENT_PB)/__init__.py $(CLIENT_PB)/context_engine/__init__.py \
		$(CLIENT_PB)/context_engine/v1/__init__.py $@

gen: $(GEN_STAMP) $(CLIENT_STAMP)

## run: serve on 127.0.0.1:50051 in dev mode (no credentials; loopback only), metrics on
## 127.0.0.1:9464, embedded PostgreSQL under .data/
run: $(GEN_STAMP) $(CLIENT_STAMP)
	$(BIN)/context-engine serve --dev

## lint: ruff, mypy --strict, buf lint
lint: $(GEN_STAMP) $(CLIENT_STAMP)
	$(BIN)/ruff check service tests clients/python
	$(BIN)/mypy service
	cd clients/python && $(BIN)/mypy
	$(BIN)/buf lint

## test: lint, promtool (installed if missing, for the rules tests), then the whole suite
## against a throwaway database
test: lint
	scripts/ensure-promtool
	$(PY) -m pytest

## bench: Build over loopback gRPC on seeded 50/200/1,000-item conversations, like with like:
## cold Build beside uncached langchain-core trim_messages and one raw pass of the service's own
## counter (bpe-openai); warm Build beside trim_messages with a memoized counter and the wire floor
## (protobuf serialize + parse, a gRPC echo of the same bytes); ratios of medians, all samples in
## tests/bench/results.md. Then the cached prefix ratio and cached input share beside a naive
## assembly. Not in `make test`.
bench: $(GEN_STAMP)
	$(PY) -m tests.bench.build_bench
	$(PY) -m tests.bench.cache_bench

## load: 100 simulated runtimes x 50 turns against `serve --workers 2` on loopback (throughput,
## p50/p95/p99 per RPC, errors, epochs per session, lost plans), then the same load with a
## SIGTERM 8 s in (in-flight calls finish, health NOT_SERVING first, no broken response).
## Bounded: each run stops by itself within 15 minutes. Not in `make test`.
load: $(GEN_STAMP)
	$(PY) -m tests.load.run --runtimes 100 --turns 50 --workers 2
	$(PY) -m tests.load.run --runtimes 100 --turns 50 --workers 2 --sigterm-after 8

## mutants: apply each deliberate bug under tests/mutants/ to a copy of the tree, one at a time,
## run the tests each one names, and fail if any survives. Not in `make test`.
mutants: $(GEN_STAMP) $(CLIENT_STAMP)
	$(PY) -m tests.mutants.run

clean:
	rm -rf $(VENV) $(GEN_DIR) $(CLIENT_PB) .mypy_cache .ruff_cache .pytest_cache .hypothesis
