"""FID benchmarks: the wall time of diffusion.fid, beside torch-fidelity, and what bf16 sampling does to the FID.

Default: diffusion.fid with every DiT-table metric on, on CPU-generated images (no model, no download).

    python -m benchmarks.fid --out /tmp/bench_fid --count 10000 --threads 1

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

    python -m benchmarks.fid --out /tmp/bench_fid_tf --vs-torch-fidelity --count 1000 --rounds 3

``--bf16-checkpoint`` compares instead fp32 and bf16 sampling of a pixel-space (Fashion-MNIST) DiT on the same
noise, seed by seed: for each seed, the samples of ``diffusion.sample --seed S`` in both precisions
(``--precision``) are scored against the Fashion-MNIST test split in ``fmnist-cnn`` features. It prints one JSON
line per seed (both FIDs, their difference, the pixel differences, the seconds each took) and the summary: the
fp32 seed-to-seed standard deviation next to the mean and spread of the paired differences
(docs/sampling-and-fid.md):

    python -m benchmarks.fid --bf16-checkpoint runs/dit_long/runs/siamese_d8_lr0.001_s0/ema.safetensors \\
        --feature-weights ~/.cache/siamesenorm/fmnist_cnn.safetensors --samples 1000 --steps 50 --seeds 0 1 2 \\
        --batch-size 250
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import (add_common_args, alternate, apply_common_args, conditions, describe_conditions,
                                is_loaded, time_call)
from benchmarks.synthetic import smooth_images, write_png_folder
from common.durable import atomic_write_text


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


def fid_commands(samples: Path, reference: Path, weights: Path, batch_size: int, result: Path,
                 device: str = "cpu") -> dict:
    """The two commands a user runs for the FID of two folders on ``device`` (cpu or cuda): ours (its JSON result in
    ``result``) and torch-fidelity's ``fidelity`` CLI."""
    return {
        "diffusion.fid": [sys.executable, "-m", "diffusion.fid", "--samples", str(samples), "--reference",
                          str(reference), "--metrics", "fid", "--extractor-weights", str(weights), "--device", device,
                          "--num-workers", "0", "--batch-size", str(batch_size), "--quiet", "--out", str(result)],
        "torch-fidelity": [sys.executable, "-m", "torch_fidelity.fidelity", "--input1", str(samples), "--input2",
                           str(reference), "--fid", *(["--cpu"] if device == "cpu" else []), "--no-cache",
                           "--feature-extractor-weights-path", str(weights), "--batch-size", str(batch_size),
                           "--silent"],
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
    if args.adm_sqrtm:  # ADM's evaluator's matrix root (scipy sqrtm), diffusion.fid's --frechet-method sqrtm
        commands["diffusion.fid --frechet-method sqrtm"] = commands["diffusion.fid"] + ["--frechet-method", "sqrtm"]
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads,
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def run(name):
        done = subprocess.run(commands[name], env=env, capture_output=True, text=True, check=True)
        return (json.loads(result_file.read_text())["metrics"]["fid"] if name.startswith("diffusion.fid")
                else torch_fidelity_fid(done.stdout))

    def on_round(round_index, timed):
        for name in commands:
            print(json.dumps({"command": name, "round": round_index, "seconds": timed[name][-1].seconds,
                              "cpu_seconds": timed[name][-1].children_cpu_seconds, "fid": timed[name][-1].value,
                              "load": timed.loads[-1], "loaded": is_loaded(timed.loads[-1], args.max_load)}),
                  flush=True)

    timed = alternate({name: (lambda name=name: run(name)) for name in commands}, args.rounds, flip=True,
                      on_round=on_round)
    runs = {name: [{"round": r, "seconds": t.seconds, "cpu_seconds": t.children_cpu_seconds, "fid": t.value}
                   for r, t in enumerate(rows)] for name, rows in timed.items()}
    result = {"count": args.count, "threads": args.threads, "commands": {k: " ".join(v) for k, v in commands.items()},
              "runs": runs, **ratio_summary(runs), "conditions": conditions(timed, args.max_load, args.threads)}
    for name, ratio in result["torch_fidelity_over"].items():
        print(f"  {name}: median {result['median_s'][name]:.1f} s, torch-fidelity / it = {ratio:.2f}x")
    print(f"FID of {args.count} vs {args.count} PNGs, {args.threads} thread(s), {args.rounds} alternating rounds: "
          f"diffusion.fid {result['median_s']['diffusion.fid']:.1f} s, torch-fidelity "
          f"{result['median_s']['torch-fidelity']:.1f} s (medians); torch-fidelity / diffusion.fid = "
          f"{result['torch_fidelity_over_ours']:.2f}x; FID {runs['diffusion.fid'][0]['fid']:.6f} and "
          f"{runs['torch-fidelity'][0]['fid']:.6f}", flush=True)
    print(describe_conditions(result["conditions"]), flush=True)
    atomic_write_text(args.out / "vs_torch_fidelity.json", json.dumps(result, indent=2) + "\n")
    return result


def bf16_vs_fp32(args) -> dict:
    """FID of fp32 and bf16 samples of one pixel-space DiT on the same noise, seed by seed (``--bf16-checkpoint``)."""
    from diffusion.checkpoints import load_dit
    from diffusion.evaluation import Evaluator
    from diffusion.sampling.decoder import Decoder
    from diffusion.sampling.sample_sets import balanced_labels
    from diffusion.sampling.sampler import Sampler

    model, spec, _ = load_dit(args.bf16_checkpoint)
    evaluator = Evaluator("fashion-mnist:test", metrics=["fid"], feature_extractor="fmnist-cnn",
                          weights=args.feature_weights, device="cpu")
    rows = []
    for seed in args.seeds:
        images, row = {}, {"seed": seed}
        for precision in ("fp32", "bf16"):
            sampler = Sampler(model, spec, Decoder("none", "cpu"), spec.diffusion(sampling_steps=args.steps), seed=seed,
                              precision=precision)
            run = time_call(lambda: torch.cat([sampler(idx, balanced_labels(idx, spec.num_classes))
                                               for idx in torch.arange(args.samples).split(args.batch_size)]))
            images[precision], row[f"seconds_{precision}"], row[f"load_{precision}"] = run.value, run.seconds, run.load
            row[f"fid_{precision}"] = evaluator.score(evaluator.features(images[precision]))["fid"]
        pixels = (images["fp32"].int() - images["bf16"].int()).abs()
        row.update(difference=row["fid_bf16"] - row["fid_fp32"], mean_abs_pixel=float(pixels.float().mean()),
                   max_abs_pixel=int(pixels.max()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    spread = lambda xs: statistics.stdev(xs) if len(xs) > 1 else float("nan")  # noqa: E731
    summary = {"fp32_seed_std": spread([r["fid_fp32"] for r in rows]),
               "difference_mean": statistics.mean(r["difference"] for r in rows),
               "difference_std": spread([r["difference"] for r in rows]), "samples": args.samples, "steps": args.steps}
    print(json.dumps(summary))
    return {"seeds": rows, "summary": summary}


def all_metrics(args) -> dict:
    """The default mode: reference statistics of a raw folder, then every metric of an .npz against them."""
    from diffusion.evaluation import Evaluator
    from diffusion import fid

    args.out.mkdir(parents=True, exist_ok=True)
    timings = {"count": args.count, "threads": args.threads, "device": "cpu"}
    run = time_call(lambda: write_inputs(args.out, args.count))
    inputs, timings["write_inputs_s"] = run.value, run.seconds
    common = ["--extractor-weights", str(inputs["weights"]), "--device", "cpu", "--num-workers", "1",
              "--batch-size", str(args.batch_size)]

    run = time_call(lambda: fid.main(["--samples", str(inputs["raw"]), "--save-stats", str(args.out / "ref.npz"),
                                      "--center-crop", "64", *common], echo=False))
    stats, timings["save_stats_s"], timings["save_stats_load"] = run.value, run.seconds, run.load
    print(json.dumps({"phase": "save_stats", "seconds": timings["save_stats_s"], "cpu_seconds": run.cpu_seconds,
                      "load": run.load, "loaded": is_loaded(run.load, args.max_load)}), flush=True)

    phases = {}
    for name in ("features", "score"):
        method = getattr(Evaluator, name)

        def timed(self, *a, _method=method, _name=name, **k):
            call = time_call(lambda: _method(self, *a, **k))
            phases[_name] = phases.get(_name, 0.0) + call.seconds
            return call.value

        setattr(Evaluator, name, timed)
    run = time_call(lambda: fid.main(["--samples", str(inputs["samples"]), "--reference", str(args.out / "ref.npz"),
                                      "--out", str(args.out / "metrics.json"), *common], echo=False))
    result, timings["fid_all_metrics_s"], timings["fid_load"] = run.value, run.seconds, run.load
    timings["fid_loaded"] = is_loaded(run.load, args.max_load)
    timings["fid_feature_pass_s"] = phases.get("features")
    timings["fid_scoring_s"] = phases.get("score")
    timings["metrics"] = result["metrics"]
    timings["reference"] = {"count": stats["statistics"]["count"], "images": stats["images"]["count"]}
    print(json.dumps({"phase": "fid", **{k: v for k, v in timings.items() if k.startswith("fid")}}), flush=True)
    atomic_write_text(args.out / "timings.json", json.dumps(timings, indent=2) + "\n")
    return timings


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="where the inputs and results are written (required, "
                                                          "except with --bf16-checkpoint)")
    p.add_argument("--count", type=int, default=10000, help="images of each set")
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--vs-torch-fidelity", action="store_true",
                   help="time the whole FID command beside torch-fidelity's `fidelity` CLI on the same images")
    p.add_argument("--adm-sqrtm", action="store_true",
                   help="--vs-torch-fidelity: also time diffusion.fid --frechet-method sqrtm (ADM's matrix root)")
    p.add_argument("--bf16-checkpoint", default=None,
                   help="instead: the FID of fp32 and bf16 samples of this pixel-space (Fashion-MNIST) DiT's "
                        "ema.safetensors, seed by seed")
    p.add_argument("--feature-weights", default=None, help="--bf16-checkpoint: fmnist-cnn weights (default: its cache)")
    p.add_argument("--samples", type=int, default=1000, help="--bf16-checkpoint: samples per seed and precision")
    p.add_argument("--steps", type=int, default=50, help="--bf16-checkpoint: sampling steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="--bf16-checkpoint: sampling seeds")
    add_common_args(p, rounds=3, rounds_help="--vs-torch-fidelity: runs of each command, alternating", threads=1)
    args = p.parse_args(argv)
    if args.out is None and args.bf16_checkpoint is None:
        p.error("--out is required (a folder for the generated inputs and the results), except with --bf16-checkpoint")
    apply_common_args(args)
    if args.bf16_checkpoint:
        return bf16_vs_fp32(args)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.vs_torch_fidelity:
        return vs_torch_fidelity(args)
    return all_metrics(args)


if __name__ == "__main__":
    main()
