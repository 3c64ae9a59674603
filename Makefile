# The two commands a newcomer needs:  make demo   and   make test
.PHONY: setup demo test lint bench
PY := .venv/bin/python

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/llm-watchdog demo

# two pytest workers (pytest-xdist): most tests wait on brokers, daemons and subprocesses; on CI's 2 cores
# the suite takes ~13 min instead of ~22. TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=30

lint:
	.venv/bin/ruff check watchdog probes tests bench integrations
	.venv/bin/mypy --follow-imports=silent watchdog

bench: setup
	$(PY) bench/ingest.py
	$(PY) bench/reaction.py
	$(PY) bench/decisions.py --jobs 2
	$(PY) bench/scoring.py
