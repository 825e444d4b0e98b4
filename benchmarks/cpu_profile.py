"""Where a command's CPU time goes: one run of an entry point (ours) or a script (a peer's) in this process, under
``torch.profiler`` (the torch ops, by their own CPU time) and ``cProfile`` (the Python functions, by their own time:
what no torch op covers, such as Pillow's JPEG decode and resize).

    python -m benchmarks.cpu_profile -- diffusion.sample --checkpoint dit.pt --model DiT-S/8 ...     # an entry point
    python -m benchmarks.cpu_profile --script benchmarks/dit_shim.py -- /tmp/DiT VAE sample.py cpu -- --model DiT-S/8 ...
    python -m benchmarks.cpu_profile --top 15 -- vision.evaluate data.num_workers=0 ...    # decoding in this process

It prints the ``--top`` torch ops and Python functions with their share of the run's CPU time, the share of the
whole that the listed torch ops take, and writes nothing (a command's own outputs aside). Data workers run in other
processes, out of the profile: give the command 0 workers to see its data loading here. ``--threads``: torch's CPU
threads in this process (default 1).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import runpy
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from benchmarks.harness import load_average


def run_profiled(target: str, args: Sequence[str], script: bool) -> tuple:
    """Run ``target`` (a module, or with ``script`` a file, its folder first on ``sys.path`` as when Python runs it)
    as ``__main__`` with ``args``: (torch profile, cProfile statistics, CPU seconds). A command that ends by
    ``SystemExit(0)`` counts as done."""
    argv, path = sys.argv, list(sys.path)
    sys.argv = [target, *args]
    if script:
        sys.path.insert(0, str(Path(target).resolve().parent))
    python = cProfile.Profile()
    cpu_start = time.process_time()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as ops:
        python.enable()
        try:
            runpy.run_path(target, run_name="__main__") if script else runpy.run_module(target, run_name="__main__")
        except SystemExit as end:
            if end.code not in (None, 0):
                raise
        finally:
            python.disable()
            sys.argv, sys.path[:] = argv, path
    return ops, pstats.Stats(python), time.process_time() - cpu_start


def top_ops(ops, top: int) -> list:
    """``[(op, self CPU seconds, calls)]`` of the ``top`` torch ops by their own CPU time."""
    rows = sorted(ops.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in rows]


def top_functions(stats: pstats.Stats, top: int) -> list:
    """``[(file:line(function), own seconds, calls)]`` of the ``top`` Python functions by their own time."""
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [(f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({name})", own, calls)
            for (file, line, name), (_, calls, own, _, _) in rows]


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_profile", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", default=None, help="profile this file (a peer's script) instead of an entry point")
    p.add_argument("--top", type=int, default=12, help="rows of each table (default 12)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("command", nargs="*", help="after --: the entry point and its arguments, or the script's arguments")
    a = p.parse_args(argv)
    if not a.script and not a.command:
        p.error("name the entry point to profile after --, e.g. -- diffusion.fid --samples ... (or give --script)")
    torch.set_num_threads(a.threads)
    target, args = (a.script, a.command) if a.script else (a.command[0], a.command[1:])
    load_before = load_average()
    ops, stats, cpu_s = run_profiled(target, args, script=a.script is not None)
    load = (load_before, load_average())
    result = {"target": target, "cpu_s": cpu_s, "load": load, "ops": top_ops(ops, a.top),
              "functions": top_functions(stats, a.top)}
    listed = sum(seconds for _, seconds, _ in result["ops"])
    print(f"\n{target}: {cpu_s:.1f} CPU-s in this process, {torch.get_num_threads()} thread(s), load "
          f"{load[0]:.1f}->{load[1]:.1f}; the top {len(result['ops'])} torch ops take {listed / cpu_s:.0%} of it")
    print(f"{'torch op':<44} {'self CPU s':>10} {'share':>7} {'calls':>8}")
    for name, seconds, calls in result["ops"]:
        print(f"{name[:44]:<44} {seconds:>10.2f} {seconds / cpu_s:>7.1%} {calls:>8}")
    print(f"\n{'Python function (own time)':<64} {'s':>8} {'share':>7} {'calls':>8}")
    for name, seconds, calls in result["functions"]:
        print(f"{name[:64]:<64} {seconds:>8.2f} {seconds / cpu_s:>7.1%} {calls:>8}")
    return result


if __name__ == "__main__":
    main()
