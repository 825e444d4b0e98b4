"""FID of generated samples (IS and KID on request), with the protocol recorded next to the number.

FID-50K as in the DiT paper (ADM's reference statistics of ImageNet-256, torch-fidelity's TF-compatible Inception):

    python -m diffusion.fid --samples samples/dit_b2.npz --reference VIRTUAL_imagenet256_labeled.npz \\
        --num-samples 50000 --out samples/dit_b2_fid.json

Cache the statistics of a reference image set once, then use them as the reference:

    python -m diffusion.fid --samples /data/imagenet256_train_folder --save-stats stats/in256.npz

Fashion-MNIST (CPU world), with the project's small classifier as feature extractor (train it once with
``python -m scripts.train_fmnist_classifier``):

    python -m diffusion.fid --samples samples/fmnist/ --reference fashion-mnist:test --feature-extractor fmnist-cnn

Samples: a folder of PNG/JPEG files, an ADM-format .npz (arr_0: uint8 [N, H, W, 3]) or fashion-mnist:train/test.
Reference: any of those, or a statistics .npz (mu, sigma: ADM's reference batches or --save-stats output).
Inception weights: --extractor-weights PATH, else torch-fidelity's cache (nothing is downloaded; a missing file
is an error that says which file to put where). Results: JSON on stdout (and --out), metrics plus protocol.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.feature_extractors import INCEPTION, FeatureExtractorError
from common.metrics import MetricsError, compute_metrics, compute_statistics


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m diffusion.fid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", required=True,
                   help="generated images: folder of PNG/JPEG, .npz with arr_0 (uint8 NHWC), or fashion-mnist:SPLIT")
    p.add_argument("--reference", default=None,
                   help="reference: statistics .npz (mu, sigma), image folder, .npz images, or fashion-mnist:SPLIT")
    p.add_argument("--out", type=Path, default=None, help="also write the results JSON to this file")
    p.add_argument("--save-stats", type=Path, default=None, metavar="PATH.npz",
                   help="only compute the statistics of --samples and save them (reusable as --reference)")
    p.add_argument("--num-samples", type=int, default=None,
                   help="expected number of sample images (e.g. 50000); a different count is an error")
    g = p.add_argument_group("features")
    g.add_argument("--feature-extractor", default=INCEPTION,
                   help=f"torch-fidelity feature extractor: {INCEPTION} (default, ADM-compatible FID) or fmnist-cnn")
    g.add_argument("--extractor-weights", "--inception-weights", dest="weights", default=None, metavar="PATH",
                   help="weights file of the feature extractor (default: torch-fidelity's cache for Inception, "
                        "~/.cache/siamesenorm/fmnist_cnn.safetensors for fmnist-cnn)")
    g.add_argument("--feature-layer", default=None,
                   help="feature layer for FID/KID (default: the extractor's, 2048 for Inception)")
    m = p.add_argument_group("metrics")
    m.add_argument("--no-fid", dest="fid", action="store_false", help="skip FID (with --isc/--kid)")
    m.add_argument("--isc", action="store_true", help="also compute the Inception Score of the samples")
    m.add_argument("--kid", action="store_true", help="also compute KID (needs reference images)")
    m.add_argument("--isc-splits", type=int, default=10)
    m.add_argument("--kid-subsets", type=int, default=100)
    m.add_argument("--kid-subset-size", type=int, default=1000)
    m.add_argument("--seed", type=int, default=2020, help="seed of the IS/KID random splits (torch-fidelity's)")
    r = p.add_argument_group("runtime")
    r.add_argument("--batch-size", type=int, default=50)
    r.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    r.add_argument("--num-workers", type=int, default=4, help="image decoding workers for folders")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def run(args) -> dict:
    common = dict(feature_extractor=args.feature_extractor, weights=args.weights, feature_layer=args.feature_layer,
                  batch_size=args.batch_size, device=args.device, num_workers=args.num_workers, progress=not args.quiet)
    if args.save_stats is not None:
        if args.reference is not None:
            raise MetricsError("--save-stats only computes statistics of --samples; drop --reference, or drop --save-stats")
        stats = compute_statistics(args.samples, **common)
        if args.num_samples is not None and stats.count != args.num_samples:
            raise MetricsError(f"{args.samples} holds {stats.count} images but --num-samples is {args.num_samples}")
        path = stats.save(args.save_stats)
        return {"statistics": str(path), "source": str(args.samples), **stats.describe()}
    return compute_metrics(
        args.samples, args.reference, fid=args.fid, isc=args.isc, kid=args.kid, expected_count=args.num_samples,
        isc_splits=args.isc_splits, kid_subsets=args.kid_subsets, kid_subset_size=args.kid_subset_size,
        seed=args.seed, **common,
    )


def sample_and_score(checkpoint, out_dir, *, num_samples: int, steps: int, reference: str = "fashion-mnist:test",
                     feature_extractor: str = "fmnist-cnn", extractor_weights=None, seed: int = 0,
                     extra_sample_args=()) -> dict:
    """The two documented commands as one call: ``diffusion.sample --num-samples`` then ``diffusion.fid``.

    Writes ``<out_dir>/samples.npz`` and ``<out_dir>/fid.json``; returns the FID results dict.
    """
    from diffusion import sample

    out_dir = Path(out_dir)
    sample.main(["--checkpoint", str(checkpoint), "--num-samples", str(num_samples), "--out-dir", str(out_dir),
                 "--steps", str(steps), "--seed", str(seed), "--quiet", *extra_sample_args])
    args = ["--samples", str(out_dir / "samples.npz"), "--reference", reference, "--feature-extractor",
            feature_extractor, "--num-workers", "0", "--quiet", "--out", str(out_dir / "fid.json")]
    if extractor_weights:
        args += ["--extractor-weights", str(extractor_weights)]
    return main(args, echo=False)


def main(argv=None, echo: bool = True) -> dict:
    args = parse_args(argv)
    try:
        result = run(args)
    except (MetricsError, FeatureExtractorError) as err:
        raise SystemExit(f"error: {err}") from err
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if echo:
        print(text, file=sys.stdout)
    return result


if __name__ == "__main__":
    main()
