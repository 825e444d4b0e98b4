# The two commands the README promises: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-timm setup data bench gpu-check clean

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

test: $(STAMP) data
	$(PY) -m pytest -q

# timm's own tests/test_models.py (from the sdist of the installed timm, fetched from PyPI) on every DeiT we
# register and on timm's deit_tiny_patch16_224; a table of passed/failed per model at the end.
test-timm: $(STAMP)
	$(PY) -m scripts.timm_suite

bench: $(STAMP)
	$(PY) -m scripts.bench_block

# The GPU figures (step time, memory, host syncs, data feed, sampling), about 8 minutes on one GPU; fails cleanly without one.
gpu-check: $(STAMP)
	$(PY) -m scripts.gpu_check --out runs/gpu_check.json

clean:
	rm -rf $(VENV) runs .pytest_cache
