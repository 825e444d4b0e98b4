"""What every benchmark shares: the one timing loop (variants in alternating rounds), device sync, memory
measurement, the conditions a figure was taken under, the report and ratio printing, and the common arguments
(``--threads``, ``--rounds``, ``--max-load``).

Variants alternate round by round (one call each per round, the order flipped every other round when asked) so
that a busy machine slows all of them alike; a figure is a median over rounds, and a ratio is to the first
variant (the baseline). Every call records its wall time, its CPU time (this process's, and that of the processes
it started and waited for) and the 1-minute load average before and after it; every round, the load before its
first call and after its last. A round above ``--max-load`` is marked LOADED: there the wall clock measures the
machine's other work as much as the benchmark's.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

# Dense bf16 tensor-core peaks (FLOP/s) by device name, for MFU; MFU is null on other devices.
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362.1e12, "A10G": 70e12, "L4": 121e12}

_START = time.perf_counter()


def progress(message: str) -> None:
    """One line on stderr with the seconds since the benchmark started (the tables go to stdout)."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def restart_clock() -> None:
    """Count :func:`progress` seconds from now (each benchmark run starts its own clock)."""
    global _START
    _START = time.perf_counter()


def sync(device: Optional[torch.device | str] = None) -> None:
    """Wait for the accelerator's queued work (nothing to wait for on a CPU)."""
    device = torch.device(device) if device is not None else None
    if (device is None and torch.cuda.is_available()) or (device is not None and device.type == "cuda"):
        torch.cuda.synchronize(device)


def load_average() -> float:
    """The 1-minute load average: processes running or waiting for a core, averaged over the last minute (NaN where
    the system keeps none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def children_cpu_seconds() -> float:
    """CPU seconds of this process's children that have ended and been waited for (their own children included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Run(NamedTuple):
    """One timed call: wall seconds, this process's CPU seconds, what the call returned, the CPU seconds of the
    processes it started and waited for (a command, a loader's workers), and the load average before and after."""
    seconds: float
    cpu_seconds: float
    value: Any
    children_cpu_seconds: float = 0.0
    load: Tuple[float, float] = (math.nan, math.nan)


def time_call(fn: Callable[[], Any], device: Optional[torch.device | str] = None) -> Run:
    """``fn()`` timed between two device syncs."""
    sync(device)
    load_before = load_average()
    start, cpu_start, children_start = time.perf_counter(), time.process_time(), children_cpu_seconds()
    value = fn()
    sync(device)
    return Run(time.perf_counter() - start, time.process_time() - cpu_start, value,
               children_cpu_seconds() - children_start, (load_before, load_average()))


class Rounds(dict):
    """What :func:`alternate` returns: ``{variant: [its Run of each round]}``, and in ``loads`` each round's load
    average before its first call and after its last."""

    def __init__(self, names):
        super().__init__({name: [] for name in names})
        self.loads: List[Tuple[float, float]] = []


def alternate(variants: Dict[str, Callable[[], Any]], rounds: int, device: Optional[torch.device | str] = None,
              flip: bool = False, on_round: Optional[Callable[[int, Rounds], None]] = None) -> Rounds:
    """The timing loop: ``rounds`` rounds, each calling every variant once in turn (in reverse order every other
    round with ``flip``); ``on_round(round_index, runs)`` after each round (progress lines)."""
    runs = Rounds(variants)
    for round_index in range(rounds):
        names = list(variants)[::-1] if flip and round_index % 2 else list(variants)
        load_before = load_average()
        for name in names:
            runs[name].append(time_call(variants[name], device))
        runs.loads.append((load_before, load_average()))
        if on_round is not None:
            on_round(round_index, runs)
    return runs


# ------------------------------------------------------------------------------------ the conditions
def default_max_load() -> float:
    """Above one runnable process per core, a benchmark's processes wait for a core: the core count."""
    return float(os.cpu_count() or 1)


def load_bar(max_load: float, workers: Optional[int] = None) -> float:
    """The load above which a round is marked: ``max_load`` plus the benchmark's own data workers, which are load it
    makes itself (a side with one worker keeps two processes busy, so a quiet machine reads about 2 on 2 cores)."""
    return max_load + (workers or 0)


def is_loaded(load: Tuple[float, float], max_load: float, workers: Optional[int] = None) -> bool:
    return max(load) > load_bar(max_load, workers)


def load_note(load: Tuple[float, float], max_load: float, workers: Optional[int] = None) -> str:
    """``load 1.2->1.4``, with ``LOADED (above 2)`` when either end is above :func:`load_bar`."""
    note = f"load {load[0]:.1f}->{load[1]:.1f}"
    return note + (f" LOADED (above {load_bar(max_load, workers):g})" if is_loaded(load, max_load, workers) else "")


def conditions(runs: Rounds, max_load: float, threads: Optional[int] = None, workers: Optional[int] = None) -> dict:
    """The conditions of :func:`alternate`'s rounds, for the JSON and :func:`describe_conditions`: cores, threads
    and data workers per side, each round's load and which rounds were above ``max_load``, and per side the medians
    of wall time, this process's CPU time and its children's."""
    return {
        "cores": os.cpu_count(), "threads": torch.get_num_threads() if threads is None else threads,
        "workers": workers, "max_load": max_load, "round_loads": [list(load) for load in runs.loads],
        "loaded_rounds": [i + 1 for i, load in enumerate(runs.loads) if is_loaded(load, max_load, workers)],
        "sides": {name: {"wall_s": statistics.median(r.seconds for r in rs),
                         "cpu_s": statistics.median(r.cpu_seconds for r in rs),
                         "children_cpu_s": statistics.median(r.children_cpu_seconds for r in rs)}
                  for name, rs in runs.items() if rs},
    }


def describe_conditions(c: dict) -> str:
    """One line: cores, threads, workers, the load over the rounds, and whether the figures are loaded ones."""
    loads = [x for load in c["round_loads"] for x in load]
    rounds, loaded = len(c["round_loads"]), len(c["loaded_rounds"])
    workers = "" if c["workers"] is None else f", {c['workers']} data worker(s) per side"
    low, high = min(loads, default=math.nan), max(loads, default=math.nan)
    text = (f"conditions: {c['cores']} cores, {c['threads']} thread(s){workers}; load {low:.1f}-{high:.1f} over "
            f"{rounds} round(s)")
    bar = f"--max-load {c['max_load']:g}" + (f" + its {c['workers']} data worker(s)" if c["workers"] else "")
    if loaded:
        return text + (f"; {loaded} of {rounds} above {bar} (rounds "
                       f"{', '.join(map(str, c['loaded_rounds']))}): LOADED, not a quiet-machine figure")
    return text + f", none above {bar}"


def bound(wall_s: float, main_cpu_s: float, workers_cpu_s: float, workers: int) -> dict:
    """Which process bounds a rate that a main process and ``workers`` data workers make together: the busier one,
    by its CPU seconds over the wall seconds (one worker's share of the workers' CPU). With no workers the main
    process also loads the data, so it is the bound."""
    main_busy = main_cpu_s / wall_s if wall_s > 0 else math.nan
    worker_busy = max(workers_cpu_s, 0.0) / workers / wall_s if workers and wall_s > 0 else 0.0
    return {"main_busy": main_busy, "worker_busy": worker_busy,
            "bound": "data worker" if workers and worker_busy > main_busy else "main process"}


def describe_bound(b: dict) -> str:
    return (f"bound by the {b['bound']} (main process busy {b['main_busy']:.0%} of the wall time, "
            f"each data worker {b['worker_busy']:.0%})")


@contextlib.contextmanager
def stopped_with(proc: subprocess.Popen):
    """Kill ``proc`` (and wait for it) when the block ends by an exception: a stopped benchmark (a budget's alarm,
    Ctrl-C) leaves no command of it running."""
    try:
        yield proc
    except BaseException:
        proc.kill()
        proc.wait()
        raise


class CpuClock:
    """Polls the CPU seconds (user + system, from /proc) of a child process and of its descendants (a loader's
    workers) every ``period`` seconds while it runs: ``samples`` holds ``(wall time, main CPU s, workers CPU s)``;
    :meth:`totals` after it ended."""

    def __init__(self, pid: int, period: float = 0.05):
        self.pid, self.period, self.samples = pid, period, []
        self.children_before = children_cpu_seconds()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _cpu(self, pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.tick

    def _descendants(self, pid: int) -> list:
        kids = []
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                kids += [int(k) for k in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):  # it, or one of its threads, ended since the listing
            pass
        return kids + [d for k in kids for d in self._descendants(k)]

    def _workers_cpu(self) -> float:
        total = 0.0
        for kid in self._descendants(self.pid):
            try:
                total += self._cpu(kid)
            except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):  # it ended since the listing
                pass
        return total

    def _poll(self):
        while True:
            try:
                main, workers = self._cpu(self.pid), self._workers_cpu()
            except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):  # the process itself ended
                return
            self.samples.append((time.time(), main, workers))
            time.sleep(self.period)

    def at(self, wall: float) -> tuple:
        """(main, workers) CPU seconds at wall time ``wall`` (the last sample before it)."""
        before = [s for s in self.samples if s[0] <= wall] or self.samples[:1]
        return before[-1][1:]

    def totals(self) -> Tuple[float, float]:
        """Once the process has been waited for: (its own CPU seconds, as last polled; those of every process it
        started, the rest of what the system counted for it: workers, compile workers, its last poll's tail)."""
        everything = children_cpu_seconds() - self.children_before
        main = self.samples[-1][1] if self.samples else everything
        return main, max(everything - main, 0.0)


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated accelerator memory; NaN on CPU, where no per-model peak is available."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return float("nan")


def saved_activation_mb(model: nn.Module, loss_fn, batch, autocast) -> float:
    """Activation memory of one forward: the bytes of the tensors autograd saves for backward.

    Counted per storage (views of one buffer, e.g. q, k and v of one qkv projection, count once, at the
    size of the buffer they keep alive). Not counted: parameters, and their low-precision copies under
    autocast (a saved tensor with a parameter's shape, or its transpose, in a narrower dtype; activations
    carry the batch dimension, so they do not collide). Works on a ``torch.compile``d model too: the hooks
    see what the compiled graph saves for its backward.
    """
    params = list(model.parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    param_shapes = {(tuple(p.shape), p.dtype) for p in params} | {(tuple(p.shape[::-1]), p.dtype) for p in params}
    seen, total = set(), 0

    def is_weight_copy(t):
        return any(shape == tuple(t.shape) and t.dtype.itemsize < dtype.itemsize for shape, dtype in param_shapes)

    def pack(t):
        nonlocal total
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in param_storages and not is_weight_copy(t):
            seen.add(key)
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss = loss_fn(model, batch)
    del loss
    return total / 2**20


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Autocast to ``dtype`` (bf16/fp16) on ``device``; off for float32 or None."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype not in (None, torch.float32))


def print_report(results: Dict[str, dict], baseline: str = "pre", title: str = "") -> None:
    """The train-step table (median and CPU ms, saved activations, peak memory, parameters, each against the
    baseline), then one line per variant with its ratios side by side."""
    if title:
        print(title)
    base = results.get(baseline)
    print(f"{'variant':<18} {'median ms':>10} {'x ' + baseline:>8} {'cpu ms':>10} {'x ' + baseline:>8} "
          f"{'act MB':>9} {'x ' + baseline:>8} {'peak MB':>9} {'params':>12} {'+params':>9}")
    for name, r in results.items():
        ratio = r["median_ms"] / base["median_ms"] if base else float("nan")
        cpu_ratio = r["cpu_ms"] / base["cpu_ms"] if base else float("nan")
        extra = r["params"] - base["params"] if base else 0
        act_ratio = r["activation_mb"] / base["activation_mb"] if base else float("nan")
        print(f"{name:<18} {r['median_ms']:>10.2f} {ratio:>8.3f} {r['cpu_ms']:>10.2f} {cpu_ratio:>8.3f} "
              f"{r['activation_mb']:>9.1f} {act_ratio:>8.3f} {r['peak_mem_mb']:>9.1f} {r['params']:>12,} {extra:>+9,}")
    if base:
        for name, r in results.items():
            if name != baseline:
                print(f"{name}/{baseline}: step time {r['median_ms'] / base['median_ms']:.3f} "
                      f"(CPU time {r['cpu_ms'] / base['cpu_ms']:.3f}), "
                      f"saved activations {r['activation_mb'] / base['activation_mb']:.3f}")
    if "conditions" in next(iter(results.values())):
        print(describe_conditions(next(iter(results.values()))["conditions"]))


def print_memory_report(results: Dict[str, Dict[str, float]], baseline: str = "pre", title: str = "") -> None:
    """The activation-memory table (one column per precision and mode) and each variant's ratios."""
    if title:
        print(title)
    columns = list(next(iter(results.values())))
    print(f"{'variant':<18}" + "".join(f" {c + ' MB':>19} {'x ' + baseline:>8}" for c in columns))
    for name, r in results.items():
        base = results.get(baseline, r)
        print(f"{name:<18}" + "".join(f" {r[c]:>19.1f} {r[c] / base[c]:>8.3f}" for c in columns))
    if baseline in results:
        for name, r in results.items():
            if name != baseline:
                print(f"{name}/{baseline} saved activations: " + ", ".join(
                    f"{c} {r[c] / results[baseline][c]:.3f}" for c in columns))


def add_common_args(parser: argparse.ArgumentParser, rounds: int | None, rounds_help: str, threads: int | None = None,
                    threads_help: str = "torch CPU threads") -> None:
    """``--rounds`` (alternating timing rounds), ``--threads`` (torch CPU threads) and ``--max-load`` (the load above
    which a round is marked LOADED), which every benchmark takes."""
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    parser.add_argument("--threads", type=int, default=threads,
                        help=threads_help + (f" (default {threads})" if threads else " (default: torch's)"))
    parser.add_argument("--max-load", type=float, default=default_max_load(),
                        help="a round whose 1-minute load average, before or after it, is above this (plus the data "
                             "workers each side runs: load the benchmark makes itself) is marked LOADED in the output "
                             f"and the JSON (default: the core count, {default_max_load():g})")


def apply_common_args(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
