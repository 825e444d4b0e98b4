"""Model outputs to uint8 images: through the VAE the latents were made with (checked), undoing their scaling, or
as pixels."""
from __future__ import annotations

import math
from typing import Optional

import torch

from common.checkpoint import weights_fingerprint
from diffusion.latents import LatentScaling, load_vae
from diffusion.sampling.options import SamplingError

Tensor = torch.Tensor


class VAEMismatchError(SamplingError):
    """The VAE given is not the one the latents (and so the model) were made with."""


class Decoder:
    """Model outputs -> uint8 images ``[B, C, H, W]``: through the VAE (``x / scaling_factor``, or with
    ``latent_norm``, the model's record of LightningDiT's per-channel normalisation, ``x * std / multiplier + mean``:
    :class:`~diffusion.latents.LatentScaling`) or as pixels.

    ``expect`` (``vae``, ``vae_sha256``, ``vae_scaling_factor``, as the latents' metadata and the model's weights
    record them) is checked against the loaded VAE: decoding with another VAE gives wrong images without an error.
    ``nonfinite="raise"`` refuses NaN/inf samples; ``"black"`` draws them black and counts them in
    :attr:`nonfinite_images` (training grids and FIDs, which must never stop a run).
    """

    def __init__(self, autoencoder: str, device, option: str = "--vae", expect: Optional[dict] = None,
                 nonfinite: str = "raise", made_with: str = "the model was trained on",
                 latent_norm: Optional[dict] = None):
        self.vae, self.scaling_factor, self.fingerprint = None, 1.0, None
        self.nonfinite, self.nonfinite_images = nonfinite, 0
        if autoencoder != "none":
            vae = load_vae(autoencoder, option=option)
            self.fingerprint = weights_fingerprint(vae.state_dict())
            self.scaling_factor = float(vae.config.scaling_factor)
            self._check(autoencoder, option, expect or {}, made_with)
            self.vae = vae.to(device).eval().requires_grad_(False)
        self.scaling = LatentScaling(self.scaling_factor, latent_norm)

    def _check(self, autoencoder: str, option: str, expect: dict, made_with: str) -> None:
        want_scale, want_sha = expect.get("vae_scaling_factor"), expect.get("vae_sha256")
        scale_differs = want_scale is not None and not math.isclose(float(want_scale), self.scaling_factor, rel_tol=1e-6)
        if not (scale_differs or (want_sha and want_sha != self.fingerprint)):
            return
        recorded = ", ".join(f"{k} {v}" for k, v in (("vae", expect.get("vae")), ("scaling factor", want_scale),
                                                        ("weights sha256", (want_sha or "")[:16])) if v)
        given = f"{option}={autoencoder}" if option.startswith(("data.", "train.")) else f"{option} {autoencoder}"
        raise VAEMismatchError(
            f"{given} is not the VAE {made_with} (recorded: {recorded}; this one: scaling factor "
            f"{self.scaling_factor:g}, weights sha256 {self.fingerprint[:16]}): its decoded images would be wrong. "
            f"Point {option} at the VAE that encoded the latents")

    def compile(self) -> None:
        """``torch.compile`` the VAE's decoder in place (fixed shapes: the sampler pads its last batch)."""
        if self.vae is not None:
            self.vae.decoder.compile(dynamic=False)

    @torch.no_grad()
    def __call__(self, x: Tensor) -> Tensor:
        if self.vae is not None:
            x = self.vae.decode(self.scaling.undo(x)).sample
        x = x.float()
        if self.nonfinite == "black":
            finite = torch.isfinite(x)
            self.nonfinite_images += int((~finite).flatten(1).any(dim=1).sum())
            x = torch.where(finite, x, -1.0)
        from diffusion.evaluation.images import images_to_uint8

        return images_to_uint8(x.clamp(-1.0, 1.0).cpu())  # with nonfinite="raise", NaN samples raise here
