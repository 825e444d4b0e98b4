"""Data for DeiT: IDX reading, folder-layout errors, corrupt images, mixup targets, resumable sampling."""
import gzip
import struct
import warnings

import numpy as np
import PIL
import pytest
import torch
from PIL import Image

import common.data as cdata
from common.data import ResumableSampler, SeededDataset, read_idx
from vision.data import DataConfig, build_dataset, unreadable_flags
from vision.augment import AugmentConfig, build_mixup, build_transform


def skipped_images(dataset) -> int:
    """How many distinct unreadable files a dataset (possibly wrapped) has met so far, over all workers."""
    flags = unreadable_flags(dataset)
    return 0 if flags is None else int(flags.sum())


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
        DataConfig(dataset="imagefolder").check_ready()  # needed to run; a printed config may lack it


def test_class_count_mismatch(tmp_path):
    root = make_folder(tmp_path)
    with pytest.raises(ValueError, match="set data.num_classes=2"):
        build_dataset(DataConfig(path=str(root), num_classes=1000), "val")


def test_corrupt_image_is_replaced_in_training_and_left_out_of_evaluation(tmp_path):
    root = make_folder(tmp_path)
    (root / "val" / "a" / "1.jpg").write_bytes(b"not a jpeg at all")
    data = cfg_for(root, train_split="val")  # the same folder read as a training split and as a val split
    train = build_dataset(data, "train", build_transform(data, training=False))
    with pytest.warns(UserWarning, match=r"skipping unreadable image .*val/a/1\.jpg"):
        image, target = train[1]
    assert image.shape == (3, 16, 16) and target == 0  # the next readable image (a/2.jpg): full batches
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file is named once, not at every encounter
        loader = torch.utils.data.DataLoader(SeededDataset(train), batch_size=3, num_workers=1)
        assert sum(len(b[1]) for b in loader) == 6  # batch shapes unchanged
        train[1]
    assert skipped_images(SeededDataset(train)) == 1  # files, not encounters (here: this process and a worker)
    val = build_dataset(data, "val", build_transform(data, training=False))
    with pytest.warns(UserWarning, match=r"skipping unreadable image .*val/a/1\.jpg"):
        image, target = val[1]
    assert image.shape == (3, 16, 16) and target == -2  # "not an image": -1 - index


def test_evaluation_counts_exactly_the_readable_images_and_names_the_others(tmp_path):
    import timm
    from accelerate import Accelerator

    from vision.evaluate import evaluate

    root = make_folder(tmp_path)
    data = cfg_for(root)
    model = timm.create_model("deit_tiny_siamese_patch16_224", img_size=16, patch_size=8, embed_dim=16, depth=1,
                              num_heads=2, num_classes=data.num_classes)
    accelerator = Accelerator(cpu=True)
    loader = lambda: torch.utils.data.DataLoader(  # noqa: E731
        build_dataset(data, "val", build_transform(data, training=False)), batch_size=4)
    broken = root / "val" / "a" / "1.jpg"
    intact = evaluate(model, loader(), accelerator)
    # The reference: the same folder without the file, the images the report must be computed on.
    saved = broken.read_bytes()
    broken.unlink()
    without = evaluate(model, loader(), accelerator)
    broken.write_bytes(saved[:40])  # truncated
    with pytest.warns(UserWarning, match="skipping unreadable image"):
        damaged = evaluate(model, loader(), accelerator)
    assert damaged["images"] == without["images"] == intact["images"] - 1
    assert damaged["unreadable"] == 1 and damaged["unreadable_files"] == [str(broken)]
    assert damaged["top1"] == without["top1"] and damaged["top5"] == without["top5"]
    # float32 sums over other batchings of the same images (the placeholder changes the batches): a few ulps
    assert damaged["loss"] == pytest.approx(without["loss"], rel=1e-6)


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


# ----------------------------------------------------------------------------- the recipe's augmentations under
# the newest Pillow/timm/torchvision: every op at every magnitude, odd images, tens of thousands of draws
import random  # noqa: E402
from pathlib import Path  # noqa: E402

from PIL import ImageOps  # noqa: E402
from timm.data import auto_augment  # noqa: E402

from common.config import from_dict, read_yaml  # noqa: E402
from common.data import sample_seed  # noqa: E402
from tests.odd_images import write_odd_images  # noqa: E402
from vision.data import load_rgb, load_rgb_tensor
from vision.augment import NormalizeErase, RandomErasingBoxes, posterize_keeping_bits

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "deit_recipe.yaml"


def recipe(root=None, input_size=16):
    """The data and augment sections of configs/deit_recipe.yaml, at a test-sized input."""
    raw = read_yaml(RECIPE)
    data = from_dict(DataConfig, {**raw["data"], "path": str(root or "unused"), "num_classes": 2,
                                  "input_size": input_size, "train_split": ".", "val_split": "."})
    return data, from_dict(AugmentConfig, raw["augment"])


def rand_augment_of(transform):
    (stage,) = [t for t in transform.transforms if isinstance(t, auto_augment.RandAugment)]
    return stage


@pytest.fixture(scope="module")
def odd_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    write_odd_images(root)
    return root


def test_posterize_zero_bits_is_black_as_pillow_12_made_it():
    rgb = Image.fromarray(np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3) * 4)
    if int(PIL.__version__.split(".")[0]) >= 13:  # the reason for the wrapper; Pillow <= 12 returns black
        with pytest.raises(ValueError, match="bits must be"):
            ImageOps.posterize(rgb, 0)
    assert not np.asarray(posterize_keeping_bits(rgb, 0)).any()
    for bits in range(0, 9):  # Pillow <= 12's arithmetic: keep the `bits` high bits
        want = np.asarray(rgb) & (~(2 ** (8 - bits) - 1) & 0xFF)
        assert np.array_equal(np.asarray(posterize_keeping_bits(rgb, bits)), want), bits
    # the recipe's RandAugment uses it for its posterize op, at magnitude 10 (0 bits) too
    data, augment = recipe()
    ops = {op.name: op for op in rand_augment_of(build_transform(data, augment, training=True)).ops}
    assert ops["PosterizeIncreasing"].aug_fn is posterize_keeping_bits
    op = ops["PosterizeIncreasing"]
    op.prob, op.magnitude, op.magnitude_std = 1.0, 10, 0
    assert not np.asarray(op(rgb)).any()


@pytest.mark.parametrize("transforms", ["inc1", "inc0"])
def test_every_rand_augment_op_at_every_magnitude(transforms):
    """Each op of timm's RandAugment (both op sets) at magnitudes 0..10 in steps of 0.25, plus magnitudes beyond
    the clip (what the magnitude noise produces), on RGB images from 1x1 to 33x20: an RGB image of the same size."""
    data, augment = recipe()
    augment.auto_augment = "rand-m9-mstd0.5-inc1" if transforms == "inc1" else "rand-m9-mstd0.5"
    ops = rand_augment_of(build_transform(data, augment, training=True)).ops
    assert len(ops) == 15
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in [(1, 1), (1, 7), (7, 1), (33, 20)]]
    random.seed(0)
    for op in ops:
        op.prob, op.magnitude_std = 1.0, 0
        for magnitude in [*np.arange(0, 10.25, 0.25).tolist(), -3.0, 10.5, 14.0]:
            op.magnitude = magnitude
            for image in images:
                out = op(image)
                assert out.mode == "RGB" and out.size == image.size, (op.name, magnitude)


def count_zero_bit_posterize(transform) -> list:
    """Instrument the posterize op of ``transform`` to record the draws that ask for 0 bits."""
    zero_bits = []
    for op in rand_augment_of(transform).ops:
        if op.name == "PosterizeIncreasing":
            inner = op.aug_fn
            op.aug_fn = lambda image, bits, **kw: (zero_bits.append(bits) if bits <= 0 else None) or inner(image, bits, **kw)
    return zero_bits


@pytest.mark.parametrize("use_prefetcher", [False, True])
def test_20000_recipe_transforms_over_odd_images(odd_folder, use_prefetcher):
    """The DeiT recipe's training transform (rand-m9-mstd0.5-inc1, random erasing 0.25), 10,000 draws in each of
    its two forms (20,000 in all) over every file of the odd folder, read by the dataset's loader. With timm
    1.0.31 and Pillow 13 the posterize op asks for 0 bits about once in 700 draws, which Pillow refuses (vision.augment keeps the bits)."""
    data, augment = recipe(odd_folder, input_size=12)
    dataset = build_dataset(data, "train", loader=load_rgb_tensor if use_prefetcher else None)
    assert len(dataset) == 140
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow's note on palette images with transparency
        images = [dataset.loader(path) for path, _ in dataset.samples]
    transform = build_transform(data, augment, training=True, use_prefetcher=use_prefetcher)
    zero_bits = count_zero_bit_posterize(transform)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    for i in range(10_000):
        out = transform(images[i % len(images)])
        if use_prefetcher:
            out, boxes = out
            assert boxes.shape == (1, 5) and out.dtype == torch.uint8
        assert out.shape == (3, 12, 12)
    assert len(zero_bits) >= 5, "the draws reached posterize's 0 bits"


def test_prefetcher_split_over_odd_images(odd_folder):
    """The ``use_prefetcher`` split of the recipe as training reads it (loader, per-sample seeds, worker half,
    collate, device half) on every odd file: finite float images, nothing skipped."""
    data, augment = recipe(odd_folder, input_size=12)
    dataset = build_dataset(data, "train", build_transform(data, augment, training=True, use_prefetcher=True),
                            loader=load_rgb_tensor)
    seeded, device_half = SeededDataset(dataset), NormalizeErase(data, augment)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for start in range(0, 1_400, 350):
            items = [seeded[(i % len(dataset), sample_seed(0, 0, i))] for i in range(start, start + 350)]
            (images, boxes), labels = torch.utils.data.default_collate(items)
            out = device_half.images(images, boxes)
            assert out.shape == (350, 3, 12, 12) and torch.isfinite(out).all() and (boxes[:, 0, 2] > 0).any()
    assert skipped_images(dataset) == 0


# ----------------------------------------------------------------------------- the prefetcher split, piece by piece
from timm.data.random_erasing import RandomErasing  # noqa: E402
from timm.data.transforms import RandomResizedCropAndInterpolation  # noqa: E402
from torchvision.datasets.folder import pil_loader  # noqa: E402

from vision.augment import RandomResizedCropTensor, hashed_normal  # noqa: E402


def test_loaders_give_pillows_pixels(odd_folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in sorted(odd_folder.rglob("*.*")):
            want = np.asarray(pil_loader(path))
            got = load_rgb(path)
            assert got.mode == "RGB" and np.array_equal(np.asarray(got), want), path.name
            tensor = load_rgb_tensor(path)
            assert tensor.dtype == torch.uint8 and np.array_equal(tensor.permute(1, 2, 0).numpy(), want), path.name
    broken = odd_folder / "broken.JPEG"
    broken.write_bytes(pil_loader_bytes := (odd_folder / "a" / "61x45_rgb.JPEG").read_bytes()[:200])
    try:
        with pytest.raises(OSError):  # Pillow's error, which ReadableImageFolder treats as unreadable
            load_rgb_tensor(broken)
    finally:
        broken.unlink()
    assert pil_loader_bytes


def test_tensor_crop_draws_timms_boxes_and_resamples_like_pillow():
    """Same boxes as timm's crop for the same seed; pixels as Pillow's bicubic: on average all but ~1% equal, and
    in every draw all but < 0.5% within one grey level (the two round their intermediate pass differently)."""
    from benchmarks.synthetic import natural_image

    rng = np.random.default_rng(0)
    image = Image.fromarray(natural_image(200, 150, rng))
    for size in (48, 96):  # mostly down-, mostly upsampling
        timm_crop = RandomResizedCropAndInterpolation(size, interpolation="bicubic")
        tensor_crop = RandomResizedCropTensor.like(timm_crop)
        differ = []
        for seed in range(30):
            random.seed(seed)
            want = np.asarray(timm_crop(image)).astype(int)
            after_timm = random.getstate()
            random.seed(seed)
            got = np.asarray(tensor_crop(rgb_tensor(image))).astype(int)
            assert random.getstate() == after_timm  # the same draws, so the same box
            diff = np.abs(got - want)
            assert (diff > 1).mean() < 0.005, (size, seed)
            differ.append((diff > 0).mean())
        assert np.mean(differ) < 0.03, size
    # an image of < 5 pixels can draw an empty crop: black, as Pillow makes it
    tiny = Image.new("RGB", (1, 1), (200, 10, 10))
    timm_crop = RandomResizedCropAndInterpolation(8, interpolation="bicubic")
    outs = []
    for seed in range(30):
        random.seed(seed)
        outs.append(np.asarray(timm_crop(tiny)))
        random.seed(seed)
        assert np.array_equal(np.asarray(RandomResizedCropTensor.like(timm_crop)(rgb_tensor(tiny))), outs[-1])
    assert any(not o.any() for o in outs) and any(o.any() for o in outs)


def rgb_tensor(image):
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


@pytest.mark.parametrize("count", [1, 3])
def test_erasing_boxes_are_timms_decisions(count):
    """RandomErasingBoxes draws with Python's random exactly what timm's RandomErasing draws: same samples erased,
    same rectangles (read off the pixels timm's pixel-mode erasing changed)."""
    ours = RandomErasingBoxes(0.5, "pixel", count)
    timms = RandomErasing(0.5, mode="pixel", max_count=count, device="cpu")
    erased = 0
    for seed in range(300):
        random.seed(seed)
        _, boxes = ours(torch.zeros(3, 20, 24, dtype=torch.uint8))
        random.seed(seed)
        changed = timms(torch.zeros(3, 20, 24)) != 0
        mask = torch.zeros(3, 20, 24, dtype=torch.bool)
        for top, left, height, width, _ in boxes.tolist():
            mask[:, top: top + height, left: left + width] = True
        assert torch.equal(mask, changed), seed
        erased += bool(mask.any())
    assert 100 < erased < 200


def test_device_half_equals_the_cpu_transform_on_the_same_seeds():
    """Worker half + NormalizeErase against timm's ToTensor + Normalize + RandomErasing on the same image and seed:
    the same erased rectangles; every other pixel bit-identical; erased pixels standard normal."""
    data, augment = recipe(input_size=24)
    cpu_tail = build_transform(data, augment, training=True).transforms[-3:]  # MaybeToTensor, Normalize, Erasing
    assert isinstance(cpu_tail[-1], RandomErasing) and cpu_tail[-1].mode == "pixel"
    worker_tail = build_transform(data, augment, training=True, use_prefetcher=True).transforms[-2:]
    device_half = NormalizeErase(data, augment)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)) for _ in range(64)]
    want, items = [], []
    for seed, image in enumerate(images):
        random.seed(seed), torch.manual_seed(seed)
        t = image
        for stage in cpu_tail:
            t = stage(t)
        want.append(t)
        random.seed(seed)
        item = image
        for stage in worker_tail:
            item = stage(item)
        items.append(item)
    (uint8, boxes), = [torch.utils.data.default_collate(items)]
    got = device_half.images(uint8, boxes)
    want = torch.stack(want)
    plain = cpu_tail[1](cpu_tail[0](images[0]))  # normalisation alone, for the unerased reference
    erased = torch.zeros_like(got, dtype=torch.bool)
    for i, (top, left, height, width, _) in enumerate(boxes[:, 0].tolist()):
        erased[i, :, top: top + height, left: left + width] = True
    assert 8 < erased.flatten(1).any(1).sum() < 32  # about a quarter of the samples (re_prob 0.25)
    assert torch.equal(got[~erased], want[~erased])  # bit-identical normalisation
    assert torch.equal(want != torch.stack([cpu_tail[1](cpu_tail[0](im)) for im in images]), erased)  # timm's boxes
    noise = got[erased]
    assert abs(noise.mean()) < 0.1 and abs(noise.std() - 1) < 0.1 and plain.shape == (3, 24, 24)


def erase_every_pixel(x, boxes, mode):
    """Reference: the noise of every pixel of every image computed, then kept inside each box (slot by slot)."""
    b, c, h, w = x.shape
    rows, cols = torch.arange(h).view(1, h, 1), torch.arange(w).view(1, 1, w)
    index = torch.arange(c).view(c, 1, 1) if mode == "rand" else torch.arange(c * h * w).view(c, h, w)
    for k in range(boxes.shape[1]):
        top, left, height, width, seed = (v.view(b, 1, 1) for v in boxes[:, k].unbind(1))
        inside = ((rows >= top) & (rows < top + height) & (cols >= left) & (cols < left + width))[:, None]
        fill = torch.zeros(()) if mode == "const" else hashed_normal(seed.view(-1), k, index)
        x = torch.where(inside, fill, x)
    return x


@pytest.mark.parametrize("mode", ["pixel", "rand", "const"])
def test_erasing_computes_only_the_boxes_and_equals_every_pixel_noise(mode):
    """Both boxes-only fills (the CPU's box by box, the accelerators' vectorised one) equal the every-pixel reference
    bit for bit, with several (overlapping) boxes per sample and samples without one; the host half's sizes give
    the same result as sizes read here; a sample's fill does not depend on the rest of the batch; channels-last
    images (DALI's layout) are filled at the same places."""
    data, augment = recipe(input_size=16)
    augment.re_mode, augment.re_count, augment.re_prob = mode, 3, 0.6
    worker = RandomErasingBoxes(augment.re_prob, mode, 3)
    device_half = NormalizeErase(data, augment)
    random.seed(0)
    items = [worker(torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8)) for _ in range(24)]
    uint8, boxes = torch.utils.data.default_collate(items)
    has_box = boxes[:, :, 2] > 0
    assert has_box.all(1).any() and (~has_box.any(1)).any()  # samples with three boxes and samples with none
    plain = NormalizeErase(data, AugmentConfig())  # re_prob 0: normalisation only
    want = erase_every_pixel(plain.images(uint8, boxes), boxes, mode)
    assert torch.equal(device_half.images(uint8, boxes), want)  # the CPU's box-by-box fill
    vectorised = plain.images(uint8, boxes)  # what an accelerator runs, here on the CPU
    for k, total in enumerate(device_half.fill_sizes(boxes, 3)):
        if total:
            device_half._fill_vectorised(vectorised, boxes[:, k], k, total)
    assert torch.equal(vectorised, want)
    (moved, moved_boxes, sizes), _ = device_half.before_copy(((uint8, boxes), None))
    assert sizes == tuple(int(3 * (boxes[:, k, 2] * boxes[:, k, 3]).sum()) for k in range(3))
    assert torch.equal(device_half((((moved, moved_boxes, sizes)), None))[0], want)
    alone = device_half.images(uint8[3:4], boxes[3:4])
    assert torch.equal(alone[0], want[3])
    channels_last = uint8.contiguous(memory_format=torch.channels_last)
    assert torch.equal(device_half.images(channels_last, boxes), want)
    if mode == "const":
        assert (want == 0).any()


@pytest.mark.parametrize("cutmix", [False, True])
def test_pairwise_mixup_equals_timms_bit_for_bit(cutmix):
    """The in-place pairwise batch mix gives timm's images and targets exactly, block by block and in one block."""
    from timm.data import Mixup

    from vision.augment import PairwiseMixup

    kw = dict(mixup_alpha=0.0 if cutmix else 0.8, cutmix_alpha=1.0 if cutmix else 0.0, label_smoothing=0.1,
              num_classes=5)
    images, targets = torch.randn(10, 3, 16, 16), torch.arange(10) % 5
    np.random.seed(0)
    want = Mixup(**kw)(images.clone(), targets)
    for chunk in (3 * 16 * 16, 2 * 3 * 16 * 16, 10 ** 9):  # one pair, two pairs, the whole batch per block
        mixup = PairwiseMixup(**kw)
        mixup.cpu_chunk_elements = chunk
        np.random.seed(0)
        got = mixup(images.clone(), targets)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), chunk
    assert not torch.equal(want[0], images)


def test_host_noise_equals_the_tensor_hash_across_the_32_bit_wrap():
    """The CPU fill's uint32 hash gives the int64 tensor hash's values bit for bit, for keys whose counters wrap
    past 2**32 inside a 224 px image and for the per-channel (``rand``) index."""
    from vision.augment import _normal_at, _normal_at_host

    c, h, w = 3, 224, 224
    index = torch.arange(c * h * w).view(c, h, w)
    start, step = (np.arange(c).reshape(c, 1, 1) * h + np.arange(h).reshape(1, h, 1)) * w, np.arange(w).reshape(1, 1, w)
    for key in (0, 1, 2**31, 2**32 - 2 * c * h * w // 3, 2**32 - 1):
        assert torch.equal(_normal_at_host(key, start, step), _normal_at(torch.tensor(key), index)), key
        channels = np.arange(c).reshape(c, 1, 1)
        assert torch.equal(_normal_at_host(key, channels, np.zeros((1, 1, 1), dtype=np.int64)),
                           _normal_at(torch.tensor(key), torch.arange(c).view(c, 1, 1))), key


def reference_worker_half(data, augment):
    """The worker half built from the reference pieces: the crop resampled through ``TF.resize`` and timm's own
    ``MaybePILToTensor``."""
    import torchvision.transforms.v2.functional as TF
    from timm.data.transforms import MaybePILToTensor

    from vision.augment import PILToUint8

    class CropThroughResize(RandomResizedCropTensor):
        def _resize(self, box, mode):
            return TF.resize(box, list(self.size), interpolation=mode, antialias=True)

    transform = build_transform(data, augment, training=True, use_prefetcher=True)
    swaps = {RandomResizedCropTensor: CropThroughResize.like, PILToUint8: lambda _: MaybePILToTensor()}
    transform.transforms = [swaps[type(t)](t) if type(t) in swaps else t for t in transform.transforms]
    assert {type(t) for t in transform.transforms}.isdisjoint(swaps)
    return transform


def test_training_batches_equal_the_reference_pipelines(odd_folder):
    """What training computes from the files, at 224 px (a mixing block of one pair) with two erasing boxes per
    sample: the loader's batches (worker half and collate in a worker process), normalised, erased and mixed, equal
    bit for bit, images and targets, those of the reference pieces on the same seeds: ``TF.resize`` for the crop,
    timm's tensor conversion, torch's ``default_collate``, ToTensor + Normalize arithmetic, the every-pixel int64
    noise and timm's ``Mixup``."""
    import torchvision.transforms.functional as F
    from timm.data import Mixup
    from timm.data.transforms import MaybePILToTensor

    from common.data import build_train_loader
    from vision.augment import PILToUint8

    data, augment = recipe(odd_folder, input_size=224)
    augment.re_prob, augment.re_count = 0.9, 2
    dataset = build_dataset(data, "train", build_transform(data, augment, training=True, use_prefetcher=True),
                            loader=load_rgb_tensor)
    reference = SeededDataset(build_dataset(data, "train", reference_worker_half(data, augment),
                                            loader=load_rgb_tensor))
    sampler = ResumableSampler(len(dataset), seed=1, epoch_samples=8)
    keys = list(sampler)
    device_half, mixup = NormalizeErase(data, augment), build_mixup(augment, data.num_classes)
    timm_mixup = Mixup(mixup_alpha=augment.mixup, cutmix_alpha=augment.cutmix, prob=augment.mixup_prob,
                       switch_prob=augment.mixup_switch_prob, mode=augment.mixup_mode,
                       label_smoothing=augment.label_smoothing, num_classes=data.num_classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow's note on palette images with transparency
        batches = list(build_train_loader(dataset, sampler, 4, num_workers=1))
        want_batches = [torch.utils.data.default_collate([reference[k] for k in keys[i: i + 4]]) for i in (0, 4)]
    modes = set()
    for n, (((images, boxes), targets), ((want_images, want_boxes), want_targets)) in enumerate(zip(batches,
                                                                                               want_batches)):
        assert torch.equal(images, want_images) and torch.equal(boxes, want_boxes) and images.is_contiguous()
        seed = 2 * n  # mixup draws for batch 0, cutmix for batch 1
        np.random.seed(seed)
        modes.add(mixup._params_per_batch()[1])
        np.random.seed(seed)
        got = mixup(*device_half(device_half.before_copy(((images, boxes), targets))))
        np.random.seed(seed)
        normalised = F.normalize(want_images.float().div(255), data.mean, data.std)
        want = timm_mixup(erase_every_pixel(normalised, want_boxes, augment.re_mode), want_targets)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), n
        assert (boxes[:, 1, 2] > 0).any()  # boxes in both slots
    assert modes == {True, False}  # a cutmix batch and a mixup batch
    gray = Image.new("L", (3, 2), 7)
    assert torch.equal(PILToUint8()(gray), MaybePILToTensor()(gray))


def test_hashed_normal_is_standard_normal_and_addressable():
    from scipy import stats

    seeds = torch.arange(200) * 7919
    z = hashed_normal(seeds, 0, torch.arange(5000).view(5, 1000))
    assert z.shape == (200, 5, 1000)
    flat = z.flatten().double()
    assert abs(flat.mean()) < 0.005 and abs(flat.std() - 1) < 0.005
    assert stats.kstest(flat[:100_000].numpy(), "norm").pvalue > 1e-3
    # any subset of a sample's elements computed alone gives the same values
    part = hashed_normal(seeds[5:6], 0, torch.tensor([[7, 4321], [999, 0]]))
    assert torch.equal(part[0], torch.stack([z[5, 0, 7], z[5, 4, 321], z[5, 0, 999], z[5, 0, 0]]).view(2, 2))
    # other seeds and other streams are uncorrelated
    other = hashed_normal(seeds, 1, torch.arange(5000).view(5, 1000)).flatten()
    assert abs(torch.corrcoef(torch.stack([z.flatten(), other]))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([z[0].flatten(), z[1].flatten()]))[0, 1]) < 0.05


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
def test_recipe_mixup_cutmix_and_eval_resize_on_odd_sizes(odd_folder, mode):
    """The rest of the recipe's augmentations at the edges: timm's mixup/cutmix (numpy 2) on images down to 1x1,
    and the bicubic evaluation resize + center crop on every odd file."""
    _, augment = recipe()
    augment.mixup_mode = mode
    mixup = build_mixup(augment, num_classes=5)
    np.random.seed(0)
    for size in (1, 2, 3, 12):
        for _ in range(20):  # both branches (switch prob 0.5), many lambdas
            images, targets = mixup(torch.randn(4, 3, size, size), torch.tensor([0, 1, 2, 4]))
            assert images.shape == (4, 3, size, size) and torch.isfinite(images).all()
            assert torch.allclose(targets.sum(1), torch.ones(4)) and targets.min() > 0
    data, _ = recipe(odd_folder, input_size=12)
    dataset = build_dataset(data, "val", build_transform(data, training=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(len(dataset)):
            image, _ = dataset[i]
            assert image.shape == (3, 12, 12) and torch.isfinite(image).all()


def test_evaluation_batches_handed_over_in_uint8_equal_the_whole_transform(odd_folder):
    """vision.evaluate's workers hand over uint8 images and the batch is normalised where it is
    (:func:`vision.evaluate.eval_transforms`): over every odd file the batches are bit-identical to those of timm's
    whole eval transform, and so are the metrics."""
    import timm
    from accelerate import Accelerator

    from vision.evaluate import eval_transforms, evaluate

    data, _ = recipe(odd_folder, input_size=12)
    transform, batch_transform = eval_transforms(data)
    whole = build_dataset(data, "val", build_transform(data, training=False))
    split = build_dataset(data, "val", transform)
    loader = lambda dataset: torch.utils.data.DataLoader(dataset, batch_size=32)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow's note on palette images with transparency
        batches = 0
        for (images, targets), handed_over in zip(loader(whole), loader(split)):
            assert handed_over[0].dtype == torch.uint8
            normalised, same_targets = batch_transform(handed_over)
            assert torch.equal(normalised, images) and torch.equal(same_targets, targets)
            batches += 1
        assert batches == 5
        model = timm.create_model("deit_tiny_siamese_patch16_224", img_size=12, patch_size=6, embed_dim=16, depth=1,
                                  num_heads=2, num_classes=data.num_classes)
        accelerator = Accelerator(cpu=True)
        assert evaluate(model, loader(split), accelerator, batch_transform=batch_transform) == \
            evaluate(model, loader(whole), accelerator)
