"""Train-step benchmark of Pre-Norm vs SiameseNorm (and Post-Norm) DeiT.

Times a full training step (forward, backward, AdamW step) per topology, interleaving the variants
round by round so that machine noise hits all of them alike, and prints median step time, the
ratio to Pre-Norm, activation memory (bytes autograd saves for backward, any device), peak
accelerator memory (GPU only) and parameter counts.

    python -m scripts.bench_block --model tiny --img-size 32 --patch-size 4 --batch-size 64
    python -m scripts.bench_block --device cuda --dtype bfloat16 --batch-size 256     # GPU, paper size
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, Dict, Sequence

import torch
from torch import nn


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(device: torch.device) -> float:
    """Peak allocated accelerator memory; NaN on CPU, where no per-model peak is available."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return float("nan")


def saved_activation_mb(model: nn.Module, loss_fn, batch, autocast) -> float:
    """Bytes autograd saves for backward in one forward: the activation memory, on any device."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss_fn(model, batch)
    return total / 2**20


def time_train_steps(
    builders: Dict[str, Callable[[], nn.Module]],
    make_batch: Callable[[], tuple],
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor],
    steps: int = 20,
    warmup: int = 3,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    compile: bool = False,
) -> Dict[str, dict]:
    """Median train-step time (ms), peak memory (MB) and parameter count of each model.

    ``dtype`` (bf16/fp16) runs forward and loss under autocast, as training does. Variants are run
    in turns, one step each per round, after ``warmup`` untimed steps each.
    """
    device = torch.device(device)
    models, optimizers, times = {}, {}, {name: [] for name in builders}
    for name, build in builders.items():
        model = build().to(device).train()
        models[name] = torch.compile(model) if compile else model
        optimizers[name] = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    batch = tuple(t.to(device) if torch.is_tensor(t) else t for t in make_batch())
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype not in (None, torch.float32))
    peak, activations = {}, {}

    def step(name):
        optimizers[name].zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(models[name], batch)
        loss.backward()
        optimizers[name].step()

    for name in builders:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warmup):
            step(name)
        _sync(device)
        peak[name] = _peak_memory_mb(device)
        activations[name] = saved_activation_mb(models[name], loss_fn, batch, autocast)
    for _ in range(steps):
        for name in builders:
            _sync(device)
            start = time.perf_counter()
            step(name)
            _sync(device)
            times[name].append(time.perf_counter() - start)
    results = {
        name: dict(
            median_ms=1e3 * statistics.median(times[name]),
            peak_mem_mb=peak[name],
            activation_mb=activations[name],
            params=sum(p.numel() for p in models[name].parameters()),
        )
        for name in builders
    }
    del models, optimizers
    gc.collect()
    return results


def print_report(results: Dict[str, dict], baseline: str = "pre", title: str = "") -> None:
    if title:
        print(title)
    base = results.get(baseline)
    print(f"{'variant':<10} {'median ms':>10} {'x ' + baseline:>8} {'act MB':>9} {'x ' + baseline:>8} "
          f"{'peak MB':>9} {'params':>12} {'+params':>9}")
    for name, r in results.items():
        ratio = r["median_ms"] / base["median_ms"] if base else float("nan")
        extra = r["params"] - base["params"] if base else 0
        act_ratio = r["activation_mb"] / base["activation_mb"] if base else float("nan")
        print(f"{name:<10} {r['median_ms']:>10.2f} {ratio:>8.3f} {r['activation_mb']:>9.1f} {act_ratio:>8.3f} "
              f"{r['peak_mem_mb']:>9.1f} {r['params']:>12,} {extra:>+9,}")


def add_timing_args(parser: argparse.ArgumentParser, batch_size: int, steps: int, warmup: int) -> None:
    """The options every train-step benchmark shares (batch, steps, device, dtype, compile, checkpointing)."""
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="autocast dtype (float32: no autocast, TF32 matmuls on CUDA)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each model first")
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def apply_timing_args(args: argparse.Namespace) -> None:
    """CPU threads as asked; TF32 matmuls on CUDA (the fp32 setting of the DiT recipe)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


DEIT_SIZES = {"tiny": "deit_tiny_siamese_patch16_224", "small": "deit_small_siamese_patch16_224",
              "base": "deit_base_siamese_patch16_224"}


def main(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(DEIT_SIZES), default="tiny", help="DeiT size")
    parser.add_argument("--topologies", default="pre,siamese,post", help="comma-separated; first is the baseline")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--num-classes", type=int, default=10)
    add_timing_args(parser, batch_size=64, steps=20, warmup=3)
    args = parser.parse_args(argv)

    import timm

    import vision  # noqa: F401

    apply_timing_args(args)
    topologies = args.topologies.split(",")

    def builder(topology):
        def build():
            torch.manual_seed(0)
            m = timm.create_model(DEIT_SIZES[args.model], topology=topology, img_size=args.img_size,
                                  patch_size=args.patch_size, num_classes=args.num_classes)
            m.set_grad_checkpointing(args.grad_checkpointing)
            return m
        return build

    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=gen),
             torch.randint(0, args.num_classes, (args.batch_size,), generator=gen))
    results = time_train_steps(
        {t: builder(t) for t in topologies}, lambda: batch,
        lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        steps=args.steps, warmup=args.warmup, device=args.device,
        dtype=getattr(torch, args.dtype), compile=args.compile,
    )
    print_report(results, baseline=topologies[0], title=(
        f"DeiT-{args.model} {args.img_size}px/patch {args.patch_size}, batch {args.batch_size}, {args.dtype}, "
        f"{args.device}, {torch.get_num_threads()} threads, median of {args.steps} train steps (fwd+bwd+AdamW)"))
    return results


if __name__ == "__main__":
    main()
