# The README's commands. `make demo` sets up and runs the main job; `make test`
# sets up and passes the tests. TORCH pins the CPU build that lies on this
# machine's disk; a plain `torch` would pull a multi-GB CUDA build.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.parc-installed
TEST_STAMP := $(VENV)/.parc-test-installed

.PHONY: setup demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(TEST_STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/parc demo

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@# mypy cannot follow setuptools' package-dir mapping; give it a tree where
	@# dsl/, compiler/ and runtime/ sit under parc/ as they are imported.
	@rm -rf .mypy_tree && mkdir -p .mypy_tree/parc
	@for f in parc/*; do ln -s "$$PWD/$$f" .mypy_tree/parc/; done
	@for d in dsl compiler runtime examples; do ln -s "$$PWD/$$d" .mypy_tree/parc/$$d; done
	cd .mypy_tree && ../$(VENV)/bin/mypy --config-file ../pyproject.toml -p parc

# pytest-xdist: two test processes. Run one at a time, the single-process tests
# (tracing, planning, parsing) leave a core idle and a multi-process test's parent
# waits on its ranks; two workers on 2 cores finish the suite in 2/3 to 4/5 of one's
# time (measured 916 and 1,115 s against 1,358 s, 2026-12-03).
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS)

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .mypy_tree
