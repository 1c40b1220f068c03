# One entry point for developers and CI. `make test` sets up .venv when needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Reinstall whenever pyproject.toml changes.
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: install test test-fast lint demo bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[tf-cpu,test,demo,bench]"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

install: $(STAMP)

# The whole suite on two pytest-xdist workers. The tests that start processes and time
# bounds run in one worker, one after another (conftest.py); the rest share both. Every
# run ends with its 25 slowest tests (--durations, pyproject.toml).
XDIST := -n 2 --dist loadgroup

test: install
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The edit-test loop: every test that starts no process (under two minutes).
test-fast: install
	$(PY) -m pytest $(XDIST) -m "not processes" $(PYTEST_ARGS)

# pyflakes and bugbear (ruff) over the code, the tests, benchmarks and examples; the
# package's types (mypy). Both are configured in pyproject.toml.
lint: install
	$(PY) -m ruff check diststrat tests benchmarks examples
	$(PY) -m mypy diststrat

# Trains a digits classifier on 4 towers, then on one device; e.g. DEMO_ARGS="--towers=2".
# TensorFlow prints start-up notices when diststrat imports it, before the demo's code runs:
# TF_CPP_MIN_LOG_LEVEL hides most, and TensorFlow 2.21 prints the oneDNN one regardless of
# it unless oneDNN's custom ops are off (they do not speed up this small model).
demo: export TF_CPP_MIN_LOG_LEVEL ?= 2
demo: export TF_ENABLE_ONEDNN_OPTS ?= 0
demo: install
	$(PY) examples/digits.py $(DEMO_ARGS)

# Every benchmark's --quick smoke run, one after another (never two at once: they time
# shared cores), each writing its JSON to benchmarks/results/.
# The figures in docs/benchmarks.md come from the full runs named there, not from these.
BENCH_RESULTS ?= benchmarks/results
bench: export TF_CPP_MIN_LOG_LEVEL ?= 2
bench: install
	@mkdir -p $(BENCH_RESULTS)
	$(PY) benchmarks/mirrored_benchmark.py --quick --out $(BENCH_RESULTS)/mirrored_quick.json
	$(PY) benchmarks/scaling_benchmark.py --quick --out $(BENCH_RESULTS)/scaling_quick.json
	$(PY) benchmarks/keras_benchmark.py --quick --out $(BENCH_RESULTS)/keras_quick.json
	$(PY) benchmarks/pipeline_benchmark.py --quick --out $(BENCH_RESULTS)/pipeline_quick.json
	$(PY) benchmarks/ps_benchmark.py --quick --out $(BENCH_RESULTS)/ps_quick.json
	$(PY) benchmarks/multi_worker_benchmark.py --quick --out $(BENCH_RESULTS)/multi_worker_quick.json
	$(PY) benchmarks/tower_schedule_benchmark.py --quick --out $(BENCH_RESULTS)/tower_schedule_quick.json

clean:
	rm -rf $(VENV) .pytest_cache
