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

``--vs-torch-fidelity`` times instead the whole FID command beside torch-fidelity's own ``fidelity`` CLI on the same
two folders of ``count`` 64x64 PNGs and the same weights file, each in a fresh process with one thread
(``OMP_NUM_THREADS=1``), the two alternating run by run, and prints each run, both FIDs and the time ratio:

    python -m scripts.bench_fid --out /tmp/bench_fid_tf --vs-torch-fidelity --count 1000 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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


def write_png_folder(folder: Path, count: int, seed: int) -> Path:
    """``count`` 64x64 PNGs of smooth random colour fields (what both FID commands read)."""
    from PIL import Image

    if not folder.exists():
        folder.mkdir(parents=True)
        for i, image in enumerate(smooth_images(np.random.default_rng(seed), count, lambda i: (64, 64))):
            Image.fromarray(image).save(folder / f"{i:06d}.png")
    return folder


def fid_commands(samples: Path, reference: Path, weights: Path, batch_size: int, result: Path) -> dict:
    """The two commands a user runs for the FID of two folders: ours (its JSON result in ``result``) and
    torch-fidelity's ``fidelity`` CLI."""
    return {
        "diffusion.fid": [sys.executable, "-m", "diffusion.fid", "--samples", str(samples), "--reference",
                          str(reference), "--metrics", "fid", "--extractor-weights", str(weights), "--device", "cpu",
                          "--num-workers", "0", "--batch-size", str(batch_size), "--quiet", "--out", str(result)],
        "torch-fidelity": [sys.executable, "-m", "torch_fidelity.fidelity", "--input1", str(samples), "--input2",
                           str(reference), "--fid", "--cpu", "--no-cache", "--feature-extractor-weights-path",
                           str(weights), "--batch-size", str(batch_size), "--silent"],
    }


def torch_fidelity_fid(stdout: str) -> float:
    """The FID ``fidelity --fid`` prints: ``frechet_inception_distance: 12.34567``."""
    for line in stdout.splitlines():
        if line.startswith("frechet_inception_distance:"):
            return float(line.split(":")[1])
    raise ValueError(f"torch-fidelity printed no FID: {stdout!r}")


def ratio_summary(runs: dict) -> dict:
    """Median seconds per command and torch-fidelity's over ours (above 1: ours is faster)."""
    medians = {name: statistics.median(r["seconds"] for r in rows) for name, rows in runs.items()}
    return {"median_s": medians, "torch_fidelity_over_ours": medians["torch-fidelity"] / medians["diffusion.fid"],
            "torch_fidelity_over": {name: medians["torch-fidelity"] / m for name, m in medians.items()}}


def vs_torch_fidelity(args) -> dict:
    from diffusion.evaluation.features import INCEPTION_WEIGHTS_FILE, write_random_inception

    weights = args.out / INCEPTION_WEIGHTS_FILE
    if not weights.exists():
        write_random_inception(weights)
    samples = write_png_folder(args.out / "samples", args.count, seed=1)
    reference = write_png_folder(args.out / "reference", args.count, seed=2)
    result_file = args.out / "ours.json"
    commands = fid_commands(samples, reference, weights, args.batch_size, result_file)
    if args.adm_sqrtm:  # ADM's matrix root, what diffusion.fid computed before the eigenvalue trace
        commands["diffusion.fid --frechet-method sqrtm"] = commands["diffusion.fid"] + ["--frechet-method", "sqrtm"]
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads,
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = {name: [] for name in commands}
    for round_index in range(args.rounds):
        order = list(commands) if round_index % 2 == 0 else list(commands)[::-1]
        for name in order:
            start = time.perf_counter()
            done = subprocess.run(commands[name], env=env, capture_output=True, text=True, check=True)
            seconds = time.perf_counter() - start
            fid = (json.loads(result_file.read_text())["metrics"]["fid"] if name.startswith("diffusion.fid")
                   else torch_fidelity_fid(done.stdout))
            row = {"round": round_index, "seconds": seconds, "fid": fid}
            runs[name].append(row)
            print(json.dumps({"command": name, **row}), flush=True)
    result = {"count": args.count, "threads": args.threads, "commands": {k: " ".join(v) for k, v in commands.items()},
              "runs": runs, **ratio_summary(runs)}
    for name, ratio in result["torch_fidelity_over"].items():
        print(f"  {name}: median {result['median_s'][name]:.1f} s, torch-fidelity / it = {ratio:.2f}x")
    print(f"FID of {args.count} vs {args.count} PNGs, {args.threads} thread(s), {args.rounds} alternating rounds: "
          f"diffusion.fid {result['median_s']['diffusion.fid']:.1f} s, torch-fidelity "
          f"{result['median_s']['torch-fidelity']:.1f} s (medians); torch-fidelity / diffusion.fid = "
          f"{result['torch_fidelity_over_ours']:.2f}x; FID {runs['diffusion.fid'][0]['fid']:.6f} and "
          f"{runs['torch-fidelity'][0]['fid']:.6f}", flush=True)
    atomic_write_text(args.out / "vs_torch_fidelity.json", json.dumps(result, indent=2) + "\n")
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_fid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--count", type=int, default=10000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--vs-torch-fidelity", action="store_true",
                   help="time the whole FID command beside torch-fidelity's `fidelity` CLI on the same images")
    p.add_argument("--rounds", type=int, default=3, help="--vs-torch-fidelity: runs of each command, alternating")
    p.add_argument("--adm-sqrtm", action="store_true",
                   help="--vs-torch-fidelity: also time diffusion.fid --frechet-method sqrtm (ADM's matrix root)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.vs_torch_fidelity:
        args.out.mkdir(parents=True, exist_ok=True)
        return vs_torch_fidelity(args)

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
