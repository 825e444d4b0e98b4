"""REPA (Yu et al. 2025): align a DiT's hidden state after block ``k`` with a frozen encoder's patch features.

The DiT gets REPA's projector (``projectors.0``: Linear, SiLU, Linear, SiLU, Linear, REPA's key names), which maps
each token after block ``k`` to the encoder's width; the loss adds ``weight * mean over tokens of
-cos(projected token, encoder patch token)`` (:func:`alignment_loss`) to the denoising loss, per sample. The encoder
is a timm ViT (REPA's: DINOv2 ViT-B/14, ``vit_base_patch14_dinov2``) whose weights come from a file the user gives;
it sees the very image the latent was encoded from, its flip included, normalised with the encoder's mean and std
and resized (bicubic) to the encoder's input size, as REPA does (:class:`FrozenEncoder`).

What is aligned for the two-stream topologies: the ``Y`` stream (:meth:`diffusion.models.DiT.forward`'s
``hidden_after``), the embedding plus every update ``Z`` of blocks 1..k, the same sum Pre-Norm's stream is. REPA
aligns exactly that sum in Pre-Norm SiT, so both arms of a comparison align the same quantity; ``X`` is
re-normalised before every sublayer and holds the updates scaled by ``1 / c_l``, and a fused readout would borrow the
output fusion's norms for an inner block. The alignment's gradient reaches ``X`` through every ``Z``, which reads both
streams.

Sampling needs no projector: :func:`diffusion.models.load_dit` drops the ``projectors.`` keys of a checkpoint (REPA's
own checkpoints hold them too).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from common.cli import InputError
from diffusion.models import DiT

Tensor = torch.Tensor


def projector(hidden_size: int, projector_dim: int, feature_dim: int) -> nn.Sequential:
    """REPA's ``build_mlp``: three linear layers with SiLU between them, applied to every token."""
    return nn.Sequential(nn.Linear(hidden_size, projector_dim), nn.SiLU(), nn.Linear(projector_dim, projector_dim),
                         nn.SiLU(), nn.Linear(projector_dim, feature_dim))


class RepaDiT(DiT):
    """A DiT with REPA's projector on the tokens after block ``align_depth`` (1-based).

    ``forward(x, t, y, force_drop_ids, align=True)`` returns ``(output, projected tokens (N, T, feature_dim))``; without
    ``align`` it is the DiT's forward, so samplers and guidance use it unchanged.
    """

    def __init__(self, *, align_depth: int, projector_dim: int, feature_dim: int, **dit_kwargs):
        super().__init__(**dit_kwargs)
        if not 1 <= align_depth <= len(self.blocks):
            raise InputError(f"repa.depth={align_depth} must lie in [1, {len(self.blocks)}] (the DiT's blocks)")
        self.align_depth = align_depth
        hidden_size = self.pos_embed.shape[-1]
        self.projectors = nn.ModuleList([projector(hidden_size, projector_dim, feature_dim)])
        for module in self.projectors.modules():  # REPA initialises the projector as every linear: xavier, zero bias
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor, t: Tensor, y: Tensor, force_drop_ids: Optional[Tensor] = None, align: bool = False):
        if not align:
            return super().forward(x, t, y, force_drop_ids)
        out, hidden = super().forward(x, t, y, force_drop_ids, hidden_after=self.align_depth)
        return out, self.projectors[0](hidden)


def alignment_loss(features: Tensor, projected: Tensor) -> Tensor:
    """Per sample, the mean over tokens of ``-cos(features, projected)`` (REPA's projection loss before its batch
    mean)."""
    cos = (nn.functional.normalize(features.float(), dim=-1) * nn.functional.normalize(projected.float(), dim=-1)).sum(-1)
    return -cos.mean(dim=1)


class EncoderError(FileNotFoundError):
    """A REPA encoder that cannot be built or loaded."""


class FrozenEncoder(nn.Module):
    """A timm ViT in eval mode without gradients: ``encoder(images (B, C, H, W), uint8 or in [0, 1]) -> patch
    tokens (B, T, D)``.

    Built by ``timm.create_model(name, img_size=image_size, **kwargs)``; its weights are read from ``weights``
    (safetensors or a torch state dict, timm's or the original DINOv2 layout, converted and the position embedding
    resampled to the input grid by timm's ``checkpoint_filter_fn``, as REPA resamples it), never downloaded. Images are
    normalised by ``mean`` and ``std`` (default: the timm model's, ImageNet's for DINOv2); grey images are repeated to
    the encoder's three channels.
    """

    def __init__(self, name: str, weights: str, image_size: int, kwargs: Optional[dict] = None,
                 mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None):
        super().__init__()
        import timm
        from timm.models.vision_transformer import checkpoint_filter_fn

        from common.checkpoint import read_file, unwrap_state_dict

        if not Path(weights).is_file():
            raise EncoderError(f"repa.encoder_weights={weights}: no such file; give the frozen encoder's weights (e.g. "
                               "DINOv2 ViT-B/14's, saved from timm or torch.hub); nothing is downloaded")
        try:
            model = timm.create_model(name, pretrained=False, num_classes=0, img_size=image_size, **(kwargs or {}))
        except (RuntimeError, TypeError) as err:
            raise EncoderError(f"repa.encoder={name!r}: {err}") from None
        state = checkpoint_filter_fn(unwrap_state_dict(read_file(weights)), model)
        state = {k: v for k, v in state.items() if not k.startswith(("head.", "head_dist."))}  # a classifier's head
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise EncoderError(f"repa.encoder_weights={weights} does not fit {name}: missing {missing[:5]}, unexpected "
                               f"{unexpected[:5]}")
        self.model = model.eval().requires_grad_(False)
        self.image_size = image_size
        mean, std = mean or model.pretrained_cfg["mean"], std or model.pretrained_cfg["std"]
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.train(False)

    @property
    def num_tokens(self) -> int:
        return self.model.patch_embed.num_patches

    @property
    def feature_dim(self) -> int:
        return self.model.embed_dim

    def train(self, mode: bool = True):
        return super().train(False)  # frozen: dropout and the like stay off

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        x = images.float() / 255 if images.dtype == torch.uint8 else images.float()
        if x.shape[1] == 1 and self.mean.shape[1] == 3:
            x = x.expand(-1, 3, -1, -1)
        x = (x - self.mean) / self.std
        if x.shape[-1] != self.image_size:
            x = nn.functional.interpolate(x, size=(self.image_size, self.image_size), mode="bicubic")
        return self.model.forward_features(x)[:, self.model.num_prefix_tokens:]
