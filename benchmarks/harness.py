"""What every benchmark shares: the one timing loop (variants in alternating rounds), device sync, memory
measurement, the report and ratio printing, and the common arguments (``--threads``, ``--rounds``).

Variants alternate round by round (one call each per round, the order flipped every other round when asked) so
that a busy machine slows all of them alike; a figure is a median over rounds, and a ratio is to the first
variant (the baseline).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional

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


class Run(NamedTuple):
    """One timed call: wall seconds, the process's CPU seconds, and what the call returned."""
    seconds: float
    cpu_seconds: float
    value: Any


def time_call(fn: Callable[[], Any], device: Optional[torch.device | str] = None) -> Run:
    """``fn()`` timed between two device syncs."""
    sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    value = fn()
    sync(device)
    return Run(time.perf_counter() - start, time.process_time() - cpu_start, value)


def alternate(variants: Dict[str, Callable[[], Any]], rounds: int, device: Optional[torch.device | str] = None,
              flip: bool = False, on_round: Optional[Callable[[int, Dict[str, List[Run]]], None]] = None
              ) -> Dict[str, List[Run]]:
    """The timing loop: ``rounds`` rounds, each calling every variant once in turn (in reverse order every other
    round with ``flip``); ``on_round(round_index, runs)`` after each round (progress lines)."""
    runs: Dict[str, List[Run]] = {name: [] for name in variants}
    for round_index in range(rounds):
        names = list(variants)[::-1] if flip and round_index % 2 else list(variants)
        for name in names:
            runs[name].append(time_call(variants[name], device))
        if on_round is not None:
            on_round(round_index, runs)
    return runs


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
    """``--rounds`` (alternating timing rounds) and ``--threads`` (torch CPU threads), which every benchmark takes."""
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    parser.add_argument("--threads", type=int, default=threads,
                        help=threads_help + (f" (default {threads})" if threads else " (default: torch's)"))


def apply_common_args(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
