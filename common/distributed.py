"""Process-group plumbing on top of accelerate: one way to build the accelerator, seed, and reduce.

Works the same under ``python -m``, ``accelerate launch`` (GPUs, nodes) and ``torchrun`` (also CPU/gloo):
accelerate reads the launcher's environment.

    accelerator = build_accelerator(precision="auto", run_dir="runs/x")   # bf16 on CUDA, fp32 on CPU
    seed_everything(cfg.seed, accelerator.process_index)                  # distinct, reproducible per rank
    mean_loss = reduce_mean(accelerator, loss)                            # same value on every rank
    states = gather_objects(accelerator, capture_rng_state())             # list, one entry per rank
"""
from __future__ import annotations

import os
import random
import warnings
from typing import Any, List, Optional, Union

import numpy as np
import torch

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(precision: str) -> str:
    """``auto`` -> ``bf16`` on a CUDA device that supports it, else ``fp32`` (CPU autocast is slow)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    return precision


def build_accelerator(precision: str = "auto", run_dir: Optional[Union[str, os.PathLike]] = None,
                      tensorboard: bool = True, cpu: bool = False):
    """An :class:`accelerate.Accelerator` with our defaults.

    ``precision``: ``auto`` | ``fp32`` | ``bf16`` (autocast; weights and optimizer stay fp32).
    ``tensorboard``: log through accelerate's TensorBoard tracker into ``run_dir/tb``.
    On CUDA, TF32 and cudnn's autotuner are enabled (:func:`use_fast_cuda_kernels`).
    """
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    mixed = {"fp32": "no", "bf16": "bf16"}[resolve_precision(precision)]
    use_tb = tensorboard and run_dir is not None
    project = ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir)) if run_dir else None
    # accelerate only joins a CPU process group (gloo, e.g. under torchrun) when told cpu=True.
    cpu = cpu or not torch.cuda.is_available()
    accelerator = Accelerator(mixed_precision=mixed, cpu=cpu, log_with="tensorboard" if use_tb else None,
                              project_config=project)
    use_fast_cuda_kernels()
    return accelerator


def use_fast_cuda_kernels(deterministic: bool = False) -> None:
    """On CUDA: TF32 matmuls and convolutions (as DiT and timm do), and cudnn's autotuner for the fixed shapes of a
    run (VAE, Inception, patch embeddings) unless ``deterministic``: the autotuner may pick other kernels run to run."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = not deterministic


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch (all devices) with ``seed + rank``; returns that seed."""
    s = int(seed) + int(rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return s


def reduce_mean(accelerator, value: Union[torch.Tensor, float]) -> torch.Tensor:
    """Mean of a scalar over all processes (a detached float32 tensor on the accelerator's device)."""
    t = torch.as_tensor(value, dtype=torch.float32, device=accelerator.device).detach().clone()
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="mean")
    return t


def reduce_sum(accelerator, value: Union[torch.Tensor, float]) -> torch.Tensor:
    """Sum of a scalar or tensor over all processes."""
    t = torch.as_tensor(value, device=accelerator.device).detach().clone()
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
    return t


def gather_objects(accelerator, obj: Any) -> List[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (picklable objects)."""
    if accelerator.num_processes == 1:
        return [obj]
    import torch.distributed as dist

    out: List[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(out, obj)
    return out


def check_divisible(global_batch: int, world_size: int, grad_accum: int = 1) -> int:
    """Per-process micro-batch size for a global batch; a clear error when it does not divide."""
    denom = world_size * grad_accum
    if global_batch % denom:
        raise ValueError(f"global batch size {global_batch} is not divisible by processes ({world_size}) x "
                         f"gradient accumulation ({grad_accum}); change optim.batch_size or optim.grad_accum")
    return global_batch // denom


def warn_once_main(accelerator, message: str) -> None:
    if accelerator.is_main_process:
        warnings.warn(message, stacklevel=2)
