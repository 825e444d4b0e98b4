"""How far apart runs on 1 and 2 processes end, and a run moved from 1 to 2 processes mid-way (CPU, gloo).

    python -m scripts.world_size_check          # micro-DeiT and micro-DiT on Fashion-MNIST, DropPath and mixup off

Each family trains three ways with the same recipe and global batch: on 1 process, on 2 (``torchrun``), and on 1
process to half-way (``train.stop_at_step``) then resumed on 2. It prints the relative L2 distance of the final
weights to the 1-process run, and the largest element difference. With the per-sample randomness of the data
and no per-process draws, only float round-off (gradient sums in another order) separates them.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "deit": ("vision.train", ["--config", str(ROOT / "configs/fmnist_deit_siamese.yaml"),
                              "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
                              "data.max_train_samples=192", "data.max_val_samples=20", "optim.batch_size=16",
                              "optim.epochs=2"], 12),
    "dit": ("diffusion.train", ["--config", str(ROOT / "configs/fmnist_dit_siamese.yaml"),
                                "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "data.max_samples=96",
                                "optim.batch_size=8", "optim.steps=24", "train.ema_decay=0.5", "train.sample_every=0"], 12),
}
COMMON = ["data.num_workers=0", "train.tensorboard=false", "train.threads=1", "train.log_every=4", "train.ckpt_every=1000"]


def train(module: str, args, out: Path, nproc: int = 1, extra=()) -> None:
    from tests.rehearsal import free_port

    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                                      str(free_port())]
    proc = subprocess.run([sys.executable, *launcher, "-m", module, *args, *COMMON, *extra, f"train.output_dir={out}"],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)
    if proc.returncode not in (0, 3):
        raise SystemExit(f"error: {module} failed ({proc.returncode}): {proc.stderr[-2000:]}")


def distance(a: Path, b: Path) -> tuple:
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    diff = sum(float((x[k].double() - y[k].double()).norm() ** 2) for k in x) ** 0.5
    norm = sum(float(x[k].double().norm() ** 2) for k in x) ** 0.5
    return diff / norm, max(float((x[k] - y[k]).abs().max()) for k in x)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.world_size_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            module, recipe, half = RUNS[family]
            base = Path(tmp) / family
            train(module, recipe, base / "one")
            train(module, recipe, base / "two", nproc=2)
            train(module, recipe, base / "moved", extra=[f"train.stop_at_step={half}"])
            train(module, recipe, base / "moved", nproc=2)
            results[family] = {"1 vs 2 processes": distance(base / "one", base / "two"),
                               f"1 -> 2 processes at step {half}": distance(base / "one", base / "moved")}
            for what, (rel, largest) in results[family].items():
                print(f"{family}: {what}: relative {rel:.2e}, largest element {largest:.2e}", flush=True)
    return results


if __name__ == "__main__":
    main()
