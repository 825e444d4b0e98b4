"""The training data feed: per-sample seeding, persistent workers, the device prefetcher, errors that name the item."""
import random
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from common.data import (DevicePrefetcher, ResumableSampler, SeededDataset, build_train_loader, sample_seed,
                         seeded_rng)


class Draws(Dataset):
    """Item i: (i, a draw from each of Python's, numpy's and torch's global generators)."""

    def __init__(self, n=24, fail_at=None):
        self.n, self.fail_at = n, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise ValueError("a bug in the transform")
        return torch.tensor([float(i), random.random(), float(np.random.rand()), float(torch.rand(()))],
                            dtype=torch.float64)


def batches_of(loader, sampler, epochs, start=0):
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch, start=start if epoch == epochs[0] else 0)
        out += [b.clone() for b in loader]
    return out


def test_seeded_rng_seeds_the_same_streams_as_manual_seed_and_restores():
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    want = (random.random(), np.random.rand(), torch.rand(3))
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    with seeded_rng(123):
        got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


def test_items_are_a_function_of_seed_epoch_and_position():
    """The same items with 0 or 2 workers, persistent or not, 1 or 2 processes (interleaved), and resumed
    mid-epoch; and each item equals the dataset read directly under ``sample_seed(seed, epoch, position)``."""
    dataset = Draws()
    reference = None
    for workers, persistent in ((0, False), (2, False), (2, True)):
        sampler = ResumableSampler(len(dataset), seed=5)
        loader = build_train_loader(dataset, sampler, 4, workers, persistent_workers=persistent)
        got = torch.cat(batches_of(loader, sampler, [0, 1]))
        reference = got if reference is None else reference
        assert torch.equal(got, reference), (workers, persistent)
    for position, row in enumerate(reference[:24]):  # epoch 0
        index = int(ResumableSampler(len(dataset), seed=5).global_order(0)[position])
        with seeded_rng(sample_seed(5, 0, position)):
            assert torch.equal(row, dataset[index])
    ranks = []
    for rank in range(2):
        sampler = ResumableSampler(len(dataset), 2, rank, seed=5)
        ranks.append(torch.cat(batches_of(build_train_loader(dataset, sampler, 2, 1), sampler, [0])))
    assert torch.equal(torch.stack(ranks, 1).flatten(0, 1), reference[:24])
    sampler = ResumableSampler(len(dataset), seed=5)
    resumed = torch.cat(batches_of(build_train_loader(dataset, sampler, 4, 2), sampler, [0, 1], start=8))
    assert torch.equal(resumed, reference[8:])


def test_persistent_workers_across_epochs_and_abandoned_epochs():
    """Workers kept across epochs deliver what fresh workers deliver, also when an epoch is left half-read
    (stop_at_step, resume) and the next iteration starts at another epoch and position."""
    dataset = Draws()
    fresh_sampler = ResumableSampler(len(dataset), seed=1)
    fresh = build_train_loader(dataset, fresh_sampler, 4, 2, persistent_workers=False)
    sampler = ResumableSampler(len(dataset), seed=1)
    kept = build_train_loader(dataset, sampler, 4, 2)
    assert kept.persistent_workers and not fresh.persistent_workers
    for epoch in range(3):
        assert all(torch.equal(a, b) for a, b in zip(batches_of(kept, sampler, [epoch]),
                                                      batches_of(fresh, fresh_sampler, [epoch])))
    sampler.set_epoch(3)
    next(iter(kept))  # abandon epoch 3 after one batch
    sampler.set_epoch(4, start=8)
    fresh_sampler.set_epoch(4, start=8)
    assert all(torch.equal(a, b) for a, b in zip(list(kept), list(fresh)))
    assert len(list(kept)) == 4


def test_device_prefetcher_on_cpu_is_the_plain_loop():
    dataset = Draws()
    sampler = ResumableSampler(len(dataset), seed=2)
    pairs = torch.utils.data.DataLoader([(dataset[i], (torch.tensor(i), [torch.ones(2) * i])) for i in range(8)],
                                        batch_size=4)

    def transform(batch):
        x, (i, [ones]) = batch
        return x * 2, (i, [ones + 1])

    plain = [transform(b) for b in pairs]
    fed = list(DevicePrefetcher(pairs, "cpu", transform))
    assert len(DevicePrefetcher(pairs, "cpu")) == 2 and len(fed) == 2
    for (x, (i, [o])), (y, (j, [p])) in zip(plain, fed):
        assert torch.equal(x, y) and torch.equal(i, j) and torch.equal(o, p)
    loader = build_train_loader(dataset, sampler, 4, 0)
    assert all(torch.equal(a, b) for a, b in zip(list(loader), list(DevicePrefetcher(loader, torch.device("cpu")))))


class HwcImages(Dataset):
    """Item i: ((a uint8 (3, 5, 7) image in HWC memory, as Pillow and the JPEG decoders give it, an int64 (1, 5)
    row), label i)."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        hwc = torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
        return (hwc.permute(2, 0, 1), torch.full((1, 5), i)), i


def test_collate_gives_default_collates_batches(monkeypatch):
    """The training loader's collate (numpy copies into the batch) gives ``default_collate``'s batches: values,
    dtypes, contiguous layout, and inside a worker a batch in shared memory as torch's; what numpy lacks
    (bfloat16), 0-d tensors and unequal shapes go to torch's own stacking, which names the mismatch."""
    from torch.utils.data import default_collate

    from common.data import collate

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b)
        return all(same(x, y) for x, y in zip(a, b))

    items = [HwcImages()[i] for i in range(6)]
    assert not items[0][0][0].is_contiguous() and same(collate(items), default_collate(items))
    others = [(torch.randn(2, 3).bfloat16(), torch.tensor(1.5), torch.randn(4).half(), np.float32(i)) for i in range(3)]
    assert same(collate(others), default_collate(others))
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        collate([torch.zeros(2), torch.zeros(3)])
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())  # as inside a worker
    assert collate(items)[0][0].is_shared()
    monkeypatch.undo()
    sampler = ResumableSampler(6, seed=0)
    through_worker = list(build_train_loader(HwcImages(), sampler, 3, num_workers=1))
    plain = torch.utils.data.DataLoader(SeededDataset(HwcImages()), batch_size=3, sampler=sampler)
    assert len(through_worker) == 2 and all(same(a, b) for a, b in zip(through_worker, plain))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_prefetcher_on_cuda_equals_cpu():
    from vision.data import DataConfig
    from vision.augment import AugmentConfig, NormalizeErase, RandomErasingBoxes

    data, augment = DataConfig(dataset="fashion_mnist"), AugmentConfig(re_prob=0.9, re_count=2)
    worker, device_half = RandomErasingBoxes(0.9, "pixel", 2), NormalizeErase(data, augment)
    random.seed(0)
    items = [(worker(torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)), i) for i in range(16)]
    loader = torch.utils.data.DataLoader(items, batch_size=8, pin_memory=True)
    on_cpu = list(DevicePrefetcher(loader, "cpu", device_half))
    on_cuda = list(DevicePrefetcher(loader, "cuda", device_half))
    for (a, i), (b, j) in zip(on_cpu, on_cuda):
        assert b.is_cuda and torch.equal(i, j.cpu())
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
def test_a_failing_item_names_its_key_and_file(tmp_path):
    with pytest.raises(ValueError, match="a bug") as err:
        SeededDataset(Draws(fail_at=3))[(3, 777)]
    assert "under sample seed 777" in "\n".join(err.value.__notes__)
    assert "SeededDataset(dataset)[(3, 777)]" in "\n".join(err.value.__notes__)

    from vision.data import ReadableImageFolder

    (tmp_path / "c").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "c" / "x.jpg")

    def broken(image):
        raise RuntimeError("transform bug")

    with pytest.raises(RuntimeError, match="transform bug") as err, warnings.catch_warnings():
        warnings.simplefilter("error")  # and no "skipping unreadable image": transform errors are not skipped
        ReadableImageFolder(tmp_path, transform=broken)[0]
    assert f"while transforming {tmp_path / 'c' / 'x.jpg'}" in err.value.__notes__
