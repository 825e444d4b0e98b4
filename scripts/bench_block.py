"""Train-step and activation-memory benchmark of Pre-Norm vs SiameseNorm (and Post-Norm) DeiT.

Default mode: times a full training step (forward, backward, AdamW step) per variant, interleaving the
variants round by round so that machine noise hits all of them alike, and prints median step time, the
ratio to the first variant, activation memory (bytes autograd saves for backward, any device), peak
accelerator memory (GPU only) and parameter counts.

``--memory``: no timing; the activation memory of one forward, fp32 and bf16 autocast, eager and (with
``--compile``) compiled, and its ratio to the first variant.

Variants are topologies with the model's defaults, or a topology with model options after ``+``:
``siamese+recompute_norms`` is SiameseNorm with ``recompute_norms=True`` (its norm chain fused into one autograd
node that rebuilds the ``LN_in`` input in backward; plain ``siamese`` runs the three norm modules, which store it),
``hc+hc_streams=2`` sets an integer. After the table, one line per variant gives its step-time and
saved-activation ratios to the first variant side by side. Progress goes to stderr as it happens.

    python -m scripts.bench_block --model tiny --img-size 32 --patch-size 4 --batch-size 64 --threads 1
    python -m scripts.bench_block --model small --img-size 224 --patch-size 16 --batch-size 2 --memory \\
        --topologies pre,siamese+recompute_norms,siamese --compile --compile-backend aot_eager_decomp_partition
    python -m scripts.bench_block --device cuda --dtype bfloat16 --batch-size 256     # GPU, paper size
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Callable, Dict, Sequence

import torch
from torch import nn

_START = time.perf_counter()


def progress(message: str) -> None:
    """One line on stderr with the seconds since the benchmark started (the table goes to stdout)."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def restart_clock() -> None:
    """Count :func:`progress` seconds from now (each benchmark run starts its own clock)."""
    global _START
    _START = time.perf_counter()


def variant_kwargs(variant: str) -> dict:
    """Model keyword arguments of a benchmark variant ``TOPOLOGY[+OPTION[=VALUE]]...``: ``siamese``,
    ``siamese+recompute_norms`` (``recompute_norms=True``), ``hc+hc_streams=2``, ``hc+hc_dynamic=false``."""
    import yaml

    topology, *options = variant.split("+")
    kwargs = {"topology": topology}
    for option in options:
        key, _, value = option.partition("=")
        kwargs[key] = yaml.safe_load(value) if value else True
    return kwargs


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(device: torch.device) -> float:
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


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype not in (None, torch.float32))


def time_train_steps(
    builders: Dict[str, Callable[[], nn.Module]],
    make_batch: Callable[[], tuple],
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor],
    steps: int = 20,
    warmup: int = 3,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    compile: bool = False,
    compile_backend: str = "inductor",
    log: Callable[[str], None] = progress,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    sequential: bool = False,
) -> Dict[str, dict]:
    """Median train-step time (ms), peak memory (MB) and parameter count of each model.

    ``cpu_ms`` is the median CPU time of the process per step: on a CPU shared with other jobs it
    leaves out the time spent waiting for a core, so its ratios are steadier than wall-clock ones
    (with one thread; several threads add their spin-waits to it).

    ``dtype`` (bf16/fp16) runs forward and loss under autocast, as training does. Variants are run
    in turns, one step each per round, after ``warmup`` untimed steps each. ``log`` receives a line
    per model built and warmed up, and one at least every 10 s while timing.

    ``make_optimizer`` (default: foreach AdamW) builds each model's optimizer, e.g. the trainer's fused AdamW.
    ``sequential``: each model is built, warmed up, timed and freed before the next is built, so its peak memory
    is its own (in turns, every model and its optimizer state is alive while any of them runs).
    """
    if sequential:
        results = {}
        for name, build in builders.items():
            results.update(time_train_steps({name: build}, make_batch, loss_fn, steps, warmup, device, dtype, compile,
                                            compile_backend, log, make_optimizer))
            gc.collect()
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
        return results
    device = torch.device(device)
    models, optimizers = {}, {}
    times, cpu_times = {name: [] for name in builders}, {name: [] for name in builders}
    for name, build in builders.items():
        model = build().to(device).train()
        models[name] = torch.compile(model, backend=compile_backend) if compile else model
        optimizers[name] = (make_optimizer(model) if make_optimizer is not None
                            else torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05))
    batch = tuple(t.to(device) if torch.is_tensor(t) else t for t in make_batch())
    autocast = _autocast(device, dtype)
    peak, activations = {}, {}

    def step(name):
        optimizers[name].zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(models[name], batch)
        loss.backward()
        optimizers[name].step()

    for name in builders:
        log(f"{name}: {warmup} warm-up steps{' (compiles)' if compile else ''}")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warmup):
            step(name)
        _sync(device)
        peak[name] = _peak_memory_mb(device)
        activations[name] = saved_activation_mb(models[name], loss_fn, batch, autocast)
        log(f"{name}: ready, {activations[name]:.1f} MB saved for backward")
    last_log = time.perf_counter()
    for round_index in range(steps):
        for name in builders:
            _sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            step(name)
            _sync(device)
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)
        if time.perf_counter() - last_log >= 10.0 or round_index == steps - 1:
            last_log = time.perf_counter()
            log(f"round {round_index + 1}/{steps}: " + ", ".join(
                f"{name} {1e3 * statistics.median(t):.1f} ms" for name, t in times.items()))
    results = {
        name: dict(
            median_ms=1e3 * statistics.median(times[name]),
            cpu_ms=1e3 * statistics.median(cpu_times[name]),
            peak_mem_mb=peak[name],
            activation_mb=activations[name],
            params=sum(p.numel() for p in models[name].parameters()),
        )
        for name in builders
    }
    del models, optimizers
    gc.collect()
    return results


def measure_activations(
    builders: Dict[str, Callable[[], nn.Module]],
    make_batch: Callable[[], tuple],
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor],
    device: str | torch.device = "cpu",
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    compile: bool = False,
    compile_backend: str = "inductor",
    log: Callable[[str], None] = progress,
) -> Dict[str, Dict[str, float]]:
    """Activation memory (MB, :func:`saved_activation_mb`) of one training-mode forward per variant, for each
    autocast dtype, eager and, with ``compile``, compiled (after one compiling forward and backward).

    Returns ``{variant: {"float32 eager": MB, "float32 compiled": MB, ...}}``.
    """
    device = torch.device(device)
    batch = tuple(t.to(device) if torch.is_tensor(t) else t for t in make_batch())
    results = {name: {} for name in builders}
    for name, build in builders.items():
        model = build().to(device).train()
        for dtype_name in dtypes:
            autocast = _autocast(device, getattr(torch, dtype_name))
            results[name][f"{dtype_name} eager"] = saved_activation_mb(model, loss_fn, batch, autocast)
            log(f"{name} {dtype_name} eager: {results[name][f'{dtype_name} eager']:.1f} MB")
            if compile:
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=compile_backend)
                with autocast:
                    loss = loss_fn(compiled, batch)
                loss.backward()
                model.zero_grad(set_to_none=True)
                results[name][f"{dtype_name} compiled"] = saved_activation_mb(compiled, loss_fn, batch, autocast)
                log(f"{name} {dtype_name} compiled ({compile_backend}): "
                    f"{results[name][f'{dtype_name} compiled']:.1f} MB")
        del model
        gc.collect()
    return results


def print_report(results: Dict[str, dict], baseline: str = "pre", title: str = "") -> None:
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


def add_timing_args(parser: argparse.ArgumentParser, batch_size: int, steps: int, warmup: int) -> None:
    """The options every train-step benchmark shares (batch, steps, device, dtype, compile, checkpointing)."""
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="autocast dtype (float32: no autocast, TF32 matmuls on CUDA)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each model first")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend; aot_eager_decomp_partition makes inductor's forward/backward "
                             "split (same saved tensors) without its code generation, so compiles fast on CPU")
    parser.add_argument("--memory", action="store_true",
                        help="measure activation memory only (fp32 and bf16 autocast; eager, and compiled with "
                             "--compile) instead of timing train steps")
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def apply_timing_args(args: argparse.Namespace) -> None:
    """CPU threads as asked; TF32 matmuls on CUDA (the fp32 setting of the DiT recipe)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def run_variants(args: argparse.Namespace, builders, make_batch, loss_fn, title: str, baseline: str):
    """Time train steps (default) or measure activation memory (``--memory``) of ``builders`` and print the table."""
    if args.memory:
        results = measure_activations(builders, make_batch, loss_fn, device=args.device,
                                      compile=args.compile, compile_backend=args.compile_backend)
        print_memory_report(results, baseline=baseline, title=(
            f"{title}, batch {args.batch_size}, {args.device}: activation memory of one forward (saved for backward; "
            f"parameters excluded){', compiled with ' + args.compile_backend if args.compile else ''}"))
        return results
    results = time_train_steps(
        builders, make_batch, loss_fn, steps=args.steps, warmup=args.warmup, device=args.device,
        dtype=getattr(torch, args.dtype), compile=args.compile, compile_backend=args.compile_backend,
    )
    print_report(results, baseline=baseline, title=(
        f"{title}, batch {args.batch_size}, {args.dtype}, {args.device}, {torch.get_num_threads()} threads"
        f"{', compiled with ' + args.compile_backend if args.compile else ''}, "
        f"median of {args.steps} train steps (fwd+bwd+AdamW)"))
    return results


DEIT_SIZES = {"tiny": "deit_tiny_siamese_patch16_224", "small": "deit_small_siamese_patch16_224",
              "base": "deit_base_siamese_patch16_224"}


def main(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(DEIT_SIZES), default="tiny", help="DeiT size")
    parser.add_argument("--topologies", default="pre,siamese,post",
                        help="comma-separated variants (topologies, or TOPOLOGY+OPTION[=VALUE], e.g. siamese+recompute_norms); "
                             "the first is the baseline")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--num-classes", type=int, default=10)
    add_timing_args(parser, batch_size=64, steps=20, warmup=3)
    args = parser.parse_args(argv)
    restart_clock()

    import timm

    import vision  # noqa: F401

    apply_timing_args(args)
    variants = args.topologies.split(",")

    def builder(variant):
        def build():
            torch.manual_seed(0)
            m = timm.create_model(DEIT_SIZES[args.model], img_size=args.img_size, patch_size=args.patch_size,
                                  num_classes=args.num_classes, **variant_kwargs(variant))
            m.set_grad_checkpointing(args.grad_checkpointing)
            return m
        return build

    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=gen),
             torch.randint(0, args.num_classes, (args.batch_size,), generator=gen))
    progress(f"DeiT-{args.model} {args.img_size}px: {', '.join(variants)}")
    return run_variants(args, {v: builder(v) for v in variants}, lambda: batch,
                        lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                        title=f"DeiT-{args.model} {args.img_size}px/patch {args.patch_size}", baseline=variants[0])


if __name__ == "__main__":
    main()
