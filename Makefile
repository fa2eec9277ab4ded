# Unwind: the two commands a newcomer needs are `make demo` and `make test`.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
TEST_STAMP := $(VENV)/.installed-test-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
BENCH_STAMP := $(VENV)/.installed-bench-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PORT ?= 8000

# The development targets run on Unwind's public development key, asked for by name; production sets SECRET_KEY
# (README, "Running it for real") and never these targets' UNWIND_INSECURE_DEV_KEY.
demo demo-check test check-saga run worker migrate chaos bench schema: export UNWIND_INSECURE_DEV_KEY ?= 1
# The demo has a database of its own, started afresh on each run (KEEP=1 keeps it); a DATABASE_URL of yours is used
# as it is and never removed.
demo demo-check: export DATABASE_URL ?= sqlite:///var/demo.sqlite3
DEMO_KEEP := $(if $(filter 1 yes true,$(KEEP)),--keep,)

.PHONY: demo demo-check test check-saga test-deps bench-deps test-pg migrate run worker chaos bench schema clean help

help:
	@echo "make demo        install, migrate, seed, serve with a worker, run the scenarios; Ctrl-C stops all"
	@echo "                 (PORT=8123 for another port; KEEP=1 keeps the demo database of the last run)"
	@echo "make demo-check  the same scenarios, non-interactive; exits non-zero on any mismatch"
	@echo "make test        the whole suite (SQLite by default; DATABASE_URL=postgres://... for PostgreSQL)"
	@echo "make check-saga  the lifecycle model for long (SAGA_EXAMPLES=2000 examples, random seeds, strict)"
	@echo "make chaos       faults and load on PostgreSQL with real workers; prints the integrity table"
	@echo "make bench       benchmarks on PostgreSQL, side by side with DBOS and the raw floor"

$(BIN)/python:
	@$(PY) -c "import sys; sys.exit(sys.version_info[:2] < (3, 11))" 2>/dev/null || { echo "Python 3.11 or newer is needed (set PY=/path/to/python3.11)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	@touch $(STAMP)

$(TEST_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e ".[test]"
	@touch $(TEST_STAMP) $(STAMP)

migrate: $(STAMP)
	$(BIN)/python manage.py migrate --noinput

demo: $(STAMP)
	UNWIND_SANDBOX=1 $(BIN)/python manage.py demo --serve --port $(PORT) $(DEMO_KEEP)

demo-check: $(STAMP)
	UNWIND_SANDBOX=1 $(BIN)/python manage.py demo --check --port $(PORT) $(DEMO_KEEP)

test-deps: $(TEST_STAMP)

bench-deps: $(BENCH_STAMP)

# Then the TypeScript client's own tests on a live server, when Node.js is present (TS=0 skips them).
test: $(TEST_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	@[ "$(TS)" = 0 ] || PYTHON=$(CURDIR)/$(BIN)/python sh clients/typescript/scripts/ci.sh

# The lifecycle model (tests/test_lifecycle_model.py) for long: SAGA_EXAMPLES examples with random seeds, failing on
# the known open findings too. DATABASE_URL=postgres://... and UNWIND_FAST_PATH=0 choose the database and the path;
# PYTEST_ARGS=--hypothesis-seed=N replays a run. A failure is kept in var/hypothesis and tried first next time.
SAGA_EXAMPLES ?= 2000
check-saga: $(TEST_STAMP)
	UNWIND_SAGA_EXAMPLES=$(SAGA_EXAMPLES) UNWIND_SAGA_STRICT=1 $(BIN)/python -m pytest tests/test_lifecycle_model.py \
		-k every_path -q -s -p no:logging $(PYTEST_ARGS)

run: migrate
	$(BIN)/python manage.py runserver $(PORT)

worker: migrate
	$(BIN)/python manage.py worker

# CHAOS_MINUTES=10 for a longer run; CHAOS_ARGS for the rest (python -m chaos --help).
chaos: $(TEST_STAMP)
	$(BIN)/python -m chaos $(CHAOS_ARGS)

$(BENCH_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e ".[bench]"
	@touch $(BENCH_STAMP) $(STAMP)

# PostgreSQL at 127.0.0.1:5432 (BENCH_PG=postgres://user@host:port for another); a dedicated database,
# BENCH_DB=unwind_bench, is dropped and created afresh. BENCH_QUICK=1 for the smoke CI runs (every part, small samples).
bench: $(BENCH_STAMP)
	$(BIN)/python -m bench

schema: $(TEST_STAMP)
	$(BIN)/python manage.py spectacular --validate --fail-on-warn --file /dev/null

clean:
	rm -rf $(VENV) var/*.sqlite3* var/test-artifacts var/demo-mail var/demo-agent.key var/demo.env
