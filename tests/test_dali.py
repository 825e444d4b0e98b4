"""data.backend=dali: a clear error without DALI; with DALI (pip install -e '.[dali]') its CPU pipeline feeds
recipe batches in the sampler's order (how it is tested without a GPU)."""
import importlib.util
import random
import sys
import warnings

import pytest
import torch

from common.data import ResumableSampler, sample_seed
from tests.odd_images import write_odd_images
from tests.test_vision_data import recipe
from vision.dali import build_dali_loader, rand_augment_args
from vision.data import build_dataset

has_dali = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None


def test_without_dali_the_error_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # as if not installed
    write_odd_images(tmp_path)
    data, augment = recipe(tmp_path)
    dataset = build_dataset(data, "train")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[dali\]'.*or set data.backend=torch"):
        build_dali_loader(dataset, ResumableSampler(len(dataset)), 4, data, augment, "cpu")


def test_rand_augment_policy_maps_to_dali_arguments():
    assert rand_augment_args("rand-m9-mstd0.5-inc1") == {"n": 2, "m": 27, "monotonic_mag": True}
    assert rand_augment_args("rand-n3-m10") == {"n": 3, "m": 30, "monotonic_mag": False}
    with pytest.raises(ValueError, match="RandAugment"):
        rand_augment_args("original-mstd0.5")


@pytest.mark.skipif(not has_dali, reason="NVIDIA DALI is not installed (pip install -e '.[dali]')")
def test_dali_cpu_pipeline_feeds_recipe_batches(tmp_path):
    write_odd_images(tmp_path)
    data, augment = recipe(tmp_path, input_size=16)
    data.num_workers = 1
    dataset = build_dataset(data, "train")
    order = ResumableSampler(len(dataset), seed=3, repeats=3)
    sampler = ResumableSampler(len(dataset), seed=3, repeats=3)
    loader = build_dali_loader(dataset, sampler, 8, data, augment, "cpu", seed=0)
    assert len(loader) == len(dataset) // 8
    for epoch, start in ((0, 0), (1, 40)):
        sampler.set_epoch(epoch, start=start)
        order.set_epoch(epoch, start=start)
        keys = list(order)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            batches = list(loader)
        assert len(batches) == (len(dataset) - start) // 8
        for b, (images, targets) in enumerate(batches):
            batch_keys = keys[8 * b: 8 * b + 8]
            assert targets.tolist() == [dataset.samples[i][1] for i, _ in batch_keys]  # the sampler's order
            assert images.shape == (8, 3, 16, 16) and images.dtype == torch.float32 and torch.isfinite(images).all()
            # erasing decisions come from each sample's seed, as in the torch backend's worker half
            want = loader._boxes([seed for _, seed in batch_keys])
            assert torch.equal(want, loader._boxes([sample_seed(3, epoch, start + 8 * b + k) for k in range(8)]))
    state = random.getstate()
    loader._boxes([1, 2, 3])
    assert random.getstate() == state


@pytest.mark.skipif(not has_dali, reason="NVIDIA DALI is not installed (pip install -e '.[dali]')")
def test_dali_batches_stay_with_their_labels_when_an_epoch_stops_early(tmp_path):
    """DALI decodes one batch ahead; a consumer that stops early (a run's last step, stop_at_step) must not leave
    that batch to the next epoch. Black and white images in two classes show which images a batch holds."""
    from PIL import Image

    for name, value in (("black", 0), ("white", 255)):
        (tmp_path / name).mkdir()
        for k in range(8):
            Image.new("RGB", (24, 24), (value,) * 3).save(tmp_path / name / f"{k}.jpg")
    data, augment = recipe(tmp_path, input_size=16)
    augment.auto_augment, augment.re_prob = None, 0.0  # keep each image black or white
    data.num_workers = 1
    dataset = build_dataset(data, "train")
    sampler = ResumableSampler(len(dataset), seed=1)
    loader = build_dali_loader(dataset, sampler, 4, data, augment, "cpu", seed=0)
    white = dataset.class_to_idx["white"]
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for b, (images, targets) in enumerate(loader):
            assert ((images.mean(dim=(1, 2, 3)) > 0) == (targets == white)).all(), (epoch, b)
            if epoch % 2 == 0:
                break  # stopped after one batch while the next one was being decoded
