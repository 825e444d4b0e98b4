"""Wall time of diffusion.fid with every DiT-table metric on, on CPU-generated images (no model, no download).

    python -m scripts.bench_fid --out /tmp/bench_fid --count 10000 --threads 1

Writes, under --out: an Inception-v3 weights file with random weights (torch-fidelity's architecture and key
names), a raw ImageNet-layout folder of ``count`` JPEGs of mixed sizes (smooth random colour fields), and
``count`` 64x64 samples as an ADM .npz. Then times, as a user runs them:

1. ``diffusion.fid --samples RAW --save-stats ref.npz --center-crop 64`` (reference statistics of a raw folder);
2. ``diffusion.fid --samples samples.npz --reference ref.npz`` (FID, sFID, IS, Precision, Recall in one pass),
   split into the feature pass and the scoring.

Prints one JSON line per phase and writes ``timings.json``. Random weights make the numbers meaningless as
quality measures; the work done (forwards, matrix roots, k-NN) is that of the real network.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from common.durable import atomic_write_text


def smooth_images(rng, count: int, sizes, grid: int = 6):
    """Smooth random RGB fields: bilinear upsampling of a small random grid, one size per image."""
    for i in range(count):
        h, w = sizes(i)
        coarse = torch.from_numpy(rng.uniform(0, 255, (1, 3, grid, grid)).astype(np.float32))
        image = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[0]
        yield image.permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


def write_inputs(out: Path, count: int, seed: int = 0) -> dict:
    from PIL import Image

    from diffusion.evaluation.features import INCEPTION_WEIGHTS_FILE, write_random_inception

    weights = out / INCEPTION_WEIGHTS_FILE
    if not weights.exists():
        write_random_inception(weights, seed)
    raw = out / "raw"
    if not raw.exists():
        rng = np.random.default_rng(seed)
        shapes = rng.integers(48, 160, (count, 2))
        for i, image in enumerate(smooth_images(rng, count, lambda i: tuple(shapes[i]))):
            folder = raw / f"n{i % 10:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"img_{i:06d}.JPEG", quality=90)
    samples = out / "samples.npz"
    if not samples.exists():
        rng = np.random.default_rng(seed + 1)
        np.savez(samples, arr_0=np.stack(list(smooth_images(rng, count, lambda i: (64, 64)))))
    return {"weights": weights, "raw": raw, "samples": samples}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_fid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--count", type=int, default=10000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=50)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from diffusion.evaluation import Evaluator
    from diffusion import fid

    args.out.mkdir(parents=True, exist_ok=True)
    timings = {"count": args.count, "threads": args.threads, "device": "cpu"}
    start = time.perf_counter()
    inputs = write_inputs(args.out, args.count)
    timings["write_inputs_s"] = time.perf_counter() - start
    common = ["--extractor-weights", str(inputs["weights"]), "--device", "cpu", "--num-workers", "1",
              "--batch-size", str(args.batch_size)]

    start = time.perf_counter()
    stats = fid.main(["--samples", str(inputs["raw"]), "--save-stats", str(args.out / "ref.npz"), "--center-crop", "64",
                      *common], echo=False)
    timings["save_stats_s"] = time.perf_counter() - start
    print(json.dumps({"phase": "save_stats", "seconds": timings["save_stats_s"]}), flush=True)

    phases = {}
    for name in ("features", "score"):
        method = getattr(Evaluator, name)

        def timed(self, *a, _method=method, _name=name, **k):
            t = time.perf_counter()
            try:
                return _method(self, *a, **k)
            finally:
                phases[_name] = phases.get(_name, 0.0) + time.perf_counter() - t

        setattr(Evaluator, name, timed)
    start = time.perf_counter()
    result = fid.main(["--samples", str(inputs["samples"]), "--reference", str(args.out / "ref.npz"),
                       "--out", str(args.out / "metrics.json"), *common], echo=False)
    timings["fid_all_metrics_s"] = time.perf_counter() - start
    timings["fid_feature_pass_s"] = phases.get("features")
    timings["fid_scoring_s"] = phases.get("score")
    timings["metrics"] = result["metrics"]
    timings["reference"] = {"count": stats["statistics"]["count"], "images": stats["images"]["count"]}
    print(json.dumps({"phase": "fid", **{k: v for k, v in timings.items() if k.startswith("fid")}}), flush=True)
    atomic_write_text(args.out / "timings.json", json.dumps(timings, indent=2) + "\n")
    return timings


if __name__ == "__main__":
    main()
