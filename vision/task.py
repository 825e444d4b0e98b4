"""What DeiT brings to the training loop (:mod:`common.trainer`): data + mixup, the model, the criterion, Top-1.

The recipe is DeiT's: AdamW with the linear scaling rule ``lr = base_lr * batch_size / lr_base_batch``, a cosine
schedule stepped every optimizer step (DeiT stepped it per epoch) after a linear warmup, mixup/cutmix with label
smoothing, repeated augmentation, drop path, an optional EMA; or DeiT III's (``configs/deit3_recipe.yaml``): LAMB at
an unscaled lr, BCE on binarised mixed targets, 3-Augment, the same drop path at every block. Evaluation
(Top-1/Top-5/loss on the val split, raw and EMA weights) runs every ``train.eval_every`` epochs and after the last
step; the final metrics are those of the final epoch, never the best one.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler

from common import trainer
from vision.augment import NormalizeErase, build_mixup, build_transform
from vision.config import AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig  # noqa: F401
from vision.data import build_eval_loader, build_splits, load_rgb_tensor, unreadable_flags
from vision.deit import build_model
from vision.evaluate import compile_for_eval, evaluate

# What a DeiT run reports (final_metrics.json, the demo, the studies): the raw model's Top-1, as DeiT's recipe does;
# the EMA's is logged alongside as val_ema/top1. vision.export exports these weights unless told otherwise.
REPORTED_METRIC, REPORTED_WEIGHTS = "val/top1", "model"


def build_criterion(augment: AugmentConfig) -> torch.nn.Module:
    """DeiT III's BCE (``augment.bce_loss``): every class whose (mixed) target is above 0 is a positive, timm's
    ``BinaryCrossEntropy`` at threshold 0 as DeiT III's ``targets.gt(0.0)``; else soft-target CE after mixup
    (smoothing is inside the soft targets), else (label-smoothed) CE."""
    if augment.bce_loss:  # label smoothing is refused with it (vision.config): it would make every class positive
        return BinaryCrossEntropy(smoothing=0.0, target_threshold=0.0)
    if augment.mixup > 0 or augment.cutmix > 0:
        return SoftTargetCrossEntropy()
    if augment.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=augment.label_smoothing)
    return torch.nn.CrossEntropyLoss()


def uniform_drop_path(model: torch.nn.Module, rate: float) -> None:
    """DeiT III's stochastic depth: ``rate`` at every block (timm's ViT rises linearly from 0 at the first block).
    Replaces each block's drop-path modules (ours ``drop_path``, timm's ``drop_path1``/``drop_path2``)."""
    from timm.layers import DropPath

    for block in model.blocks:
        for name, _ in list(block.named_children()):
            if name.startswith("drop_path"):
                setattr(block, name, DropPath(rate) if rate > 0 else torch.nn.Identity())


def finetune_changes(model: torch.nn.Module, shapes: dict, reset) -> str:
    """What :func:`vision.deit.load_finetune` changed between a file (``shapes``: its tensors' shapes) and ``model``:
    the position embedding's grid and the patch size resampled, the heads reset (``reset``, their keys)."""
    changes = []
    own = tuple(model.pos_embed.shape)
    if shapes.get("pos_embed", own) != own:
        prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
        old = math.isqrt(shapes["pos_embed"][1] - prefix)
        new = "x".join(map(str, model.patch_embed.grid_size))
        changes.append(f"position embedding resampled from a {old}x{old} grid to {new}")
    own = tuple(model.patch_embed.proj.weight.shape)
    if shapes.get("patch_embed.proj.weight", own) != own:
        old = "x".join(map(str, shapes["patch_embed.proj.weight"][2:]))
        changes.append(f"patch embedding resampled from {old} to {'x'.join(map(str, own[2:]))} pixels")
    if reset:
        changes.append(f"{', '.join(reset)} reset to their initialisation ({shapes[reset[0]][0]} classes in the file, "
                       f"{model.num_classes} here)")
    return "; ".join(changes) or "every weight loaded as it is (the same grid, patch size and classes)"


class DeiTTask(trainer.Task):
    """DeiT's pieces for :class:`common.trainer.Trainer`."""

    # Besides the trainer's own list: the length and the learning-rate schedule (applied from the resumed step
    # on: the cosine is recomputed for the new settings) and the evaluation settings.
    resumable_changes = ("optim.base_lr", "optim.lr_base_batch", "optim.epochs", "optim.warmup_epochs",
                         "optim.warmup_lr", "optim.min_lr", "train.eval_every", "train.eval_batch_size",
                         "data.max_val_samples")
    compile_pays_after_steps_on_cpu = None  # the micro-DeiT's compiled step is no faster on a CPU (docs/benchmarks.md)

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.repeats = cfg.augment.repeated_aug
        self.lr = cfg.optim.lr
        self.loss_parts = ("loss_cls", "loss_dist") if cfg.distill.on else ()
        self.last_eval: dict = {}
        self.eval_models: dict = {}  # id(weights) -> their compiled evaluation model, when the run compiles

    def setup(self, accelerator) -> None:
        cfg = self.cfg
        self.accelerator = accelerator
        if cfg.data.backend == "dali":
            from vision.dali import require_dali

            require_dali()  # before any data is read
        # Workers decode, crop and augment to uint8 (+ erasing boxes); normalising and erasing run on the device.
        self.train_set, val_set = build_splits(
            cfg.data, None if cfg.data.backend == "dali" else
            build_transform(cfg.data, cfg.augment, training=True, use_prefetcher=True),
            build_transform(cfg.data, training=False), train_loader=load_rgb_tensor)
        self.val_loader = build_eval_loader(val_set, cfg.train.eval_batch_size, cfg.data.num_workers,
                                            accelerator.process_index, accelerator.num_processes,
                                            persistent_workers=True, ignore_signals=cfg.train.stop_signals)
        self.mixup = build_mixup(cfg.augment, cfg.data.num_classes)
        self.criterion = build_criterion(cfg.augment)
        if cfg.distill.on:  # DeiT's distillation: the teacher sees the same (mixed) images as the student
            from vision.distill import DistillationLoss, build_teacher

            teacher = build_teacher(cfg.distill, cfg.data.num_classes).to(accelerator.device)
            self.criterion = DistillationLoss(self.criterion, teacher, cfg.distill.type, cfg.distill.alpha,
                                              cfg.distill.tau or 1.0)
        self.batch_transform = NormalizeErase(cfg.data, cfg.augment)

    def build_feed(self, sampler, batch_size: int, device):
        cfg = self.cfg
        if cfg.data.backend != "dali":
            return None  # the standard feed, finished on the device by NormalizeErase
        from vision.dali import build_dali_loader

        return build_dali_loader(self.train_set, sampler, batch_size, cfg.data, cfg.augment, device,
                                 seed=cfg.train.seed * 1000 + self.accelerator.process_index)

    def build_model(self) -> torch.nn.Module:
        model = build_model(self.cfg.model, self.cfg.data)
        if self.cfg.model.drop_path_schedule == "uniform":
            uniform_drop_path(model, self.cfg.model.drop_path)
        if self.cfg.train.finetune:  # a resumed run then loads its own checkpoint over these weights
            from common.checkpoint import weight_shapes
            from vision.deit import load_finetune

            reset = load_finetune(model, self.cfg.train.finetune)
            changes = finetune_changes(model, weight_shapes(self.cfg.train.finetune), reset)
            self.accelerator.print(f"fine-tuning from {self.cfg.train.finetune}: {changes}")
        if self.cfg.distill.on:
            model.set_distilled_training(True)  # training returns both heads' logits; evaluation their average
        return model

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.cfg.optim.epochs * steps_per_epoch

    def lr_scheduler(self, optimizer, steps_per_epoch: int, total_steps: int) -> CosineLRScheduler:
        o = self.cfg.optim
        return CosineLRScheduler(optimizer, t_initial=total_steps, lr_min=o.min_lr,
                                 warmup_t=round(o.warmup_epochs * steps_per_epoch), warmup_lr_init=o.warmup_lr or 0.0,
                                 t_in_epochs=False)

    def loss(self, model, batch):
        images, targets = batch
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        if self.cfg.distill.on:  # both heads' terms logged apart (train/loss_cls, train/loss_dist), unweighted
            cls_loss, dist_loss = self.criterion.terms(images, model(images), targets)
            return self.criterion.combine(cls_loss, dist_loss), {"loss_cls": cls_loss, "loss_dist": dist_loss}
        return self.criterion(model(images), targets), {}

    def run_summary(self) -> dict:
        return {"lr_peak": self.cfg.optim.lr}

    def log_extras(self) -> dict:
        return {"train/skipped_images": self._skipped()}

    def _skipped(self) -> int:
        """Distinct unreadable training files met by any process (a file met twice, or by two ranks, counts once)."""
        flags = unreadable_flags(self.train_set)
        if flags is None:
            return 0
        if self.accelerator.num_processes > 1:
            seen = torch.tensor([int(flags.sum())], device=self.accelerator.device)
            torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
            if not seen.item():  # the usual case: no process met an unreadable file, no need to merge the flags
                return 0
            flags = flags.to(self.accelerator.device, dtype=torch.int32)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return int(flags.sum())

    def after_step(self, ctx: trainer.StepContext) -> Optional[dict]:
        every, epoch = self.cfg.train.eval_every, ctx.epoch
        if not (ctx.last or (ctx.epoch_end and every and epoch % every == 0)):
            return None
        metrics = {f"val/{k}": v for k, v in self._evaluate(ctx.model, ctx.compiled).items()}
        if ctx.ema_model is not None:
            metrics.update({f"val_ema/{k}": v for k, v in self._evaluate(ctx.ema_model, ctx.compiled).items()})
        metrics["epoch"] = epoch
        self.accelerator.print(f"epoch {epoch}: " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()
                                                             if k.endswith(("top1", "loss"))))
        self.last_eval = metrics
        return metrics

    def _evaluate(self, weights: torch.nn.Module, compiled: bool) -> dict:
        """Top-1 etc. of ``weights`` (bare), through an evaluation model compiled once per weights when the
        training model is ``compiled`` (its own eval-mode graph, fixed shapes), else eager."""
        if not compiled:
            return evaluate(weights, self.val_loader, self.accelerator)
        if id(weights) not in self.eval_models:
            self.eval_models[id(weights)] = compile_for_eval(weights)
        return evaluate(self.eval_models[id(weights)], self.val_loader, self.accelerator, compiled=True)

    def final_metrics(self, ctx: trainer.StepContext) -> dict:
        return {**self.last_eval, "skipped_images": self._skipped()}

    def weights_metadata(self, step: int) -> dict:
        return {"model": self.cfg.model.name, "step": step}
