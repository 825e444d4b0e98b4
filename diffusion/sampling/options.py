"""The sampling options every sampling command offers, and the error bad options raise."""
import contextlib

import torch

from common.cli import InputError

SAMPLERS = ("ddpm", "ddim")  # a DDPM model's (GaussianDiffusion)
TRANSPORT_SAMPLERS = ("euler", "heun", "dopri5", "sde-euler", "sde-heun")  # a transport model's (Transport)
PRECISIONS = ("fp32", "bf16")


class SamplingError(InputError):
    """Options or checkpoints that cannot give the requested samples."""


def autocast(device, precision: str):
    """The model's forward in ``precision``: ``bf16`` autocast (its matmuls in bfloat16; the streams, the model
    output and the chain arithmetic stay float32) or plain ``fp32``."""
    if precision not in PRECISIONS:
        raise SamplingError(f"precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
