"""DeiT's knowledge distillation: a frozen teacher and the loss of the distillation head.

The student is a distilled DeiT (:class:`vision.deit.SiameseNormVisionTransformerDistilled`, or timm's
``deit_*_distilled_patch16_224``) that returns ``(class-token logits, distillation-token logits)`` in training.
The loss is DeiT's ``DistillationLoss`` (facebookresearch/deit, losses.py): the base criterion on the class head,
and on the distillation head either the cross-entropy with the teacher's argmax (hard) or the KL divergence of the
tempered softmaxes, summed and divided by the number of logits, times tau^2 (soft). timm's TokenDistillationTask
divides the soft term by the batch size instead and weighs the terms otherwise, so it is not used here.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from vision.config import DistillConfig


def build_teacher(cfg: DistillConfig, num_classes: int) -> nn.Module:
    """The timm model ``cfg.teacher`` with the weights of ``cfg.teacher_weights``, frozen, in eval mode.

    Built without pretrained weights (nothing is downloaded) and loaded strictly, as DeiT loads its RegNetY."""
    import timm

    from common.checkpoint import WeightsMismatchError, load_weights

    teacher = timm.create_model(cfg.teacher, pretrained=False, num_classes=num_classes, **cfg.teacher_kwargs)
    try:
        load_weights(teacher, cfg.teacher_weights)
    except WeightsMismatchError as err:
        raise WeightsMismatchError(
            f"distill.teacher_weights={cfg.teacher_weights} does not fit distill.teacher={cfg.teacher} with "
            f"{num_classes} classes (data.num_classes): {err.summary()}. Give that model's weights for these classes, "
            "or name the model of this file in distill.teacher (and its arguments in distill.teacher_kwargs)",
            err.missing, err.unexpected, err.shapes) from None
    return teacher.requires_grad_(False).eval()


class DistillationLoss(nn.Module):
    """``(1 - alpha) * base(outputs, targets) + alpha * distillation(outputs_dist, teacher(images))``, as DeiT.

    ``forward(images, outputs, targets)`` takes the (mixed) images the student saw, its ``(outputs, outputs_dist)``
    and the (soft) targets. The teacher runs without gradients and stays in eval mode whatever ``train()`` is given.
    """

    def __init__(self, base_criterion: nn.Module, teacher: nn.Module, kind: str, alpha: float, tau: float = 1.0):
        super().__init__()
        if kind not in ("soft", "hard"):
            raise ValueError(f"distillation kind must be soft or hard, got {kind!r}")
        self.base_criterion, self.teacher, self.kind, self.alpha, self.tau = base_criterion, teacher, kind, alpha, tau

    def train(self, mode: bool = True) -> "DistillationLoss":
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, images: torch.Tensor, outputs: Tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor
                ) -> torch.Tensor:
        return self.combine(*self.terms(images, outputs, targets))

    def terms(self, images: torch.Tensor, outputs: Tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(base loss of the class head, distillation loss of the distillation head)``, unweighted."""
        if isinstance(outputs, torch.Tensor):
            raise ValueError("distillation needs the student's (class head, distillation head) logits: a distilled "
                             "model with set_distilled_training(True), in training mode")
        outputs, outputs_dist = outputs
        base_loss = self.base_criterion(outputs, targets)
        with torch.no_grad():
            teacher_outputs = self.teacher(images)
        if self.kind == "soft":
            t = self.tau
            distill_loss = F.kl_div(F.log_softmax(outputs_dist / t, dim=1), F.log_softmax(teacher_outputs / t, dim=1),
                                    reduction="sum", log_target=True) * (t * t) / outputs_dist.numel()
        else:
            distill_loss = F.cross_entropy(outputs_dist, teacher_outputs.argmax(dim=1))
        return base_loss, distill_loss

    def combine(self, base_loss: torch.Tensor, distill_loss: torch.Tensor) -> torch.Tensor:
        """The trained loss: ``(1 - alpha) * base + alpha * distillation``."""
        return base_loss * (1 - self.alpha) + distill_loss * self.alpha
