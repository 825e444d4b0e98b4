"""What bf16 sampling does to the FID of a pixel-space DiT: fp32 and bf16 on the same noise, seed by seed.

    python -m scripts.bench_bf16_fid --checkpoint runs/dit_long/runs/siamese_d8_lr0.001_s0/ema.safetensors \\
        --feature-weights ~/.cache/siamesenorm/fmnist_cnn.safetensors --samples 1000 --steps 50 --seeds 0 1 2

For each seed, the samples of ``diffusion.sample --seed S`` in both precisions (``--precision``) are scored against
the Fashion-MNIST test split in ``fmnist-cnn`` features. Prints one JSON line per seed (both FIDs, their difference,
the pixel differences, the seconds each took) and the summary: the fp32 seed-to-seed standard deviation next to
the mean and spread of the paired differences. The figures in docs/sampling-and-fid.md come from this.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from diffusion.evaluation import Evaluator
from diffusion.checkpoints import load_dit
from diffusion.sampling import Decoder, Sampler, balanced_labels


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_bf16_fid", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a pixel-space (Fashion-MNIST) DiT's ema.safetensors")
    p.add_argument("--feature-weights", default=None, help="fmnist-cnn weights (default: its cache)")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, spec, _ = load_dit(args.checkpoint)
    evaluator = Evaluator("fashion-mnist:test", metrics=["fid"], feature_extractor="fmnist-cnn",
                          weights=args.feature_weights, device="cpu")
    rows = []
    for seed in args.seeds:
        images, row = {}, {"seed": seed}
        for precision in ("fp32", "bf16"):
            sampler = Sampler(model, spec, Decoder("none", "cpu"), spec.diffusion(sampling_steps=args.steps), seed=seed,
                              precision=precision)
            start = time.perf_counter()
            images[precision] = torch.cat([sampler(idx, balanced_labels(idx, spec.num_classes))
                                           for idx in torch.arange(args.samples).split(args.batch_size)])
            row[f"seconds_{precision}"] = time.perf_counter() - start
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


if __name__ == "__main__":
    main()
