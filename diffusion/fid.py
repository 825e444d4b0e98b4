"""FID, sFID, Inception Score, Precision and Recall of generated samples (the DiT tables' metric set, as ADM's
evaluator computes them), from one feature pass, with the protocol recorded next to the numbers.

The DiT paper's numbers (50,000 samples against ADM's ImageNet-256 reference batch, torch-fidelity's
TF-compatible Inception):

    python -m diffusion.fid --samples samples/dit_b2.npz --reference VIRTUAL_imagenet256_labeled.npz \\
        --num-samples 50000 --out samples/dit_b2_metrics.json

Reference statistics of a raw image folder (any sizes, e.g. ImageNet's train folder), with ADM's center crop;
streamed and resumable (rerun the same command after an interruption), written in ADM's reference-batch layout:

    python -m diffusion.fid --samples /data/imagenet/train --save-stats stats/in256.npz --center-crop 256

Fashion-MNIST (CPU world), with the project's small classifier as feature extractor (train it once with
``python -m scripts.train_fmnist_classifier``):

    python -m diffusion.fid --samples samples/fmnist/ --reference fashion-mnist:test --feature-extractor fmnist-cnn

Samples: a folder of PNG/JPEG files, an ADM-format .npz (arr_0: uint8 [N, H, W, 3]) or fashion-mnist:train/test.
Reference: any of those, or a statistics .npz (ADM's reference batches: mu, sigma, mu_s, sigma_s, arr_0; or
--save-stats output). Metrics (--metrics): fid, sfid, is, pr (precision and recall), kid; by default the DiT
tables' fid,sfid,is,pr, minus what the extractor or the reference cannot give (a warning says which and why).
Inception weights: --extractor-weights PATH, else torch-fidelity's cache (nothing is downloaded; a missing file
is an error that says which file to put where). Results: JSON on stdout (and --out), metrics plus protocol.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common.cli import ArgumentParser, one_line_errors
from common.data import resolve_num_workers
from common.distributed import use_fast_cuda_kernels
from common.durable import atomic_write_text

# diffusion.evaluation (torch-fidelity, torchvision) is imported by run(): --help and a refused command line come
# back without it. The defaults it owns (extractor, metric names, ADM's sizes) are filled in there.


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m diffusion.fid", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", required=True,
                   help="generated images: folder of PNG/JPEG, .npz with arr_0 (uint8 NHWC), or fashion-mnist:SPLIT")
    p.add_argument("--reference", default=None,
                   help="reference: statistics .npz (ADM's reference batch or --save-stats output), image folder, "
                        ".npz images, or fashion-mnist:SPLIT")
    p.add_argument("--out", type=Path, default=None, help="also write the results JSON to this file")
    p.add_argument("--num-samples", type=int, default=None,
                   help="expected number of sample images (e.g. 50000); a different count is an error")
    m = p.add_argument_group("metrics")
    m.add_argument("--metrics", default=None,
                   help="comma-separated, from fid,sfid,is,pr,kid (default: fid,sfid,is,pr as far as the extractor "
                        "and the reference allow)")
    m.add_argument("--frechet-method", choices=("eigh", "sqrtm"), default="eigh",
                   help="the matrix-root trace of FID/sFID: eigh (default: from symmetric eigenvalues, float64, "
                        "seconds) or sqrtm (ADM's evaluator's scipy.linalg.sqrtm of the non-symmetric product: "
                        "slower); they agree to 1e-6")
    m.add_argument("--is-split-size", type=int, default=None,
                   help="Inception Score over consecutive splits of this many samples (default: ADM's 5000)")
    m.add_argument("--pr-batch-size", type=int, default=5000,
                   help="rows/columns per distance block of precision/recall (memory only; results do not change)")
    m.add_argument("--kid-subsets", type=int, default=100)
    m.add_argument("--kid-subset-size", type=int, default=1000)
    m.add_argument("--seed", type=int, default=2020, help="seed of the KID subsets (torch-fidelity's)")
    s = p.add_argument_group("reference statistics (--save-stats)")
    s.add_argument("--save-stats", type=Path, default=None, metavar="PATH.npz",
                   help="only compute the reference statistics of --samples and save them (reusable as --reference)")
    s.add_argument("--center-crop", type=int, default=None, metavar="SIZE",
                   help="read a raw image folder (any sizes) with ADM's center crop to SIZE x SIZE")
    s.add_argument("--reference-images", type=int, default=None,
                   help="images kept in the file (arr_0, drawn at random) for precision/recall; 0: none (default: "
                        "ADM's 10000)")
    s.add_argument("--shard-size", type=int, default=10000,
                   help="images between two saved progress points (the unit of resume)")
    g = p.add_argument_group("features")
    g.add_argument("--feature-extractor", default=None,
                   help="torch-fidelity feature extractor: inception-v3-compat (default, ADM-compatible) or fmnist-cnn")
    g.add_argument("--extractor-weights", "--inception-weights", dest="weights", default=None, metavar="PATH",
                   help="weights file of the feature extractor (default: torch-fidelity's cache for Inception, "
                        "~/.cache/siamesenorm/fmnist_cnn.safetensors for fmnist-cnn)")
    g.add_argument("--feature-layer", default=None,
                   help="pool feature layer for FID/precision/recall/KID (default: the extractor's; Inception: 2048)")
    r = p.add_argument_group("runtime")
    r.add_argument("--batch-size", type=int, default=50)
    r.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    r.add_argument("--num-workers", default="auto", help="image decoding workers for folders (auto: from the CPU count)")
    r.add_argument("--quiet", action="store_true", help="no progress bar; one summary line instead of the JSON result "
                   "(the whole result still goes to --out)")
    return p.parse_args(argv)


def run(args) -> dict:
    from diffusion.evaluation.evaluator import compute_metrics
    from diffusion.evaluation.features import INCEPTION
    from diffusion.evaluation.images import open_images
    from diffusion.evaluation.metrics import ADM_IS_SPLIT_SIZE, MetricsError
    from diffusion.evaluation.reference import ADM_REFERENCE_IMAGES, build_reference_statistics

    args.feature_extractor = args.feature_extractor or INCEPTION
    args.is_split_size = ADM_IS_SPLIT_SIZE if args.is_split_size is None else args.is_split_size
    args.reference_images = ADM_REFERENCE_IMAGES if args.reference_images is None else args.reference_images
    common = dict(feature_extractor=args.feature_extractor, weights=args.weights, feature_layer=args.feature_layer,
                  batch_size=args.batch_size, device=args.device, num_workers=resolve_num_workers(args.num_workers), progress=not args.quiet)
    if args.save_stats is not None:
        if args.reference is not None:
            raise MetricsError("--save-stats only computes statistics of --samples; drop --reference, or drop --save-stats")
        start = time.perf_counter()
        images = open_images(args.samples, center_crop=args.center_crop)
        if args.num_samples is not None and len(images) != args.num_samples:
            raise MetricsError(f"{args.samples} holds {len(images)} images but --num-samples is {args.num_samples}")
        ref = build_reference_statistics(images, args.save_stats, reference_images=args.reference_images,
                                         shard_size=args.shard_size, **common)
        return {"saved": str(args.save_stats), "seconds": round(time.perf_counter() - start, 1), **ref.describe()}
    if args.center_crop is not None:
        raise MetricsError("--center-crop prepares raw folders for --save-stats; samples are scored as they are")
    metrics = None if args.metrics is None else [m.strip() for m in args.metrics.split(",") if m.strip()]
    return compute_metrics(
        args.samples, args.reference, metrics=metrics, expected_count=args.num_samples,
        is_split_size=args.is_split_size, pr_batch_size=args.pr_batch_size, kid_subsets=args.kid_subsets,
        kid_subset_size=args.kid_subset_size, seed=args.seed, frechet_method=args.frechet_method, **common,
    )


def sample_and_score(checkpoint, out_dir, *, num_samples: int, steps: int, reference: str = "fashion-mnist:test",
                     feature_extractor: str = "fmnist-cnn", extractor_weights=None, seed: int = 0,
                     extra_sample_args=(), metrics: str = "fid") -> dict:
    """The two documented commands as one call: ``diffusion.sample --num-samples`` then ``diffusion.fid``.

    Writes ``<out_dir>/samples.npz`` and ``<out_dir>/fid.json``; returns the results dict (``metrics``: FID only
    unless ``metrics`` names more, e.g. ``"fid,is,pr"``).
    """
    from diffusion import sample

    out_dir = Path(out_dir)
    sample.main(["--checkpoint", str(checkpoint), "--num-samples", str(num_samples), "--out-dir", str(out_dir),
                 "--steps", str(steps), "--seed", str(seed), "--quiet", *extra_sample_args])
    args = ["--samples", str(out_dir / "samples.npz"), "--reference", reference, "--feature-extractor",
            feature_extractor, "--num-workers", "0", "--quiet", "--out", str(out_dir / "fid.json"),
            "--metrics", metrics]
    if extractor_weights:
        args += ["--extractor-weights", str(extractor_weights)]
    return main(args, echo=False)


def main(argv=None, echo: bool = True) -> dict:
    args = parse_args(argv)
    use_fast_cuda_kernels()  # Inception's convolutions: cudnn's autotuner
    with one_line_errors():  # MetricsError, FeatureExtractorError, ...: InputErrors
        result = run(args)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        atomic_write_text(args.out, text + "\n")
    if echo:
        print(summary_line(result) if args.quiet else text, file=sys.stdout)
    return result


def summary_line(result: dict) -> str:
    """What ``--quiet`` prints: the metrics (or the statistics written) on one line."""
    if "metrics" in result:
        return "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result["metrics"].items())
    return f"wrote {result.get('saved')} ({result.get('seconds')} s)"


if __name__ == "__main__":
    main()
