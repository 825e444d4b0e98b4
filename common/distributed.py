"""Process-group plumbing on top of accelerate: one way to build the accelerator, seed, and reduce.

Works the same under ``python -m``, ``accelerate launch`` (GPUs, nodes) and ``torchrun`` (also CPU/gloo):
accelerate reads the launcher's environment.

    accelerator = build_accelerator(precision="auto", run_dir="runs/x")   # bf16 on CUDA, fp32 on CPU
    seed_everything(cfg.seed)                                             # the same initial weights on every rank
    seed_everything(rank_seed(cfg.seed, accelerator.process_index))       # then each rank's own streams
    states = gather_objects(accelerator, capture_rng_state())             # list, one entry per rank
"""
from __future__ import annotations

import os
import random
import sys
from typing import Any, List, Optional, Sequence, Union

import numpy as np
import torch

from common.cli import InputError

PRECISIONS = ("auto", "fp32", "bf16")
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one folder per GPU while NVIDIA's kernel driver is loaded
_said_unusable_gpu = False


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, with one line (once a process, from local rank 0) when the machine has NVIDIA
    GPUs this torch cannot use: a CPU-only build, or a CUDA build newer than the driver (pip's default torch is built
    for a recent CUDA). Without it the run would go on on the CPU, many times slower, unannounced."""
    global _said_unusable_gpu
    if torch.cuda.is_available():
        return True
    try:
        gpus = os.listdir(NVIDIA_GPUS)
    except OSError:  # no NVIDIA driver (the usual CPU machine), or a container that hides it
        gpus = []
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")  # the CPU on purpose
    if gpus and not hidden and not _said_unusable_gpu and os.environ.get("LOCAL_RANK", "0") == "0":
        _said_unusable_gpu = True
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        print(f"warning: this machine has {len(gpus)} NVIDIA GPU(s) that torch {torch.__version__} ({build}) cannot "
              "use, so this runs on the CPU; install the torch build for this machine's driver "
              "(https://pytorch.org/get-started/locally/), or set CUDA_VISIBLE_DEVICES= to run on the CPU without "
              "this line", file=sys.stderr, flush=True)
    return False


def resolve_precision(precision: str) -> str:
    """``auto`` -> ``bf16`` on a CUDA device that supports it, else ``fp32`` (CPU autocast is slow)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    return precision


def build_accelerator(precision: str = "auto", run_dir: Optional[Union[str, os.PathLike]] = None,
                      tensorboard: bool = True, cpu: bool = False, timeout_minutes: Optional[float] = None,
                      static_graph: bool = False, trackers: Sequence[str] = ()):
    """An :class:`accelerate.Accelerator` with our defaults.

    ``precision``: ``auto`` | ``fp32`` | ``bf16`` (autocast; weights and optimizer stay fp32).
    ``tensorboard``: log through accelerate's TensorBoard tracker into ``run_dir/tb``; ``trackers``: more of
    accelerate's trackers (``wandb``, ``mlflow``, ...).
    ``timeout_minutes``: how long a collective may wait (a dead or stuck rank) before the process group fails.
    DDP keeps gradients as views of its all-reduce buckets (no copy, less memory); ``static_graph`` is DDP's.
    On CUDA, TF32 and cudnn's autotuner are enabled (:func:`use_fast_cuda_kernels`).
    """
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, ProjectConfiguration

    mixed = {"fp32": "no", "bf16": "bf16"}[resolve_precision(precision)]
    log_with = ([] if run_dir is None else (["tensorboard"] if tensorboard else []) + list(trackers)) or None
    project = ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir)) if run_dir else None
    handlers = [DistributedDataParallelKwargs(gradient_as_bucket_view=True, static_graph=static_graph)]
    if timeout_minutes is not None:
        handlers.append(InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes)))
    # accelerate only joins a CPU process group (gloo, e.g. under torchrun) when told cpu=True.
    cpu = cpu or not cuda_available()
    accelerator = Accelerator(mixed_precision=mixed, cpu=cpu, log_with=log_with,
                              project_config=project, kwargs_handlers=handlers)
    use_fast_cuda_kernels()
    return accelerator


def use_fast_cuda_kernels(deterministic: bool = False) -> None:
    """On CUDA: TF32 matmuls and convolutions (as DiT and timm do), and cudnn's autotuner for the fixed shapes of a
    run (VAE, Inception, patch embeddings) unless ``deterministic``: the autotuner may pick other kernels run to run."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = not deterministic


SUPPORTED_DISTRIBUTED = ("NO", "MULTI_GPU", "MULTI_CPU")  # one process, or DDP over GPUs or CPU processes


TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")
TRACKER_PACKAGES = {"comet_ml": "comet_ml", "dvclive": "dvclive"}  # module names where they differ from the tracker's


def check_trackers(names: Sequence[str]) -> None:
    """Every tracker named is one of accelerate's and installed: one line naming the missing package otherwise."""
    import importlib.util

    from common.cli import InputError

    for name in names:
        if name not in TRACKERS:
            raise InputError(f"train.trackers: {name!r} is not one of accelerate's trackers ({', '.join(TRACKERS)})")
        if importlib.util.find_spec(TRACKER_PACKAGES.get(name, name)) is None:
            raise InputError(f"train.trackers: {name} is not installed: pip install {name.replace('_', '-')} "
                             "(or leave it out of train.trackers)")


def check_engine(accelerator, compile_model: bool) -> None:
    """Refuse what the trainer does not support, in one line, before any work: FSDP, DeepSpeed and Megatron (its
    EMA, checkpoints and exact resume are written for whole replicas), and accelerate's dynamo plugin together
    with ``train.compile`` (the model would be compiled twice)."""
    from common.cli import InputError

    kind = accelerator.distributed_type.name if hasattr(accelerator.distributed_type, "name") else str(
        accelerator.distributed_type)
    if kind not in SUPPORTED_DISTRIBUTED:
        raise InputError(f"accelerate is configured for {kind}, which this trainer does not support: it trains whole "
                         "replicas with DDP (EMA, checkpoints and exact resume assume that). Run `accelerate config` "
                         "and choose multi-GPU (DDP), or launch with torchrun / accelerate launch --multi_gpu")
    dynamo = getattr(getattr(accelerator.state, "dynamo_plugin", None), "backend", None)
    if compile_model and dynamo is not None and getattr(dynamo, "name", str(dynamo)).upper() != "NO":
        raise InputError(f"accelerate's dynamo_backend ({getattr(dynamo, 'name', dynamo)}) and train.compile would "
                         "both compile the model: set train.compile=false, or dynamo_backend: no in the accelerate config")


def rank_seed(seed: int, rank: int) -> int:
    """The seed of process ``rank``'s own random streams (drop path, mixup): independent across ranks and runs, and
    apart from ``seed`` itself, which every rank uses for the initial weights."""
    return int(np.random.SeedSequence([int(seed), 1 + int(rank)]).generate_state(1)[0])


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch (all devices) with ``seed + rank``; returns that seed."""
    s = int(seed) + int(rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return s


def gather_objects(accelerator, obj: Any) -> List[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (picklable objects)."""
    if accelerator.num_processes == 1:
        return [obj]
    import torch.distributed as dist

    out: List[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(out, obj)
    return out


def cpu_group(world: int):
    """A gloo group for host-side agreement (stop signals) that never waits for a GPU; None with one process or when
    the default group is gloo already. Every process must call it (it creates a group)."""
    if world == 1 or torch.distributed.get_backend() == "gloo":
        return None
    return torch.distributed.new_group(backend="gloo")


def check_divisible(global_batch: int, world_size: int, grad_accum: int = 1) -> int:
    """Per-process micro-batch size for a global batch; a clear error when it does not divide."""
    denom = world_size * grad_accum
    if global_batch % denom:
        raise InputError(f"global batch size {global_batch} is not divisible by processes ({world_size}) x "
                         f"gradient accumulation ({grad_accum}); change optim.batch_size or optim.grad_accum")
    return global_batch // denom
