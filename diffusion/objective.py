"""What training and sampling read of a diffusion objective, DDPM's :class:`~diffusion.gaussian_diffusion.
GaussianDiffusion` or SiT's :class:`~diffusion.transport.Transport`: one small protocol, so that the task, the sampler
and the command lines never ask which one they hold."""
from typing import Callable, Dict, Optional, Protocol

import torch

Tensor = torch.Tensor


class Objective(Protocol):
    """Training reads :attr:`time_draw` and :meth:`losses`; sampling reads :attr:`default_sampler`, whose options
    object (:class:`diffusion.sampling.chains.DDPMSampling` or :class:`~diffusion.sampling.chains.FlowSampling`) runs
    the objective's chain; records read :meth:`description`."""

    time_draw: str  # what a training example draws for its time: "index" (DDPM), "uniform" or "normal"
    default_sampler: str  # the chain its paper samples with: "ddpm" (DDPM's ancestral steps), "sde-euler" (SiT's)

    def losses(self, model: Callable, x0: Tensor, draw: Tensor, noise: Tensor,
               model_kwargs: Optional[dict] = None) -> Dict[str, Tensor]:
        """Per-sample ``loss`` and its parts for data ``x0`` at the examples' time draws; a model that returns
        ``(output, extra)`` (REPA's aligned tokens) gets ``extra`` back under ``"extra"``."""

    def description(self) -> dict:
        """The objective, as a model's records hold it."""

    def to(self, device) -> "Objective":
        """The objective's tensors (a schedule) on ``device``."""


def model_and_extra(out):
    """``(prediction, extra or None)`` of a model's output: a tensor, or ``(tensor, extra)`` (REPA's tokens)."""
    return out if isinstance(out, tuple) else (out, None)
