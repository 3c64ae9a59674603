# The two commands a newcomer needs:  make demo   and   make test
.PHONY: setup demo test lint bench
PY := .venv/bin/python

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/llm-watchdog demo

test: setup
	$(PY) -m pytest -q --durations=30

lint:
	.venv/bin/ruff check watchdog probes tests bench integrations
	.venv/bin/mypy --follow-imports=silent watchdog

bench: setup
	$(PY) bench/ingest.py
	$(PY) bench/reaction.py
	$(PY) bench/decisions.py --jobs 2
	$(PY) bench/scoring.py
