# weightsync developer entry points. `make sandbox` and `make test` are the README's two commands.
.DEFAULT_GOAL := help
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

venv:  ## build .venv with torch 2.13.0, vLLM (CPU build) and the test tools (idempotent)
	@bash tools/setup-env.sh

sandbox: venv  ## sync a trainer into a real vLLM engine on a generated tiny model and verify it
	.venv/bin/weightsync sandbox

lint: venv  ## ruff (lint + format check) and mypy
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: venv  ## apply ruff's formatting and fixes
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

models: venv  ## generate and cache the tiny test models
	.venv/bin/weightsync models tiny-qwen2 tiny-llama

test: venv lint models  ## everything CI runs: lint, type checks, all test tiers
	$(PY) -m pytest tests

unit: venv  ## only the unit tier (seconds)
	$(PY) -m pytest tests -m unit

integration: venv models  ## only the integration tier (real vLLM, real processes)
	$(PY) -m pytest tests -m integration

.PHONY: help venv sandbox lint format models test unit integration
