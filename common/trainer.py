"""The training loop of both families, written once. (Over 500 lines because the loop is one unit that reads top to
bottom: its settings, the task contract, set-up, resume, the step, logging, checkpoints and the final outputs.)

A *task* (:class:`vision.task.DeiTTask`, :class:`diffusion.task.DiTTask`) brings what is its own, through the
small contract of :class:`Task`: the training examples, the model, the loss, the learning-rate schedule, and what
happens after a step (evaluation, sample grids, in-training FID). Its hooks see a read-only :class:`StepContext`,
never the trainer. :class:`Trainer` does everything else, the same way for both:

* the run directory: a lock (one run per directory), ``config.yaml`` written only after every check passed and
  always describing what the run does, ``metrics.jsonl`` + TensorBoard cut back to the resumed step;
* resume (``train.resume=auto``): the newest readable checkpoint; changed settings are applied where
  :data:`RESUMABLE_CHANGES` (plus the task's own list) allows it and refused, naming the keys, otherwise; a run
  that already finished is left exactly as it was;
* the step: ``optim.grad_accum`` micro-batches (no gradient all-reduce but the last), autocast, gradient norm
  (clipping only when ``optim.clip_grad`` is set), fused AdamW (or LAMB), EMA. Whether a step is finite is decided
  on the device: a non-finite step changes neither the weights, the optimizer state nor the EMA, and the host never
  waits for the device except on logging and checkpoint steps (a :class:`LogWindow` accumulates there; LAMB's step
  waits for the flag);
* checkpoints every ``train.ckpt_every`` steps, at ``train.stop_at_step`` and at the end, never during a streak of
  non-finite steps (the newest checkpoint is always one taken after a finite step);
* task hooks run under :func:`preserved_rng`, so evaluation never moves training randomness (a resumed run is
  bit-identical whether or not an evaluation ran before the kill);
* final outputs: ``model.safetensors``, ``ema.safetensors``, ``final_metrics.json``.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Dict, Iterable, List, Literal, Optional, Sequence, Tuple, Union

import torch
from torch.utils.data import Dataset

from common.checkpoint import bare_model, save_weights
from common.cli import InputError, one_line_errors, process_rank
from common.config import (ConfigError, Range, check_ready, check_registered, config_from_cli, config_to_dict, flatten,
                           save_config, schema_defaults)
from common.data import DevicePrefetcher, ResumableSampler, build_train_loader
from common.distributed import (build_accelerator, check_divisible, check_engine, check_trackers, cpu_group,
                                gather_objects, rank_seed, seed_everything, use_fast_cuda_kernels)
from common.durable import atomic_write_text
from common.logging import MetricsLogger, NonFiniteGuard, labelled, progress_bar
from common.preemption import (EXIT_PAUSED, EXIT_PREEMPTED, STOP_SIGNALS, StopRequests, ignore_stop_signals_at_exit,
                               signal_number)
from common.train_state import (CheckpointManager, RunDirectoryError, RunLock, RunLockedError, capture_rng_state,
                                check_run_directory, checkpoint_size, preserved_rng, resolve_resume,
                                restore_process_rng)

FINAL_METRICS_FILE = "final_metrics.json"
KEEP_LAST_WHY = ("when a run diverges, the newest checkpoint may hold the diverged weights, and the one before it is "
                 "what the run resumes from")
Beta = Annotated[float, Range(ge=0, lt=1)]  # an Adam moment's decay


class ResumeError(InputError):
    """A run directory whose checkpoint cannot be continued with the given settings."""


@dataclass(kw_only=True)
class OptimConfig:
    """The ``optim:`` settings both families share (each adds its learning rate and length). The recipes give the
    numbers; the defaults here are "off" or AdamW's own."""

    batch_size: Annotated[int, Range(ge=1)]  # GLOBAL batch: all processes x grad_accum x per-process micro-batch
    weight_decay: Annotated[float, Range(ge=0)] = 0.0  # not applied to biases, norms and the model's no_weight_decay() (timm's filter)
    betas: Tuple[Beta, Beta] = (0.9, 0.999)  # torch.optim.AdamW's defaults
    eps: Annotated[float, Range(gt=0)] = 1e-8  # AdamW epsilon
    clip_grad: Optional[Annotated[float, Range(gt=0)]] = None  # max global grad norm; null = no clipping
    grad_accum: Annotated[int, Range(ge=1)] = 1  # micro-batches per optimizer step (the global batch stays optim.batch_size)


@dataclass
class RunConfig:
    """The ``train:`` settings both families share: everything about a run that is not the recipe."""

    output_dir: str = "runs/run"  # the run directory: run the same command again to continue it
    seed: Annotated[int, Range(ge=0)] = 0  # initial weights, data order, augmentation, every random draw
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: Union[bool, Literal["auto"]] = "auto"  # torch.compile the training model; auto: on CUDA, and on a CPU in runs long enough to repay it (docs/training.md)
    deterministic: bool = False  # torch.use_deterministic_algorithms (slower on GPU)
    threads: Optional[Annotated[int, Range(ge=1)]] = None  # CPU intra-op threads (null: torch's default; 1 is fastest on a busy machine)
    ema_decay: Optional[Annotated[float, Range(ge=0, lt=1)]] = None  # keep, evaluate and save an EMA of the weights
    log_every: Annotated[int, Range(ge=1)] = 100  # steps
    ckpt_every: Annotated[int, Range(ge=1)] = 1000  # steps (a checkpoint is also written at the end and at stop_at_step)
    keep_last: Annotated[int, Range(ge=2, why=KEEP_LAST_WHY)] = 2  # newest checkpoints kept (one from before a divergence must survive the newest one)
    keep_every: Optional[Annotated[int, Range(ge=1)]] = None  # also keep checkpoints of steps divisible by this
    resume: Optional[str] = "auto"  # auto | null (fresh; refused where checkpoints exist) | path to a step_*.pt
    max_nonfinite: Annotated[int, Range(ge=1)] = 20  # non-finite steps in a row before the run stops (checked on logging steps)
    stop_at_step: Optional[Annotated[int, Range(ge=1)]] = None  # end this invocation at this step (exit 3); the same command continues
    ckpt_every_minutes: Optional[Annotated[float, Range(gt=0)]] = None  # also checkpoint when this long passed since the last one
    stop_signals: List[str] = field(default_factory=lambda: list(STOP_SIGNALS))  # checkpoint this step, exit 4
    stop_check_every: Annotated[int, Range(ge=1)] = 1  # steps between the ranks' agreement on signals and time (a CPU all-reduce)
    dist_timeout_minutes: Annotated[float, Range(gt=0)] = 30.0  # a collective waiting this long (a dead or stuck rank) ends the run
    ddp_static_graph: bool = False  # DDP static_graph=True (valid when every step uses every parameter the same way)
    tensorboard: bool = True  # TensorBoard events under <output_dir>/tb
    trackers: List[str] = field(default_factory=list)  # more of accelerate's trackers: wandb, mlflow, comet_ml, ...
    tracker_project: str = "siamesenorm"  # the trackers' project (W&B project, MLflow experiment)

    def __post_init__(self):
        for name in self.stop_signals:
            try:
                signal_number(name)
            except InputError as err:
                raise ConfigError(f"train.stop_signals: {err}") from None


# Settings a resumed run may change, by dotted prefix; they take effect from the resumed step on. Everything else
# (model, data, augmentation, seed, global batch, ...) must equal the checkpoint's. Tasks add their own entries.
RESUMABLE_CHANGES = (
    "train.output_dir", "train.resume", "train.stop_at_step", "train.log_every", "train.ckpt_every",
    "train.keep_last", "train.keep_every", "train.max_nonfinite", "train.tensorboard", "train.threads",
    "train.precision", "train.compile", "train.deterministic", "train.ema_decay", "train.ckpt_every_minutes",
    "train.stop_signals", "train.stop_check_every", "train.dist_timeout_minutes", "train.ddp_static_graph",
    "train.trackers", "train.tracker_project",
    "optim.weight_decay", "optim.betas", "optim.eps", "optim.clip_grad", "optim.grad_accum",
    "data.path", "data.num_workers",
)


@dataclass(frozen=True)
class StepContext:
    """What a task's hooks see of the run after a step: read-only, and nothing of the trainer itself."""

    step: int
    epoch: int  # epochs completed at this step
    epoch_end: bool  # this step ended an epoch
    last: bool  # this step is the run's last
    model: torch.nn.Module  # the trained weights (bare: no DDP or compile wrapper)
    ema_model: Optional[torch.nn.Module]  # the EMA weights, None without train.ema_decay
    compiled: bool  # the training model runs compiled (train.compile, resolved): evaluation may compile too
    run_dir: Path
    set_postfix: Callable[..., None]  # show values on the progress bar: set_postfix(fd="12.3")
    log_images: Callable[[Dict[str, "np.ndarray"]], None]  # uint8 (H, W, C) images to the trackers, at this step


class Task:
    """What a model family brings to :class:`Trainer`: set or override the members above the line of no-op
    defaults; the rest is optional.

    Required: :meth:`setup` (build the data; set :attr:`train_set`), :attr:`lr`, :meth:`build_model`,
    :meth:`total_steps`, :meth:`loss`. Optional: everything else.
    """

    train_set: Dataset  # set by setup(); item i is the i-th training example (seeded per sample by the feed)
    lr: float  # the optimizer's (peak) learning rate

    def setup(self, accelerator) -> None:
        """Build the data and everything that can fail on bad input, before any file is written."""
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def total_steps(self, steps_per_epoch: int) -> int:
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``(mean loss, {part: mean value})`` of one micro-batch, the parts named by :attr:`loss_parts`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ optional, with no-op defaults
    repeats: int = 1  # copies of each example per epoch (repeated augmentation)
    loss_parts: Tuple[str, ...] = ()  # extra loss terms, logged as train/<part>
    resumable_changes: Tuple[str, ...] = ()  # settings (dotted prefixes) a resumed run may change, beyond the loop's
    batch_transform: Optional[Callable] = None  # runs on the device on every batch of the standard feed
    # Optimizer steps in one invocation after which train.compile=auto compiles on a CPU: where the compiled step's
    # saving has repaid the compiling (benchmarks.compile_payback; docs/benchmarks.md). None: never on a CPU.
    compile_pays_after_steps_on_cpu: Optional[int] = None

    def build_feed(self, sampler: ResumableSampler, batch_size: int, device) -> Optional[Iterable]:
        """An iterable of device batches instead of the standard feed (per-sample seeded workers, moved to the
        device one batch ahead, :attr:`batch_transform` applied there); None keeps the standard one."""
        return None

    def lr_scheduler(self, optimizer, steps_per_epoch: int, total_steps: int):
        """An object with ``step_update(step)`` (timm's schedulers), or None for a constant learning rate."""
        return None

    def run_summary(self) -> dict:
        """Constants logged once at step 0."""
        return {}

    def log_extras(self) -> dict:
        """Values added to every training log record."""
        return {}

    def after_step(self, ctx: StepContext) -> Optional[dict]:
        """Evaluation, grids, FID after a step (under preserved random state); metrics to log, or None."""
        return None

    def final_metrics(self, ctx: StepContext) -> dict:
        """Added to ``final_metrics.json``."""
        return {}

    def weights_metadata(self, step: int) -> dict:
        """Written into ``model.safetensors`` / ``ema.safetensors``: what a loader needs to rebuild the model."""
        return {"step": step}


def resumed_log_window(saved: Optional[list], rank: int, world: int, size: int) -> Optional[List[float]]:
    """This rank's log-window sums from a checkpoint's ``log_window`` (one list per rank), so a run stopped between
    two log records logs the same means as one never stopped. Under another number of processes rank 0 takes the
    total (the logged means stay means over every step and process); None for a checkpoint without it."""
    if not saved or any(len(sums) != size for sums in saved):
        return None
    if len(saved) == world:
        return saved[rank]
    return [sum(column) for column in zip(*saved)] if rank == 0 else None


class LogWindow:
    """The steps since the last log record, summed on the device (finite steps, loss, gradient norm, the task's
    loss parts) and timed on the host; read once per logging step, which is then the only host sync."""

    def __init__(self, parts: Sequence[str], device):
        self.parts = tuple(parts)
        self.sums = torch.zeros(3 + len(self.parts), device=device)  # finite steps, loss, grad norm, parts
        self.reset()

    def reset(self) -> None:
        self.sums.zero_()
        self.steps, self.seconds, self.waited = 0, 0.0, 0.0

    def add(self, finite: torch.Tensor, means: torch.Tensor, grad_norm: torch.Tensor, waited: float) -> None:
        """One optimizer step: ``means`` = [loss, parts...] of its micro-batches (a non-finite step adds only 0s),
        ``waited`` the seconds it waited for batches."""
        values = torch.cat([means[:1], grad_norm[None].float(), means[1:]])
        self.sums += torch.cat([finite.float()[None], torch.where(finite, values, 0.0)])
        self.waited += waited

    def add_time(self, seconds: float) -> None:
        """The wall time of one optimizer step."""
        self.steps += 1
        self.seconds += seconds

    def read(self, world: int, *also: torch.Tensor) -> Tuple[dict, List[float]]:
        """``({train/loss, train/grad_norm, train/<part>, ...}, the values of also)``; means over the window's
        finite steps and all processes, NaN where none was finite. ``also`` rides along in the same host read."""
        sums = self.sums
        if world > 1:
            sums = sums.clone()
            torch.distributed.all_reduce(sums)
        count, loss, grad_norm, *parts_and_also = torch.cat([sums, *[a.float() for a in also]]).tolist()
        parts, extra = parts_and_also[:len(self.parts)], parts_and_also[len(self.parts):]
        count /= world  # every process counted the same (agreed) steps
        mean = (lambda v: v / world / count) if count else (lambda v: math.nan)
        steps_per_s = self.steps / max(self.seconds, 1e-9)
        record = {"train/loss": mean(loss), **{f"train/{k}": mean(v) for k, v in zip(self.parts, parts)},
                  "train/grad_norm": mean(grad_norm), "train/steps_per_s": steps_per_s,
                  "train/data_wait": self.waited / max(self.seconds, 1e-9)}
        return record, extra


def task_feed(task: Task, sampler: ResumableSampler, batch_size: int, num_workers, device,
              stop_signals: Sequence[str] = STOP_SIGNALS) -> Iterable:
    """The task's own feed, or the standard one: per-sample seeded items from persistent workers (which ignore the
    stop signals: the loop stops at a step boundary), moved to the device one batch ahead and finished there by
    the task's :attr:`Task.batch_transform`."""
    return task.build_feed(sampler, batch_size, device) or DevicePrefetcher(
        build_train_loader(task.train_set, sampler, batch_size, num_workers, ignore_signals=stop_signals), device,
        task.batch_transform)


def resolve_compile(setting, device: torch.device, steps: Optional[int] = None,
                    pays_after: Optional[int] = None) -> bool:
    """``train.compile`` (and a command's ``compile``): true and false force it; ``auto`` compiles on CUDA, and on
    a CPU a training that runs at least ``pays_after`` optimizer ``steps`` (the task's
    :attr:`Task.compile_pays_after_steps_on_cpu`: where the time each step saves has repaid the compiling; None:
    never), never a one-off command there (evaluation, sampling: no ``steps``)."""
    if setting != "auto":
        return bool(setting)
    if device.type == "cuda":
        return True
    return steps is not None and pays_after is not None and steps >= pays_after


def changed_settings(saved: dict, current: dict, defaults: Optional[dict] = None) -> Dict[str, Tuple[object, object]]:
    """``{dotted key: (saved value, current value)}`` for every setting that differs.

    A key the checkpoint does not know (a setting added since it was written) counts as unchanged while it holds
    its default (``defaults``, the schema's own).
    """
    old, new, default = flatten(saved), flatten(current), flatten(defaults or {})
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
            and not (k not in old and k in default and new.get(k) == default[k])}


def build_optimizer(model: torch.nn.Module, optim, lr: float) -> torch.optim.Optimizer:
    """Fused AdamW, or timm's ``Lamb`` with ``optim.optimizer=lamb`` (DeiT III's); no weight decay on biases, norms
    and ``model.no_weight_decay()``, as timm, DeiT and DeiT III do.

    Fused AdamW takes a ``found_inf`` tensor: a non-finite step is skipped on the device, no host sync. LAMB takes
    none, so the trainer reads the flag on the host before its step (one sync per step; DeiT III's loop reads its
    loss every step too).
    """
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay

    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    layer_decay = getattr(optim, "layer_decay", None)  # DeiT's; each group's lr_scale is applied by timm's schedulers
    if layer_decay is not None:
        groups = param_groups_layer_decay(model, optim.weight_decay, skip, layer_decay=layer_decay)
    else:
        groups = (param_groups_weight_decay(model, optim.weight_decay, no_weight_decay_list=skip) if optim.weight_decay
                  else model.parameters())  # by keyword: timm 1.0.31 put weight_decay_exclude_1d third
    if getattr(optim, "optimizer", "adamw") == "lamb":
        from timm.optim import Lamb

        return Lamb(groups, lr=lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas), eps=optim.eps)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
                             eps=optim.eps, fused=True)


class Trainer:
    """Runs (or continues) the training that ``cfg`` describes with ``task``'s pieces; see the module docstring."""

    def __init__(self, cfg, task):
        check_registered(cfg)  # the names a library's registry must know (timm's models, ...), before any work
        check_ready(cfg)  # the settings a run needs beyond a printable config (a data path)
        self.cfg, self.task = cfg, task
        self.run: RunConfig = cfg.train
        self.optim = cfg.optim
        self.run_dir = Path(self.run.output_dir)
        self.hooks_pending = False

    # ------------------------------------------------------------------------------------------ set-up
    def fit(self) -> dict:
        run = self.run
        check_trackers(run.trackers)
        check_run_directory(self.run_dir)  # a read-only place is refused before any work
        accelerator = self.accelerator = build_accelerator(run.precision, self.run_dir, run.tensorboard,
                                                           timeout_minutes=run.dist_timeout_minutes,
                                                           static_graph=run.ddp_static_graph, trackers=run.trackers)
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        check_engine(accelerator, run.compile is True)  # auto is checked once it has decided (_build)
        if run.threads:
            torch.set_num_threads(run.threads)
        use_fast_cuda_kernels(deterministic=run.deterministic)
        if run.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self._build()
        lock = RunLock(self.run_dir)
        error = None
        if accelerator.is_main_process:
            try:
                taken_over = lock.acquire()
                if taken_over:
                    print(f"{self.run_dir}: taking over the lock of a run that ended without releasing it ({taken_over})")
            except (RunLockedError, RunDirectoryError) as err:
                error = err
        error = gather_objects(accelerator, error)[0]  # every rank stops, not only the main one
        if error:
            raise error
        # From here to the end of the process a stop signal is recorded, never fatal: before the first step it is
        # acted on there, after the last one it changes nothing (the run's exit status stands).
        self.stop = StopRequests(run.stop_signals, run.ckpt_every_minutes, run.stop_check_every,
                                 group=cpu_group(self.world), world=self.world, rank=self.rank).install()
        try:
            return self._fit()
        finally:
            if hasattr(self.feed, "close"):
                self.feed.close()
            lock.release()
            accelerator.end_training()  # it destroys the process group
            self.stop.restore()  # last: a command line ignores the signals from here (release_stop_signals)

    def _build(self) -> None:
        """Data, model, optimizer, schedule, EMA: everything that can fail on bad input, before any file is written."""
        run, optim, task, accelerator = self.run, self.optim, self.task, self.accelerator
        task.setup(accelerator)
        self.per_process_batch = check_divisible(optim.batch_size, self.world, optim.grad_accum)
        self.sampler = ResumableSampler(len(task.train_set), self.world, self.rank, seed=run.seed, repeats=task.repeats)
        self.samples_per_step = self.per_process_batch * optim.grad_accum  # per process
        self.steps_per_epoch = len(self.sampler) // self.samples_per_step
        if self.steps_per_epoch == 0:
            raise InputError(f"an epoch has {len(self.sampler)} samples per process, fewer than one step needs "
                             f"({self.samples_per_step}); lower optim.batch_size or use more data")
        self.total_steps = task.total_steps(self.steps_per_epoch)
        self.feed = task_feed(task, self.sampler, self.per_process_batch, self.cfg.data.num_workers, accelerator.device,
                              run.stop_signals)

        seed_everything(run.seed)  # the same initial weights on every rank
        model = task.build_model().to(accelerator.device)
        seed_everything(rank_seed(run.seed, self.rank))  # then each rank draws its own drop path, mixup, ...
        self.n_params = sum(p.numel() for p in model.parameters())
        self.optimizer = build_optimizer(model, optim, task.lr)
        self.scheduler = task.lr_scheduler(self.optimizer, self.steps_per_epoch, self.total_steps)
        from common.ema import ModelEma  # timm's: imported when a run starts, not to read its command line

        self.ema = ModelEma(model, run.ema_decay) if run.ema_decay is not None else None
        self.checkpoint_bytes = checkpoint_size(model, ema=self.ema is not None)
        self.model = accelerator.prepare(model)
        self.guard = NonFiniteGuard(run.max_nonfinite, accelerator.device)
        self.ckpts = CheckpointManager(self.run_dir / "checkpoints", run.keep_last, run.keep_every)

    def _resume(self) -> Tuple[int, Optional[dict]]:
        """The step to continue from and what changed, after checking the checkpoint against the settings."""
        run = self.run
        self.resumed_window, self.last_record = None, {}
        if run.resume is None or str(run.resume).lower() in ("", "none", "null", "false"):
            if self.ckpts.steps():
                raise ResumeError(
                    f"{self.run_dir} holds checkpoints up to step {self.ckpts.steps()[-1]}: train.resume=null would "
                    "start over on top of them. Continue the run with train.resume=auto, or start a new one in "
                    "another train.output_dir (or delete that directory).")
            return 0, None
        resumed = resolve_resume(run.resume, self.ckpts)
        seen = gather_objects(self.accelerator, None if resumed is None else (resumed[0].name, int(resumed[1]["step"])))
        if len(set(seen)) > 1:
            listed = ", ".join(f"rank {r}: {s[0] if s else 'none'}" for r, s in enumerate(seen))
            raise ResumeError(f"the processes see different checkpoints in {self.ckpts.directory} ({listed}): the run "
                              "directory must be on a file system every process shares (and sees the same way)")
        if resumed is None:
            return 0, None
        path, state = resumed
        self.hooks_pending = bool(state.get("hooks_pending"))
        changes = changed_settings(state.get("config", {}), config_to_dict(self.cfg), schema_defaults(type(self.cfg)))
        allowed = RESUMABLE_CHANGES + tuple(self.task.resumable_changes)
        fixed = {k: v for k, v in changes.items() if not k.startswith(allowed)}
        if fixed:
            listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in fixed.items())
            raise ResumeError(
                f"{path} was trained with other settings that cannot change in a resumed run ({listed}). Run the "
                f"original settings to continue it, or start a new run: another train.output_dir.")
        if (state.get("ema") is None) != (self.ema is None):
            raise ResumeError(f"{path} was trained {'without' if state.get('ema') is None else 'with'} an EMA; keep "
                              f"train.ema_decay {'null' if state.get('ema') is None else 'set'} to continue it")
        bare = bare_model(self.model)
        try:
            bare.load_state_dict(state["model"])
        except RuntimeError as err:
            raise ResumeError(f"{path} does not fit this model ({str(err).splitlines()[0]})") from None
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        # Hyper-parameters come from the current settings, the moments and step counts from the checkpoint.
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, hyper in zip(self.optimizer.param_groups, fresh):
            group.update(hyper)
        self.guard.load_state_dict(state.get("nonfinite", {}))
        saved = state["sampler"]
        if (saved["num_samples"], saved["repeats"]) != (self.sampler.num_samples, self.sampler.repeats):
            raise ResumeError(f"{path} was trained on {saved['num_samples']} samples x{saved['repeats']} repeats, this "
                              f"run has {self.sampler.num_samples} x{self.sampler.repeats}: the data changed")
        restore_process_rng(state["rng"], self.rank, self.world, path)
        self.resumed_window = resumed_log_window(state.get("log_window"), self.rank, self.world,
                                                 3 + len(self.task.loss_parts))
        self.last_record = dict(state.get("last_record") or {})  # a run resumed at its last step logs no new one
        return int(state["step"]), {"from": str(path), "changed": {k: list(v) for k, v in changes.items()},
                                    "compiled": state.get("compiled")}

    # -------------------------------------------------------------------------------------------- run
    def disk_use(self) -> str:
        """The run directory's size per checkpoint, said at the start: a DiT-XL/2 run needs 16 GB after one step."""
        checkpoint, weights = self.checkpoint_bytes
        files = ["model.safetensors"] + ["ema.safetensors"] * (self.ema is not None)
        every = f" and every train.keep_every={self.run.keep_every}-th" if self.run.keep_every else ""
        size = lambda n: f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"  # noqa: E731
        return (f"{self.run_dir}: {size(checkpoint)} per checkpoint (the weights{', their EMA' * (self.ema is not None)}"
                f" and the optimizer's moments), {size(weights)} each for {' and '.join(files)}: "
                f"{size(checkpoint + len(files) * weights)} with one checkpoint; the newest "
                f"train.keep_last={self.run.keep_last}{every} checkpoints are kept")

    def _compile(self, step: int, compiled_before: Optional[bool] = None) -> None:
        """The training model, compiled where ``train.compile`` says so: ``auto`` on a CPU by the steps this
        invocation runs (from ``step`` to the run's end or ``train.stop_at_step``). A resumed run keeps the choice
        ``auto`` made when the run began (``compiled_before``, from its checkpoint): compiled and eager steps round
        differently, and a resume must reach the uninterrupted run's weights."""
        run, accelerator, pays_after = self.run, self.accelerator, self.task.compile_pays_after_steps_on_cpu
        steps = max(min(self.total_steps, run.stop_at_step or self.total_steps) - step, 0)
        if run.compile == "auto" and compiled_before is not None:
            self.compiled = compiled_before
        else:
            self.compiled = resolve_compile(run.compile, accelerator.device, steps, pays_after)
        check_engine(accelerator, self.compiled)
        if self.compiled and run.compile == "auto" and accelerator.device.type == "cpu" and compiled_before is None:
            accelerator.print(f"train.compile=auto: compiling the training model for the {steps} optimizer steps to "
                              f"run (on a CPU it pays back after {pays_after}; train.compile=false: eager)")
        self.train_model = torch.compile(self.model) if self.compiled else self.model

    def _fit(self) -> dict:
        accelerator, run = self.accelerator, self.run
        step, resumed = self._resume()
        self._compile(step, resumed.get("compiled") if resumed else None)
        final_file = self.run_dir / FINAL_METRICS_FILE
        if step >= self.total_steps and final_file.is_file():
            accelerator.print(f"{self.run_dir} already finished at step {step}; its results are in {final_file} "
                              "(nothing was changed). Raise the length (optim.epochs / optim.steps) to train on.")
            return json.loads(final_file.read_text())
        if accelerator.is_main_process:
            save_config(self.cfg, self.run_dir / "config.yaml")
            print(self.disk_use())
        self.step = step
        summary = {"params": self.n_params, "examples": len(self.task.train_set), "steps_per_epoch": self.steps_per_epoch,
                   "total_steps": self.total_steps, "world_size": self.world, **self.task.run_summary()}
        # The run's constants reach the trackers as hyper-parameters (run/...), not as one-point curves.
        self.logger = MetricsLogger(accelerator, self.run_dir, resume_step=step if resumed else None,
                                    config={**flatten(config_to_dict(self.cfg)), **{f"run/{k}": v for k, v in summary.items()}},
                                    project=run.tracker_project)
        if resumed:
            self.logger.log({"event": "resumed", **resumed}, step, curves=False)
            accelerator.print(f"resumed from {resumed['from']} at step {step}/{self.total_steps}")
        else:
            self.logger.log(summary, step=0, curves=False)
        if self.scheduler is not None:
            self.scheduler.step_update(step)
        self.bar = progress_bar(accelerator, self.total_steps, initial=step)
        self.window = LogWindow(self.task.loss_parts, accelerator.device)
        if self.resumed_window is not None:  # the steps since the last log record, before the stop
            self.window.sums.copy_(torch.tensor(self.resumed_window))
        self.last_saved = step
        self.stop.checkpoint_written()  # ckpt_every_minutes counts from the start of training
        try:
            if self.hooks_pending and 0 < step < self.total_steps:  # stopped by a signal before this step's hooks
                self._after_step(last=False, epoch_end=step % self.steps_per_epoch == 0)
            if step < self.total_steps:
                stopped = self._train()
                if stopped is not None:
                    return stopped
            else:  # resumed from the final checkpoint of a run killed before its final outputs were written
                self._after_step(last=True)
            return self._finish()
        finally:
            self.bar.close()
            self.logger.close()

    def _train(self) -> Optional[dict]:
        accelerator, run = self.accelerator, self.run
        self.model.train()
        while self.step < self.total_steps:
            epoch, done_in_epoch = divmod(self.step, self.steps_per_epoch)
            self.sampler.set_epoch(epoch, start=done_in_epoch * self.samples_per_step * self.world)
            batches = iter(self.feed)
            for _ in range(done_in_epoch, self.steps_per_epoch):
                started = time.perf_counter()
                self.train_step(batches)
                self.step += 1
                self.window.add_time(time.perf_counter() - started)
                if self.scheduler is not None:
                    self.scheduler.step_update(self.step)
                self.bar.update(1)
                last = self.step == self.total_steps
                if self.step % run.log_every == 0 or last:
                    self._log_window()
                stop_now = run.stop_at_step is not None and self.step >= run.stop_at_step and not last
                signalled, minutes_due = self.stop.agree(self.step)
                signalled = signalled if not last else None  # the last step finishes the run as usual
                if self.step % run.ckpt_every == 0 or last or stop_now or signalled or minutes_due:
                    self._save_checkpoint(hooks_pending=bool(signalled))
                if signalled:  # out now, within the scheduler's grace time; the next run does this step's hooks
                    accelerator.print(labelled(f"{signalled} received: stopped at step {self.step} with a checkpoint "
                                               f"(exit {EXIT_PREEMPTED}); run the same command to continue"))
                    return {"stopped_at": self.step, "signal": signalled}
                self._after_step(last=last, epoch_end=self.step % self.steps_per_epoch == 0)
                if stop_now:
                    accelerator.print(f"paused at step {self.step} (train.stop_at_step, exit {EXIT_PAUSED}); run the "
                                      "same command with train.stop_at_step unset (or later) to continue")
                    return {"stopped_at": self.step}
                if last:
                    break
        return None

    def train_step(self, batches) -> None:
        """One optimizer step: micro-batches, gradient norm, device-side finite check, AdamW, EMA, log window."""
        accelerator, optim, task = self.accelerator, self.optim, self.task
        sums = None
        wait = 0.0
        for micro in range(optim.grad_accum):
            t0 = time.perf_counter()
            batch = next(batches)  # on the device already (DevicePrefetcher)
            wait += time.perf_counter() - t0
            sync = micro == optim.grad_accum - 1
            with (contextlib.nullcontext() if sync else accelerator.no_sync(self.model)), accelerator.autocast():
                loss, parts = task.loss(self.train_model, batch)
                accelerator.backward(loss / optim.grad_accum)
            values = torch.stack([loss.detach().float(), *(parts[k].detach().float() for k in task.loss_parts)])
            sums = values if sums is None else sums + values
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if optim.clip_grad is not None:
            torch.nn.utils.clip_grads_with_norm_(params, optim.clip_grad, grad_norm)
        means = sums / optim.grad_accum
        found_inf = (~(torch.isfinite(means).all() & torch.isfinite(grad_norm))).float()
        if self.world > 1:  # every rank must skip together (the gradients are shared; the losses are not)
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
        self.optimizer.found_inf = found_inf  # fused AdamW skips the whole update (and its step count) when 1
        if self.optimizer.defaults.get("fused") or not found_inf.item():  # LAMB: skipped from the host
            self.optimizer.step()
        if self.ema is not None:
            self.ema.update(self.model, self.step + 1, skip=found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        self.guard.record(found_inf)
        self.window.add(found_inf == 0, means, grad_norm, wait)

    def _log_window(self) -> None:
        """Log the window's means (one host sync); stop on a streak of non-finite steps."""
        record, (in_row, total) = self.window.read(self.world, self.guard.counts)
        in_row, total = int(in_row), int(total)
        record.update({"train/lr": max(g["lr"] for g in self.optimizer.param_groups),  # unscaled by layer decay
                       "train/epoch": self.step / self.steps_per_epoch,
                       "train/images_per_s": record["train/steps_per_s"] * self.optim.batch_size,
                       "train/nonfinite_steps": total, **self.task.log_extras()})
        self.logger.log(record, self.step)
        self.last_record = record
        self.bar.set_postfix(loss=f"{record['train/loss']:.4f}", lr=f"{record['train/lr']:.2e}")
        self.window.reset()
        if in_row >= self.guard.max_in_row:
            raise self._diverged(in_row, total)

    def _diverged(self, in_row: int, total: int):
        """Set aside the checkpoints whose weights already produced a non-finite step; return the error to raise.

        The streak began at step ``step - in_row + 1``, so the weights saved at ``step - in_row`` or later are the
        ones that diverged: they move to ``checkpoints/diverged/`` (kept, never deleted), and ``train.resume=auto``
        continues from the newest checkpoint before them.
        """
        first_bad = self.step - in_row + 1
        suspect = [s for s in self.ckpts.steps() if s >= first_bad - 1]
        moved = []
        if self.accelerator.is_main_process:
            aside = self.ckpts.directory / "diverged"
            aside.mkdir(parents=True, exist_ok=True)  # no checkpoint may exist yet
            for s in suspect:
                self.ckpts.path_for(s).replace(aside / self.ckpts.path_for(s).name)
                moved.append(str(aside / self.ckpts.path_for(s).name))
        self.accelerator.wait_for_everyone()
        good = [s for s in self.ckpts.steps() if s < first_bad - 1]
        return self.guard.error(in_row, total, self.step, good[-1] if good else None, moved)

    def _save_checkpoint(self, hooks_pending: bool = False) -> None:
        """A complete checkpoint (all ranks' RNG states), unless the last step was not finite. ``hooks_pending``: the
        task's hooks of this step will not run in this invocation (a stop signal), so the resumed one runs them."""
        in_row, _ = self.guard.read()
        if in_row:
            self.accelerator.print(f"step {self.step}: no checkpoint during a streak of non-finite steps; the newest "
                                   f"one stays step {self.last_saved}")
            return
        rng, window = zip(*gather_objects(self.accelerator, (capture_rng_state(), self.window.sums.tolist())))
        if self.accelerator.is_main_process:
            epoch, done = divmod(self.step, self.steps_per_epoch)
            self.ckpts.save({
                "model": bare_model(self.model).state_dict(), "ema": self.ema.state_dict() if self.ema else None,
                "optimizer": self.optimizer.state_dict(), "step": self.step, "epoch": epoch,
                "sampler": {**self.sampler.state_dict(), "epoch": epoch,
                            "start": done * self.samples_per_step * self.world},
                "rng": list(rng), "log_window": list(window), "last_record": self.last_record,
                "nonfinite": self.guard.state_dict(), "world_size": self.world,
                "config": config_to_dict(self.cfg), "hooks_pending": hooks_pending,
                "weights_metadata": self.task.weights_metadata(self.step), "compiled": self.compiled,
            }, self.step)
            if self.ema is not None:  # the freshest EMA weights, for samplers and evaluators, at every checkpoint
                save_weights(self.ema.module, self.run_dir / "ema.safetensors",
                             metadata=self.task.weights_metadata(self.step))
        self.last_saved = self.step
        self.stop.checkpoint_written()
        self.accelerator.wait_for_everyone()

    def context(self, last: bool, epoch_end: bool) -> StepContext:
        return StepContext(step=self.step, epoch=self.step // self.steps_per_epoch, epoch_end=epoch_end, last=last,
                           model=bare_model(self.model), ema_model=self.ema.module if self.ema is not None else None,
                           compiled=self.compiled, run_dir=self.run_dir, set_postfix=self.bar.set_postfix,
                           log_images=lambda images: self.logger.log_images(images, self.step))

    def _after_step(self, last: bool, epoch_end: bool = True) -> None:
        """The task's evaluation / sampling hooks, which must not move training randomness."""
        with preserved_rng():
            metrics = self.task.after_step(self.context(last, epoch_end))
        if metrics:
            self.logger.log(metrics, self.step)

    def _finish(self) -> dict:
        accelerator = self.accelerator
        final = {"steps": self.step, "params": self.n_params, "nonfinite_steps": self.guard.read()[1],
                 **{k.split("/", 1)[1]: v for k, v in self.last_record.items()},
                 **self.task.final_metrics(self.context(last=True, epoch_end=self.step % self.steps_per_epoch == 0))}
        if accelerator.is_main_process:
            meta = self.task.weights_metadata(self.step)
            save_weights(self.model, self.run_dir / "model.safetensors", metadata=meta)
            if self.ema is not None:
                save_weights(self.ema.module, self.run_dir / "ema.safetensors", metadata=meta)
            atomic_write_text(self.run_dir / FINAL_METRICS_FILE, json.dumps(final, indent=2))
        accelerator.wait_for_everyone()
        return final


def run_state(run_dir: Union[str, Path]) -> dict:
    """Where a run stands, for the commands that share its weights: ``final`` (its final metrics, None before it
    finished), ``newest`` (its newest checkpoint's step, None without one), ``total_steps`` (from its start record,
    None if unknown), ``finished`` (final metrics written and no checkpoint past them)."""
    from common.logging import METRICS_FILE, read_metrics

    run_dir = Path(run_dir)
    final_file = run_dir / FINAL_METRICS_FILE
    final = json.loads(final_file.read_text()) if final_file.is_file() else None
    steps = CheckpointManager(run_dir / "checkpoints").steps()
    newest = steps[-1] if steps else None
    records = read_metrics(run_dir) if (run_dir / METRICS_FILE).is_file() else []
    total = next((r["total_steps"] for r in reversed(records) if "total_steps" in r), None)
    finished = final is not None and (newest is None or newest <= final["steps"])  # not resumed for longer since
    return {"final": final, "newest": newest, "total_steps": total, "finished": finished}


def unfinished_run_error(run_dir: Union[str, Path], state: dict, trainer: str, exported: str) -> InputError:
    """The refusal of an export of an unfinished run (``state``: :func:`run_state`): where it stands, how to finish it
    (``trainer``, the command that trained it) and the flag that exports ``exported`` anyway."""
    of_total = f" of {state['total_steps']}" if state["total_steps"] else ""
    where = (f"it is at step {state['newest']}{of_total}" if state["newest"] is not None else "it has no checkpoint") \
        + (f", resumed past its end at step {state['final']['steps']}" if state["final"] else "")
    return InputError(f"{run_dir} is not finished ({where}; no final_metrics.json for it): finish it by rerunning "
                      f"{trainer} with the same config, or export {exported} with --allow-unfinished")


def run_cli(schema, train, argv, *, prog: str, description: str, examples: Sequence[str]) -> dict:
    """A trainer's command line: parse and validate the config, then run; bad input ends in one line. Nothing heavy
    is imported before the config is checked; a first line says what starts while the libraries load.

    ``argv=None`` reads the process's own command line: the process ends with the run, so a stop signal that
    arrives while the run shuts down is ignored (:func:`common.preemption.ignore_stop_signals_at_exit`) instead of
    ending the process with 143, which a job script reads as a failure."""
    if argv is None:
        ignore_stop_signals_at_exit()
    cfg = config_from_cli(schema, argv, prog=prog, description=description, examples=examples)
    if process_rank() == 0:
        print(f"{prog.split()[-1]}: {cfg.train.output_dir}: loading the libraries, the data and the model", flush=True)
    with one_line_errors():
        result = train(cfg)
    if "stopped_at" in result:  # paused or preempted: a job script tells these from "finished" (0) by the status
        raise SystemExit(EXIT_PREEMPTED if "signal" in result else EXIT_PAUSED)
    return result
