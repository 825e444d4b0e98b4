"""End-to-end training speed of ``vision.train`` beside timm's own ``train.py``, run alternately, same everything.

Both train the same model (timm's ``deit_tiny_patch16_224`` at ``--width``/``--depth``) on the same JPEG folder
(ImageNet-like sizes, written once into ``--workdir``), with the same batch, workers, threads and augmentation:
RandAugment ``rand-m9-mstd0.5`` (``-inc1`` is left out: timm's posterize dies on its 0-bit draws under Pillow 13,
and this script changes nothing in timm's code), mixup 0.8, cutmix 1.0, random erasing 0.25, label smoothing
0.1, drop path 0.1, an EMA, AdamW, for ``--epochs`` epochs of ``--steps`` steps. The figures are images/s over the
whole command (start-up included) and over the steps after ``--warmup``, from each trainer's own per-step record
(ours: ``metrics.jsonl``, written every step; theirs: its per-step log line, stamped as it arrives), the latter in
two ways: by the wall clock, and by CPU time, the main process's and the workers' CPU seconds per step (polled
from /proc): on an idle machine with a core for each, the slower of the two sets the pace (the bound each round
names), and unlike the wall clock it holds on a machine busy with other work. The two trainers alternate run by
run (the order flips each round; each round prints its load, LOADED above ``--max-load``); each printed ratio is
the median of the per-round ratios.

timm's ``train.py`` is not part of timm's wheel or sdist: it sits at the root of timm's repository
(huggingface/pytorch-image-models on GitHub). Clone it (the tag of the installed timm, or near it) and pass
the file, or set ``TIMM_TRAIN``::

    git clone --depth 1 https://github.com/huggingface/pytorch-image-models /tmp/timm-repo
    python -m benchmarks.vs_timm --timm-train /tmp/timm-repo/train.py          # about 4 minutes on 2 cores
    python -m benchmarks.vs_timm --timm-train ... --epochs 8 --rounds 5        # 320-step trainings
    python -m benchmarks.vs_timm --timm-train ... --rounds 1 --steps 6 --warmup 2 --images 512   # a try
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Sequence

from benchmarks.harness import (CpuClock, add_common_args, alternate, bound, conditions, describe_bound,
                                describe_conditions, load_note, stopped_with)

ROOT = Path(__file__).resolve().parents[1]
AUGMENT = dict(auto_augment="rand-m9-mstd0.5", mixup=0.8, cutmix=1.0, re_prob=0.25, smoothing=0.1, drop_path=0.1,
               ema_decay=0.99996, lr=1e-3, weight_decay=0.05)


def write_folder(root: Path, images: int) -> Path:
    """``root/train/class{0,1}`` ImageNet-like JPEGs (:func:`benchmarks.synthetic.write_jpegs`) and a small ``val``
    split; kept."""
    from benchmarks.synthetic import write_jpegs

    done = root / ".complete"
    if not done.exists() or int(done.read_text()) != images:
        write_jpegs(root, images)
        write_jpegs(root, 8, seed=1, split="val")
        done.write_text(str(images))
    return root


def ours_command(folder: Path, out: Path, a) -> list:
    kwargs = f"{{embed_dim: {a.width}, depth: {a.depth}, num_heads: {a.heads}}}"
    return [sys.executable, "-m", "vision.train", "--config", str(Path(a.ours_tree) / "configs" / "deit_tiny_pre.yaml"),
            f"data.path={folder}", "data.num_classes=2", f"data.num_workers={a.workers}",
            f"model.kwargs={kwargs}", f"model.drop_path={AUGMENT['drop_path']}",
            f"augment.auto_augment={AUGMENT['auto_augment']}", f"augment.mixup={AUGMENT['mixup']}",
            f"augment.cutmix={AUGMENT['cutmix']}", f"augment.re_prob={AUGMENT['re_prob']}",
            f"augment.label_smoothing={AUGMENT['smoothing']}", "augment.repeated_aug=1",
            f"optim.batch_size={a.batch_size}", f"optim.epochs={a.epochs}", "optim.warmup_epochs=0",
            f"optim.base_lr={AUGMENT['lr']}", f"optim.lr_base_batch={a.batch_size}",
            f"optim.weight_decay={AUGMENT['weight_decay']}", f"train.ema_decay={AUGMENT['ema_decay']}",
            f"train.precision={a.precision}", f"train.threads={a.threads}", "train.log_every=1", "train.eval_every=0",
            "train.tensorboard=false", f"train.ckpt_every={10**9}", "train.resume=null", f"train.output_dir={out}"]


def timm_amp(a) -> list:
    """timm's scripts' precision flags: bf16 autocast for ``a.precision == "bf16"``."""
    return ["--amp", "--amp-dtype", "bfloat16"] if a.precision == "bf16" else []


def timm_command(train_py: Path, folder: Path, out: Path, a) -> list:
    return [sys.executable, str(train_py), str(folder), "--model", "deit_tiny_patch16_224", "--model-kwargs",
            f"embed_dim={a.width}", f"depth={a.depth}", f"num_heads={a.heads}", "--num-classes", "2",
            "--device", a.device, *timm_amp(a), "-b", str(a.batch_size), "-j", str(a.workers),
            "--input-size", "3", "224", "224",
            "--train-split", "train", "--val-split", "val", "--epochs", str(a.epochs), "--warmup-epochs", "0",
            "--sched", "cosine", "--opt", "adamw", "--lr", str(AUGMENT["lr"]),
            "--weight-decay", str(AUGMENT["weight_decay"]), "--aa", AUGMENT["auto_augment"],
            "--mixup", str(AUGMENT["mixup"]), "--cutmix", str(AUGMENT["cutmix"]),
            "--reprob", str(AUGMENT["re_prob"]), "--smoothing", str(AUGMENT["smoothing"]),
            "--drop-path", str(AUGMENT["drop_path"]), "--model-ema", "--model-ema-decay", str(AUGMENT["ema_decay"]),
            "--log-interval", "1", "--checkpoint-hist", "1", "--output", str(out), "--experiment", "run"]


TIMM_STEP_LINE = r"Train: \d+ \["  # train.py's per-step log line


class TrainerRun(NamedTuple):
    output: str
    stamps: list  # the wall times at which its per-step log lines arrived
    clock: CpuClock
    seconds: float  # from its start to its exit


def run(name: str, command: list, env: dict, step_line: str = TIMM_STEP_LINE, cwd=None) -> TrainerRun:
    """Run one trainer, with a :class:`benchmarks.harness.CpuClock` of it. A peer's per-step log lines
    (``step_line``, a regular expression) are stamped as they arrive (its logger flushes each)."""
    started = time.time()
    proc = subprocess.Popen(command, cwd=cwd or env["PYTHONPATH"].split(os.pathsep)[0], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    clock = CpuClock(proc.pid)
    lines, stamps = [], []
    with stopped_with(proc):
        for line in proc.stdout:
            lines.append(line)
            if re.search(step_line, line):
                stamps.append(time.time())
        proc.wait()
    output = "".join(lines)
    if proc.returncode != 0:
        sys.exit(f"error: {name} failed (exit {proc.returncode}):\n{output[-4000:]}")
    return TrainerRun(output, stamps, clock, time.time() - started)


def ours_step_ends(out: Path) -> list:
    return [r["time"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]


def measure(ends: list, run: TrainerRun, warmup: int, batch: int, workers: int) -> dict:
    """Images/s over the steps after ``warmup``: by the wall clock, and by CPU time (the main process's CPU seconds
    per step, and the workers'; on an idle machine with a core each, the slower of the two sets the pace); which of
    the two bounds the rate (:func:`benchmarks.harness.bound`); and images/s of the whole command, start-up and
    warm-up included (``whole``)."""
    if len(ends) <= warmup + 1:
        sys.exit("error: no steps left after the warm-up; raise --steps or lower --warmup")
    first, last, steps = ends[warmup], ends[-1], len(ends) - 1 - warmup
    (main0, work0), (main1, work1) = run.clock.at(first), run.clock.at(last)
    main_s, workers_s, wall_s = (main1 - main0) / steps, (work1 - work0) / steps, (last - first) / steps
    main_cpu_s, children_cpu_s = run.clock.totals()
    return {"wall": batch / wall_s, "cpu": batch / max(main_s, workers_s, 1e-9),
            "whole": batch * len(ends) / run.seconds, "wall_s": run.seconds, "main_cpu_s": main_cpu_s,
            "children_cpu_s": children_cpu_s, "main_cpu_ms": 1e3 * main_s, "workers_cpu_ms": 1e3 * workers_s,
            "wall_ms": 1e3 * wall_s, "steps": steps, **bound(wall_s, main_s, workers_s, workers)}


def train_once(name: str, folder: Path, out: Path, a, env: dict, timm_train: Path | None) -> dict:
    """One training run of ``name`` (ours or timm) into a fresh ``out``, measured (:func:`measure`)."""
    subprocess.run(["rm", "-rf", str(out)], check=True)
    if name == "ours":
        trainer = run(name, ours_command(folder, out, a), env)
        ends = ours_step_ends(out)
    else:
        trainer = run(name, timm_command(timm_train, folder, out, a), env)
        ends = trainer.stamps
    return measure(ends, trainer, a.warmup, a.batch_size, a.workers)


UNITS = {"whole": "whole command", "wall": "steps after the warm-up, by the clock", "cpu": "by CPU time"}


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_timm", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timm-train", default=os.environ.get("TIMM_TRAIN"),
                   help="timm's train.py (from timm's repository; default: $TIMM_TRAIN)")
    p.add_argument("--steps", type=int, default=40, help="training steps per epoch (one epoch of that many batches)")
    p.add_argument("--epochs", type=int, default=1, help="epochs per run (a few hundred steps: more epochs of the same "
                                                          "images; timm's train.py validates 8 images after each)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the figure")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    add_common_args(p, rounds=3, rounds_help="runs of each trainer, alternating (the order flips each round)",
                    threads=1, threads_help="torch threads of each trainer (OMP_NUM_THREADS)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--images", type=int, default=None, help="training JPEGs (default: steps x batch size)")
    p.add_argument("--workdir", default=None, help="where the JPEGs are written and kept (default: a temporary one)")
    p.add_argument("--only", choices=("ours", "timm"), help="run one side (for profiling it)")
    p.add_argument("--ours-tree", default=str(ROOT),
                   help="the checkout whose vision.train runs (default: this one; e.g. an earlier revision's "
                        "`git archive` to compare before and after a change)")
    a = p.parse_args(argv)
    if a.only != "ours" and not (a.timm_train and Path(a.timm_train).is_file()):
        p.error("--timm-train (or TIMM_TRAIN) must name timm's train.py; see --help for where it comes from")
    if a.epochs < 1:
        p.error(f"--epochs {a.epochs}: must be positive")
    a.device, a.precision = "cpu", "fp32"  # on a GPU: python -m benchmarks.vs_peers --rows train --device cuda
    images = a.images or a.steps * a.batch_size
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads),
           "PYTHONPATH": os.pathsep.join([a.ours_tree, os.environ.get("PYTHONPATH", "")])}
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="bench_vs_timm_"))
    folder = write_folder(work / "images", images)
    done = {"ours": 0, "timm": 0}

    def train(name):
        done[name] += 1
        m = train_once(name, folder, work / f"{name}_{done[name] - 1}", a, env, a.timm_train and Path(a.timm_train))
        print(f"round {done[name]}/{a.rounds} {name}: {m['whole']:6.1f} images/s over the whole command, "
              f"{m['wall']:6.1f} by the clock after the warm-up, {m['cpu']:6.1f} by CPU time (per step: main process "
              f"{m['main_cpu_ms']:.0f} ms, workers {m['workers_cpu_ms']:.0f} ms, wall {m['wall_ms']:.0f} ms: "
              f"{describe_bound(m)}; {m['steps']} steps)", flush=True)
        return m

    def on_round(index, runs):
        print(f"round {index + 1}/{a.rounds}: {load_note(runs.loads[-1], a.max_load, a.workers)}", flush=True)

    sides = [name for name in ("ours", "timm") if not a.only or name == a.only]
    runs = alternate({name: (lambda name=name: train(name)) for name in sides}, a.rounds, flip=True, on_round=on_round)
    rates = {name: [r.value for r in rs] for name, rs in runs.items()}
    result = {f"{k} {unit}": statistics.median(m[unit] for m in v) for k, v in rates.items() if v for unit in UNITS}
    if not a.only:
        for unit, what in UNITS.items():
            ratio = statistics.median(o[unit] / t[unit] for o, t in zip(rates["ours"], rates["timm"]))
            result[f"ours/timm {unit}"] = ratio
            print(f"{what}: ours {result[f'ours {unit}']:.1f} images/s, timm {result[f'timm {unit}']:.1f}: "
                  f"ours/timm {ratio:.2f}x (median of {a.rounds} alternating rounds)")
    result["conditions"] = conditions(runs, a.max_load, a.threads, a.workers)
    print(describe_conditions(result["conditions"]))
    return {**result, "rounds": rates}


if __name__ == "__main__":
    main()
