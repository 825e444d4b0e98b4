"""`make demo`: train and compare Pre-Norm and SiameseNorm on real data, on a CPU, in a few minutes.

Each model family contributes one function ``demo_<family>(out_dir, args) -> (rows, curves)``; ``main`` runs
the selected families, prints one table (Top-1, params, training images/s, wall time) and writes
``<out>/loss_curves.png`` and ``<out>/results.json``. The DeiT part trains micro-DeiTs
(``configs/fmnist_deit_{pre,siamese}.yaml``) on Fashion-MNIST and evaluates them on its 10k test images.

    python -m scripts.demo                          # both topologies, default budget
    python -m scripts.demo --train-images 10000     # quicker, less accurate
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_deit(out_dir: Path, args) -> tuple:
    """Micro-DeiT Pre-Norm vs SiameseNorm on Fashion-MNIST (same data order, same init seed)."""
    from common.config import load_config
    from common.logging import read_metrics
    from vision.train import TrainConfig, train

    rows, curves = [], {}
    for topology in args.topologies:
        run_dir = out_dir / f"deit_{topology}"
        overrides = [f"train.output_dir={run_dir}", "train.resume=null", "train.tensorboard=false",
                     f"optim.epochs={args.epochs}"]
        if args.train_images:
            overrides.append(f"data.max_train_samples={args.train_images}")
        cfg = load_config(TrainConfig, ROOT / f"configs/fmnist_deit_{topology}.yaml", overrides)
        start = time.perf_counter()
        final = train(cfg)
        wall = time.perf_counter() - start
        records = read_metrics(run_dir)
        losses = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
        speeds = [r["train/images_per_s"] for r in records if "train/images_per_s" in r]
        curves[f"DeiT {topology}"] = losses
        rows.append({"family": "DeiT", "model": cfg.model.name, "topology": topology,
                     "metric": "Top-1 %", "value": final["val/top1"], "params": final["params"],
                     "images_per_s": statistics.median(speeds), "wall_s": wall, "data": "Fashion-MNIST test (10k)"})
    return rows, curves


FAMILIES = {"deit": demo_deit}  # the diffusion demo registers here too


def print_table(rows: list) -> None:
    header = f"{'family':<8}{'topology':<10}{'metric':<10}{'value':>8}{'params':>12}{'train img/s':>13}{'wall s':>9}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{r['family']:<8}{r['topology']:<10}{r['metric']:<10}{r['value']:>8.2f}{r['params']:>12,}"
              f"{r['images_per_s']:>13.1f}{r['wall_s']:>9.1f}")


def plot_curves(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in curves.items():
        steps, losses = zip(*points)
        ax.plot(steps, losses, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(prog="python -m scripts.demo", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--topologies", nargs="+", default=["pre", "siamese"], choices=["pre", "siamese", "post"])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument("--train-images", type=int, default=None, help="DeiT: first N Fashion-MNIST training images (default: all 60k)")
    parser.add_argument("--epochs", type=int, default=1, help="DeiT: passes over those images")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for family in args.families:
        r, c = FAMILIES[family](args.out, args)
        rows += r
        curves.update(c)
    print_table(rows)
    plot_curves(curves, args.out / "loss_curves.png")
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"\nwrote {args.out / 'loss_curves.png'} and {args.out / 'results.json'}")
    return rows


if __name__ == "__main__":
    main()
