# The two entry points of the README: `make serve` and `make test` (each sets everything up first).
.PHONY: setup setup-test serve generate test bench

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

serve: setup
	.venv/bin/appliance serve $(ARGS)

generate: setup
	.venv/bin/appliance generate $(ARGS)

test: setup-test
	.venv/bin/python -m pytest -q tests

bench: setup
	.venv/bin/python bench/bench_engine.py --json bench/results/engine_offline.json
