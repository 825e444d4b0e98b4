"""Exponential moving average of model weights: timm's ``ModelEmaV3`` behind a small, fixed API.

Why timm's: it already does the fused ``foreach`` lerp over parameters *and* buffers, float32 EMA of a
low-precision model, and decay warmup; we only add the bits a trainer needs around it (build it from the
bare model under DDP/compile wrappers, save/load its weights by name).

    ema = ModelEma(model, decay=0.9999)       # a copy of the weights now (DiT starts the EMA as a copy)
    ema.update(model, skip=found_inf)         # after each optimizer step (skip: 1 for a skipped step)
    ema.module                                # the averaged nn.Module, for evaluation / sampling
    ema.state_dict() / ema.load_state_dict()  # the averaged weights only (same keys as the model)
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from timm.utils import ModelEmaV3

from common.checkpoint import bare_model


class ModelEma(nn.Module):
    """EMA of ``model``'s parameters and buffers, ``ema = decay * ema + (1 - decay) * model`` per update.

    Args:
        model: the trained model (DDP / ``torch.compile`` wrappers are looked through).
        decay: the per-update decay (DeiT: 0.99996, DiT: 0.9999).
        warmup: use timm's decay warmup ``1 - (1 + step)^(-2/3)`` capped at ``decay`` (pass ``step``).
        device: keep the EMA on another device (e.g. ``"cpu"`` to save accelerator memory).
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = False, device: Optional[torch.device] = None):
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay={decay} must lie in [0, 1)")
        self.ema = ModelEmaV3(bare_model(model), decay=decay, use_warmup=warmup, device=device)
        self.ema.module.requires_grad_(False)
        self._cache = None  # (model, lists): a tuple, so nn.Module does not register the model as a child

    @property
    def module(self) -> nn.Module:
        return self.ema.module

    @property
    def decay(self) -> float:
        return self.ema.decay

    @torch.no_grad()
    def update(self, model: nn.Module, step: Optional[int] = None, skip: Optional[torch.Tensor] = None) -> None:
        """One EMA step towards ``model``. ``skip`` (a 0-d float tensor, 1 = skip) leaves the EMA unchanged for a
        step the optimizer skipped, decided on the device without a host sync."""
        decay = self.ema.get_decay(step if self.ema.use_warmup else None)
        ema_values, model_values, ema_other, model_other = self._pairs(bare_model(model))
        for ema_v, model_v in zip(ema_other, model_other):  # integer buffers (e.g. BatchNorm's step count)
            ema_v.copy_(model_v)
        if skip is None:
            torch._foreach_lerp_(ema_values, model_values, 1.0 - decay)
            return
        # A Python weight would need the host to read ``skip`` (a sync), and no torch release (2.6 .. 2.14) has a
        # _foreach_lerp_ overload taking one device tensor as the weight: the list overload gets that one tensor
        # once per lerped tensor.
        weight = (1.0 - skip) * (1.0 - decay)
        torch._foreach_lerp_(ema_values, model_values, [weight] * len(ema_values))

    def _pairs(self, model: nn.Module):
        """``(ema floats, model floats, ema others, model others)``: the parameters and buffers of both models, by
        state-dict order, taken once per model (the model's tensors stay the same objects while it trains)."""
        if self._cache is None or self._cache[0] is not model:
            ema = self.ema.module.state_dict(keep_vars=True).values()
            pairs = list(zip(ema, model.state_dict(keep_vars=True).values()))
            floats = [(e, m) for e, m in pairs if e.is_floating_point()]
            others = [(e, m) for e, m in pairs if not e.is_floating_point()]
            self._cache = (model, ([e for e, _ in floats], [m for _, m in floats], [e for e, _ in others],
                                   [m for _, m in others]))
        return self._cache[1]

    def state_dict(self, *args, **kwargs):
        return self.ema.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.ema.module.load_state_dict(state_dict, strict=strict)

    def forward(self, *args, **kwargs):
        return self.ema.module(*args, **kwargs)
