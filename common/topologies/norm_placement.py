"""Where the norms sit on one (or two) residual streams: Pre-Norm, Post-Norm, SiameseNorm, Mix-LN, ResiDual,
Sandwich (Peri-LN), DeepNorm, LayerScale and Dynamic Tanh, and their registrations.

SiameseNorm's classes live in :mod:`common.topologies.siamese`; it is registered here, beside the placements it
spans (zeroing its ``LN_y`` gives a Post-Norm-style network, zeroing ``LN_x`` Pre-Norm).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from common.cli import InputError
from common.topologies.base import NormLayer, ResidualBlock, StreamFusion, TwoStreams, default_norm
from common.topologies.registry import BlockSpec, Topology, TopologyPlan, register
from common.topologies.siamese import RecomputedSiameseNormBlock, SiameseFusion, SiameseNormBlock

Tensor = torch.Tensor


class PreNormBlock(ResidualBlock):
    """Pre-Norm: ``Y <- Y + F(LN(Y))`` (timm's ``Block``). ``norm_layer`` is the norm a sublayer reads through."""

    topology = "pre"

    def __init__(self, dim: int, layer_index: int = 0, *, norm_layer: NormLayer = default_norm,
                 input_norm_layer: Optional[NormLayer] = None, drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.norm1 = (input_norm_layer or norm_layer)(dim)
        self.norm2 = (input_norm_layer or norm_layer)(dim)

    def forward(self, y: Tensor, ctx: Optional[Tensor] = None) -> Tensor:
        y = y + self.drop_path(self.sublayer1(self.norm1(y), ctx))
        return y + self.drop_path(self.sublayer2(self.norm2(y), ctx))


class PostNormBlock(ResidualBlock):
    """Post-Norm: ``X <- LN(X + F(X))`` (the original Transformer; timm's ``ResPostBlock`` norms ``F(X)`` instead)."""

    topology = "post"
    normalizes_output = True

    def __init__(self, dim: int, layer_index: int = 0, *, norm_layer: NormLayer = default_norm,
                 input_norm_layer: Optional[NormLayer] = None, drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.norm1 = norm_layer(dim)
        self.norm2 = norm_layer(dim)

    def forward(self, x: Tensor, ctx: Optional[Tensor] = None) -> Tensor:
        x = self.norm1(x + self.drop_path(self.sublayer1(x, ctx)))
        return self.norm2(x + self.drop_path(self.sublayer2(x, ctx)))


def deepnorm_alpha(num_blocks: int) -> float:
    """DeepNorm's residual up-weighting ``(2N)^(1/4)`` for an encoder of ``N`` blocks."""
    return (2.0 * num_blocks) ** 0.25


def deepnorm_beta(num_blocks: int) -> float:
    """DeepNorm's init gain ``(8N)^(-1/4)`` for the value, output and MLP weights of an ``N``-block encoder."""
    return (8.0 * num_blocks) ** -0.25


@torch.no_grad()
def deepnorm_init_(blocks: Sequence[nn.Module]) -> None:
    """DeepNorm's init for blocks with timm-style sublayers (``attn.qkv``, ``attn.proj``, ``mlp.fc1/fc2``):
    scale the value, output and MLP weights (not query and key) by ``(8N)^(-1/4)``."""
    gain = deepnorm_beta(len(blocks))
    for block in blocks:
        dim = block.attn.proj.weight.shape[0]
        block.attn.qkv.weight[2 * dim:].mul_(gain)
        for linear in (block.attn.proj, block.mlp.fc1, block.mlp.fc2):
            linear.weight.mul_(gain)


class DeepNormBlock(ResidualBlock):
    """DeepNorm (Wang et al. 2022): ``X <- LN(alpha X + F(X))`` with ``alpha = (2N)^(1/4)`` for ``N`` blocks.

    The model scales its value, output and MLP weights by :func:`deepnorm_beta` at init (:func:`deepnorm_init_`).
    """

    topology = "deepnorm"
    normalizes_output = True

    def __init__(self, dim: int, layer_index: int = 0, *, num_blocks: int, norm_layer: NormLayer = default_norm,
                 input_norm_layer: Optional[NormLayer] = None, drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.residual_scale = deepnorm_alpha(num_blocks)
        self.norm1 = norm_layer(dim)
        self.norm2 = norm_layer(dim)

    def forward(self, x: Tensor, ctx: Optional[Tensor] = None) -> Tensor:
        x = self.norm1(x * self.residual_scale + self.drop_path(self.sublayer1(x, ctx)))
        return self.norm2(x * self.residual_scale + self.drop_path(self.sublayer2(x, ctx)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.residual_scale:.4f}"


class SandwichBlock(ResidualBlock):
    """Peri-LN / Sandwich-LN: ``Y <- Y + LN_out(F(LN(Y)))`` (norms ``norm{i}`` and ``out_norm{i}``)."""

    topology = "sandwich"

    def __init__(self, dim: int, layer_index: int = 0, *, norm_layer: NormLayer = default_norm,
                 input_norm_layer: Optional[NormLayer] = None, drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.norm1 = (input_norm_layer or norm_layer)(dim)
        self.out_norm1 = norm_layer(dim)
        self.norm2 = (input_norm_layer or norm_layer)(dim)
        self.out_norm2 = norm_layer(dim)

    def forward(self, y: Tensor, ctx: Optional[Tensor] = None) -> Tensor:
        y = y + self.drop_path(self.out_norm1(self.sublayer1(self.norm1(y), ctx)))
        return y + self.drop_path(self.out_norm2(self.sublayer2(self.norm2(y), ctx)))


class ResiDualBlock(ResidualBlock):
    """ResiDual (Xie et al. 2023): ``Z <- F(X); X <- LN(X + Z); Y <- Y + Z``, read out as ``X + LN(Y)``
    (:class:`ResiDualFusion`). Both streams start as the embedding."""

    topology = "residual"

    def __init__(self, dim: int, layer_index: int = 0, *, norm_layer: NormLayer = default_norm,
                 input_norm_layer: Optional[NormLayer] = None, drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.norm1 = norm_layer(dim)
        self.norm2 = norm_layer(dim)

    def forward(self, state: Tuple[Tensor, Tensor], ctx: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        x, y = state
        z = self.drop_path(self.sublayer1(x, ctx))
        x, y = self.norm1(x + z), y + z
        z = self.drop_path(self.sublayer2(x, ctx))
        return self.norm2(x + z), y + z


class ResiDualFusion(StreamFusion):
    """ResiDual's output ``X + LN(Y)``: the Post-Norm stream plus the normalised accumulation."""

    def __init__(self, dim: int, norm_layer: NormLayer = default_norm):
        super().__init__()
        self.norm_y = norm_layer(dim)

    def forward(self, state: Tuple[Tensor, Tensor], final_norm: bool = True) -> Tensor:
        """``final_norm`` is accepted for :func:`common.topologies.readout`; ResiDual has no final norm."""
        x, y = state
        return x + self.norm_y(y)


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al. 2025), a drop-in LayerNorm replacement: ``weight * tanh(alpha x) + bias``.

    Not in timm or torch, hence written here. ``alpha`` is one learned scalar (init 0.5).
    """

    def __init__(self, dim: int, alpha_init: float = 0.5, affine: bool = True, eps: float = 0.0, **kwargs):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init), **kwargs))
        self.weight = nn.Parameter(torch.ones(dim, **kwargs)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim, **kwargs)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.alpha * x)
        return x * self.weight + self.bias if self.weight is not None else x


def _every(block: type, **kwargs):
    """``blocks`` of a topology whose every block is ``block`` with ``kwargs``."""
    return lambda depth, options: [(block, dict(kwargs))] * depth


def _mixln_blocks(depth: int, options: Dict[str, Any]) -> List[BlockSpec]:
    k = options["mixln_post_blocks"]
    k = max(1, round(0.25 * depth)) if k is None else int(k)  # Mix-LN's default: the first quarter, at least one
    if not 0 <= k <= depth:
        raise InputError(f"mixln_post_blocks={k} must lie in [0, depth={depth}]")
    return [(PostNormBlock, {})] * k + [(PreNormBlock, {})] * (depth - k)


def _siamese_blocks(depth: int, options: Dict[str, Any]) -> List[BlockSpec]:
    block = RecomputedSiameseNormBlock if options["recompute_norms"] else SiameseNormBlock
    return [(block, dict(normalized_input=options["normalized_input"], depth_scaling=options["depth_scaling"]))] * depth


def _two_streams(plan: TopologyPlan, dim: int) -> nn.Module:
    return TwoStreams()


DEIT = ("deit",)

register(Topology("pre", "Pre-Norm: Y <- Y + F(LN(Y))", _every(PreNormBlock), color="tab:blue"))
register(Topology("post", "Post-Norm: X <- LN(X + F(X))", _every(PostNormBlock), color="tab:red"))
register(Topology(
    "siamese", "SiameseNorm: a Post-Norm and a Pre-Norm stream sharing every sublayer", _siamese_blocks,
    color="tab:green", options=dict(normalized_input=True, depth_scaling=True, recompute_norms=False),
    streams=_two_streams, output=lambda plan, dim, norm_layer, final_norm: SiameseFusion(dim, norm_layer, final_norm)))
register(Topology("mixln", "Mix-LN: Post-Norm in the first mixln_post_blocks blocks, Pre-Norm after", _mixln_blocks,
                  color="tab:purple", options=dict(mixln_post_blocks=None)))
register(Topology("residual", "ResiDual: a Post-Norm stream and an accumulating one, read out as X + LN(Y)",
                  _every(ResiDualBlock), color="tab:orange", streams=_two_streams,
                  output=lambda plan, dim, norm_layer, final_norm: ResiDualFusion(dim, norm_layer)))
register(Topology("sandwich", "Peri-LN / Sandwich-LN: Y <- Y + LN(F(LN(Y)))", _every(SandwichBlock),
                  color="tab:brown", families=DEIT))
register(Topology("deepnorm", "DeepNorm: X <- LN(alpha X + F(X)), value, output and MLP weights scaled at init",
                  lambda depth, options: [(DeepNormBlock, dict(num_blocks=depth))] * depth, color="tab:pink",
                  init_weights=deepnorm_init_))
register(Topology("layerscale", "Pre-Norm with a learned per-channel gain on each update (CaiT)", _every(PreNormBlock),
                  color="tab:olive", families=DEIT, model_defaults=lambda depth: {"init_values": 1e-5 if depth <= 18
                                                                                 else 1e-6}))
register(Topology("dyt", "Pre-Norm with Dynamic Tanh in place of every LayerNorm", _every(PreNormBlock),
                  color="tab:cyan", families=DEIT, model_defaults=lambda depth: {"norm_layer": DyT}))
