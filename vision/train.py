"""Train DeiT (Pre-Norm, Post-Norm or SiameseNorm) on ImageNet or Fashion-MNIST; resumable, multi-process.

    python -m vision.train --config configs/deit_tiny_siamese.yaml data.path=/data/imagenet
    accelerate launch --multi_gpu --num_processes 8 -m vision.train --config configs/deit_tiny_siamese.yaml data.path=...
    torchrun --nproc_per_node 2 -m vision.train --config configs/fmnist_deit_siamese.yaml     # CPU, gloo

Settings are ``section.key=value`` overrides on top of the YAML (see ``--help`` for the keys). The global
batch (``optim.batch_size``) is fixed by the recipe and split over processes and gradient-accumulation
steps, so the same recipe gives the same training on 1 GPU or 64.

Per step: ``optim.grad_accum`` micro-batches -> optional clipping -> AdamW -> EMA -> per-step cosine LR
(DeiT stepped it per epoch). A non-finite loss skips the update (counted, logged); ``train.max_nonfinite``
in a row stops the run. Checkpoints every ``train.ckpt_every`` steps and at the end hold everything needed
to continue bit-exactly mid-epoch (``train.resume=auto``, the default). The run directory gets
``config.yaml``, ``metrics.jsonl``, TensorBoard events (``tb/``), ``checkpoints/``, the final
``model.safetensors`` (+ ``ema.safetensors``) and ``final_metrics.json`` (the final epoch, not the best).
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Tuple

import torch
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler

from common.checkpoint import bare_model, save_weights
from common.config import config_from_cli, config_to_dict, flatten, save_config
from common.data import ResumableSampler, build_train_loader
from common.distributed import build_accelerator, check_divisible, gather_objects, reduce_mean, seed_everything
from common.ema import ModelEma
from common.logging import MetricsLogger, NonFiniteGuard, progress_bar
from common.train_state import CheckpointManager, capture_rng_state, resolve_resume, restore_process_rng
from vision.data import (AugmentConfig, DataConfig, build_dataset, build_eval_loader, build_mixup,
                         build_transform, skipped_images)
from vision.evaluate import ModelConfig, build_model, evaluate


@dataclass
class OptimConfig:
    """AdamW with a per-step cosine schedule and linear warmup."""

    batch_size: int = 256  # GLOBAL batch: all processes x grad_accum x per-process micro-batch
    base_lr: float = 5e-4
    lr_base_batch: int = 512  # lr = base_lr * batch_size / lr_base_batch (DeiT's linear scaling rule)
    weight_decay: float = 0.05  # not applied to biases, norms, pos_embed, cls_token (timm's filter)
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: Optional[float] = None  # max global grad norm; null = no clipping
    grad_accum: int = 1
    epochs: int = 10
    warmup_epochs: float = 0.0
    warmup_lr: float = 1e-6  # lr at step 0 of the warmup
    min_lr: float = 1e-5  # lr at the end of the cosine

    @property
    def lr(self) -> float:
        return self.base_lr * self.batch_size / self.lr_base_batch


@dataclass
class RunConfig:
    """Everything about the run that is not the recipe."""

    output_dir: str = "runs/deit"
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: bool = False  # torch.compile the model
    deterministic: bool = False  # torch.use_deterministic_algorithms (slower on GPU)
    threads: Optional[int] = None  # CPU intra-op threads (null: torch's default; 1 is fastest on a busy machine)
    ema_decay: Optional[float] = None  # keep, evaluate and save an EMA of the weights
    eval_every: int = 1  # evaluate every N epochs (and always after the last); 0 = only at the end
    eval_batch_size: int = 256  # per process
    log_every: int = 50  # steps
    ckpt_every: int = 1000  # steps (a checkpoint is also written at the end)
    keep_last: int = 2
    keep_every: Optional[int] = None  # also keep checkpoints of steps divisible by this
    resume: Optional[str] = "auto"  # auto | null | path to a step_*.pt
    max_nonfinite: int = 20  # non-finite losses in a row before the run stops
    stop_at_step: Optional[int] = None  # end this invocation at this step (a time-limited job slot); resume later
    tensorboard: bool = True


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(dataset="fashion_mnist"))
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        if self.augment.mixup > 0 or self.augment.cutmix > 0:
            if self.optim.batch_size % 2:
                raise ValueError("mixup/cutmix mix pairs of images: optim.batch_size must be even")


def build_criterion(augment: AugmentConfig) -> torch.nn.Module:
    """Soft-target CE after mixup (smoothing is inside the soft targets), else (label-smoothed) CE."""
    if augment.mixup > 0 or augment.cutmix > 0:
        return SoftTargetCrossEntropy()
    if augment.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=augment.label_smoothing)
    return torch.nn.CrossEntropyLoss()


def train(cfg: TrainConfig) -> dict:
    """Run (or continue) the training a config describes; return the final metrics (main process)."""
    run_dir = Path(cfg.train.output_dir)
    accelerator = build_accelerator(cfg.train.precision, run_dir, cfg.train.tensorboard)
    rank, world = accelerator.process_index, accelerator.num_processes
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    if accelerator.is_main_process:
        save_config(cfg, run_dir / "config.yaml")

    # Data: per-sample seeded augmentations over a resumable sampler (see common.data).
    per_process_batch = check_divisible(cfg.optim.batch_size, world, cfg.optim.grad_accum)
    train_set = build_dataset(cfg.data, "train", build_transform(cfg.data, cfg.augment, training=True))
    val_set = build_dataset(cfg.data, "val", build_transform(cfg.data, training=False))
    sampler = ResumableSampler(len(train_set), world, rank, seed=cfg.train.seed, repeats=cfg.augment.repeated_aug)
    samples_per_step = per_process_batch * cfg.optim.grad_accum  # per process
    steps_per_epoch = len(sampler) // samples_per_step
    if steps_per_epoch == 0:
        raise ValueError(f"an epoch has {len(sampler)} samples per process, fewer than one step needs "
                         f"({samples_per_step}); lower optim.batch_size or use more data")
    total_steps = cfg.optim.epochs * steps_per_epoch
    train_loader = build_train_loader(train_set, sampler, per_process_batch, cfg.data.num_workers)
    val_loader = accelerator.prepare(build_eval_loader(val_set, cfg.train.eval_batch_size, cfg.data.num_workers))

    # Model (same init on every rank), optimizer, schedule, EMA.
    seed_everything(cfg.train.seed)
    model = build_model(cfg.model, cfg.data).to(accelerator.device)
    optimizer = create_optimizer_v2(model, "adamw", lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                    betas=cfg.optim.betas, eps=cfg.optim.eps)
    scheduler = CosineLRScheduler(optimizer, t_initial=total_steps, lr_min=cfg.optim.min_lr,
                                  warmup_t=round(cfg.optim.warmup_epochs * steps_per_epoch),
                                  warmup_lr_init=cfg.optim.warmup_lr, t_in_epochs=False)
    ema = ModelEma(model, cfg.train.ema_decay) if cfg.train.ema_decay else None
    n_params = sum(p.numel() for p in model.parameters())
    model = accelerator.prepare(model)
    if cfg.train.compile:
        model = torch.compile(model)
    seed_everything(cfg.train.seed, rank)  # distinct drop-path / mixup randomness per rank
    mixup = build_mixup(cfg.augment, cfg.data.num_classes)
    criterion = build_criterion(cfg.augment)
    guard = NonFiniteGuard(cfg.train.max_nonfinite)
    ckpts = CheckpointManager(run_dir / "checkpoints", cfg.train.keep_last, cfg.train.keep_every)

    step = 0
    resumed = resolve_resume(cfg.train.resume, ckpts)
    if resumed is not None:
        path, state = resumed
        step = _load_state(state, model, ema, optimizer, scheduler, guard, sampler, rank, world, path)
        accelerator.print(f"resumed from {path} at step {step}/{total_steps}")
    scheduler.step_update(step)

    logger = MetricsLogger(accelerator, run_dir, config=flatten(config_to_dict(cfg)) if cfg.train.tensorboard else None,
                           fresh=resumed is None)
    if step == 0:
        logger.log({"params": n_params, "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
                    "world_size": world, "lr_peak": cfg.optim.lr}, step=0)
    bar = progress_bar(accelerator, total_steps, initial=step)

    def save_checkpoint():
        rng = gather_objects(accelerator, capture_rng_state())
        if accelerator.is_main_process:
            state = {
                "model": bare_model(model).state_dict(), "ema": ema.state_dict() if ema else None,
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "epoch": step // steps_per_epoch,
                "sampler": {**sampler.state_dict(), "start": (step % steps_per_epoch) * samples_per_step * world,
                            "epoch": step // steps_per_epoch},
                "rng": rng, "nonfinite": guard.state_dict(), "world_size": world, "config": config_to_dict(cfg),
            }
            ckpts.save(state, step)
        accelerator.wait_for_everyone()

    window = {"loss": 0.0, "steps": 0, "all_steps": 0, "wait": 0.0, "time": 0.0, "grad_norm": 0.0}
    final = {}
    last_saved = step
    model.train()
    while step < total_steps:
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch, start=done_in_epoch * samples_per_step * world)
        batches = iter(train_loader)
        for _ in range(done_in_epoch, steps_per_epoch):
            t_start = time.perf_counter()
            wait = 0.0
            loss_sum = torch.zeros((), device=accelerator.device)
            for micro in range(cfg.optim.grad_accum):
                t_wait = time.perf_counter()
                images, targets = next(batches)
                wait += time.perf_counter() - t_wait
                images = images.to(accelerator.device, non_blocking=True)
                targets = targets.to(accelerator.device, non_blocking=True)
                if mixup is not None:
                    images, targets = mixup(images, targets)
                sync = micro == cfg.optim.grad_accum - 1
                with (contextlib.nullcontext() if sync else accelerator.no_sync(model)), accelerator.autocast():
                    loss = criterion(model(images), targets)
                    accelerator.backward(loss / cfg.optim.grad_accum)
                loss_sum += loss.detach().float()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad or math.inf)
            mean_loss = reduce_mean(accelerator, loss_sum / cfg.optim.grad_accum)
            finite = bool(torch.isfinite(mean_loss) & torch.isfinite(grad_norm))  # one host sync per step
            if not finite:
                logger.log({"train/nonfinite_steps": guard.total + 1, "train/nonfinite_loss": float(mean_loss)}, step + 1)
            if guard.check(finite, step + 1):
                optimizer.step()
                if ema is not None:
                    ema.update(model, step + 1)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            scheduler.step_update(step)
            bar.update(1)

            if finite:
                window["loss"] += float(mean_loss)
                window["grad_norm"] += float(grad_norm)
                window["steps"] += 1
            window["all_steps"] += 1
            window["wait"] += wait
            window["time"] += time.perf_counter() - t_start
            if step % cfg.train.log_every == 0 or step == total_steps:
                n_steps = max(window["steps"], 1)
                record = {
                    "train/loss": window["loss"] / n_steps, "train/grad_norm": window["grad_norm"] / n_steps,
                    "train/lr": optimizer.param_groups[0]["lr"], "train/epoch": step / steps_per_epoch,
                    "train/images_per_s": cfg.optim.batch_size * window["all_steps"] / max(window["time"], 1e-9),
                    "train/data_wait": window["wait"] / max(window["time"], 1e-9),
                    "train/nonfinite_steps": guard.total, "train/skipped_images": _skipped(accelerator, train_set),
                }
                logger.log(record, step)
                bar.set_postfix(loss=f"{record['train/loss']:.4f}", lr=f"{record['train/lr']:.2e}")
                window = dict.fromkeys(window, 0.0)

            stop_now = cfg.train.stop_at_step is not None and step >= cfg.train.stop_at_step and step < total_steps
            if step % cfg.train.ckpt_every == 0 or step == total_steps or stop_now:
                save_checkpoint()
                last_saved = step
            if stop_now:
                bar.close()
                logger.close()
                accelerator.print(f"stopped at step {step} (train.stop_at_step); continue with train.resume=auto")
                return {"stopped_at": step}

        epoch_done = step // steps_per_epoch
        last = step == total_steps
        if last or (cfg.train.eval_every and epoch_done % cfg.train.eval_every == 0):
            metrics = {f"val/{k}": v for k, v in evaluate(model, val_loader, accelerator).items()}
            if ema is not None:
                metrics.update({f"val_ema/{k}": v for k, v in evaluate(ema.module, val_loader, accelerator).items()})
            metrics["epoch"] = epoch_done
            logger.log(metrics, step)
            accelerator.print(f"epoch {epoch_done}: " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()
                                                                    if k.endswith(("top1", "loss"))))
            final = metrics
    bar.close()

    if last_saved != step:
        save_checkpoint()
    final = {**final, "params": n_params, "steps": step, "nonfinite_steps": guard.total,
             "skipped_images": _skipped(accelerator, train_set)}
    if accelerator.is_main_process:
        save_weights(model, run_dir / "model.safetensors")
        if ema is not None:
            save_weights(ema.module, run_dir / "ema.safetensors")
        (run_dir / "final_metrics.json").write_text(json.dumps(final, indent=2))
    logger.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # last: it destroys the process group
    return final


def _skipped(accelerator, dataset) -> int:
    from common.distributed import reduce_sum

    return int(reduce_sum(accelerator, torch.tensor(skipped_images(dataset))))


def _load_state(state, model, ema, optimizer, scheduler, guard, sampler, rank, world, path) -> int:
    """Restore a training checkpoint; returns the step to continue from."""
    bare_model(model).load_state_dict(state["model"])
    if ema is not None:
        if state.get("ema") is None:
            raise ValueError(f"{path} has no EMA weights but train.ema_decay is set; resume with train.ema_decay=null")
        ema.load_state_dict(state["ema"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    guard.load_state_dict(state.get("nonfinite", {}))
    saved = state["sampler"]
    if saved["num_samples"] != sampler.num_samples or saved["repeats"] != sampler.repeats:
        raise ValueError(f"{path} was trained on {saved['num_samples']} samples x{saved['repeats']} repeats, this run "
                         f"has {sampler.num_samples} x{sampler.repeats}: the data or augment.repeated_aug changed")
    restore_process_rng(state["rng"], rank, world, path)
    return int(state["step"])


def main(argv=None) -> dict:
    cfg = config_from_cli(TrainConfig, argv, prog="python -m vision.train", description=__doc__.split("\n\n")[0],
                          examples=["python -m vision.train --config configs/fmnist_deit_siamese.yaml optim.epochs=2",
                                    "accelerate launch --multi_gpu --num_processes 8 -m vision.train "
                                    "--config configs/deit_tiny_siamese.yaml data.path=/data/imagenet"])
    return train(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
