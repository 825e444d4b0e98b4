"""A model, its objective, decoder and options, as one callable: ``sampler(indices, labels) -> uint8 images``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple, Union

import torch

from common.data import pad_batch
from diffusion.sampling.chains import DDPMSampling, FlowSampling, default_sampling
from diffusion.sampling.decoder import Decoder
from diffusion.sampling.guidance import resolve_guided_channels
from diffusion.sampling.noise import sample_generators
from diffusion.sampling.options import SAMPLERS, TRANSPORT_SAMPLERS, SamplingError, autocast
from diffusion.transport import Transport

if TYPE_CHECKING:
    from diffusion.models import DiT
    from diffusion.objective import Objective
    from diffusion.spec import DiTSpec

Tensor = torch.Tensor


def sampling_objective(spec: "DiTSpec", steps: int, sampler: Optional[str] = None, spacing: Optional[str] = None,
                       eta: Optional[float] = None, **flow_options) -> Tuple["Objective", Union[DDPMSampling, FlowSampling]]:
    """``(objective, sampling)`` to sample a model as it was trained: its :class:`GaussianDiffusion` respaced to
    ``steps`` with :class:`DDPMSampling` (``sampler`` ``ddpm``, the default, or ``ddim`` with ``eta``; ``spacing`` by
    default ``even`` for ddpm and ``ddim`` for ddim), or its :class:`Transport` with :class:`FlowSampling`
    (``sampler`` by default ``sde-euler``, SiT's FID sampler; ``flow_options`` its other settings)."""
    if spec.transport is not None:
        if sampler in SAMPLERS or spacing is not None:
            raise SamplingError(f"this model was trained with SiT's transport ({spec.transport['path']} path, "
                                f"{spec.transport['prediction']} prediction): sample it with "
                                f"{', '.join(TRANSPORT_SAMPLERS)} (no --spacing)")
        flow = FlowSampling(sampler=sampler or "sde-euler", steps=steps, **flow_options)
        if eta is not None:
            raise SamplingError(f"--eta {eta:g} is the noise of --sampler ddim, and this command samples with "
                                f"{flow.sampler}: drop --eta (this model was trained with SiT's transport, whose "
                                "samplers have no eta)")
        ignored = ["--" + k.replace("_", "-") for k in flow_options if not flow.applies(k)]
        if ignored:
            it = "them" if len(ignored) > 1 else "it"
            raise SamplingError(f"{', '.join(ignored)}: --sampler {flow.sampler} does not read {it} (--atol and --rtol "
                                "set dopri5's adaptive steps, --diffusion-* and --last-step* the SDE samplers', "
                                f"sde-euler and sde-heun); drop {it}, or choose a --sampler that reads {it}")
        return Transport.from_description(spec.transport), flow
    if sampler in TRANSPORT_SAMPLERS or flow_options:
        given = [f"sampler {sampler}"] * (sampler in TRANSPORT_SAMPLERS) + [k.replace("_", " ") for k in sorted(flow_options)]
        raise SamplingError(f"this model was trained with DDPM: sample it with {' or '.join(SAMPLERS)}; "
                            f"{', '.join(given)}: a transport model's options (SiT's)")
    sampler = sampler or "ddpm"
    if eta is not None and sampler != "ddim":
        raise SamplingError(f"--eta {eta:g} is the noise of --sampler ddim, and this command samples with {sampler}: "
                            "add --sampler ddim, or drop --eta")
    spacing = spacing or ("ddim" if sampler == "ddim" else "even")
    try:
        return spec.diffusion(sampling_steps=steps, spacing=spacing), DDPMSampling(sampler, eta or 0.0, spacing)
    except ValueError as err:
        raise SamplingError(f"--steps {steps} --spacing {spacing}: {err}") from err


@dataclass
class Sampler:
    """A model, its objective and decoder, and the sampling options: ``sampler(indices, labels) -> uint8``.

    ``objective`` is the model's :class:`GaussianDiffusion` (DDPM) or its :class:`~diffusion.transport.Transport`,
    sampled as ``sampling`` says (:class:`DDPMSampling` or :class:`FlowSampling`, which run the objective's chain; by
    default its paper's, :func:`default_sampling`).
    ``compile``: ``torch.compile`` the model and the VAE's decoder in place, once, for the shapes of the first batch;
    a smaller batch (the last of a set) is padded to that size with copies of its last sample and cut back, so
    nothing compiles twice. Each sample's noise comes from its own stream, so padding changes no sample.
    """

    model: "DiT"
    spec: "DiTSpec"
    decoder: Decoder
    objective: "Objective"
    sampling: Optional[Union[DDPMSampling, FlowSampling]] = None
    cfg_scale: float = 1.0
    guided_channels: Optional[str] = None  # None: resolve_guided_channels's default for the model
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"
    compile: bool = False

    def __post_init__(self):
        self.sampling = self.sampling or default_sampling(self.objective)
        self.objective.to(self.device)  # the schedule next to the model: no host-to-device copy per step
        self.guided_channels = resolve_guided_channels(self.guided_channels, self.model.in_channels)
        autocast(self.device, self.precision)  # an unknown precision fails here, before any sampling
        self.compiled_batch: Optional[int] = None
        if self.compile:
            self.model.compile(dynamic=False)
            self.decoder.compile()

    @property
    def sampler(self) -> str:
        return self.sampling.sampler

    def __call__(self, indices: Tensor, labels: Tensor) -> Tensor:
        """uint8 images ``[B, C, H, W]`` of samples ``indices`` (their noise streams) of classes ``labels``."""
        count = len(indices)
        if self.compile:
            self.compiled_batch = self.compiled_batch or count
            indices, labels = pad_batch(indices, self.compiled_batch), pad_batch(labels, self.compiled_batch)
        return self.decoder(self.latents(indices, labels))[:count]

    def latents(self, indices: Tensor, labels: Tensor) -> Tensor:
        """The chain's end (VAE latents, or pixels in [-1, 1]) for samples ``indices`` of classes ``labels``."""
        generators = sample_generators(self.seed, indices.tolist())
        model_fn = self.sampling.model_fn(self.model, labels.to(self.device), self.cfg_scale, self.guided_channels)

        def forward(x, t):
            with autocast(self.device, self.precision):
                return model_fn(x, t)

        for x in self.sampling.states(self.objective, forward, generators, self.spec.shape, self.device):
            pass
        return x

    def settings(self) -> dict:
        """What this sampler makes a sample set with: recorded with the set, compared on resume."""
        guided = self.cfg_scale != 1.0
        model = {k: v for k, v in vars(self.spec).items() if k != "class_names"}
        return {"model": model, **self.sampling.settings(self.objective),
                "cfg_scale": self.cfg_scale, "guided_channels": self.guided_channels if guided else None,
                "precision": self.precision, "vae": self.spec.autoencoder,
                "vae_scaling_factor": self.decoder.scaling_factor, "vae_sha256": self.decoder.fingerprint,
                "seed": self.seed, "labels": "sample i has class i % num_classes"}
