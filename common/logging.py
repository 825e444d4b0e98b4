"""Run logging: a JSONL metrics file, TensorBoard through accelerate's trackers, a tqdm bar, a NaN guard.

    logger = MetricsLogger(accelerator, run_dir, config=flat_hparams)   # main process writes, others no-op
    logger.log({"train/loss": 2.3, "train/lr": 1e-3}, step=100)        # -> run_dir/metrics.jsonl + TensorBoard
    bar = progress_bar(accelerator, total=steps, initial=start_step)    # tqdm on the main process only
    guard = NonFiniteGuard(max_in_row=20, device=device)
    guard.record(found_inf)                                             # per step, on the device
    in_row, total = guard.read()                                        # on logging steps (a host sync)
    if in_row >= guard.max_in_row: raise guard.error(in_row, total, step, last_good_checkpoint)

The accelerator must have been built with ``log_with="tensorboard"`` and ``project_dir=run_dir``
(:func:`common.distributed.build_accelerator` does that) for TensorBoard events under ``run_dir/tb``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from common.cli import InputError
from common.durable import atomic_write_text, raise_disk_failure

METRICS_FILE = "metrics.jsonl"
TRACKER_NAME = "siamesenorm"  # the trackers' project (W&B project, MLflow experiment): train.tracker_project
TENSORBOARD_DIR = "tb"  # <run_dir>/tb


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
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # blank, or the torn last line of a run killed (or a disk filled) mid-write
                pass
    return records


class MetricsLogger:
    """Append metrics to ``run_dir/metrics.jsonl`` and to accelerate's trackers, on the main process.

    ``resume_step=None`` starts a new file (a fresh run); a resumed run passes its checkpoint's step, and records of
    later steps (logged after that checkpoint by the interrupted invocation) are dropped from the file and from
    TensorBoard (``purge_step``), so no step appears twice.
    """

    def __init__(self, accelerator, run_dir: Union[str, os.PathLike], config: Optional[Mapping] = None,
                 resume_step: Optional[int] = None, project: str = TRACKER_NAME):
        self.accelerator = accelerator
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = accelerator.is_main_process
        self._file = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.is_file():
                _truncate_records(self.path, resume_step)
            self._file = open(self.path, "w" if resume_step is None else "a", buffering=1)
        if accelerator.log_with:
            hparams = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in (config or {}).items()}
            purge = {} if resume_step is None else {"purge_step": resume_step + 1}
            run_dir = Path(run_dir)
            if self.enabled:  # TensorBoard's events in <run_dir>/tb whatever the trackers' project is called
                from accelerate.tracking import TensorBoardTracker

                accelerator.log_with = [TensorBoardTracker(TENSORBOARD_DIR, run_dir, **purge) if str(t) == "tensorboard"
                                        else t for t in accelerator.log_with]
            # W&B: one run per run directory, continued on resume (its id is kept next to the metrics).
            wandb = {"dir": str(run_dir), "name": run_dir.name, "id": tracker_run_id(run_dir, self.enabled),
                     "resume": "allow"}
            accelerator.init_trackers(project, config=hparams, init_kwargs={"wandb": wandb})

    def log(self, metrics: Mapping, step: int, curves: bool = True) -> None:
        """A record in ``metrics.jsonl`` and, with ``curves``, its numbers as scalar curves in the trackers (the
        run's constants go to the trackers as hyper-parameters instead, see the ``config`` argument)."""
        if not self.enabled:
            return
        record = {"step": int(step), "time": round(time.time(), 3), **{k: _plain(v) for k, v in metrics.items()}}
        try:  # one whole line per record, on disk before the call returns (a line is the unit a resume cuts back to)
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as err:
            raise_disk_failure(err, self.path, "The lines logged before stay.")
            raise
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self.accelerator.log_with and scalars and curves:
            self.accelerator.log(scalars, step=int(step))

    def log_images(self, images: Mapping[str, "np.ndarray"], step: int) -> None:
        """uint8 ``(H, W, C)`` images (sample grids) to every tracker that takes images."""
        if not (self.enabled and self.accelerator.log_with):
            return
        for tracker in self.accelerator.trackers:
            if not hasattr(tracker, "log_images"):
                continue
            if tracker.name == "tensorboard":
                tracker.log_images({k: v[None] for k, v in images.items()}, step=step, dataformats="NHWC")
            else:
                tracker.log_images({k: [v] for k, v in images.items()}, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        # Finish the trackers only: accelerator.end_training() also destroys the process group, which the
        # trainers still need for their final barrier (every multi-process run then exited 1).
        for tracker in self.accelerator.trackers:
            tracker.finish()


TRACKER_ID_FILE = ".tracker_run_id"


def tracker_run_id(run_dir: Path, main: bool) -> str:
    """The id trackers that continue runs (W&B) give this run directory: made once, kept in it."""
    import uuid

    path = run_dir / TRACKER_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:16]
    if main:
        atomic_write_text(path, run_id)
    return run_id


def _truncate_records(path: Path, last_step: int) -> None:
    """Keep the records of steps <= ``last_step`` (and drop a torn last line), atomically."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(record.get("step", 0)) <= last_step:
            kept.append(line)
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))


_RUN_LABEL: Optional[str] = None


@contextlib.contextmanager
def run_label(label: str):
    """Name the training that runs inside, on its progress bar and in its stop line, where one command trains several
    in turn (``make demo``: "DeiT siamese (2 of 4)")."""
    global _RUN_LABEL
    before, _RUN_LABEL = _RUN_LABEL, label
    try:
        yield
    finally:
        _RUN_LABEL = before


def labelled(text: str) -> str:
    """``text`` after the label of the training in progress (:func:`run_label`), if a command set one."""
    return f"{_RUN_LABEL}: {text}" if _RUN_LABEL else text


def progress_bar(accelerator, total: int, initial: int = 0, desc: Optional[str] = None):
    """tqdm bar shown on the main process only, named ``desc`` (default: the :func:`run_label`, else "train")."""
    return tqdm(total=total, initial=initial, desc=desc or _RUN_LABEL or "train", dynamic_ncols=True,
                disable=not accelerator.is_main_process)


class NonFiniteLossError(InputError, RuntimeError):
    """Too many consecutive non-finite losses: the run is diverging."""


class NonFiniteGuard:
    """Counts non-finite optimizer steps on the device; stops the run after ``max_in_row`` of them in a row.

    :meth:`record` takes the step's ``found_inf`` (a 0-d float tensor, the same on every rank) without a host
    sync; the trainer reads the counts on its logging steps, so a run stops at the first logging step after the
    limit (skipped steps change nothing, so the overshoot costs only time).
    """

    def __init__(self, max_in_row: int = 20, device="cpu"):
        if max_in_row < 1:
            raise ValueError(f"max_in_row={max_in_row} must be >= 1")
        self.max_in_row = max_in_row
        self.counts = torch.zeros(2, dtype=torch.long, device=device)  # in a row, in total

    def record(self, found_inf: torch.Tensor) -> None:
        bad = found_inf.long()
        self.counts[0].add_(1).mul_(bad)
        self.counts[1].add_(bad)

    def read(self) -> tuple:
        """``(in a row, in total)`` as ints (a host sync)."""
        in_row, total = self.counts.tolist()
        return in_row, total

    def error(self, in_row: int, total: int, step: int, last_good: Optional[int], set_aside: Sequence[str] = ()):
        """The :class:`NonFiniteLossError` to raise when ``in_row`` reached ``max_in_row``."""
        aside = f" Checkpoints taken after the divergence began were moved to {', '.join(set_aside)}." if set_aside else ""
        kept = (f"The newest checkpoint is now step {last_good}, from before the divergence. Lower optim.lr / "
                "optim.base_lr, set optim.clip_grad or train.precision=fp32, and run the same command again: it resumes "
                "from there with the new settings (train.resume=auto)." if last_good is not None else
                "No checkpoint from before the divergence exists: start over with a lower learning rate.")
        return NonFiniteLossError(f"the loss or gradient was NaN/inf for the last {in_row} steps in a row (up to step "
                                  f"{step}, {total} in total); stopping.{aside} {kept}")

    def state_dict(self) -> dict:
        in_row, total = self.read()
        return {"in_row": in_row, "total": total}

    def load_state_dict(self, state: Mapping) -> None:
        self.counts.copy_(torch.tensor([int(state.get("in_row", 0)), int(state.get("total", 0))]))
