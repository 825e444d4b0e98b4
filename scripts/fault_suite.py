"""The slow fault suite: stop both trainers at many random moments, resume, compare bit for bit.

    python -m scripts.fault_suite --trials 20                         # SIGKILL; per family, k/N bit-identical
    python -m scripts.fault_suite --trials 10 --fault sigterm --nproc 1 2   # a scheduler's SIGTERM, 1 and 2 processes

Each trial runs a tiny Fashion-MNIST training (DeiT, then DiT) in a subprocess (under ``torchrun`` for
``--nproc 2``) and stops it at a random moment of its training (counted from the end of its set-up, within the
training time of an uninterrupted run: a stop during the imports tests nothing): ``--fault sigkill`` kills it then
or at a random seam of
tests/faults.py (inside a checkpoint write, right after one, inside a weights write, mid-step, before the final
outputs); ``--fault sigterm`` sends SIGTERM then, as SLURM or Kubernetes do before a kill (to
``torchrun`` with 2 processes, which passes it on), and expects the run to checkpoint and exit with status 4. Then it
runs the same command again (more than once if a stop landed before the first checkpoint) and compares model and
EMA weights with an uninterrupted run of the same process count. The fast, fixed-point version is tests/test_faults.py.
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
from typing import Optional, Tuple
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
STARTED = "metrics.jsonl"  # exists once a run has finished its set-up
SEAMS = {"ckpt_write": 4, "ckpt_done": 4, "weights": 5, "step": 12, "final": 1}  # seam -> occurrences to draw from


def command(family: str, out: Path, fault=None, nproc: int = 1) -> list:
    module, recipe, overrides = RUNS[family]
    args = ["--config", str(ROOT / "configs" / recipe), *COMMON, *overrides, f"train.output_dir={out}"]
    prefix = ["-m", "tests.faults", fault[0], str(fault[1]), "--"] if fault else []
    if nproc > 1:
        from tests.rehearsal import free_port

        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(free_port()), "-m", module, *args]
    return [sys.executable, *prefix, "-m", module, *args]


def launch(cmd) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(cmd, stop_after=None, stop_signal=signal.SIGKILL, started: Optional[Path] = None) -> int:
    """Run ``cmd``; with ``stop_after``, send ``stop_signal`` that many seconds after ``started`` appears (after the
    start without it)."""
    proc = launch(cmd)
    if stop_after is not None:
        while started is not None and not started.is_file() and proc.poll() is None:
            time.sleep(0.02)
        try:
            proc.wait(timeout=stop_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(stop_signal)
    return proc.wait()


def timed_reference(cmd, out: Path) -> Tuple[float, float]:
    """Run the uninterrupted run; (seconds until it started training, seconds in all). Training has started when
    ``metrics.jsonl`` exists (:data:`STARTED`: its first record is written after the set-up, before step 1)."""
    start, started = time.perf_counter(), None
    proc = launch(cmd)
    while proc.poll() is None:
        if started is None and (out / STARTED).is_file():
            started = time.perf_counter() - start
        time.sleep(0.02)
    assert proc.returncode == 0, f"the uninterrupted run failed: {' '.join(map(str, cmd))}"
    total = time.perf_counter() - start
    return (started if started is not None else 0.3), total


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    for name in ("model.safetensors", "ema.safetensors"):
        x, y = load_file(a / name), load_file(b / name)
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


def trial(family: str, out: Path, fault: str, nproc: int, window: Tuple[float, float], rng: random.Random) -> dict:
    """One stop at a random moment of the training (seconds after this run's set-up, within the training time of the
    uninterrupted run, ``window``: a stop during the imports tests nothing) or at a seam, and the reruns that finish
    the run."""
    training_s = max(window[1] - window[0], 0.1)
    if fault == "sigterm":
        how = {"sigterm_after_training_started_s": round(rng.uniform(0, training_s), 2)}
        code = run(command(family, out, nproc=nproc), stop_after=how["sigterm_after_training_started_s"],
                   stop_signal=signal.SIGTERM, started=out / STARTED)
        how["stopped"] = (out / "final_metrics.json").is_file() is False
        how["exit"] = code
    elif nproc == 1 and rng.random() < 0.5:
        seam = rng.choice(list(SEAMS))
        how = {"seam": seam, "nth": rng.randint(1, SEAMS[seam])}
        code = run(command(family, out, (seam, how["nth"])))
        how["stopped"] = code == -signal.SIGKILL
    else:
        how = {"sigkill_after_training_started_s": round(rng.uniform(0, training_s), 2)}
        code = run(command(family, out, nproc=nproc), stop_after=how["sigkill_after_training_started_s"],
                   started=out / STARTED)
        how["stopped"] = code == -signal.SIGKILL
    reruns = 0
    while not (out / "final_metrics.json").is_file() and reruns < 3:
        reruns += 1
        if run(command(family, out, nproc=nproc)) != 0:
            break
    return {**how, "reruns": reruns, "finished": (out / "final_metrics.json").is_file()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.fault_suite", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20, help="stop-and-resume trials per family and process count")
    p.add_argument("--families", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--fault", choices=("sigkill", "sigterm"), default="sigkill",
                   help="sigkill: kill -9 at a random moment or seam; sigterm: a scheduler's stop signal")
    p.add_argument("--nproc", nargs="+", type=int, default=[1], help="process counts (2: under torchrun, gloo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results file (default: print only)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for family in args.families:
            for nproc in args.nproc:
                key = f"{family} {nproc}p {args.fault}"
                reference = tmp / f"{family}_{nproc}_reference"
                window = timed_reference(command(family, reference, nproc=nproc), reference)
                print(f"{key}: the uninterrupted run trains from {window[0]:.1f} s to {window[1]:.1f} s", flush=True)
                trials = []
                for i in range(args.trials):
                    out = tmp / f"{family}_{nproc}_{i}"
                    t = trial(family, out, args.fault, nproc, window, rng)
                    t["bit_identical"] = t["finished"] and same_weights(reference, out)
                    trials.append(t)
                    print(f"{key} trial {i + 1}/{args.trials}: {t}", flush=True)
                k = sum(t["bit_identical"] for t in trials)
                stopped = sum(t["stopped"] for t in trials)
                results[key] = {"bit_identical": k, "trials": len(trials), "stopped_mid_run": stopped,
                                "exit_4": sum(t.get("exit") == 4 for t in trials), "details": trials}
                print(f"{key}: {k}/{len(trials)} bit-identical after resume ({stopped} stopped mid-run"
                      + (f", {results[key]['exit_4']} exited 4" if args.fault == "sigterm" else "") + ")", flush=True)
    if args.out:
        atomic_write_text(args.out, json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
