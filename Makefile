# The two commands the README promises: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-timm test-floor setup data bench gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Fashion-MNIST from Debian's dataset-fashion-mnist package (needs root; skipped with a hint otherwise).
data:
	@bash scripts/install_fashion_mnist.sh

demo: $(STAMP) data
	$(PY) -m scripts.demo

# One pytest worker per core (TEST_WORKERS=0: in this process); each test file stays on one worker, and the files
# go out in collection order (tests/conftest.py's FILE_ORDER: longest first), not xdist's most-tests-first.
TEST_WORKERS ?= auto
test: $(STAMP) data
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# timm's own tests/test_models.py (from the sdist of the installed timm, fetched from PyPI) on every DeiT we
# register and on timm's deit_tiny_patch16_224; a table of passed/failed per model at the end.
test-timm: $(STAMP)
	$(PY) -m scripts.timm_suite
# The suite against the oldest versions pyproject.toml allows: every dependency pinned to its floor (pip picks the
# rest), in its own environment. FLOOR_PYTHON: the oldest Python it allows (3.10) where one is installed.
FLOOR_VENV ?= .venv-floor
FLOOR_PYTHON ?= $(PYTHON)
test-floor: data
	test -x $(FLOOR_VENV)/bin/python || $(FLOOR_PYTHON) -m venv $(FLOOR_VENV)
	$(PYTHON) scripts/floor_pins.py > $(FLOOR_VENV)/floor.txt
	$(FLOOR_VENV)/bin/python -m pip install -q -r $(FLOOR_VENV)/floor.txt
	$(FLOOR_VENV)/bin/python -m pip install -q --no-deps -e .
	$(FLOOR_VENV)/bin/python -m pytest -q

bench: $(STAMP)
	$(PY) -m benchmarks.step

# The GPU figures (the real trainers' images/s and MFU, step time, memory, host syncs, data feed, sampling), part
# by part into runs/gpu_check.json (docs/benchmarks.md); fails cleanly without a GPU.
gpu-check: $(STAMP)
	$(PY) -m benchmarks.gpu_check --out runs/gpu_check.json

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .venv-latest runs .pytest_cache
