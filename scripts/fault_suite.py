"""The slow fault suite: kill both trainers with SIGKILL at many random moments, resume, compare bit for bit.

    python -m scripts.fault_suite --trials 20            # per family; prints and writes k/N bit-identical

Each trial runs a tiny Fashion-MNIST training (DeiT, then DiT) in a subprocess and kills it either at a random
wall-clock moment or at a random seam of tests/faults.py (inside a checkpoint write, right after one, inside a
weights write, mid-step, before the final outputs); then it runs the same command again (possibly more than once,
if a kill landed before the first checkpoint) and compares model and EMA weights with an uninterrupted run.
The fast, fixed-point version of this is tests/test_faults.py.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.durable import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "deit": ("vision.train", "fmnist_deit_siamese.yaml",
             ["model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
              "data.max_train_samples=96", "data.max_val_samples=20", "optim.batch_size=16", "optim.epochs=2",
              "model.drop_path=0.1", "augment.mixup=0.8", "augment.cutmix=1.0", "augment.re_prob=0.5",
              "augment.repeated_aug=2", "train.ema_decay=0.5", "train.ckpt_every=3", "train.log_every=1"]),
    "dit": ("diffusion.train", "fmnist_dit_siamese.yaml",
            ["model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "data.max_samples=48", "optim.batch_size=8",
             "optim.steps=12", "train.ema_decay=0.5", "train.ckpt_every=3", "train.log_every=1",
             "train.sample_every=6", "train.sample_count=2", "train.sample_steps=2"]),
}
COMMON = ["data.num_workers=1", "train.tensorboard=true", "train.threads=1"]
SEAMS = {"ckpt_write": 4, "ckpt_done": 4, "weights": 5, "step": 12, "final": 1}  # seam -> occurrences to draw from


def command(family: str, out: Path, fault=None) -> list:
    module, recipe, overrides = RUNS[family]
    args = ["--config", str(ROOT / "configs" / recipe), *COMMON, *overrides, f"train.output_dir={out}"]
    prefix = ["-m", "tests.faults", fault[0], str(fault[1]), "--"] if fault else []
    return [sys.executable, *prefix, "-m", module, *args]


def run(cmd, kill_after=None) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
    return proc.wait()


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    for name in ("model.safetensors", "ema.safetensors"):
        x, y = load_file(a / name), load_file(b / name)
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.fault_suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="kill-and-resume trials per family")
    p.add_argument("--families", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results file (default: print only)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for family in args.families:
            reference = tmp / f"{family}_reference"
            start = time.perf_counter()
            assert run(command(family, reference)) == 0, f"the uninterrupted {family} run failed"
            duration = time.perf_counter() - start
            trials = []
            for i in range(args.trials):
                out = tmp / f"{family}_{i}"
                if rng.random() < 0.5:
                    seam = rng.choice(list(SEAMS))
                    how = {"seam": seam, "nth": rng.randint(1, SEAMS[seam])}
                    code = run(command(family, out, (seam, how["nth"])))
                else:
                    how = {"after_s": round(rng.uniform(0.3, duration), 2)}
                    code = run(command(family, out), kill_after=how["after_s"])
                reruns = 0
                while not (out / "final_metrics.json").is_file() and reruns < 3:
                    reruns += 1
                    if run(command(family, out)) != 0:
                        break
                ok = (out / "final_metrics.json").is_file() and same_weights(reference, out)
                trials.append({**how, "killed": code == -signal.SIGKILL, "reruns": reruns, "bit_identical": ok})
                print(f"{family} trial {i + 1}/{args.trials}: {how} killed={code == -signal.SIGKILL} "
                      f"bit-identical={ok}", flush=True)
            k = sum(t["bit_identical"] for t in trials)
            killed = sum(t["killed"] for t in trials)
            results[family] = {"bit_identical": k, "trials": len(trials), "killed": killed, "details": trials}
            print(f"{family}: {k}/{len(trials)} bit-identical after resume ({killed} trials were killed mid-run)",
                  flush=True)
    if args.out:
        atomic_write_text(args.out, json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
