"""Data for DeiT: IDX reading, folder-layout errors, corrupt images, mixup targets, resumable sampling."""
import gzip
import struct
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import common.data as cdata
from common.data import ResumableSampler, SeededDataset, read_idx
from vision.data import AugmentConfig, DataConfig, build_dataset, build_mixup, build_transform, skipped_images


def write_idx(path, array):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_idx_reader_and_torchvision_root(tmp_path, monkeypatch):
    monkeypatch.setattr(cdata, "DEBIAN_FASHION_MNIST", tmp_path / "absent")
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.arange(3 * 28 * 28).reshape(3, 28, 28) % 256
    write_idx(raw / "t10k-images-idx3-ubyte.gz", images)
    write_idx(raw / "t10k-labels-idx1-ubyte.gz", np.array([1, 2, 9]))
    assert np.array_equal(read_idx(raw / "t10k-images-idx3-ubyte.gz"), images)
    x, y = cdata.load_fashion_mnist("test", root=tmp_path)
    assert x.shape == (3, 28, 28) and y.tolist() == [1, 2, 9]
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        cdata.load_fashion_mnist("train", root=tmp_path)
    (tmp_path / "bad.gz").write_bytes(gzip.compress(b"\x01\x02\x03\x04"))
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad.gz")


def make_folder(root, classes=("a", "b"), per_class=3, size=20):
    rng = np.random.default_rng(0)
    for c in classes:
        (root / "val" / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / "val" / c / f"{i}.jpg")
    return root


def cfg_for(root, **kw):
    return DataConfig(dataset="imagefolder", path=str(root), num_classes=2, input_size=16, crop_pct=1.0, **kw)


@pytest.mark.parametrize("setup, fragment", [
    (lambda r: None, "does not exist"),
    (lambda r: (r / "train").mkdir(parents=True), "val is missing (found: train)"),
    (lambda r: (r / "val").mkdir(parents=True), "no class sub-folders"),
    (lambda r: (r / "val" / "a").mkdir(parents=True), "hold no images"),
])
def test_layout_errors_name_the_expected_layout(tmp_path, setup, fragment):
    root = tmp_path / "imagenet"
    setup(root)
    with pytest.raises(FileNotFoundError) as err:
        build_dataset(cfg_for(root), "val")
    assert fragment in str(err.value) and "<class name>/<image>.JPEG" in str(err.value)


def test_missing_path_and_class_count():
    with pytest.raises(ValueError, match="data.path is required"):
        DataConfig(dataset="imagefolder")


def test_class_count_mismatch(tmp_path):
    root = make_folder(tmp_path)
    with pytest.raises(ValueError, match="set data.num_classes=2"):
        build_dataset(DataConfig(path=str(root), num_classes=1000), "val")


def test_corrupt_image_is_skipped_with_warning_and_count(tmp_path):
    root = make_folder(tmp_path)
    broken = root / "val" / "a" / "1.jpg"
    broken.write_bytes(b"not a jpeg at all")
    data = cfg_for(root)
    ds = build_dataset(data, "val", build_transform(data, training=False))
    with pytest.warns(UserWarning, match=r"skipping unreadable image .*a/1\.jpg"):
        image, target = ds[1]
    assert image.shape == (3, 16, 16) and target == 0  # the next readable image (a/2.jpg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = torch.utils.data.DataLoader(SeededDataset(ds), batch_size=3, num_workers=1)
        assert sum(len(b[1]) for b in loader) == 6  # batch shapes unchanged
    assert skipped_images(SeededDataset(ds)) == 2  # once in this process, once in the worker


def test_mixup_cutmix_targets_are_distributions():
    mixup = build_mixup(AugmentConfig(mixup=0.8, cutmix=1.0, label_smoothing=0.1), num_classes=10)
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8)
    for _ in range(6):  # both mixup and cutmix branches (switch prob 0.5)
        mixed, targets = mixup(x.clone(), y)
        assert targets.shape == (8, 10) and mixed.shape == x.shape
        assert torch.allclose(targets.sum(1), torch.ones(8))
        assert targets.min() >= 0.1 / 10 - 1e-6  # label smoothing keeps every class above eps / C
    assert build_mixup(AugmentConfig(), 10) is None


@pytest.mark.parametrize("world", [1, 2])
def test_repeated_aug_sampler_covers_each_image_repeats_times(world):
    n, repeats = 12, 3
    samplers = [ResumableSampler(n, world, r, seed=1, repeats=repeats, epoch_samples=n * repeats) for r in range(world)]
    drawn = [list(s) for s in samplers]
    indices = [i for d in drawn for i, _ in d]
    assert sorted(indices) == sorted(list(range(n)) * repeats)
    seeds = [s for d in drawn for _, s in d]
    assert len(set(seeds)) == len(seeds)  # every copy gets its own augmentation
    # default epoch length = dataset size (DeiT): a third of the images, each three times
    default = [i for r in range(world) for i, _ in ResumableSampler(n, world, r, seed=1, repeats=repeats)]
    assert len(default) == n and all(default.count(i) == repeats for i in set(default))


def test_sampler_resume_and_world_size_independence():
    one = list(ResumableSampler(20, 1, 0, seed=3))
    two = [list(ResumableSampler(20, 2, r, seed=3)) for r in range(2)]
    assert [x for pair in zip(*two) for x in pair] == one  # same global order, interleaved
    s = ResumableSampler(20, 2, 1, seed=3)
    s.set_epoch(0, start=8)
    assert list(s) == two[1][4:]
    s.set_epoch(1)
    assert list(s) != two[1]  # a new permutation each epoch
    with pytest.raises(ValueError, match="multiple of num_replicas"):
        s.set_epoch(0, start=3)


def test_seeded_items_are_reproducible(tmp_path):
    root = make_folder(tmp_path)
    data = cfg_for(root)
    aug = AugmentConfig(auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.5, scale=(0.3, 1.0))
    ds = SeededDataset(build_dataset(data, "val", build_transform(data, aug, training=True)))
    before = torch.get_rng_state()
    a, b, c = ds[(0, 7)][0], ds[(0, 7)][0], ds[(0, 8)][0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is left alone
