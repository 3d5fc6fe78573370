# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv in the repo root and installs what it needs (Python 3.11).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where torch comes from: pip's default (see README), or e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: demo test lint tools venv proto clean

demo: $(STAMP)
	$(VENV)/bin/kvpager demo

# The tests run on PYTEST_WORKERS processes (pytest-xdist; 0: in pytest's own process), a module at a
# time, so that a module's fixtures (servers, Ray clusters, checkpoints) are set up once in one
# process; tests/gpu is one unit (tests/conftest.py: pytest_xdist_make_scheduler), and the longest
# modules start first (LONGEST_FIRST there). Two workers keep CI's two cores busy: one test waiting
# for a server or a Ray cluster to start leaves the other core to the other worker.
PYTEST_WORKERS ?= 2

test: $(STAMP) lint tools
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The house's rules, checked before the tests: the import layers (pyproject.toml's
# [tool.importlinter] contracts: commands on top, the manager free of torch/Ray, the scheduler and
# the workers sharing only the step contract), ruff's checks ([tool.ruff]) and mypy on the
# modules listed in [tool.mypy].
lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/mypy

# Prometheus, promtool, docker-compose and wget for the metrics and deployment tests, as files:
# Debian's packages downloaded and unpacked into .cache/tools (nothing installed, no service
# started). Quick when done before; where fetching is impossible it says why in one line and
# the tests that need them are skipped. Any python3 runs it (standard library only).
tools:
	python3 tests/support/fetch_tools.py

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==2.13.0"
	$(PY) -m pip install -q -e ".[torch,ray,metrics,models,dev]"
	touch $(STAMP)

# Regenerate the committed protobuf/gRPC code from proto/ (tests check it is current).
proto: $(STAMP)
	$(PY) -m kvpager.protogen

clean:
	rm -rf $(VENV) build *.egg-info .cache/tools
