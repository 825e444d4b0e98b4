"""What every topology shares: the block a topology subclasses, the norms, and the stream state's two ends.

A block is two sublayers, ``F1`` (attention) and ``F2`` (MLP), on a residual stream. A topology is a subclass of
:class:`ResidualBlock` that owns its norms and whose ``forward`` is its update rule; a model's block
(``vision.deit.DeiTBlock``, ``diffusion.models.DiTBlock``) is a subclass too, which owns the sublayers and defines
``sublayer1(h, ctx)`` and ``sublayer2(h, ctx)``. ``ctx`` is what a sublayer reads besides its input: the attention
mask (DeiT) or the adaLN modulation (DiT).

The stream state is a tensor for the single-stream topologies, ``(X, Y)`` for the two-stream ones, ``(B, T, n, D)``
for the ``n`` streams of Hyper-Connections and the list of earlier outputs for depth attention. A
:class:`StreamStart` makes the first state from the embedding and says what a state holds, and a
:class:`StreamFusion` reads the last one out; both are modules so that a model's block loop is written once
(TorchScript types the state by the modules a model holds).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.fx
from torch import nn

Tensor = torch.Tensor
StreamState = Union[Tensor, Tuple[Tensor, Tensor], List[Tensor]]
NormLayer = Callable[[int], nn.Module]
LN_EPS = 1e-6


def default_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=LN_EPS)


class ResidualBlock(nn.Module):
    """A transformer block of two sublayers on a residual topology.

    The topology subclasses create the norms and write ``forward`` as their update; a model's block class creates
    the sublayers and defines :meth:`sublayer1` and :meth:`sublayer2`. The norms are attributes of the block itself,
    so state-dict keys match timm (``blocks.i.norm1``) and the public SiameseNorm files (``blocks.i.pre_norm1``).

    Args:
        dim: channel width of the streams.
        layer_index: 0-based depth of the block.
        drop_path: stochastic-depth rate, applied once to each sublayer output ``Z``.
    """

    topology: str = ""
    # True for blocks whose output is a norm's (Post-Norm, DeepNorm): a single-stream model needs no final norm.
    normalizes_output: bool = False

    def __init__(self, dim: int, layer_index: int = 0, *, drop_path: float = 0.0):
        super().__init__()
        self.layer_index = layer_index
        # Imported lazily so that common/ has no hard dependency on timm at import time.
        from timm.layers import DropPath

        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def sublayer1(self, h: Tensor, ctx: Optional[Tensor]) -> Tensor:
        """``F1``, the attention sublayer, on its input ``h``."""
        raise NotImplementedError(f"{type(self).__name__} defines no sublayers; build it with block_class()")

    def sublayer2(self, h: Tensor, ctx: Optional[Tensor]) -> Tensor:
        """``F2``, the MLP sublayer, on its input ``h``."""
        raise NotImplementedError(f"{type(self).__name__} defines no sublayers; build it with block_class()")

    def extra_repr(self) -> str:
        return f"topology={self.topology}, layer_index={self.layer_index}"


class StreamStart(nn.Module):
    """The owner of a topology's stream state: makes the first state from the embedding ``x`` (and ``cond``, the
    model's per-sample conditioning, ``(B, D)`` or None, which timestep-aware routing reads) and says what a state
    holds, so that nothing outside the topology interprets a state by its type."""

    def forward(self, x: Tensor, cond: Optional[Tensor] = None):
        raise NotImplementedError

    def accumulated(self, state) -> Tensor:
        """The embedding plus every sublayer update so far, the tensor Pre-Norm's stream is (REPA aligns it)."""
        raise NotImplementedError

    def named_streams(self, state) -> Dict[str, Tensor]:
        """Each stream of ``state`` by name, ``(B, T, D)`` each (the diagnostics' hidden-state norms)."""
        raise NotImplementedError


class SingleStream(StreamStart):
    """One stream, the embedding itself."""

    def forward(self, x: Tensor, cond: Optional[Tensor] = None) -> Tensor:
        return x

    def accumulated(self, state: Tensor) -> Tensor:
        return state

    def named_streams(self, state: Tensor) -> Dict[str, Tensor]:
        return {"h": state}


class TwoStreams(StreamStart):
    """Two streams that both start as the embedding: ``X`` (normalised, Post-Norm-like) and ``Y`` (accumulating)."""

    def forward(self, x: Tensor, cond: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        return x, x

    def accumulated(self, state: Tuple[Tensor, Tensor]) -> Tensor:
        return state[1]

    def named_streams(self, state: Tuple[Tensor, Tensor]) -> Dict[str, Tensor]:
        return {"x": state[0], "y": state[1]}


class StreamFusion(nn.Module):
    """A module that reads a multi-stream state out as one tensor: ``forward(state, final_norm=True)``."""


def single_stream_output(dim: int, norm_layer: NormLayer, final_norm: bool, last_block: type) -> nn.Module:
    """The module between a single-stream model's last block and its head: the usual final norm (key
    ``norm.weight``, as timm) when ``final_norm``, none after a block whose output is already normalised."""
    return norm_layer(dim) if final_norm and not last_block.normalizes_output else nn.Identity()


def autograd_records() -> bool:
    """Autograd records and ``torch.fx.symbolic_trace`` does not run (it cannot trace ``Function.apply``; dynamo and
    export can): when the fused autograd nodes (the norm chain, the routing) run instead of their plain ops.
    torch 2.6 lacks ``is_fx_symbolic_tracing``; the fallback computes it as later releases define it."""
    fx = torch.fx._symbolic_trace
    tracing = fx.is_fx_symbolic_tracing() if hasattr(fx, "is_fx_symbolic_tracing") else (
        fx.is_fx_tracing() and not torch.compiler.is_compiling())
    return torch.is_grad_enabled() and not tracing


def readout(fusion: nn.Module, state: StreamState, norm: bool = True) -> Tensor:
    """The features ``fusion`` (a model's output module) reads from a stream state.

    The fusion of a multi-stream state, with its final norm (SiameseNorm's ``LN_out``) when ``norm``; a single
    stream through ``fusion`` when ``norm``, else as it is. Applied to the state after block ``l``, it is what the
    head would read if the network ended there.
    """
    if isinstance(fusion, StreamFusion):
        return fusion(state, final_norm=norm)
    return fusion(state) if norm else state
