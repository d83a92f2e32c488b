# The two commands of the README: `make run` and `make test`.
PY ?= python3

.PHONY: install run test lint eval-quick eval-slice bench

install:
	bash scripts/install.sh

run: install
	$(PY) -m memlm.cli up --demo

eval-quick:
	$(PY) -m memlm.cli eval --start 2017-02-13 --days 2 --max-docs-per-day 5 --out runs/quick

# The same checks locally and in CI (.ci/run): format, lint, types, layering, then tests.
# Three test processes: most slow tests wait on servers and subprocesses, not on the two
# cores (the parallel run shares one Milvus server: tests/milvus_fixtures.py). loadgroup:
# the tests marked xdist_group("memlm_up") run in one process, which starts one `memlm up`.
test: install lint
	$(PY) -m pytest -q -n 3 --dist loadgroup

lint:
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m mypy memlm service workers tests/fakes.py
	lint-imports --no-cache

eval-slice:
	$(PY) -m memlm.cli eval --start 2017-02-13 --days 5 --max-docs-per-day 20 --out runs/slice20

bench:
	$(PY) benchmarks/bench_encoder.py --threads 2 --docs 6 --memory-docs 20 --repeat 5
