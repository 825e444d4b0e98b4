"""The residual topologies of a two-sublayer transformer block, implemented once.

Every model in this repository (DeiT in ``vision/``, DiT in ``diffusion/``) builds its blocks on
:class:`ResidualBlock`: the block owns the LayerNorms and the stream arithmetic, the model only
supplies the two sublayer functions (attention and MLP, plus whatever adaLN modulation wraps them).

Topologies (per block):

* ``pre``     -- ``Y <- Y + F(LN(Y))``                      (norm named ``norm{i}``)
* ``post``    -- ``X <- LN(X + F(X))``                      (norm named ``norm{i}``)
* ``siamese`` -- SiameseNorm (arXiv 2602.08064, docs/method.md section 1)::

      X <- LN_post(X)
      Z <- F(LN_in(X + LN_pre(Y)))      # LN_in optional ("Normalized Input")
      X <- X + Z / c_l                  # c_l = sqrt(2(l+1)), optional ("Depth-wise Scaling")
      Y <- Y + Z

  norms named ``pre_norm{i}``, ``post_norm{i}``, ``input_norm{i}`` as in the public SiameseNorm DeiT.
  The ``X`` update is one fused ``X.add(Z, alpha=1/c_l)``. ``recompute_norms=True`` keeps only ``X`` and ``Y``
  of the norm chain for backward (one stream tensor per sublayer more than Pre-Norm instead of two) at a
  few percent of step time; see :class:`ResidualBlock`.

Baselines on the same block:

* ``residual`` -- ResiDual (Xie et al. 2023): ``Z <- F(X); X <- LN(X + Z); Y <- Y + Z``, output
  ``X + LN(Y)`` (:class:`ResiDualFusion`); both streams start as the embedding.  (norm ``norm{i}``)
* ``sandwich`` -- Peri-LN / Sandwich-LN: ``Y <- Y + LN_out(F(LN(Y)))``.  (norms ``norm{i}``, ``out_norm{i}``)
* ``deepnorm`` -- DeepNorm (Wang et al. 2022): ``X <- LN(alpha X + F(X))``, ``alpha = (2N)^(1/4)`` for ``N``
  blocks; the model scales its value/output/MLP weights by :func:`deepnorm_beta` at init.

Model-level topologies add ``mixln`` (Mix-LN: Post-Norm in the first ``k`` blocks, Pre-Norm after),
``layerscale`` (Pre-Norm with a learned per-channel gain on each update, CaiT) and ``dyt`` (Pre-Norm with
:class:`DyT` in place of every LayerNorm); :func:`block_topologies` resolves a model topology into one
block topology per depth, and the model applies the LayerScale gain or the DyT norm.

A stream *state* is a tensor for the single-stream topologies and a tuple ``(X, Y)`` for the two-stream
ones (Siamese, ResiDual); :func:`init_streams` creates it from the embedding and :func:`build_fusion`
turns the final state into the features the head reads.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Tensor = torch.Tensor
StreamState = Union[Tensor, Tuple[Tensor, Tensor]]
Sublayer = Callable[[Tensor], Tensor]

BLOCK_TOPOLOGIES = ("pre", "post", "siamese", "residual", "sandwich", "deepnorm")
TWO_STREAM_TOPOLOGIES = ("siamese", "residual")
MODEL_TOPOLOGIES = ("pre", "post", "siamese", "mixln", "residual", "sandwich", "deepnorm", "layerscale", "dyt")
# Model topologies that are Pre-Norm blocks plus something the model adds (a gain, a norm).
_PRE_NORM_VARIANTS = ("layerscale", "dyt")
LN_EPS = 1e-6


def check_topology(topology: str, allowed: Sequence[str] = MODEL_TOPOLOGIES) -> str:
    if topology not in allowed:
        raise ValueError(f"unknown residual topology {topology!r}; valid topologies are {', '.join(allowed)}")
    return topology


def default_mixln_post_blocks(depth: int) -> int:
    """Mix-LN's default: Post-Norm in the first quarter of the blocks (at least one)."""
    return max(1, round(0.25 * depth))


def block_topologies(topology: str, depth: int, mixln_post_blocks: Optional[int] = None) -> list:
    """Resolve a model-level topology into the topology of each of ``depth`` blocks."""
    check_topology(topology)
    if topology in _PRE_NORM_VARIANTS:
        return ["pre"] * depth
    if topology != "mixln":
        return [topology] * depth
    k = default_mixln_post_blocks(depth) if mixln_post_blocks is None else int(mixln_post_blocks)
    if not 0 <= k <= depth:
        raise ValueError(f"mixln_post_blocks={k} must lie in [0, depth={depth}]")
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


def init_streams(x: Tensor, topology: str) -> StreamState:
    """Both streams of a two-stream topology start as the same embedding; others carry one stream."""
    return (x, x) if topology in TWO_STREAM_TOPOLOGIES else x


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


class ResidualBlock(nn.Module):
    """Base class of a transformer block with two sublayers wired by a residual topology.

    Subclasses create their sublayers and call :meth:`residual` for sublayer 1 and 2 in ``forward``.
    The norms are attributes of the block itself (not of a wrapper) so that state-dict keys match
    timm (``blocks.i.norm1``) and the public SiameseNorm files (``blocks.i.pre_norm1``) by name.

    Args:
        dim: channel width of the streams.
        layer_index: 0-based depth of the block (sets the Siamese depth scale).
        topology: ``pre``, ``post`` or ``siamese``.
        normalized_input: Siamese only; apply ``LN_in`` to ``X + LN_pre(Y)`` (paper Table 3).
        depth_scaling: Siamese only; divide the ``X`` update by ``sqrt(2(l+1))`` (paper Table 3).
        norm_layer: factory ``dim -> module`` for the affine stream norms (pre/post/fusion norms).
        input_norm_layer: factory for the norm a sublayer reads through (Pre-Norm's norm, Siamese's
            ``LN_in``). Defaults to ``norm_layer``; DiT passes a non-affine LayerNorm and applies its
            adaLN modulation inside the sublayer function.
        drop_path: stochastic-depth rate applied once to each sublayer output ``Z``.
        num_blocks: DeepNorm only; the model's depth ``N`` (sets ``alpha = (2N)^(1/4)``).
        recompute_norms: Siamese only; keep only ``X`` and ``Y`` of the norm chain ``LN_post``, ``LN_pre``, sum,
            ``LN_in`` for backward and recompute the rest there (``torch.utils.checkpoint`` of the chain alone;
            no effect without autograd). Same values and gradients, bit for bit. Eager autograd then keeps
            one stream tensor per sublayer more than Pre-Norm instead of two. Under ``torch.compile`` the
            partitioner decides: fp32 DeiT then keeps what Pre-Norm keeps (it recomputes the sublayer input
            too); DiT and bf16 graphs keep one stream tensor more with or without the switch. Off by default:
            it costs 0.4-3% of CPU step time (``scripts.bench_block``). Norm hooks fire again in backward.
    """

    def __init__(
        self,
        dim: int,
        layer_index: int = 0,
        topology: str = "pre",
        *,
        normalized_input: bool = True,
        depth_scaling: bool = True,
        norm_layer: Callable[[int], nn.Module] = default_norm,
        input_norm_layer: Optional[Callable[[int], nn.Module]] = None,
        drop_path: float = 0.0,
        num_blocks: Optional[int] = None,
        recompute_norms: bool = False,
    ):
        super().__init__()
        check_topology(topology, BLOCK_TOPOLOGIES)
        self.topology = topology
        self.layer_index = layer_index
        self.normalized_input = normalized_input
        self.recompute_norms = recompute_norms
        self.depth_scale = depth_scale(layer_index, depth_scaling) if topology == "siamese" else 1.0
        if topology == "deepnorm" and not num_blocks:
            raise ValueError("the deepnorm topology needs num_blocks (the model depth) to set alpha = (2N)^(1/4)")
        self.residual_scale = deepnorm_alpha(num_blocks) if topology == "deepnorm" else 1.0
        input_norm_layer = input_norm_layer or norm_layer
        for i in (1, 2):
            if topology in ("pre", "sandwich"):
                setattr(self, f"norm{i}", input_norm_layer(dim))
                if topology == "sandwich":
                    setattr(self, f"out_norm{i}", norm_layer(dim))
            elif topology in ("post", "residual", "deepnorm"):
                setattr(self, f"norm{i}", norm_layer(dim))
            else:
                setattr(self, f"pre_norm{i}", norm_layer(dim))
                setattr(self, f"post_norm{i}", norm_layer(dim))
                setattr(self, f"input_norm{i}", input_norm_layer(dim) if normalized_input else nn.Identity())
        # Imported lazily so that common/ has no hard dependency on timm at import time.
        from timm.layers import DropPath

        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def residual(self, index: int, state: StreamState, sublayer: Sublayer) -> StreamState:
        """Apply sublayer ``index`` (1 or 2) to the stream state with this block's topology."""
        if self.topology == "pre":
            norm = getattr(self, f"norm{index}")
            return state + self.drop_path(sublayer(norm(state)))
        if self.topology == "post":
            norm = getattr(self, f"norm{index}")
            return norm(state + self.drop_path(sublayer(state)))
        if self.topology == "sandwich":
            z = getattr(self, f"out_norm{index}")(sublayer(getattr(self, f"norm{index}")(state)))
            return state + self.drop_path(z)
        if self.topology == "deepnorm":
            norm = getattr(self, f"norm{index}")
            return norm(state * self.residual_scale + self.drop_path(sublayer(state)))
        x, y = state
        if self.topology == "residual":
            z = self.drop_path(sublayer(x))
            return getattr(self, f"norm{index}")(x + z), y + z
        if self.recompute_norms and torch.is_grad_enabled():
            x, h = checkpoint(self._norm_chain, index, x, y, use_reentrant=False, preserve_rng_state=False,
                           determinism_check="none")
        else:
            x, h = self._norm_chain(index, x, y)
        z = self.drop_path(sublayer(h))
        return x.add(z, alpha=1.0 / self.depth_scale), y + z

    def _norm_chain(self, index: int, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        """Siamese front of sublayer ``index``: ``X' = LN_post(X)`` and the sublayer input ``LN_in(X' + LN_pre(Y))``."""
        x = getattr(self, f"post_norm{index}")(x)
        return x, getattr(self, f"input_norm{index}")(x + getattr(self, f"pre_norm{index}")(y))

    def extra_repr(self) -> str:
        s = f"topology={self.topology}, layer_index={self.layer_index}"
        if self.topology == "siamese":
            s += (f", normalized_input={self.normalized_input}, depth_scale={self.depth_scale:.4f}, "
                  f"recompute_norms={self.recompute_norms}")
        if self.topology == "deepnorm":
            s += f", alpha={self.residual_scale:.4f}"
        return s


class SiameseFusion(nn.Module):
    """Fuse the two Siamese streams after the last block: ``LN_out(LN_x(X) + LN_y(Y))``.

    ``final_norm=False`` drops ``LN_out`` (DiT, whose final layer normalises again).
    """

    def __init__(self, dim: int, norm_layer: Callable[[int], nn.Module] = default_norm, final_norm: bool = True):
        super().__init__()
        self.norm_x = norm_layer(dim)
        self.norm_y = norm_layer(dim)
        self.norm_out = norm_layer(dim) if final_norm else nn.Identity()

    def forward(self, state: Tuple[Tensor, Tensor]) -> Tensor:
        x, y = state
        return self.norm_out(self.norm_x(x) + self.norm_y(y))


class ResiDualFusion(nn.Module):
    """ResiDual's output ``X + LN(Y)``: the Post-Norm stream plus the normalised accumulation."""

    def __init__(self, dim: int, norm_layer: Callable[[int], nn.Module] = default_norm):
        super().__init__()
        self.norm_y = norm_layer(dim)

    def forward(self, state: Tuple[Tensor, Tensor]) -> Tensor:
        x, y = state
        return x + self.norm_y(y)


def build_fusion(
    dim: int,
    topology: str,
    *,
    last_block_topology: Optional[str] = None,
    final_norm: bool = True,
    norm_layer: Callable[[int], nn.Module] = default_norm,
) -> nn.Module:
    """The module between the last block and the head.

    * siamese: :class:`SiameseFusion`; residual: :class:`ResiDualFusion`;
    * a model whose last block is Pre-Norm-like (``pre``, ``mixln``, ``sandwich``, ``layerscale``, ``dyt``):
      the usual final norm when ``final_norm`` (key ``norm.weight``, as timm), else identity;
    * a model whose last block is Post-Norm-like (``post``, ``deepnorm``): identity, already normalised.
    """
    check_topology(topology)
    if topology == "siamese":
        return SiameseFusion(dim, norm_layer, final_norm=final_norm)
    if topology == "residual":
        return ResiDualFusion(dim, norm_layer)
    last = last_block_topology or ("pre" if topology == "mixln" else block_topologies(topology, 1)[0])
    if last in ("pre", "sandwich") and final_norm:
        return norm_layer(dim)
    return nn.Identity()
