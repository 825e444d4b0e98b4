"""Train-step and activation-memory benchmark of Pre-Norm vs SiameseNorm (and Post-Norm) DiT.

Times forward + backward + AdamW on the DiT noise-prediction objective (MSE on epsilon from random
latents; the diffusion schedule costs nothing next to the transformer) for each variant, with the
variants interleaved step by step (timing loop shared with ``scripts.bench_block``), and prints the
median step time and its ratio to the first variant, the activation memory autograd saves (any
device) and its ratio, peak GPU memory (CUDA only) and parameter counts. ``--memory`` measures
activation memory only (fp32 and bf16 autocast, eager and with ``--compile`` compiled), and variants
are topologies or ``TOPOLOGY+OPTION[=VALUE]`` (``siamese+recompute_norms``: the fused norm chain; plain ``siamese``:
the three norm modules), as in ``scripts.bench_block``, which also prints each variant's ratios side by side.
Progress goes to stderr as it happens.

    python -m scripts.bench_dit --models DiT-S/2,DiT-B/2 --batch-size 8                 # CPU, 32x32 latents
    python -m scripts.bench_dit --models DiT-B/2 --batch-size 2 --memory \
        --topologies pre,siamese+recompute_norms,siamese --compile --compile-backend aot_eager_decomp_partition
    python -m scripts.bench_dit --models DiT-B/2,DiT-L/4 --device cuda --dtype bfloat16 --batch-size 256
"""
from __future__ import annotations

import argparse
from typing import Sequence

import torch
import torch.nn.functional as F

from diffusion.models import DiT_models
from scripts.bench_block import (
    add_timing_args,
    apply_timing_args,
    progress,
    restart_clock,
    run_variants,
    variant_kwargs,
)


def dit_batch(batch_size: int, latent_size: int, in_channels: int, num_classes: int, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, in_channels, latent_size, latent_size, generator=gen),
            torch.randint(0, 1000, (batch_size,), generator=gen),
            torch.randint(0, num_classes, (batch_size,), generator=gen),
            torch.randn(batch_size, in_channels, latent_size, latent_size, generator=gen))


def dit_loss(model, batch) -> torch.Tensor:
    """MSE between the predicted and the true noise (the epsilon half of a learned-sigma output)."""
    x, t, y, noise = batch
    return F.mse_loss(model(x, t, y)[:, : x.shape[1]].float(), noise)


def main(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="DiT-S/2,DiT-B/2",
                        help=f"comma-separated DiT names; one of {', '.join(DiT_models)}")
    parser.add_argument("--topologies", default="pre,siamese,post",
                        help="comma-separated variants (topologies, or TOPOLOGY+OPTION[=VALUE], e.g. siamese+recompute_norms); "
                             "the first is the baseline")
    parser.add_argument("--latent-size", type=int, default=32, help="latent height/width (32 = 256px images)")
    parser.add_argument("--in-channels", type=int, default=4)
    parser.add_argument("--num-classes", type=int, default=1000)
    add_timing_args(parser, batch_size=8, steps=10, warmup=2)
    args = parser.parse_args(argv)
    restart_clock()

    names = args.models.split(",")
    unknown = [n for n in names if n not in DiT_models]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; valid names are {', '.join(DiT_models)}")
    apply_timing_args(args)
    variants = args.topologies.split(",")
    batch = dit_batch(args.batch_size, args.latent_size, args.in_channels, args.num_classes)

    def builder(name, variant):
        def build():
            torch.manual_seed(0)
            model = DiT_models[name](input_size=args.latent_size, in_channels=args.in_channels,
                                     num_classes=args.num_classes, **variant_kwargs(variant))
            model.set_grad_checkpointing(args.grad_checkpointing)
            return model
        return build

    all_results = {}
    for name in names:
        progress(f"{name} {args.latent_size}x{args.latent_size} latents: {', '.join(variants)}")
        all_results[name] = run_variants(
            args, {v: builder(name, v) for v in variants}, lambda: batch, dit_loss,
            title=f"{name} {args.latent_size}x{args.latent_size} latents", baseline=variants[0])
    return all_results


if __name__ == "__main__":
    main()
