"""Run logging: a JSONL metrics file, TensorBoard through accelerate's trackers, a tqdm bar, a NaN guard.

    logger = MetricsLogger(accelerator, run_dir, config=flat_hparams)   # main process writes, others no-op
    logger.log({"train/loss": 2.3, "train/lr": 1e-3}, step=100)        # -> run_dir/metrics.jsonl + TensorBoard
    bar = progress_bar(accelerator, total=steps, initial=start_step)    # tqdm on the main process only
    guard = NonFiniteGuard(max_in_row=20)
    if guard.check(loss_is_finite, step): optimizer.step()              # raises NonFiniteLossError after 20 in a row

The accelerator must have been built with ``log_with="tensorboard"`` and ``project_dir=run_dir``
(:func:`common.distributed.build_accelerator` does that) for TensorBoard events under ``run_dir/tb``.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Mapping, Optional, Union

import torch
from tqdm.auto import tqdm

METRICS_FILE = "metrics.jsonl"
TRACKER_NAME = "tb"


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


def read_metrics(path: Union[str, os.PathLike]) -> list:
    """All records of a JSONL metrics file (a run directory or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsLogger:
    """Append metrics to ``run_dir/metrics.jsonl`` and to accelerate's trackers, on the main process.

    ``fresh=True`` starts a new file (a run started over); otherwise records are appended (a resumed run).
    """

    def __init__(self, accelerator, run_dir: Union[str, os.PathLike], config: Optional[Mapping] = None,
                 fresh: bool = False):
        self.accelerator = accelerator
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = accelerator.is_main_process
        self._file = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w" if fresh else "a", buffering=1)
        if accelerator.log_with:
            hparams = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in (config or {}).items()}
            accelerator.init_trackers(TRACKER_NAME, config=hparams)

    def log(self, metrics: Mapping, step: int) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "time": round(time.time(), 3), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self.accelerator.log_with and scalars:
            self.accelerator.log(scalars, step=int(step))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        # Finish the trackers only: accelerator.end_training() also destroys the process group, which the
        # trainers still need for their final barrier (every multi-process run then exited 1).
        for tracker in self.accelerator.trackers:
            tracker.finish()


def progress_bar(accelerator, total: int, initial: int = 0, desc: str = "train"):
    """tqdm bar shown on the main process only."""
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                disable=not accelerator.is_main_process)


class NonFiniteLossError(RuntimeError):
    """Too many consecutive non-finite losses: the run is diverging."""


class NonFiniteGuard:
    """Skip optimizer steps whose loss (or gradient norm) is not finite; stop after too many in a row.

    ``check`` must get the same verdict on every rank (reduce the loss across ranks first) so that all
    ranks skip together. The guard never saves anything: raising leaves the last checkpoint as it was.
    """

    def __init__(self, max_in_row: int = 20):
        if max_in_row < 1:
            raise ValueError(f"max_in_row={max_in_row} must be >= 1")
        self.max_in_row = max_in_row
        self.in_row = 0
        self.total = 0

    def check(self, finite: bool, step: int) -> bool:
        """Return whether the step may be applied; raise :class:`NonFiniteLossError` at the limit."""
        if finite:
            self.in_row = 0
            return True
        self.in_row += 1
        self.total += 1
        if self.in_row >= self.max_in_row:
            raise NonFiniteLossError(
                f"the loss was NaN/inf for {self.in_row} steps in a row (up to step {step}, {self.total} in total); "
                "stopping. The last checkpoint is left untouched. Lower the learning rate, enable gradient "
                "clipping (optim.clip_grad) or use fp32, then resume=auto."
            )
        return False

    def state_dict(self) -> dict:
        return {"in_row": self.in_row, "total": self.total}

    def load_state_dict(self, state: Mapping) -> None:
        self.in_row = int(state.get("in_row", 0))
        self.total = int(state.get("total", 0))
