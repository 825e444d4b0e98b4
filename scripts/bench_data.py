"""Data-feed benchmark: what one DataLoader worker delivers, today's path and the new one side by side.

* DeiT: images/s per worker for the recipe's training transform (``configs/deit_recipe.yaml``: random-resized
  crop, flip, RandAugment rand-m9-mstd0.5-inc1, random erasing), on JPEGs it writes first: ImageNet-like sizes
  (mostly 500x375 and 375x500, some up to 1024 px), 1/f "natural" content at quality 90 (about 0.6 bytes per
  pixel, like ImageNet's). ``old``: Pillow decode, Pillow crop, float32 normalise and random erasing in the worker,
  ``torch.manual_seed`` per sample. ``new``: torchvision.io decode, torch's uint8 crop kernel, uint8 images and
  erasing boxes out of the worker (normalise + erase run on the device: :class:`vision.augment.NormalizeErase`),
  generators seeded directly. Both include the worker's collate.
* DiT: examples/s per worker for the latent loader (latents written in ``diffusion.extract_latents``'s format):
  ``old`` reads both flipped views of the posterior moments and seeds with ``torch.manual_seed``; ``new`` reads
  only the view it draws and seeds the generators directly.

The two paths alternate round by round on the same samples (same seeds), one thread, so a busy machine slows
both alike; the ratio of the medians is the figure. ``--breakdown`` adds a per-stage table.

    python -m scripts.bench_data                                   # about 2 minutes on one core
    python -m scripts.bench_data --images 48 --rounds 2 --latents 256 --breakdown
"""
from __future__ import annotations

import argparse
import contextlib
import io
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate

from common.config import from_dict, read_yaml
from common.data import SeededDataset, sample_seed
from diffusion.latents import sample_latents
from torchvision.datasets.folder import pil_loader

from vision.data import DataConfig, build_dataset, load_rgb_tensor

from vision.augment import AugmentConfig, NormalizeErase, build_transform

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "deit_recipe.yaml"
# (width, height, weight): ImageNet's training set is dominated by 500-pixel-wide Flickr sizes
IMAGE_SIZES = ((500, 375, 6), (375, 500, 2), (500, 333, 3), (500, 500, 1), (333, 500, 1), (640, 480, 1),
               (800, 600, 1), (1024, 768, 1), (300, 225, 1))


# ----------------------------------------------------------------------------- today's path, restated
@contextlib.contextmanager
def legacy_seeded_rng(seed: int):
    """Per-sample seeding as it was: ``torch.manual_seed`` (visits every device backend) and the three global
    states saved and restored around every item."""
    py, npy, th = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(th)


class LegacySeededDataset(SeededDataset):
    def __getitem__(self, key):
        index, seed = key
        with legacy_seeded_rng(seed):
            return self.dataset[index]


# ----------------------------------------------------------------------------- inputs
def natural_image(width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 (H, W, 3) with a 1/f amplitude spectrum (the statistics of photographs), channels correlated."""
    fy, fx = np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :]
    amplitude = 1.0 / np.maximum(np.hypot(fx, fy), 1.0 / max(width, height))

    def field():
        phase = np.exp(2j * np.pi * rng.random((height, width // 2 + 1)))
        return np.fft.irfft2(amplitude * phase, s=(height, width))

    shared = field()
    x = np.stack([shared + 0.5 * field() for _ in range(3)], axis=-1)
    x = 128 + 50 * (x - x.mean()) / x.std() + rng.normal(0, 3, x.shape)
    return np.clip(x, 0, 255).astype(np.uint8)


def write_jpegs(root: Path, count: int, seed: int = 0, quality: int = 90, split: str = "train") -> float:
    """``count`` JPEGs in ``root/<split>/<class>/`` (two classes); returns the mean bytes per pixel."""
    rng = np.random.default_rng(seed)
    sizes = [(w, h) for w, h, weight in IMAGE_SIZES for _ in range(weight)]
    total_bytes = total_pixels = 0
    for i in range(count):
        w, h = sizes[i % len(sizes)]
        folder = root / split / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i:05d}.JPEG"
        Image.fromarray(natural_image(w, h, rng)).save(path, quality=quality)
        total_bytes += path.stat().st_size
        total_pixels += w * h
    return total_bytes / total_pixels


def write_latents(root: Path, count: int, shard_size: int, latent_shape=(4, 32, 32), seed: int = 0) -> None:
    """Posterior moments in ``diffusion.extract_latents``'s format (float16, two views per image)."""
    from diffusion.extract_latents import write_metadata
    from diffusion.latents import shard_name, shard_settings, write_shard

    gen = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    settings = shard_settings(vae="bench", scaling_factor=0.18215, image_size=8 * latent_shape[-1], shard_size=shard_size,
                              dtype="float16", num_listed=count, classes=[f"c{i}" for i in range(1000)])
    shards = range(0, count, shard_size)
    for k, start in enumerate(shards):
        n = min(shard_size, count - start)
        mean = torch.randn(n, 2, *latent_shape, generator=gen).half()
        logvar = (torch.randn(n, 2, *latent_shape, generator=gen) - 4).half()
        write_shard(root / shard_name(k), mean, logvar, torch.randint(0, 1000, (n,), generator=gen),
                    torch.arange(start, start + n), [], settings)
    write_metadata(root, len(shards), settings, latent_shape)


# ----------------------------------------------------------------------------- timing
def side_by_side(name: str, unit: str, paths: dict, size: int, rounds: int, batch_size: int) -> dict:
    """Time the paths batch by batch in alternation over the same keys (fetch every item, then collate: what a
    worker does per batch), inside a DataLoader worker process (one thread, the worker's seeding); print each
    round; return the median rates and the median of the per-round ratios."""
    task = _InWorker(lambda: _alternate(name, unit, paths, size, rounds, batch_size))
    return next(iter(torch.utils.data.DataLoader(task, batch_size=None, num_workers=1)))


class _InWorker(torch.utils.data.Dataset):
    """A one-item dataset whose item is ``fn()``: runs ``fn`` in a DataLoader worker process."""

    def __init__(self, fn):
        self.fn = fn

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return self.fn()


def _alternate(name, unit, paths, size, rounds, batch_size) -> dict:
    rates = {p: [] for p in paths}
    for r in range(rounds):
        keys = [(i % size, sample_seed(0, r, i)) for i in range(size // batch_size * batch_size)]
        seconds = dict.fromkeys(paths, 0.0)
        for i in range(0, len(keys), batch_size):
            for p, dataset in paths.items():
                start = time.perf_counter()
                default_collate([dataset[k] for k in keys[i: i + batch_size]])
                seconds[p] += time.perf_counter() - start
        for p in paths:
            rates[p].append(len(keys) / seconds[p])
        line = "  ".join(f"{p} {rates[p][-1]:7.1f}" for p in paths)
        print(f"  {name} round {r + 1}/{rounds}: {line} {unit}  (new/old {rates['new'][-1] / rates['old'][-1]:.2f}x)",
              flush=True)
    medians = {p: statistics.median(v) for p, v in rates.items()}
    ratio = statistics.median(n / o for n, o in zip(rates["new"], rates["old"]))
    return {**{f"{p}_per_s": m for p, m in medians.items()}, "ratio": ratio, "rounds": rates}


def time_call(fn, items, repeat: int = 3) -> float:
    """Best-of-``repeat`` milliseconds per item of ``fn(item)``."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, (time.perf_counter() - start) / len(items) * 1e3)
    return best


def breakdown(files, data: DataConfig, augment: AugmentConfig) -> dict:
    """Milliseconds per image of each stage, old vs new, on the same images and crop draws."""
    old = build_transform(data, augment, training=True).transforms
    new = build_transform(data, augment, training=True, use_prefetcher=True).transforms
    pils = [pil_loader(f) for f in files]
    loaded = [load_rgb_tensor(f) for f in files]
    crops = [old[0](p) for p in pils]
    augmented = [old[2](old[1](c)) for c in crops]
    as_uint8 = [new[4](new[3](a)) for a in augmented]
    rows = {
        "decode": (time_call(pil_loader, files), time_call(load_rgb_tensor, files)),
        "random-resized crop": (time_call(old[0], pils), time_call(new[0], loaded)),
        "flip + RandAugment": (time_call(lambda c: old[2](old[1](c)), crops),) * 2,
        "to tensor, normalise, erase": (time_call(lambda a: old[5](old[4](old[3](a))), augmented),
                                        time_call(lambda a: new[4](new[3](a)), augmented)),
        "per-sample seeding": (time_call(lambda s: legacy_seeded_rng(s).__enter__(), range(len(files))),
                               time_call(lambda s: _enter(s), range(len(files)))),
    }
    device = NormalizeErase(data, augment)
    batch = default_collate(as_uint8[:32] if len(as_uint8) >= 32 else as_uint8)
    device_ms = time_call(lambda _: device.images(*batch), [0]) / len(batch[0])
    print("  stage (ms per image)             old      new")
    for name, (o, n) in rows.items():
        print(f"  {name:30s} {o:7.3f}  {n:7.3f}")
    print(f"  device half (normalise + erase) run on this CPU: {device_ms:.3f} ms per image (on a GPU: a few "
          "kernels per batch)")
    print("  " + draft_report(files, old[0]))
    return {name: {"old_ms": o, "new_ms": n} for name, (o, n) in rows.items()}


def _enter(seed):
    from common.data import seeded_rng

    with seeded_rng(seed):
        pass


def draft_report(files, crop) -> str:
    """How often Pillow's JPEG draft mode (DCT-domain 1/2 .. 1/8 downscale) could be used without decoding a
    crop smaller than the output, and what decoding at 1/2 saves."""
    random.seed(0)
    allowed = draws = 0
    for f in files:
        with Image.open(f) as image:
            for _ in range(20):
                top, left, h, w = crop.get_params(image, crop.scale, crop.ratio)
                allowed += min(h / crop.size[0], w / crop.size[1]) >= 2
                draws += 1
    raw = [Path(f).read_bytes() for f in files]

    def decode(data, scale=1):
        image = Image.open(io.BytesIO(data))
        if scale > 1:
            image.draft("RGB", (image.size[0] // scale, image.size[1] // scale))
        return image.convert("RGB")

    full, half = time_call(decode, raw), time_call(lambda d: decode(d, 2), raw)
    return (f"JPEG draft mode: a >=2x DCT downscale fits {allowed / draws:.1%} of the recipe's crops on these sizes; "
            f"decoding at 1/2 takes {half / full:.0%} of the full decode")


# ----------------------------------------------------------------------------- main
def recipe_configs(root: Path, input_size: int):
    raw = read_yaml(RECIPE)
    data = from_dict(DataConfig, {**raw["data"], "path": str(root), "num_classes": 2, "input_size": input_size})
    return data, from_dict(AugmentConfig, raw["augment"])


def latent_paths(root: Path) -> dict:
    from diffusion.data import DiffusionExamples, LatentImages

    class TwoViews(LatentImages):
        def __getitem__(self, i):  # the loader as it was: read both views, keep one
            mean, logvar, label = self.moments[i]
            flip = torch.rand(1) < 0.5 if self.hflip else torch.zeros(1, dtype=torch.bool)
            noise = torch.randn(mean.shape[1:])
            return sample_latents(mean[None], logvar[None], flip, noise[None], self.moments.scaling_factor)[0], label

    return {"old": LegacySeededDataset(DiffusionExamples(TwoViews(str(root)), 1000, 0.1)),
            "new": SeededDataset(DiffusionExamples(LatentImages(str(root)), 1000, 0.1))}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=128, help="JPEGs to write and cycle through per round")
    parser.add_argument("--input-size", type=int, default=224)
    parser.add_argument("--latents", type=int, default=4096, help="latent moments to write (0: skip DiT)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds per path")
    parser.add_argument("--batch-size", type=int, default=32, help="items a worker collates at a time")
    parser.add_argument("--breakdown", action="store_true", help="also time each stage of the DeiT transform")
    parser.add_argument("--workdir", default=None, help="where to write the inputs (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.images < args.batch_size:
        parser.error(f"--images {args.images} must be at least --batch-size {args.batch_size}")
    torch.set_num_threads(1)  # what a DataLoader worker gets

    results = {}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        print(f"writing {args.images} JPEGs ...", flush=True)
        bytes_per_pixel = write_jpegs(root / "images", args.images)
        data, augment = recipe_configs(root / "images", args.input_size)
        old = LegacySeededDataset(build_dataset(data, "train", build_transform(data, augment, training=True),
                                                loader=pil_loader))
        new = SeededDataset(build_dataset(data, "train", build_transform(data, augment, True, use_prefetcher=True),
                                          loader=load_rgb_tensor))
        print(f"DeiT recipe transform, {args.input_size} px, {bytes_per_pixel:.2f} JPEG bytes/pixel, one thread:",
              flush=True)
        results["deit"] = side_by_side("deit", "images/s", {"old": old, "new": new}, args.images, args.rounds,
                                       args.batch_size)
        if args.breakdown:
            files = [path for path, _ in old.dataset.samples]
            results["deit"]["breakdown"] = breakdown(files, data, augment)
        if args.latents:
            print(f"writing {args.latents} latents (4x32x32, float16, both views) ...", flush=True)
            write_latents(root / "latents", args.latents, shard_size=1024)
            print("DiT latent loader (DiffusionExamples over LatentImages), one thread:", flush=True)
            results["dit"] = side_by_side("dit", "examples/s", latent_paths(root / "latents"), args.latents,
                                          args.rounds, args.batch_size)

    print("\nper worker (median over rounds)        old        new    new/old")
    for name, unit in (("deit", "images/s"), ("dit", "examples/s")):
        if name in results:
            r = results[name]
            print(f"  {name:5s} {unit:12s}         {r['old_per_s']:9.1f}  {r['new_per_s']:9.1f}  {r['ratio']:7.2f}x")
    return results


if __name__ == "__main__":
    main()
