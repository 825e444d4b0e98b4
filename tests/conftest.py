"""Test-session settings.

* One BLAS thread (scipy's sqrtm spins on a busy 2-core machine otherwise). Under pytest-xdist (`make test` runs
  one worker per core) each worker also computes on one torch thread: the workers share the cores.
* Tests marked ``fashion_mnist`` need the Fashion-MNIST files (`make test` installs them where it can, as
  `make demo` does). Without them such a test is skipped with the command to run, except under CI
  (``CI=true``), where a missing dataset fails the test: CI must never go green by skipping.
"""
import os

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)

MISSING_DATA = ("Fashion-MNIST is not installed: run `make data` as root "
                "(it runs `apt-get install dataset-fashion-mnist`)")


def pytest_configure(config):
    config.addinivalue_line("markers", "fashion_mnist: needs the Fashion-MNIST files (skipped without them, "
                                       "failed under CI=true)")


def _fashion_mnist_installed() -> bool:
    from common.data import find_fashion_mnist

    try:
        find_fashion_mnist("train")
        find_fashion_mnist("test")
    except FileNotFoundError:
        return False
    return True


def pytest_runtest_setup(item):
    if item.get_closest_marker("fashion_mnist") is None or _fashion_mnist_installed():
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{MISSING_DATA}; under CI a missing dataset is a failure, not a skip", pytrace=False)
    pytest.skip(MISSING_DATA)
