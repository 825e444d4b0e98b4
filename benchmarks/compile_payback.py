"""After how many steps ``train.compile=true`` pays for its compiling: a training command, eager and compiled,
alternating run by run.

Each round runs the same training command twice from a fresh run directory, ``train.compile=false`` and
``train.compile=true``, logging every step (its ``metrics.jsonl`` stamps each step's end), with a
:class:`benchmarks.harness.CpuClock` on the process and its workers. Per run: the steady step (the median interval
between step ends after ``--warmup`` steps, and the main process's mean CPU time per step) and the fixed cost
(the whole command less its steps at the steady rate: start-up, compiling, evaluation). The break-even is the
compiled run's extra fixed cost over the steady step's saving::

    break-even steps = (fixed compiled - fixed eager) / (step eager - step compiled)

in wall seconds and in CPU seconds (the main process's and its children's, inductor's compile workers included;
the CPU figure holds better on a machine busy with other work). Every round prints its load
(``--max-load`` marks the loaded ones). Each compiled run starts with an empty inductor cache (its own
``TORCHINDUCTOR_CACHE_DIR``), as a user's first run of a model does; ``--warm-cache`` lets the compiled runs share
one, as a resumed run or a rerun of the same model finds it.

    python -m benchmarks.compile_payback --family dit --rounds 3 -- --config configs/fmnist_dit_siamese.yaml \\
        optim.steps=300 data.max_samples=9600
    python -m benchmarks.compile_payback --family deit --rounds 3 -- --config configs/fmnist_deit_siamese.yaml \\
        data.max_train_samples=19200 data.max_val_samples=1000
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from benchmarks.harness import add_common_args, alternate, conditions, describe_conditions, load_note
from benchmarks.vs_timm import ours_step_ends, run

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"deit": "vision.train", "dit": "diffusion.train"}


def steady_and_fixed(ends: list, trainer, warmup: int) -> dict:
    """The steady step after ``warmup`` steps (the median interval between step ends; the main process's mean CPU
    seconds per step) and the fixed cost of the command (its whole wall / CPU seconds less its steps at the steady
    step)."""
    if len(ends) < warmup + 3:
        sys.exit(f"error: the run logged {len(ends)} steps; the figure needs at least --warmup {warmup} + 3: "
                 "lengthen the run (optim.steps, or more samples per epoch)")
    wall_steps = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]
    main_cpu_s, children_cpu_s = trainer.clock.totals()
    # the clock's CPU seconds come in ticks (10 ms): the mean over the window, not a median of ticked steps
    step_s = statistics.median(wall_steps)
    step_cpu_s = (trainer.clock.at(ends[-1])[0] - trainer.clock.at(ends[warmup])[0]) / len(wall_steps)
    return {"steps": len(ends), "step_s": step_s, "step_cpu_s": step_cpu_s, "seconds": trainer.seconds,
            "cpu_s": main_cpu_s + children_cpu_s, "fixed_s": trainer.seconds - len(ends) * step_s,
            "fixed_cpu_s": main_cpu_s + children_cpu_s - len(ends) * step_cpu_s}


def break_even(eager: dict, compiled: dict, clock: str) -> float:
    """Steps after which the compiled run is ahead (``clock``: "" for wall seconds, "cpu_" for CPU seconds); inf
    when compiling saves nothing per step."""
    extra = compiled[f"fixed_{clock}s"] - eager[f"fixed_{clock}s"]
    saving = eager[f"step_{clock}s"] - compiled[f"step_{clock}s"]
    return max(extra, 0.0) / saving if saving > 0 else float("inf")


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_payback", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(ENTRY_POINTS), required=True, help="deit (vision.train) or dit "
                   "(diffusion.train)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the steady step")
    add_common_args(p, rounds=3, rounds_help="runs of each mode, alternating (the order flips each round)", threads=1,
                    threads_help="train.threads of each run")
    p.add_argument("--workdir", default=None, help="where the runs are written (default: a temporary folder)")
    p.add_argument("--warm-cache", action="store_true", help="the compiled runs share one inductor cache (the first "
                   "compiles, the others find its kernels); default: each compiles from an empty cache")
    p.add_argument("train_args", nargs="*", help="after --: the training command's arguments (--config, settings)")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.warmup < 1:
        p.error("--rounds and --warmup must be positive")
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="bench_compile_"))
    done = {"eager": 0, "compiled": 0}

    def train(mode: str) -> dict:
        out = work / f"{mode}_{done[mode]}"
        done[mode] += 1
        shutil.rmtree(out, ignore_errors=True)
        command = [sys.executable, "-m", ENTRY_POINTS[a.family], *a.train_args,
                   f"train.compile={str(mode == 'compiled').lower()}", "train.log_every=1", "train.tensorboard=false",
                   f"train.threads={a.threads}", f"train.ckpt_every={10 ** 9}", "train.resume=null",
                   f"train.output_dir={out}"]
        cache = work / ("inductor_cache" if a.warm_cache else f"inductor_cache_{mode}_{done[mode] - 1}")
        trainer = run(mode, command, {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
        figures = steady_and_fixed(ours_step_ends(out), trainer, a.warmup)
        print(f"  {mode}: {figures['steps']} steps in {figures['seconds']:.1f} s ({figures['cpu_s']:.1f} CPU-s); step "
              f"{1e3 * figures['step_s']:.1f} ms ({1e3 * figures['step_cpu_s']:.1f} CPU-ms); fixed "
              f"{figures['fixed_s']:.1f} s ({figures['fixed_cpu_s']:.1f} CPU-s)", flush=True)
        return figures

    def on_round(index, runs):
        eager, compiled = runs["eager"][-1].value, runs["compiled"][-1].value
        print(f"round {index + 1}/{a.rounds}: break-even {break_even(eager, compiled, ''):.0f} steps by the clock, "
              f"{break_even(eager, compiled, 'cpu_'):.0f} by CPU time; {load_note(runs.loads[-1], a.max_load)}",
              flush=True)

    runs = alternate({"eager": lambda: train("eager"), "compiled": lambda: train("compiled")}, a.rounds, flip=True,
                     on_round=on_round)
    figures = {mode: [r.value for r in rs] for mode, rs in runs.items()}
    medians = {mode: {k: statistics.median(f[k] for f in fs) for k in fs[0]} for mode, fs in figures.items()}
    result = {"medians": medians, "rounds": figures, "conditions": conditions(runs, a.max_load, a.threads),
              "break_even_steps": statistics.median(break_even(e, c, "") for e, c in zip(*figures.values())),
              "break_even_steps_cpu": statistics.median(break_even(e, c, "cpu_") for e, c in zip(*figures.values()))}
    e, c = medians["eager"], medians["compiled"]
    print(f"steady step: eager {1e3 * e['step_s']:.1f} ms ({1e3 * e['step_cpu_s']:.1f} CPU-ms), compiled "
          f"{1e3 * c['step_s']:.1f} ms ({1e3 * c['step_cpu_s']:.1f} CPU-ms); fixed cost: eager {e['fixed_s']:.1f} s "
          f"({e['fixed_cpu_s']:.1f} CPU-s), compiled {c['fixed_s']:.1f} s ({c['fixed_cpu_s']:.1f} CPU-s)")
    print(f"break-even: {result['break_even_steps']:.0f} steps by the clock, {result['break_even_steps_cpu']:.0f} by "
          f"CPU time (medians of the per-round figures over {a.rounds} rounds)")
    print(describe_conditions(result["conditions"]))
    return result


if __name__ == "__main__":
    main()
