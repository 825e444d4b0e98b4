"""Test-session settings.

* One BLAS thread (scipy's sqrtm spins on a busy 2-core machine otherwise), and one OpenMP thread in every process
  a test starts (torchrun's own default): the processes share the cores, and a thread that waits for a core spins.
  Under pytest-xdist (`make test` runs one worker per core) each worker also computes on one torch thread.
* Tests marked ``fashion_mnist`` need the Fashion-MNIST files (`make test` installs them where it can, as
  `make demo` does). Without them such a test is skipped with the command to run, except under CI
  (``CI=true``), where a missing dataset fails the test: CI must never go green by skipping.
* The longest files are collected first, multi-process and one-process files alternating (``FILE_ORDER``).
"""
import os

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)

MISSING_DATA = ("Fashion-MNIST is not installed: run `make data` as root "
                "(it runs `apt-get install dataset-fashion-mnist`)")


def pytest_configure(config):
    config.addinivalue_line("markers", "fashion_mnist: needs the Fashion-MNIST files (skipped without them, "
                                       "failed under CI=true)")


# The longest files first (by their --durations): pytest-xdist's loadfile hands whole files to whichever worker is
# free, in collection order, so a long file collected last would leave the other worker idle while it runs. Files
# that start several processes (cluster, faults, the trainers, the rehearsals) alternate with files that compute in
# one, because two multi-process files side by side put three or four busy processes on the two cores.
FILE_ORDER = ("test_cluster.py", "test_cuda_defaults.py", "test_faults.py", "test_step.py", "test_diffusion_train.py",
              "test_timm_suite.py", "test_rehearsal_dit.py", "test_gpu_check.py", "test_vision_train.py",
              "test_compiled_sampling.py", "test_compare.py", "test_metrics.py", "test_demo.py",
              "test_deit_features.py", "test_sample.py", "test_compiled_eval.py", "test_paper_imagenet.py",
              "test_dit_models.py", "test_startup.py", "test_fid.py", "test_cli.py", "test_trackers.py",
              "test_transport.py", "test_vision_data.py", "test_hub.py", "test_rehearsal_deit.py", "test_bad_input.py",
              "test_vs_peers.py", "test_deit3.py")


def pytest_collection_modifyitems(config, items):
    order = {name: rank for rank, name in enumerate(FILE_ORDER)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest keep their order


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


@pytest.fixture
def images():
    """Three 32 px RGB images, the input of the small DeiTs of the model tests."""
    import torch

    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def latents():
    """``(x, t, y)`` of four 8 x 8 latents for the small DiTs: timesteps at both ends, a null-class label."""
    import torch

    gen = torch.Generator().manual_seed(2)
    return torch.randn(4, 4, 8, 8, generator=gen), torch.tensor([0, 17, 500, 999]), torch.tensor([0, 3, 9, 10])
