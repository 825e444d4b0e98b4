"""Data-feed benchmark: what one DataLoader worker delivers, for DeiT beside timm's plain pipeline, and for DiT.

* DeiT: images/s per worker for the recipe's training transform (``configs/deit_recipe.yaml``: random-resized
  crop, flip, RandAugment rand-m9-mstd0.5-inc1, random erasing), on JPEGs it writes first: ImageNet-like sizes
  (mostly 500x375 and 375x500, some up to 1024 px), 1/f "natural" content at quality 90 (about 0.6 bytes per
  pixel, like ImageNet's). ``timm``: timm's plain pipeline (Pillow decode and crop, float32 normalise and random
  erasing in the worker). ``ours``: what ``vision.train`` runs (torchvision.io decode, torch's uint8 crop kernel,
  uint8 images and erasing boxes out of the worker; normalise + erase run on the device:
  :class:`vision.augment.NormalizeErase`). Both are seeded per sample as training seeds them and include their
  loader's collate (torch's ``default_collate``; ours :func:`common.data.collate`); the two alternate batch by
  batch on the same samples, one thread, so a busy machine slows both alike; the figure is the median over rounds
  of the per-round ratio.
* Formats: ours on the same JPEGs read from the folder, from WebDataset tars and from a Hugging Face dataset (both
  written by ``python -m vision.shard``), alternating batch by batch on the same samples, one thread; ratios to the
  folder. The files are in the page cache (just written): this is each reader's CPU cost per image, not a file
  system's.
* DiT: examples/s per worker for the latent loader (latents written in ``diffusion.extract_latents``'s format).

``--breakdown`` adds a per-stage table (ms per image, timm's pipeline and ours) and what Pillow's JPEG draft mode
could save.

    python -m benchmarks.data_feed                                   # about 4 minutes on one core
    python -m benchmarks.data_feed --images 48 --rounds 2 --latents 256 --breakdown
    python -m benchmarks.data_feed --latents 0 --skip-timm --cpu-time    # the formats alone, by CPU time
"""
from __future__ import annotations

import argparse
import io
import random
import statistics
import tempfile
from pathlib import Path
from typing import Callable, Dict, Sequence, Tuple

import torch
from PIL import Image
from torch.utils.data import default_collate

from benchmarks.harness import (add_common_args, alternate, apply_common_args, conditions, default_max_load,
                                describe_conditions, load_note)
from benchmarks.synthetic import write_jpegs, write_latents
from common.image_sets import FORMATS

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "deit_recipe.yaml"


def side_by_side(name: str, unit: str, paths: dict, size: int, rounds: int, batch_size: int,
                 cpu_time: bool = False, max_load: float | None = None) -> dict:
    """Time the paths (name -> (dataset, collate function)) batch by batch in alternation over the same keys
    (fetch every item, then collate: what a worker does per batch), inside a DataLoader worker process (one
    thread, the worker's seeding); print each round; return the median rates and the medians of the per-round
    ratios of each path to the first. ``cpu_time``: rates per second of the worker's CPU time, not of the wall clock
    (a busy machine's waits left out). Each round's load is printed, LOADED above ``max_load`` (default: the core
    count), and the conditions returned."""
    max_load = default_max_load() if max_load is None else max_load
    task = _InWorker(lambda: _alternate(name, unit, paths, size, rounds, batch_size, cpu_time, max_load))
    return next(iter(torch.utils.data.DataLoader(task, batch_size=None, num_workers=1)))


class _InWorker(torch.utils.data.Dataset):
    """A one-item dataset whose item is ``fn()``: runs ``fn`` in a DataLoader worker process."""

    def __init__(self, fn):
        self.fn = fn

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return self.fn()


def _alternate(name, unit, paths, size, rounds, batch_size, cpu_time, max_load) -> dict:
    from common.data import sample_seed

    per_round = size // batch_size
    at = {"batch": 0}  # the harness's round is one batch; a reported round is ``per_round`` batches

    def keys():
        r, i = divmod(at["batch"], per_round)
        return [(j % size, sample_seed(0, r, j)) for j in range(i * batch_size, (i + 1) * batch_size)]

    rates = {p: [] for p in paths}
    names = list(paths)

    def on_round(batch_index, runs):
        at["batch"] = batch_index + 1
        if at["batch"] % per_round:
            return
        for p in paths:
            spent = sum(run.cpu_seconds if cpu_time else run.seconds for run in runs[p][-per_round:])
            rates[p].append(per_round * batch_size / spent)
        line = "  ".join(f"{p} {rates[p][-1]:7.1f}" for p in paths)
        ratios = ", ".join(f"{p}/{names[0]} {rates[p][-1] / rates[names[0]][-1]:.2f}x" for p in names[1:])
        load = (runs.loads[-per_round][0], runs.loads[-1][1])
        print(f"  {name} round {len(rates[names[0]])}/{rounds}: {line} {unit}" + (f"  ({ratios})" if ratios else "")
              + f"; {load_note(load, max_load)}", flush=True)

    runs = alternate({p: (lambda d=dataset, c=collate: c([d[k] for k in keys()]))
                      for p, (dataset, collate) in paths.items()}, rounds * per_round, on_round=on_round)
    out = {**{f"{p}_per_s": statistics.median(v) for p, v in rates.items()}, "rounds": rates,
           "conditions": conditions(runs, max_load, threads=1)}
    out["ratios"] = {p: statistics.median(b / a for a, b in zip(rates[names[0]], rates[p])) for p in names[1:]}
    if len(names) > 1:
        out["ratio"] = out["ratios"][names[1]]
    return out


def best_ms(variants: Dict[str, Tuple[Callable[[object], object], Sequence]], repeat: int = 3) -> Dict[str, float]:
    """Best-of-``repeat`` milliseconds per item of each variant ``(fn, items)``, the variants alternating."""
    runs = alternate({k: (lambda fn=fn, items=items: [fn(item) for item in items])
                      for k, (fn, items) in variants.items()}, repeat)
    return {k: 1e3 * min(r.seconds for r in rs) / len(variants[k][1]) for k, rs in runs.items()}


def breakdown(files, data, augment) -> dict:
    """Milliseconds per image of each stage, timm's plain pipeline and ours, on the same images and crop draws."""
    from common.data import seeded_rng
    from torchvision.datasets.folder import pil_loader

    from vision.augment import NormalizeErase, build_transform
    from vision.data import load_rgb_tensor

    timm = build_transform(data, augment, training=True).transforms
    ours = build_transform(data, augment, training=True, use_prefetcher=True).transforms
    pils = [pil_loader(f) for f in files]
    loaded = [load_rgb_tensor(f) for f in files]
    crops = [timm[0](p) for p in pils]
    augmented = [timm[2](timm[1](c)) for c in crops]
    as_uint8 = [ours[4](ours[3](a)) for a in augmented]

    def seed(s):
        with seeded_rng(s):
            pass

    def pair(timm_fn, timm_items, ours_fn, ours_items):
        ms = best_ms({"timm": (timm_fn, timm_items), "ours": (ours_fn, ours_items)})
        return ms["timm"], ms["ours"]

    augment_ms = best_ms({"both": (lambda c: timm[2](timm[1](c)), crops)})["both"]
    seed_ms = best_ms({"both": (seed, range(len(files)))})["both"]
    rows = {
        "decode": pair(pil_loader, files, load_rgb_tensor, files),
        "random-resized crop": pair(timm[0], pils, ours[0], loaded),
        "flip + RandAugment": (augment_ms, augment_ms),
        "to tensor, normalise, erase": pair(lambda a: timm[5](timm[4](timm[3](a))), augmented,
                                            lambda a: ours[4](ours[3](a)), augmented),
        "per-sample seeding": (seed_ms, seed_ms),
    }
    device = NormalizeErase(data, augment)
    batch = default_collate(as_uint8[:32] if len(as_uint8) >= 32 else as_uint8)
    device_ms = best_ms({"device": (lambda _: device.images(*batch), [0])})["device"] / len(batch[0])
    print("  stage (ms per image)            timm     ours")
    for name, (t, o) in rows.items():
        print(f"  {name:30s} {t:7.3f}  {o:7.3f}")
    print(f"  device half (normalise + erase) run on this CPU: {device_ms:.3f} ms per image (on a GPU: a few "
          "kernels per batch)")
    print("  " + draft_report(files, timm[0]))
    return {name: {"timm_ms": t, "ours_ms": o} for name, (t, o) in rows.items()}


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

    ms = best_ms({"full": (decode, raw), "half": (lambda d: decode(d, 2), raw)})
    return (f"JPEG draft mode: a >=2x DCT downscale fits {allowed / draws:.1%} of the recipe's crops on these sizes; "
            f"decoding at 1/2 takes {ms['half'] / ms['full']:.0%} of the full decode")


def read_costs(image_sets: dict) -> Dict[str, float]:
    """Microseconds to have one image's encoded bytes in hand, by format (best of 3 passes over the set): a file's
    open, read and close; a ``pread`` at its offset in a tar; a row of an Arrow table."""
    def encoded(images, i):
        data = images.read(i)
        return Path(data).read_bytes() if isinstance(data, str) else data

    ms = best_ms({fmt: (lambda i, images=images: encoded(images, i), range(len(images)))
                  for fmt, images in image_sets.items()})
    print("  read the encoded bytes (us per image): " + "  ".join(f"{fmt} {1e3 * v:.1f}" for fmt, v in ms.items()))
    return {fmt: 1e3 * v for fmt, v in ms.items()}


def recipe_configs(root: Path, input_size: int, data_format: str = "imagefolder"):
    from common.config import from_dict, read_yaml
    from vision.augment import AugmentConfig
    from vision.data import DataConfig

    raw = read_yaml(RECIPE)
    data = from_dict(DataConfig, {**raw["data"], "path": str(root), "num_classes": 2, "input_size": input_size,
                                  "format": data_format})
    return data, from_dict(AugmentConfig, raw["augment"])


def format_feeds(root: Path, formats: Sequence[str], input_size: int, shard_size: int) -> dict:
    """``{format: (seeded recipe dataset, collate)}``: the JPEGs of ``root/images/train`` converted into each format
    by ``python -m vision.shard``, read as ``vision.train`` reads them (the image set is ``dataset.dataset.images``)."""
    from common.data import SeededDataset, collate
    from vision import shard
    from vision.augment import build_transform
    from vision.data import build_dataset, load_rgb_tensor

    feeds = {}
    for fmt in formats:
        where = root / "images"
        if fmt != "imagefolder":
            where = root / fmt
            shard.main(["--data-path", str(root / "images" / "train"), "--out", str(where / "train"), "--format", fmt,
                        "--shard-size", str(shard_size)])
        data, augment = recipe_configs(where, input_size, fmt)
        transform = build_transform(data, augment, True, use_prefetcher=True)
        feeds[fmt] = (SeededDataset(build_dataset(data, "train", transform, loader=load_rgb_tensor)), collate)
    return feeds


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_feed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=128, help="JPEGs to write and cycle through per round")
    parser.add_argument("--input-size", type=int, default=224)
    parser.add_argument("--latents", type=int, default=4096, help="latent moments to write (0: skip DiT)")
    parser.add_argument("--batch-size", type=int, default=32, help="items a worker collates at a time")
    parser.add_argument("--breakdown", action="store_true", help="also time each stage of the DeiT transform")
    parser.add_argument("--formats", nargs="*", choices=FORMATS, default=list(FORMATS),
                        help="ours reading the JPEGs from each of these stores (the first is the baseline; none: skip)")
    parser.add_argument("--shard-size", type=int, default=32, help="images per tar / Arrow part for --formats")
    parser.add_argument("--skip-timm", action="store_true", help="leave out timm's pipeline beside ours")
    parser.add_argument("--cpu-time", action="store_true", help="--formats: images per second of the worker's CPU "
                        "time (for a busy machine) instead of the wall clock")
    parser.add_argument("--workdir", default=None, help="where to write the inputs (default: a temporary folder)")
    add_common_args(parser, rounds=5, rounds_help="alternating timing rounds per path", threads=1)
    args = parser.parse_args(argv)
    if args.images < args.batch_size:
        parser.error(f"--images {args.images} must be at least --batch-size {args.batch_size}")
    if args.breakdown and args.skip_timm:
        parser.error("--breakdown times timm's stages beside ours: leave out --skip-timm")
    apply_common_args(args)  # one thread: what a DataLoader worker gets

    from common.data import SeededDataset, collate
    from diffusion.data import DiffusionExamples, LatentImages
    from torchvision.datasets.folder import pil_loader

    from vision.augment import build_transform
    from vision.data import build_dataset, load_rgb_tensor

    results = {}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        print(f"writing {args.images} JPEGs ...", flush=True)
        bytes_per_pixel = write_jpegs(root / "images", args.images)
        data, augment = recipe_configs(root / "images", args.input_size)
        print(f"DeiT recipe transform, {args.input_size} px, {bytes_per_pixel:.2f} JPEG bytes/pixel, one thread:",
              flush=True)
        if not args.skip_timm:
            timm = SeededDataset(build_dataset(data, "train", build_transform(data, augment, training=True),
                                               loader=pil_loader))
            ours = SeededDataset(build_dataset(data, "train", build_transform(data, augment, True,
                                                                              use_prefetcher=True),
                                               loader=load_rgb_tensor))
            results["deit"] = side_by_side("deit", "images/s", {"timm": (timm, default_collate),
                                                                "ours": (ours, collate)},
                                           args.images, args.rounds, args.batch_size, max_load=args.max_load)
            if args.breakdown:
                files = [path for path, _ in ours.dataset.samples]
                results["deit"]["breakdown"] = breakdown(files, data, augment)
        if args.formats:
            feeds = format_feeds(root, args.formats, args.input_size, args.shard_size)
            print(f"ours from {', '.join(args.formats)} (tars and parts of {args.shard_size} images):", flush=True)
            results["formats"] = side_by_side("formats", "images/s" + " of CPU time" * args.cpu_time, feeds,
                                              args.images, args.rounds, args.batch_size, args.cpu_time, args.max_load)
            results["formats"]["read_us"] = read_costs({fmt: feed.dataset.images for fmt, (feed, _) in feeds.items()})
        if args.latents:
            print(f"writing {args.latents} latents (4x32x32, float16, both views) ...", flush=True)
            write_latents(root / "latents", args.latents, shard_size=1024)
            print("DiT latent loader (DiffusionExamples over LatentImages), one thread:", flush=True)
            loader = SeededDataset(DiffusionExamples(LatentImages(str(root / "latents")), 1000, 0.1))
            results["dit"] = side_by_side("dit", "examples/s", {"ours": (loader, collate)}, args.latents, args.rounds,
                                          args.batch_size, max_load=args.max_load)

    if "deit" in results or "dit" in results:
        print("\nper worker (median over rounds)       timm       ours   ours/timm")
    for name, unit in (("deit", "images/s"), ("dit", "examples/s")):
        if name in results:
            r = results[name]
            timm_rate = f"{r['timm_per_s']:9.1f}" if "timm_per_s" in r else f"{'-':>9}"
            ratio = f"{r['ratio']:7.2f}x" if "ratio" in r else ""
            print(f"  {name:5s} {unit:12s}        {timm_rate}  {r['ours_per_s']:9.1f}  {ratio}")
    if "formats" in results:
        r, first = results["formats"], args.formats[0]
        print(f"\nours per worker by format (median)   images/{'CPU-s' if args.cpu_time else 's':6s}/{first}")
        for fmt in args.formats:
            ratio = f"{r['ratios'][fmt]:9.2f}x" if fmt in r["ratios"] else ""
            print(f"  {fmt:35s} {r[f'{fmt}_per_s']:9.1f}  {ratio}  (reading the bytes: {r['read_us'][fmt]:.1f} us)")
    for name in ("deit", "formats", "dit"):
        if name in results:
            print(f"{name} {describe_conditions(results[name]['conditions'])}")
    return results


if __name__ == "__main__":
    main()
