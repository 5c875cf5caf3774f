# make run   : install, then run the main job on the embedded default model
# make test  : install, then run the test suite (what CI runs)
.PHONY: setup run test bench-quick bench

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/knorm-batch --job jobs/summarize.toml --overwrite

test: setup
	.venv/bin/python -m pytest -q

bench-quick: setup
	.venv/bin/python benchmarks/run_all.py --quick

bench: setup
	.venv/bin/python benchmarks/run_all.py
