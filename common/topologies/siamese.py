"""SiameseNorm (arXiv 2602.08064): a Pre-Norm and a Post-Norm stream that share every sublayer.

Registered with the other norm placements in :mod:`common.topologies.norm_placement`.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from common.cli import InputError
from common.topologies.base import NormLayer, ResidualBlock, StreamFusion, default_norm
from common.topologies.fused_norm_chain import siamese_norm_chain

Tensor = torch.Tensor


def depth_scale(layer_index: int, enabled: bool = True) -> float:
    """SiameseNorm's depth-wise scale ``c_l = sqrt(2(l+1))`` for 0-based block ``l``."""
    return math.sqrt(2.0 * (layer_index + 1)) if enabled else 1.0


class SiameseNormBlock(ResidualBlock):
    """SiameseNorm, per sublayer::

        X <- LN_post(X);  Z <- F(LN_in(X + LN_pre(Y)));  X <- X + Z / c_l;  Y <- Y + Z

    ``Z`` carries one DropPath mask into both streams. Norms ``pre_norm{i}``, ``post_norm{i}``, ``input_norm{i}``, as
    in the public SiameseNorm DeiT.

    Args:
        normalized_input: apply ``LN_in`` (paper Table 3 "Normalized Input"); without it the sublayer reads
            ``X' + LN_pre(Y)``.
        depth_scaling: ``c_l = sqrt(2(l+1))`` (Table 3 "Depth-wise Scaling"); else ``c_l = 1``.
        norm_layer: the affine stream norms ``LN_pre``, ``LN_post``.
        input_norm_layer: ``LN_in`` (default ``norm_layer``); DiT passes a non-affine LayerNorm and modulates
            its output in the sublayer.
    """

    topology = "siamese"
    recompute_norms = False

    def __init__(self, dim: int, layer_index: int = 0, *, normalized_input: bool, depth_scaling: bool,
                 norm_layer: NormLayer = default_norm, input_norm_layer: Optional[NormLayer] = None,
                 drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.normalized_input = normalized_input
        self.depth_scale = depth_scale(layer_index, depth_scaling)
        input_norm_layer = input_norm_layer or norm_layer
        self.pre_norm1 = norm_layer(dim)
        self.post_norm1 = norm_layer(dim)
        self.input_norm1 = input_norm_layer(dim) if normalized_input else nn.Identity()
        self.pre_norm2 = norm_layer(dim)
        self.post_norm2 = norm_layer(dim)
        self.input_norm2 = input_norm_layer(dim) if normalized_input else nn.Identity()

    def forward(self, state: Tuple[Tensor, Tensor], ctx: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        x, y = state
        x, h = self.norm_chain1(x, y)
        z = self.drop_path(self.sublayer1(h, ctx))
        x, y = x.add(z, alpha=1.0 / self.depth_scale), y + z
        x, h = self.norm_chain2(x, y)
        z = self.drop_path(self.sublayer2(h, ctx))
        return x.add(z, alpha=1.0 / self.depth_scale), y + z

    def norm_chain1(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        """``(LN_post(X), LN_in(LN_post(X) + LN_pre(Y)))`` in front of the attention sublayer."""
        x = self.post_norm1(x)
        return x, self.input_norm1(x + self.pre_norm1(y))

    def norm_chain2(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        """The same in front of the MLP sublayer."""
        x = self.post_norm2(x)
        return x, self.input_norm2(x + self.pre_norm2(y))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, normalized_input={self.normalized_input}, "
                f"depth_scale={self.depth_scale:.4f}, recompute_norms={self.recompute_norms}")


class RecomputedSiameseNormBlock(SiameseNormBlock):
    """SiameseNorm whose norm chains run as one autograd node each while autograd records
    (:class:`common.topologies.fused_norm_chain.SiameseNormChain`): backward rebuilds the ``LN_in`` input instead of
    keeping it, one stream tensor per sublayer less. Same weights and keys as :class:`SiameseNormBlock`; the norms'
    forward hooks do not fire on that path, and TorchScript needs the plain block (build with
    ``recompute_norms=False``, the weights load unchanged)."""

    recompute_norms = True

    def __init__(self, dim: int, layer_index: int = 0, **kwargs):
        super().__init__(dim, layer_index, **kwargs)
        if not all(isinstance(m, (nn.LayerNorm, nn.Identity)) for m in (self.post_norm1, self.pre_norm1, self.input_norm1)):
            raise InputError(f"recompute_norms fuses LayerNorms, and this model's norms are "
                             f"{type(self.post_norm1).__name__}s: set recompute_norms=false")

    def norm_chain1(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        return siamese_norm_chain(x, y, self.post_norm1, self.pre_norm1, self.input_norm1, recompute=True)

    def norm_chain2(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        return siamese_norm_chain(x, y, self.post_norm2, self.pre_norm2, self.input_norm2, recompute=True)


class SiameseFusion(StreamFusion):
    """Fuse the two streams after the last block: ``LN_out(LN_x(X) + LN_y(Y))``; ``final_norm=False`` drops
    ``LN_out`` (DiT, whose final layer normalises again)."""

    def __init__(self, dim: int, norm_layer: NormLayer = default_norm, final_norm: bool = True):
        super().__init__()
        self.norm_x = norm_layer(dim)
        self.norm_y = norm_layer(dim)
        self.norm_out = norm_layer(dim) if final_norm else nn.Identity()

    def forward(self, state: Tuple[Tensor, Tensor], final_norm: bool = True) -> Tensor:
        x, y = state
        h = self.norm_x(x) + self.norm_y(y)
        return self.norm_out(h) if final_norm else h
