"""Train the small Fashion-MNIST CNN whose features give the ``fmnist-cnn`` Frechet distance.

    python -m scripts.train_fmnist_classifier                     # 5 epochs: 90.6% test accuracy, ~5 min of one core
    python -m diffusion.fid --samples samples/ --reference fashion-mnist:test --feature-extractor fmnist-cnn

Writes ``~/.cache/siamesenorm/fmnist_cnn.safetensors`` ($SIAMESENORM_CACHE moves it; ``--out`` overrides), with
the test accuracy in the file's metadata. The weights are derived data: keep them out of git.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common.cli import one_line_errors
from diffusion.evaluation.features import fmnist_weights_path
from diffusion.evaluation.fmnist_classifier import train_fmnist_classifier


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.train_fmnist_classifier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help=f"weights file (default: {fmnist_weights_path()})")
    p.add_argument("--data-root", default=None,
                   help="directory with the IDX files if not in /usr/share/datasets/fashion-mnist (see common/data.py)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (cosine decay to 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="train on the first N images only (quick checks)")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    with one_line_errors():  # e.g. Fashion-MNIST not installed: one line naming 'make data'
        return train_fmnist_classifier(**vars(args))


if __name__ == "__main__":
    main()
