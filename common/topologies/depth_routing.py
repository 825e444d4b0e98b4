"""Routing across depth: Attention Residuals (``attnres``, ``attnres_block``; arXiv 2603.15031), and their
registrations.

The state is the list of sources a sublayer attends over, first the embedding: every earlier sublayer output
(Full AttnRes) or every earlier block sum (Block AttnRes). Each sublayer reads a softmax-weighted mix of the sources
instead of one residual stream, and the head reads one more such mix.
"""
import math
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from common.cli import InputError
from common.topologies.base import (LN_EPS, NormLayer, ResidualBlock, StreamFusion, StreamStart, autograd_records,
                                    default_norm)
from common.topologies.fused_routing import RoutedMix, mix_sources
from common.topologies.registry import BlockSpec, Topology, register

Tensor = torch.Tensor


class DepthAttention(nn.Module):
    """Attention over depth (Attention Residuals, arXiv 2603.15031): the softmax-weighted sum of the sources
    ``v_i`` with weights ``softmax_i(w . RMSNorm(v_i))``, one learned pseudo-query ``w`` (zero at init: the mean)
    and the RMSNorm's weight (one at init) per reader.

    Written per source, ``(v_i . (gamma * w)) / rms(v_i)``, so nothing of ``(sources, B, T, D)`` is stacked: backward
    keeps the sources (kept anyway) and a few numbers per token and source.
    """

    def __init__(self, dim: int, eps: float = LN_EPS):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(dim))
        self.key_weight = nn.Parameter(torch.ones(dim))

    def forward(self, sources: List[Tensor]) -> Tensor:
        query = self.query * self.key_weight
        if torch.jit.is_scripting():  # TorchScript compiles no autograd.Function: the plain ops
            return mix_sources(sources, [v @ query for v in sources], self.eps)
        return self.routed(sources, query)

    @torch.jit.unused
    def routed(self, sources: List[Tensor], query: Tensor) -> Tensor:
        """The fused routing under autograd; the plain ops without it and while FX traces (no branch on a traced
        value: the query is a vector)."""
        if autograd_records():
            return RoutedMix.apply(query, self.eps, 1.0, *sources)
        return mix_sources(sources, [v @ query for v in sources], self.eps)


class SoleSource(nn.Module):
    """The depth attention of the first sublayer, which has one source, the embedding: a softmax over one source is
    1, so it reads the embedding and has nothing to learn (a pseudo-query there would get no gradient)."""

    def forward(self, sources: List[Tensor]) -> Tensor:
        return sources[0]


class AttnResBlock(ResidualBlock):
    """Attention Residuals over Pre-Norm sublayers: each sublayer reads a depth attention over the sources and adds
    its output as a new source (``attnres``) or into the newest one (``attnres_block``)::

        Z <- F(LN(sum_i softmax_i(w_k . RMSNorm(v_i)) v_i));  v <- v + [Z]  or  v_last <- v_last + Z

    The sources start as ``[embedding]``. With ``source_sublayers = s``, sublayer ``k`` (``2l`` attention,
    ``2l+1`` MLP of block ``l``) starts a new source when ``k`` is a multiple of ``s``: ``s = 1`` is Full AttnRes,
    ``s = 2 x blocks`` Block AttnRes, whose block sums are those of the standard residual inside the block.
    Depth attentions ``depth_attn{1,2}`` (:class:`DepthAttention`; block 0's first reads the embedding alone,
    :class:`SoleSource`), norms ``norm{1,2}`` as Pre-Norm's.
    """

    topology = "attnres"

    def __init__(self, dim: int, layer_index: int = 0, *, source_sublayers: int,
                 norm_layer: NormLayer = default_norm, input_norm_layer: Optional[NormLayer] = None,
                 drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.source_sublayers = source_sublayers
        self.norm1 = (input_norm_layer or norm_layer)(dim)
        self.norm2 = (input_norm_layer or norm_layer)(dim)
        self.depth_attn1 = DepthAttention(dim) if layer_index > 0 else SoleSource()
        self.depth_attn2 = DepthAttention(dim)

    def add_source(self, sources: List[Tensor], z: Tensor, sublayer_index: int) -> List[Tensor]:
        if sublayer_index % self.source_sublayers == 0:
            return sources + [z]
        return sources[:-1] + [sources[-1] + z]

    def forward(self, sources: List[Tensor], ctx: Optional[Tensor] = None) -> List[Tensor]:
        z = self.drop_path(self.sublayer1(self.norm1(self.depth_attn1(sources)), ctx))
        sources = self.add_source(sources, z, 2 * self.layer_index)
        z = self.drop_path(self.sublayer2(self.norm2(self.depth_attn2(sources)), ctx))
        return self.add_source(sources, z, 2 * self.layer_index + 1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, source_sublayers={self.source_sublayers}"



class SourceList(StreamStart):
    """The first state: the list of sources, the embedding alone."""

    def forward(self, x: Tensor, cond: Optional[Tensor] = None) -> List[Tensor]:
        return [x]

    def accumulated(self, sources: List[Tensor]) -> Tensor:
        """The sources' sum: the embedding plus every update."""
        total = sources[0]
        for source in sources[1:]:
            total = total + source
        return total

    def named_streams(self, sources: List[Tensor]) -> Dict[str, Tensor]:
        """``v``, the newest source: the output (or block sum) the last sublayer wrote."""
        return {"v": sources[-1]}


class DepthAttentionFusion(StreamFusion):
    """The output: one more depth attention over every source, as if the head were the next sublayer, then
    ``LN_out`` (``final_norm=False``: none, DiT)."""

    def __init__(self, dim: int, norm_layer: NormLayer = default_norm, final_norm: bool = True):
        super().__init__()
        self.depth_attn = DepthAttention(dim)
        self.norm_out = norm_layer(dim) if final_norm else nn.Identity()

    def forward(self, sources: List[Tensor], final_norm: bool = True) -> Tensor:
        h = self.depth_attn(sources)
        return self.norm_out(h) if final_norm else h


def _attnres_blocks(depth: int, options: Dict[str, Any]) -> List[BlockSpec]:
    """Full AttnRes: every sublayer output is a source."""
    return [(AttnResBlock, dict(source_sublayers=1))] * depth


def _block_attnres_blocks(depth: int, options: Dict[str, Any]) -> List[BlockSpec]:
    """Block AttnRes: a source sums ``attnres_block_size`` transformer blocks (attention and MLP each); by default
    at most 8 sources, which the paper finds recover most of the full variant's gain."""
    size = options["attnres_block_size"]
    size = max(1, math.ceil(depth / 8)) if size is None else int(size)
    if size < 1:
        raise InputError(f"attnres_block_size={size} must be at least 1 (transformer blocks per AttnRes block)")
    return [(AttnResBlock, dict(source_sublayers=2 * size))] * depth


def _attnres(name: str, summary: str, blocks, color: str, **options) -> Topology:
    return Topology(name, summary, blocks, color=color, options=options, streams=lambda plan, dim: SourceList(),
                    output=lambda plan, dim, norm_layer, final_norm: DepthAttentionFusion(dim, norm_layer, final_norm))


register(_attnres("attnres", "Full Attention Residuals: each sublayer reads a softmax mix of every earlier output",
                  _attnres_blocks, color="navy"))
register(_attnres("attnres_block", "Block Attention Residuals: each sublayer reads a softmax mix of block sums",
                  _block_attnres_blocks, color="slateblue", attnres_block_size=None))
