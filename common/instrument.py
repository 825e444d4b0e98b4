"""Step instrumentation: which device values the host reads during a training step, step by step.

    with HostSyncCounter() as counter:
        trainer.train_step(batches)
    counter.reads                        # ["common/trainer.py:412", ...]: one entry per read from project code

    with count_step_syncs(Trainer) as steps:   # every Trainer.train_step of the block, counted
        Trainer(cfg, task).fit()
    steps[3].project_reads, steps[3].cuda_syncs, steps[3].logging

Used by the tests (no sync outside logging steps) and by ``benchmarks.gpu_check`` (the same counts on a GPU, plus
the synchronisations CUDA's sync-debug mode reports).
"""
from __future__ import annotations

import contextlib
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PROJECT_DIRS = tuple(str(Path(__file__).resolve().parents[1] / d) for d in ("common", "vision", "diffusion"))


class HostSyncCounter(TorchDispatchMode):
    """Counts the float/bool device values the host reads (``aten._local_scalar_dense``: ``.item()``, ``bool()``,
    ``float()``, ``.tolist()``) from project code, by ``file:line``. On a GPU each such read waits for the device.

    Integer reads are left out: on a CPU they cannot be told apart from host-side index bookkeeping (the sampler's
    ``int(order[i])``); values that decide or report training (a loss, a norm, a finite flag) are float or bool.
    """

    def __init__(self):
        super().__init__()
        self.reads: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and (args[0].is_floating_point()
                                                                     or args[0].dtype == torch.bool):
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(PROJECT_DIRS)
                      and f.filename != __file__]  # this mode's own frame is not the reader
            if frames:
                self.reads.append(f"{frames[-1].filename}:{frames[-1].lineno}")
        return func(*args, **(kwargs or {}))


@dataclass
class StepSyncs:
    """What one training step made the host wait for."""

    logging: bool  # a logging step reads its window on purpose (one sync)
    project_reads: List[str] = field(default_factory=list)  # HostSyncCounter's reads
    cuda_syncs: List[str] = field(default_factory=list)  # torch.cuda.set_sync_debug_mode("warn") warnings


@contextlib.contextmanager
def count_step_syncs(trainer_cls, cuda: bool = None):
    """Count the host reads of every ``trainer_cls.train_step`` run inside the block: yields ``{step: StepSyncs}``
    (steps from 1). ``cuda`` (default: whether CUDA is available) also records CUDA's sync-debug warnings, which
    see every synchronising call (copies from pageable memory, ``nonzero``, ...), not only value reads."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    steps: Dict[int, StepSyncs] = {}
    original = trainer_cls.train_step

    def counted(self, batches):
        step = self.step + 1
        record = steps[step] = StepSyncs(logging=step % self.run.log_every == 0 or step == self.total_steps)
        with warnings.catch_warnings(record=True) as caught, HostSyncCounter() as counter:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                return original(self, batches)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                record.project_reads = counter.reads
                record.cuda_syncs = [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()]

    trainer_cls.train_step = counted
    try:
        yield steps
    finally:
        trainer_cls.train_step = original
