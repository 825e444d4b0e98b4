"""The residual topologies of a two-sublayer transformer block, one class each, written as its update.

A block is two sublayers, ``F1`` (attention) and ``F2`` (MLP), on a residual stream; Pre-Norm, Post-Norm,
SiameseNorm and the baselines differ only in where the norms sit and which stream ``F`` reads and writes. Each
topology is a subclass of :class:`ResidualBlock` that owns its norms, named as timm and the public SiameseNorm
files name them, and whose ``forward`` is its update rule. A model's block (``vision.deit.DeiTBlock``,
``diffusion.models.DiTBlock``) is a subclass of :class:`ResidualBlock` too: it owns the sublayers and defines
``sublayer1(h, ctx)`` and ``sublayer2(h, ctx)``. :func:`block_class` joins the two into one class per topology
(``SiameseNormDeiTBlock(DeiTBlock, SiameseNormBlock)``) and :func:`build_block` builds one. ``ctx`` is what a
sublayer reads besides its input: the attention mask (DeiT) or the adaLN modulation (DiT).

The stream state is a tensor for the single-stream topologies and ``(X, Y)`` for the two-stream ones
(SiameseNorm, ResiDual); a module from :func:`build_streams` creates it from the embedding and one from
:func:`build_fusion` turns the final state into the features the head reads. Both are modules so that a model's
block loop is written once: TorchScript types the state by the modules a model holds.

The multi-stream and cross-layer designs generalise the state: ``hc`` and ``mhc`` (Hyper-Connections and their
manifold-constrained form) carry ``n`` streams as one ``(B, T, n, D)`` tensor, and ``attnres`` / ``attnres_block``
(Attention Residuals) carry the list of every earlier output (or block sum), from which each sublayer reads a
softmax-weighted mix. The model holds the module that makes the first state and the one that reads the last.

Model-level topologies add ``mixln`` (Mix-LN: Post-Norm in the first ``k`` blocks, Pre-Norm after),
``layerscale`` (Pre-Norm with a learned per-channel gain on each update, CaiT), ``dyt`` (Pre-Norm with
:class:`DyT` in place of every LayerNorm) and ``attnres_block`` (Attention Residuals over block sums);
:func:`block_topologies` resolves a model topology into one block topology per depth, and the model applies the
gain or the norm.

(Over 500 lines: every topology lives here, one class each, so that no second copy of a rule exists.)
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn
import torch.fx

from common.cli import InputError

Tensor = torch.Tensor
StreamState = Union[Tensor, Tuple[Tensor, Tensor], List[Tensor]]

BLOCK_TOPOLOGIES = ("pre", "post", "siamese", "residual", "sandwich", "deepnorm", "hc", "mhc", "attnres")
TWO_STREAM_TOPOLOGIES = ("siamese", "residual")
HYPER_TOPOLOGIES = ("hc", "mhc")  # n streams in one (B, T, n, D) tensor
ATTNRES_TOPOLOGIES = ("attnres", "attnres_block")  # the list of earlier outputs
MODEL_TOPOLOGIES = ("pre", "post", "siamese", "mixln", "residual", "sandwich", "deepnorm", "layerscale", "dyt",
                    "hc", "mhc", "attnres", "attnres_block")
# Model topologies that are Pre-Norm blocks plus something the model adds (a gain, a norm).
_PRE_NORM_VARIANTS = ("layerscale", "dyt")
LN_EPS = 1e-6
# The streams' RMSNorm in (m)HC: the hyper-connections package normalises x / ||x|| (clamped at 1e-12), which
# an eps of 1e-6 would not match on streams as small as an embedding at init.
HC_NORM_EPS = 1e-12


def check_topology(topology: str, allowed: Sequence[str] = MODEL_TOPOLOGIES) -> str:
    if topology not in allowed:
        raise InputError(f"unknown residual topology {topology!r}; valid topologies are {', '.join(allowed)}")
    return topology


def default_mixln_post_blocks(depth: int) -> int:
    """Mix-LN's default: Post-Norm in the first quarter of the blocks (at least one)."""
    return max(1, round(0.25 * depth))


def block_topologies(topology: str, depth: int, mixln_post_blocks: Optional[int] = None) -> list:
    """Resolve a model-level topology into the topology of each of ``depth`` blocks."""
    check_topology(topology)
    if topology in _PRE_NORM_VARIANTS:
        return ["pre"] * depth
    if topology == "attnres_block":
        return ["attnres"] * depth
    if topology != "mixln":
        return [topology] * depth
    k = default_mixln_post_blocks(depth) if mixln_post_blocks is None else int(mixln_post_blocks)
    if not 0 <= k <= depth:
        raise InputError(f"mixln_post_blocks={k} must lie in [0, depth={depth}]")
    return ["post"] * k + ["pre"] * (depth - k)


def depth_scale(layer_index: int, enabled: bool = True) -> float:
    """SiameseNorm's depth-wise scale ``c_l = sqrt(2(l+1))`` for 0-based block ``l``."""
    return math.sqrt(2.0 * (layer_index + 1)) if enabled else 1.0


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


class TwoStreams(nn.Module):
    """The state of a two-stream topology: both streams start as the embedding."""

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return x, x


class ExpandStreams(nn.Module):
    """The state of Hyper-Connections: ``n`` copies of the embedding, ``(B, T, D) -> (B, T, n, D)``."""

    def __init__(self, streams: int):
        super().__init__()
        self.streams = streams

    def forward(self, x: Tensor) -> Tensor:
        return x.unsqueeze(-2).expand(-1, -1, self.streams, -1)

    def extra_repr(self) -> str:
        return f"streams={self.streams}"


class SourceList(nn.Module):
    """The state of Attention Residuals: the list of sources a sublayer attends over, first the embedding."""

    def forward(self, x: Tensor) -> List[Tensor]:
        return [x]


def build_streams(topology: str, hc_streams: int = 4) -> nn.Module:
    """The module that turns the embedding into the state the first block of ``topology`` reads."""
    check_topology(topology)
    if topology in TWO_STREAM_TOPOLOGIES:
        return TwoStreams()
    if topology in HYPER_TOPOLOGIES:
        return ExpandStreams(hc_streams)
    if topology in ATTNRES_TOPOLOGIES:
        return SourceList()
    return nn.Identity()


def default_attnres_block_size(depth: int) -> int:
    """Block AttnRes's default: transformer blocks per AttnRes block so that there are at most 8 (the paper finds
    about 8 blocks recover most of the full variant's gain)."""
    return max(1, math.ceil(depth / 8))


def attnres_source_sublayers(topology: str, depth: int, block_size: Optional[int] = None) -> int:
    """How many consecutive sublayer outputs one AttnRes source sums: 1 for ``attnres`` (every output is a source),
    ``2 * block_size`` for ``attnres_block`` (a block of transformer blocks, attention and MLP each)."""
    if topology != "attnres_block":
        return 1
    size = default_attnres_block_size(depth) if block_size is None else int(block_size)
    if size < 1:
        raise InputError(f"attnres_block_size={size} must be at least 1 (transformer blocks per AttnRes block)")
    return 2 * size


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


def default_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=LN_EPS)


NormLayer = Callable[[int], nn.Module]


class ResidualBlock(nn.Module):
    """A transformer block of two sublayers on a residual topology.

    The topology subclasses below create the norms and write ``forward`` as their update; a model's block class
    creates the sublayers and defines :meth:`sublayer1` and :meth:`sublayer2`. The norms are attributes of the
    block itself, so state-dict keys match timm (``blocks.i.norm1``) and the public SiameseNorm files
    (``blocks.i.pre_norm1``) by name.

    Args:
        dim: channel width of the streams.
        layer_index: 0-based depth of the block.
        drop_path: stochastic-depth rate, applied once to each sublayer output ``Z``.
    """

    topology: str = ""
    two_stream: bool = False

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

    def __init__(self, dim: int, layer_index: int = 0, *, norm_layer: NormLayer = default_norm,
                 input_norm_layer: Optional[NormLayer] = None, drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.norm1 = norm_layer(dim)
        self.norm2 = norm_layer(dim)

    def forward(self, x: Tensor, ctx: Optional[Tensor] = None) -> Tensor:
        x = self.norm1(x + self.drop_path(self.sublayer1(x, ctx)))
        return self.norm2(x + self.drop_path(self.sublayer2(x, ctx)))


class DeepNormBlock(ResidualBlock):
    """DeepNorm (Wang et al. 2022): ``X <- LN(alpha X + F(X))`` with ``alpha = (2N)^(1/4)`` for ``N`` blocks.

    The model scales its value, output and MLP weights by :func:`deepnorm_beta` at init (:func:`deepnorm_init_`).
    """

    topology = "deepnorm"

    def __init__(self, dim: int, layer_index: int = 0, *, num_blocks: Optional[int] = None,
                 norm_layer: NormLayer = default_norm, input_norm_layer: Optional[NormLayer] = None,
                 drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        if not num_blocks:
            raise InputError("the deepnorm topology needs num_blocks (the model depth) to set alpha = (2N)^(1/4)")
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
    two_stream = True

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


class SiameseNormChain(torch.autograd.Function):
    """SiameseNorm's norm chain as one autograd node: ``X' = LN_post(X)``, ``H = LN_in(X' + LN_pre(Y))``.

    Backward keeps ``X``, ``Y``, the mean and rstd of the three norms and their affine weights, not the
    ``LN_in`` input ``X' + LN_pre(Y)`` autograd would keep; it rebuilds that input with the forward's own kernels.
    The outputs are the unfused chain's bit for bit, the gradients to round-off. ``LN_in`` is non-affine when its weight and bias are
    None (DiT) and absent with ``normalized_input=False``. Runs in eager mode and under ``torch.compile``.
    """

    @staticmethod
    def forward(ctx, x, y, post_weight, post_bias, pre_weight, pre_bias, in_weight, in_bias,
                post_eps: float, pre_eps: float, in_eps: float, normalized_input: bool):
        shape = x.shape[-1:]
        x_out, x_mean, x_rstd = torch.native_layer_norm(x, shape, post_weight, post_bias, post_eps)
        y_out, y_mean, y_rstd = torch.native_layer_norm(y, shape, pre_weight, pre_bias, pre_eps)
        h = x_out + y_out
        h_mean = h_rstd = None
        if normalized_input:
            h, h_mean, h_rstd = torch.native_layer_norm(h, shape, in_weight, in_bias, in_eps)
        ctx.save_for_backward(x, y, post_weight, post_bias, pre_weight, pre_bias, in_weight, in_bias,
                              x_mean, x_rstd, y_mean, y_rstd, h_mean, h_rstd)
        ctx.eps = (post_eps, pre_eps)
        ctx.normalized_input = normalized_input
        return x_out, h

    @staticmethod
    def backward(ctx, grad_x_out, grad_h):
        (x, y, post_weight, post_bias, pre_weight, pre_bias, in_weight, in_bias,
         x_mean, x_rstd, y_mean, y_rstd, h_mean, h_rstd) = ctx.saved_tensors
        shape = x.shape[-1:]
        layer_norm_backward = torch.ops.aten.native_layer_norm_backward
        grad_in_weight = grad_in_bias = None
        grad_sum = grad_h
        if ctx.normalized_input:
            x_out = torch.native_layer_norm(x, shape, post_weight, post_bias, ctx.eps[0])[0]
            y_out = torch.native_layer_norm(y, shape, pre_weight, pre_bias, ctx.eps[1])[0]
            grad_sum, grad_in_weight, grad_in_bias = layer_norm_backward(
                grad_h, x_out + y_out, shape, h_mean, h_rstd, in_weight, in_bias,
                [True, in_weight is not None, in_bias is not None])
        grad_x, grad_post_weight, grad_post_bias = layer_norm_backward(
            grad_x_out + grad_sum, x, shape, x_mean, x_rstd, post_weight, post_bias,
            [True, post_weight is not None, post_bias is not None])
        grad_y, grad_pre_weight, grad_pre_bias = layer_norm_backward(
            grad_sum, y, shape, y_mean, y_rstd, pre_weight, pre_bias,
            [True, pre_weight is not None, pre_bias is not None])
        return (grad_x, grad_y, grad_post_weight, grad_post_bias, grad_pre_weight, grad_pre_bias,
                grad_in_weight, grad_in_bias, None, None, None, None)


def _layer_norm_args(norm: nn.Module) -> Tuple[Optional[Tensor], Optional[Tensor], float]:
    if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
        raise TypeError(f"recompute_norms fuses LayerNorms over the last dimension, not {type(norm).__name__}")
    return norm.weight, norm.bias, norm.eps


def _fx_symbolic_tracing() -> bool:
    """True while ``torch.fx.symbolic_trace`` runs, which cannot trace ``Function.apply`` (dynamo and export can).
    torch 2.6 lacks ``is_fx_symbolic_tracing``; the fallback computes it as later releases define it."""
    fx = torch.fx._symbolic_trace
    if hasattr(fx, "is_fx_symbolic_tracing"):
        return fx.is_fx_symbolic_tracing()
    return fx.is_fx_tracing() and not torch.compiler.is_compiling()


def _autograd_records() -> bool:
    """Autograd records and FX does not trace: when :class:`SiameseNormChain` can run."""
    return torch.is_grad_enabled() and not _fx_symbolic_tracing()


def siamese_norm_chain(x: Tensor, y: Tensor, post: nn.Module, pre: nn.Module, inp: nn.Module,
                       recompute: bool = False) -> Tuple[Tensor, Tensor]:
    """SiameseNorm's norm chain in front of a sublayer: ``X' = LN_post(X)`` and the input ``LN_in(X' + LN_pre(Y))``.

    ``recompute`` runs it as :class:`SiameseNormChain` when autograd records (not while FX traces), which keeps
    less for backward; otherwise the three norm modules run as they are.
    """
    if recompute and _autograd_records():
        if y is x:  # the first block's streams are one tensor; dynamo traces Function.apply only on distinct inputs
            y = y.view_as(y)
        post_weight, post_bias, post_eps = _layer_norm_args(post)
        pre_weight, pre_bias, pre_eps = _layer_norm_args(pre)
        normalized_input = not isinstance(inp, nn.Identity)
        in_weight, in_bias, in_eps = _layer_norm_args(inp) if normalized_input else (None, None, 0.0)
        return SiameseNormChain.apply(x, y, post_weight, post_bias, pre_weight, pre_bias, in_weight, in_bias,
                                      post_eps, pre_eps, in_eps, normalized_input)
    x = post(x)
    return x, inp(x + pre(y))


class SiameseNormBlock(ResidualBlock):
    """SiameseNorm (arXiv 2602.08064), per sublayer::

        X <- LN_post(X);  Z <- F(LN_in(X + LN_pre(Y)));  X <- X + Z / c_l;  Y <- Y + Z

    ``Z`` carries one DropPath mask into both streams; the ``X`` update is one fused ``X.add(Z, alpha=1/c_l)``.
    Norms ``pre_norm{i}``, ``post_norm{i}``, ``input_norm{i}``, as in the public SiameseNorm DeiT.

    Args:
        normalized_input: apply ``LN_in`` (paper Table 3 "Normalized Input"); without it the sublayer reads
            ``X' + LN_pre(Y)``.
        depth_scaling: ``c_l = sqrt(2(l+1))`` (Table 3 "Depth-wise Scaling"); else ``c_l = 1``.
        recompute_norms: run the norm chain as :class:`SiameseNormChain` under autograd, which rebuilds the
            ``LN_in`` input in backward instead of keeping it: backward keeps one stream tensor per sublayer more
            than Pre-Norm instead of two. The norms' forward hooks do not fire on that path.
        norm_layer: the affine stream norms ``LN_pre``, ``LN_post``.
        input_norm_layer: ``LN_in`` (default ``norm_layer``); DiT passes a non-affine LayerNorm and modulates
            its output in the sublayer.
    """

    topology = "siamese"
    two_stream = True

    def __init__(self, dim: int, layer_index: int = 0, *, normalized_input: bool = True, depth_scaling: bool = True,
                 recompute_norms: bool = False, norm_layer: NormLayer = default_norm,
                 input_norm_layer: Optional[NormLayer] = None, drop_path: float = 0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.normalized_input = normalized_input
        self.recompute_norms = recompute_norms
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
        fused = False
        if not torch.jit.is_scripting():  # TorchScript compiles no further: Function.apply is not scriptable
            fused = self.recompute_norms and _autograd_records()
        if fused:
            x, h = self._fused_norm_chain(x, y, 1)
        else:
            x = self.post_norm1(x)
            h = self.input_norm1(x + self.pre_norm1(y))
        z = self.drop_path(self.sublayer1(h, ctx))
        x, y = x.add(z, alpha=1.0 / self.depth_scale), y + z
        if fused:
            x, h = self._fused_norm_chain(x, y, 2)
        else:
            x = self.post_norm2(x)
            h = self.input_norm2(x + self.pre_norm2(y))
        z = self.drop_path(self.sublayer2(h, ctx))
        return x.add(z, alpha=1.0 / self.depth_scale), y + z

    @torch.jit.unused
    def _fused_norm_chain(self, x, y, sublayer):
        """Sublayer ``sublayer``'s norm chain as one :class:`SiameseNormChain` node (``recompute_norms``)."""
        return siamese_norm_chain(x, y, getattr(self, f"post_norm{sublayer}"), getattr(self, f"pre_norm{sublayer}"),
                                  getattr(self, f"input_norm{sublayer}"), recompute=True)

    # TorchScript reads an unused method's signature from its annotations, which must be types, not strings
    _fused_norm_chain.__annotations__ = {"x": Tensor, "y": Tensor, "sublayer": int, "return": Tuple[Tensor, Tensor]}

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, normalized_input={self.normalized_input}, "
                f"depth_scale={self.depth_scale:.4f}, recompute_norms={self.recompute_norms}")


# ----------------------------------------------------------------------------- Hyper-Connections and mHC

def sinkhorn_knopp(logits: Tensor, iters: int = 20) -> Tensor:
    """A doubly stochastic matrix from ``logits`` over the last two dimensions: ``exp``, then ``iters`` rounds of
    scaling each column, then each row, to sum 1 (mHC's projection; the column-first order of the hyper-connections
    package). The column maximum is taken out first, which the column scaling undoes exactly."""
    m = (logits - logits.amax(dim=-2, keepdim=True).detach()).exp()
    for _ in range(iters):
        m = m / m.sum(dim=-2, keepdim=True)
        m = m / m.sum(dim=-1, keepdim=True)
    return m


class HyperConnection(nn.Module):
    """The width and depth connections of one sublayer over ``n`` streams ``H`` (Hyper-Connections, arXiv 2409.19606).

    ``alpha`` (``n x (1+n)``): column 0 mixes the streams into the sublayer input ``h = sum_s alpha[s,0] H_s``, the
    other columns mix the streams among themselves ``H'_t = sum_s alpha[s,1+t] H_s``; ``beta`` (``n``) writes the
    sublayer output back, ``H <- H' + beta_s F(h)``. Static: learned matrices, initialised as the paper (column 0
    one-hot at stream ``k mod n`` for sublayer ``k``, the identity, ``beta = 1``). Dynamic (the paper's DHC) adds
    ``s_alpha tanh(norm(H) W_alpha)`` and ``s_beta tanh(norm(H) w_beta)``, with ``W`` zero and ``s = 0.01`` at init and
    ``norm`` an RMSNorm per stream (the hyper-connections package's choice, with its epsilon; the paper names
    LayerNorm).
    """

    __constants__ = ["dynamic"]

    def __init__(self, dim: int, streams: int = 4, sublayer_index: int = 0, dynamic: bool = True):
        super().__init__()
        self.streams = streams
        self.dynamic = dynamic
        alpha = torch.zeros(streams, 1 + streams)
        alpha[sublayer_index % streams, 0] = 1.0
        alpha[:, 1:] = torch.eye(streams)
        self.static_alpha = nn.Parameter(alpha)
        self.static_beta = nn.Parameter(torch.ones(streams))
        if dynamic:
            self.norm = nn.RMSNorm(dim, eps=HC_NORM_EPS)
            self.dynamic_alpha = nn.Parameter(torch.zeros(dim, 1 + streams))
            self.dynamic_beta = nn.Parameter(torch.zeros(dim))
            self.alpha_scale = nn.Parameter(torch.full((), 0.01))
            self.beta_scale = nn.Parameter(torch.full((), 0.01))

    def coefficients(self, streams: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(into the sublayer (..., n), among the streams (..., n, n), back from it (..., n))``."""
        alpha, beta = self.static_alpha, self.static_beta
        if self.dynamic:
            normed = self.norm(streams)
            alpha = alpha + self.alpha_scale * torch.tanh(normed @ self.dynamic_alpha)
            beta = beta + self.beta_scale * torch.tanh(normed @ self.dynamic_beta)
        return alpha[..., 0], alpha[..., 1:], beta

    def forward(self, streams: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(sublayer input (B, T, D), mixed streams (B, T, n, D), beta (..., n))`` of ``streams (B, T, n, D)``."""
        into, among, beta = self.coefficients(streams)
        h = (into.unsqueeze(-1) * streams).sum(dim=-2)
        return h, among.transpose(-1, -2) @ streams, beta

    def extra_repr(self) -> str:
        return f"streams={self.streams}, dynamic={self.dynamic}"


class ManifoldHyperConnection(HyperConnection):
    """mHC (arXiv 2512.24880): the Hyper-Connection with its maps constrained, ``H_pre = sigmoid(.)``,
    ``H_post = 2 sigmoid(.)`` and ``H_res = SinkhornKnopp(.)`` doubly stochastic, so the stream mixing neither grows
    nor shrinks a signal across depth. The logits are ``static + scale * (norm(H) W)`` (no tanh), with one scale for
    the pre map and one for the residual map, as the hyper-connections package computes them, in float32.
    """

    def __init__(self, dim: int, streams: int = 4, sublayer_index: int = 0, dynamic: bool = True,
                 sinkhorn_iters: int = 20):
        super().__init__(dim, streams, sublayer_index, dynamic)
        self.sinkhorn_iters = sinkhorn_iters
        if dynamic:  # one scale for the pre map and one for the residual map instead of HC's one
            del self.alpha_scale
            self.pre_scale = nn.Parameter(torch.full((1,), 0.01))
            self.residual_scale = nn.Parameter(torch.full((1,), 0.01))

    def coefficients(self, streams: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        alpha, beta = self.static_alpha, self.static_beta
        if self.dynamic:
            normed = self.norm(streams).float()
            scale = torch.cat([self.pre_scale, self.residual_scale.expand(self.streams)])
            alpha = alpha + (normed @ self.dynamic_alpha) * scale
            beta = beta + self.beta_scale * (normed @ self.dynamic_beta)
        into, among = torch.sigmoid(alpha[..., 0]), sinkhorn_knopp(alpha[..., 1:], self.sinkhorn_iters)
        return into.to(streams.dtype), among.to(streams.dtype), (2.0 * torch.sigmoid(beta)).to(streams.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sinkhorn_iters={self.sinkhorn_iters}"


class HyperConnectionBlock(ResidualBlock):
    """Hyper-Connections over a Pre-Norm sublayer, per sublayer ``k`` (``2l`` attention, ``2l+1`` MLP of block ``l``)::

        h, H' = alpha_k(H);  Z <- F(LN(h));  H <- H' + beta_k Z

    on ``n`` streams ``H (B, T, n, D)`` that start as copies of the embedding and are summed for the head.
    Connections ``hc{1,2}`` (:class:`HyperConnection`), norms ``norm{1,2}`` as Pre-Norm's.
    """

    topology = "hc"
    connection: Type[HyperConnection] = HyperConnection

    def __init__(self, dim: int, layer_index: int = 0, *, streams: int = 4, dynamic: bool = True,
                 norm_layer: NormLayer = default_norm, input_norm_layer: Optional[NormLayer] = None,
                 drop_path: float = 0.0, **connection_options):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.norm1 = (input_norm_layer or norm_layer)(dim)
        self.norm2 = (input_norm_layer or norm_layer)(dim)
        self.hc1 = self.connection(dim, streams, 2 * layer_index, dynamic, **connection_options)
        self.hc2 = self.connection(dim, streams, 2 * layer_index + 1, dynamic, **connection_options)

    def forward(self, streams: Tensor, ctx: Optional[Tensor] = None) -> Tensor:
        h, streams, beta = self.hc1(streams)
        streams = streams + beta.unsqueeze(-1) * self.drop_path(self.sublayer1(self.norm1(h), ctx)).unsqueeze(-2)
        h, streams, beta = self.hc2(streams)
        return streams + beta.unsqueeze(-1) * self.drop_path(self.sublayer2(self.norm2(h), ctx)).unsqueeze(-2)


class ManifoldHyperConnectionBlock(HyperConnectionBlock):
    """mHC: :class:`HyperConnectionBlock` with :class:`ManifoldHyperConnection` maps."""

    topology = "mhc"
    connection = ManifoldHyperConnection


# ----------------------------------------------------------------------------- Attention Residuals

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
        logits = [(v @ query) * torch.rsqrt(v.pow(2).mean(dim=-1) + self.eps) for v in sources]
        weights = torch.softmax(torch.stack(logits), dim=0).unsqueeze(-1)
        h = weights[0] * sources[0]
        for i in range(1, len(sources)):
            h = h + weights[i] * sources[i]
        return h


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

    def __init__(self, dim: int, layer_index: int = 0, *, source_sublayers: int = 1,
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



TOPOLOGY_BLOCKS: Dict[str, Type[ResidualBlock]] = {
    cls.topology: cls
    for cls in (PreNormBlock, PostNormBlock, SiameseNormBlock, ResiDualBlock, SandwichBlock, DeepNormBlock,
                HyperConnectionBlock, ManifoldHyperConnectionBlock, AttnResBlock)
}


@lru_cache(maxsize=None)
def block_class(family: Type[ResidualBlock], topology: str) -> Type[ResidualBlock]:
    """The block class of ``family`` (a model's sublayers) on ``topology``'s wiring, e.g.
    ``SiameseNormDeiTBlock(DeiTBlock, SiameseNormBlock)``; one class per pair."""
    base = TOPOLOGY_BLOCKS[check_topology(topology, BLOCK_TOPOLOGIES)]
    name = base.__name__[: -len("Block")] + family.__name__
    return type(name, (family, base), {"__module__": family.__module__, "__qualname__": name,
                                        "__doc__": f"{family.__name__} on {base.__name__}: {base.__doc__}"})


def build_block(family: Type[ResidualBlock], topology: str, *args, normalized_input: bool = True,
                depth_scaling: bool = True, recompute_norms: bool = False, num_blocks: Optional[int] = None,
                hc_streams: int = 4, hc_dynamic: bool = True, mhc_sinkhorn_iters: int = 20,
                attnres_source_sublayers: int = 1, **kwargs) -> ResidualBlock:
    """A ``family`` block on ``topology``; each topology option goes to the topology that reads it
    (``normalized_input``, ``depth_scaling``, ``recompute_norms``: SiameseNorm; ``num_blocks``: DeepNorm;
    ``hc_streams``, ``hc_dynamic``: hc and mhc; ``mhc_sinkhorn_iters``: mhc; ``attnres_source_sublayers``: attnres)."""
    options = {
        "siamese": dict(normalized_input=normalized_input, depth_scaling=depth_scaling,
                        recompute_norms=recompute_norms),
        "deepnorm": dict(num_blocks=num_blocks),
        "hc": dict(streams=hc_streams, dynamic=hc_dynamic),
        "mhc": dict(streams=hc_streams, dynamic=hc_dynamic, sinkhorn_iters=mhc_sinkhorn_iters),
        "attnres": dict(source_sublayers=attnres_source_sublayers),
    }.get(topology, {})
    return block_class(family, topology)(*args, **kwargs, **options)


class StreamFusion(nn.Module):
    """A module that reads a multi-stream state out as one tensor: ``forward(state, final_norm=True)``."""


class SiameseFusion(StreamFusion):
    """Fuse the two Siamese streams after the last block: ``LN_out(LN_x(X) + LN_y(Y))``.

    ``final_norm=False`` drops ``LN_out`` (DiT, whose final layer normalises again).
    """

    def __init__(self, dim: int, norm_layer: NormLayer = default_norm, final_norm: bool = True):
        super().__init__()
        self.norm_x = norm_layer(dim)
        self.norm_y = norm_layer(dim)
        self.norm_out = norm_layer(dim) if final_norm else nn.Identity()

    def forward(self, state: Tuple[Tensor, Tensor], final_norm: bool = True) -> Tensor:
        x, y = state
        h = self.norm_x(x) + self.norm_y(y)
        return self.norm_out(h) if final_norm else h


class ResiDualFusion(StreamFusion):
    """ResiDual's output ``X + LN(Y)``: the Post-Norm stream plus the normalised accumulation."""

    def __init__(self, dim: int, norm_layer: NormLayer = default_norm):
        super().__init__()
        self.norm_y = norm_layer(dim)

    def forward(self, state: Tuple[Tensor, Tensor], final_norm: bool = True) -> Tensor:
        """``final_norm`` is accepted for :func:`readout`; ResiDual has no final norm."""
        x, y = state
        return x + self.norm_y(y)


class StreamSum(StreamFusion):
    """Hyper-Connections' output: the sum of the ``n`` streams, then ``LN_out`` (``final_norm=False``: none, DiT)."""

    def __init__(self, dim: int, norm_layer: NormLayer = default_norm, final_norm: bool = True):
        super().__init__()
        self.norm_out = norm_layer(dim) if final_norm else nn.Identity()

    def forward(self, streams: Tensor, final_norm: bool = True) -> Tensor:
        h = streams.sum(dim=-2)
        return self.norm_out(h) if final_norm else h


class DepthAttentionFusion(StreamFusion):
    """Attention Residuals' output: one more depth attention over every source, as if the head were the next
    sublayer, then ``LN_out`` (``final_norm=False``: none, DiT)."""

    def __init__(self, dim: int, norm_layer: NormLayer = default_norm, final_norm: bool = True):
        super().__init__()
        self.depth_attn = DepthAttention(dim)
        self.norm_out = norm_layer(dim) if final_norm else nn.Identity()

    def forward(self, sources: List[Tensor], final_norm: bool = True) -> Tensor:
        h = self.depth_attn(sources)
        return self.norm_out(h) if final_norm else h


def accumulated_stream(state: StreamState) -> Tensor:
    """The embedding plus every sublayer update so far, the tensor Pre-Norm's stream is, from any stream state:
    a single stream as it is, ``Y`` of the two-stream topologies, the mean of Hyper-Connections' ``n`` streams (each
    is that sum at init), the sum of Attention Residuals' sources. REPA aligns it (:mod:`diffusion.repa`)."""
    if isinstance(state, tuple):
        return state[1]
    if isinstance(state, list):
        total = state[0]
        for source in state[1:]:
            total = total + source
        return total
    return state.mean(dim=-2) if state.dim() == 4 else state


def readout(fusion: nn.Module, state: StreamState, norm: bool = True) -> Tensor:
    """The features ``fusion`` (the module :func:`build_fusion` made) reads from a stream state.

    The fusion of a multi-stream state, with its final norm (SiameseNorm's ``LN_out``) when ``norm``; a single
    stream through ``fusion`` when ``norm``, else as it is. Applied to the state after block ``l``, it is what the
    head would read if the network ended there.
    """
    if isinstance(fusion, StreamFusion):
        return fusion(state, final_norm=norm)
    return fusion(state) if norm else state


def build_fusion(
    dim: int,
    topology: str,
    *,
    last_block_topology: Optional[str] = None,
    final_norm: bool = True,
    norm_layer: NormLayer = default_norm,
) -> nn.Module:
    """The module between the last block and the head.

    * siamese: :class:`SiameseFusion`; residual: :class:`ResiDualFusion`; hc, mhc: :class:`StreamSum`;
      attnres, attnres_block: :class:`DepthAttentionFusion`;
    * a model whose last block is Pre-Norm-like (``pre``, ``mixln``, ``sandwich``, ``layerscale``, ``dyt``):
      the usual final norm when ``final_norm`` (key ``norm.weight``, as timm), else identity;
    * a model whose last block is Post-Norm-like (``post``, ``deepnorm``): identity, already normalised.
    """
    check_topology(topology)
    if topology == "siamese":
        return SiameseFusion(dim, norm_layer, final_norm=final_norm)
    if topology == "residual":
        return ResiDualFusion(dim, norm_layer)
    if topology in HYPER_TOPOLOGIES:
        return StreamSum(dim, norm_layer, final_norm=final_norm)
    if topology in ATTNRES_TOPOLOGIES:
        return DepthAttentionFusion(dim, norm_layer, final_norm=final_norm)
    last = last_block_topology or ("pre" if topology == "mixln" else block_topologies(topology, 1)[0])
    if last in ("pre", "sandwich") and final_norm:
        return norm_layer(dim)
    return nn.Identity()
