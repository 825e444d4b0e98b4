"""Start-up of every public entry point next to a bare ``python -c "import torch"``.

    python -m benchmarks.startup                   # every entry point, 5 rounds
    python -m benchmarks.startup --repeats 3 --only vision.train diffusion.sample

For each entry point it times ``--help`` and one refused command line (an argument error, exit 2), and for the two
trainers the first progress line of a run that starts; each is the median of ``--repeats`` rounds, the commands of
a round run one after the other, alternating with the bare ``import torch``, so a busy machine slows all alike. The
goal: ``--help`` and an argument error within 1.5x of the bare import (the commands import torch themselves, and
nothing heavier: timm, diffusers, accelerate, torch-fidelity, scipy, datasets, webdataset load only once a command
line is accepted).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from benchmarks.harness import alternate, conditions, default_max_load, describe_conditions, time_call

ROOT = Path(__file__).resolve().parents[1]
BARE = ["-c", "import torch"]
TARGET_RATIO = 1.5

# entry point -> a command line it refuses (exit 2) before any work
ARGUMENT_ERRORS: Dict[str, List[str]] = {
    "vision.train": ["--config", "configs/fmnist_deit_siamese.yaml", "data.input_size=0"],
    "vision.evaluate": ["--config", "configs/fmnist_deit_siamese.yaml", "batch_size=0"],
    "vision.export": ["--run", "runs/none", "--out", "exports/none", "--weights", "best"],
    "diffusion.train": ["--config", "configs/fmnist_dit_siamese.yaml", "model.class_dropout_prob=2"],
    "diffusion.sample": ["--checkpoint", "runs/none/ema.safetensors", "--grid", "grid.png", "--labels", "207,cat"],
    "diffusion.fid": ["--samples", "samples.npz", "--batch-size", "fifty"],
    "diffusion.export": ["--checkpoint", "runs/none/ema.safetensors", "--out", "exports/none", "--format", "onnx"],
    "diffusion.extract_latents": ["--data-path", "images", "--out", "latents", "--image-size", "0"],
    "vision.shard": ["--data-path", "images", "--out", "shards", "--shard-size", "0"],
    "scripts.compare": ["--shard", "3/2"],
    "scripts.demo": ["--families", "gpt"],
}
ENTRY_POINTS = tuple(ARGUMENT_ERRORS)
# trainers: a run that starts (its first line comes before the libraries load), stopped once that line is read
FIRST_LINE: Dict[str, List[str]] = {
    "vision.train": ["--config", "configs/fmnist_deit_siamese.yaml", "optim.epochs=1", "data.max_train_samples=8",
                     "data.max_val_samples=8", "optim.batch_size=8"],
    "diffusion.train": ["--config", "configs/fmnist_dit_siamese.yaml", "optim.steps=1", "data.max_samples=8",
                        "optim.batch_size=8"],
}


def command(module: Optional[str], args: Sequence[str]) -> List[str]:
    return [sys.executable, *(BARE if module is None else ["-m", module, *args])]


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_once(cmd: Sequence[str]) -> int:
    """The exit status of one command, output discarded."""
    return subprocess.run(cmd, cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode


def first_line_once(cmd: Sequence[str], out_dir: Path) -> tuple:
    """``(seconds to the first line on stdout, the line)`` of a starting run, which is then stopped."""
    proc = None

    def start_and_read():
        nonlocal proc
        proc = subprocess.Popen([*cmd, f"train.output_dir={out_dir}"], cwd=ROOT, env=environment(),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return proc.stdout.readline()

    run = time_call(start_and_read)
    proc.kill()
    proc.wait()
    return run.seconds, run.value.strip()


def measure(entry_points: Sequence[str], repeats: int, first_lines: bool = True, scratch: Optional[Path] = None) -> dict:
    """``{"bare": [s...], "<ep> --help": [s...], "<ep> error": [s...], "<ep> first line": [s...]}`` and the exit
    statuses seen, over ``repeats`` alternating rounds."""
    import tempfile

    variants = {"bare": lambda: run_once(command(None, ()))}
    firsts = {}
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        for ep in entry_points:
            for kind, args in (("--help", ["--help"]), ("error", ARGUMENT_ERRORS[ep])):
                variants[f"{ep} {kind}"] = lambda cmd=command(ep, args): run_once(cmd)
            if first_lines and ep in FIRST_LINE:
                count = iter(range(repeats))
                firsts[f"{ep} first line"] = lambda ep=ep, count=count: first_line_once(
                    command(ep, FIRST_LINE[ep]), Path(tmp) / f"{ep}_{next(count)}")[0]
                variants[f"{ep} first line"] = firsts[f"{ep} first line"]
        runs = alternate(variants, repeats)
    # a first line's figure is its own (to the line, not to the end of the call); the others are whole calls
    times = {name: [r.value if name in firsts else r.seconds for r in rs] for name, rs in runs.items()}
    statuses = {name: {r.value for r in rs} for name, rs in runs.items() if name not in firsts and name != "bare"}
    return {"times": times, "statuses": statuses, "conditions": conditions(runs, default_max_load(), threads=1)}


def summarise(times: Dict[str, List[float]]) -> List[dict]:
    """One row per measured command: its median seconds and the ratio to the bare import's median."""
    bare = statistics.median(times["bare"])
    return [{"what": name, "median_s": statistics.median(values), "ratio": statistics.median(values) / bare,
             "runs": len(values)} for name, values in times.items()]


def table(rows: List[dict], statuses: Dict[str, set]) -> str:
    lines = [f"{'command':<36} {'median s':>9} {'x import torch':>15}  exit", "-" * 70]
    for row in rows:
        exits = ",".join(str(s) for s in sorted(statuses.get(row["what"], ()))) or "-"
        name = "python -c 'import torch'" if row["what"] == "bare" else row["what"]
        flag = "" if row["what"] == "bare" or row["what"].endswith("first line") or row["ratio"] <= TARGET_RATIO else "  > 1.5x"
        lines.append(f"{name:<36} {row['median_s']:>9.2f} {row['ratio']:>15.2f}  {exits}{flag}")
    return "\n".join(lines)


def main(argv=None) -> List[dict]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="alternating rounds; the medians are printed")
    p.add_argument("--only", nargs="+", choices=ENTRY_POINTS, default=list(ENTRY_POINTS), help="these entry points")
    p.add_argument("--no-first-line", dest="first_lines", action="store_false",
                   help="skip the trainers' time to their first progress line")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    measured = measure(args.only, args.repeats, args.first_lines)
    rows = summarise(measured["times"])
    print(f"start-up, median of {args.repeats} alternating rounds, Python {sys.version.split()[0]}; "
          f"{describe_conditions(measured['conditions'])}")
    print(table(rows, measured["statuses"]))
    return rows


if __name__ == "__main__":
    main()
