"""Learned mixing of ``n`` residual streams: Hyper-Connections (``hc``, arXiv 2409.19606) and their
manifold-constrained form (``mhc``, arXiv 2512.24880), and their registrations.

The state is the ``n`` streams as one ``(B, T, n, D)`` tensor, which starts as ``n`` copies of the embedding and
is summed for the head. Per sublayer a connection mixes the streams into the sublayer's input, mixes them among
themselves and writes the sublayer's output back with a gain per stream.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Type

import torch
from torch import nn

from common.cli import InputError
from common.topologies.base import NormLayer, ResidualBlock, StreamFusion, StreamStart, autograd_records, default_norm
from common.topologies.registry import Topology, register

Tensor = torch.Tensor
# The streams' RMSNorm: the hyper-connections package normalises x / ||x|| (clamped at 1e-12), which an eps of 1e-6
# would not match on streams as small as an embedding at init.
HC_NORM_EPS = 1e-12


def sinkhorn_knopp(logits: Tensor, iters: int) -> Tensor:
    """A doubly stochastic matrix from ``logits`` over the last two dimensions: ``exp``, then ``iters`` rounds of
    scaling each column, then each row, to sum 1 (mHC's projection; the column-first order of the hyper-connections
    package). The column maximum is taken out first, which the column scaling undoes exactly."""
    m = (logits - logits.amax(dim=-2, keepdim=True).detach()).exp()
    for _ in range(iters):
        m = m / m.sum(dim=-2, keepdim=True)
        m = m / m.sum(dim=-1, keepdim=True)
    return m


def few_column_product(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight`` for a ``weight (D, m)`` of a few columns, computed as ``(weight^T x^T)^T``: BLAS (oneDNN, MKL) runs
    a product whose output has ``m`` columns several times slower than its transpose, with ``m`` rows
    (docs/benchmarks.md). The result is a view of that transpose."""
    rows = x.reshape(-1, x.shape[-1])
    return (weight.t() @ rows.t()).t().reshape(x.shape[:-1] + weight.shape[-1:])


class FewColumnProduct(torch.autograd.Function):
    """:func:`few_column_product` whose weight gradient is ``(g^T x)^T``, not autograd's ``x^T g``, for the same
    reason (its output has the few rows); equal to ``x @ weight``'s gradients to float round-off."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return few_column_product(x, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight.t() if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).t()
        return grad_x, grad_weight


class StreamConnection(nn.Module):
    """The width and depth connections of one sublayer over ``n`` streams ``H``.

    ``alpha`` (``n x (1+n)``): column 0 mixes the streams into the sublayer input ``h = sum_s alpha[s,0] H_s``, the
    other columns mix the streams among themselves ``H'_t = sum_s alpha[s,1+t] H_s``; ``beta`` (``n``) writes the
    sublayer output back, ``H <- H' + beta_s F(h)``. The static part is learned and initialised as the paper (column 0
    one-hot at stream ``k mod n`` for sublayer ``k``, the identity, ``beta = 1``); the dynamic part reads the streams
    through an RMSNorm per stream (the hyper-connections package's choice, with its epsilon) and zero projections.
    Subclasses map the logits to coefficients (:meth:`coefficients`).
    """

    __constants__ = ["dynamic"]

    def __init__(self, dim: int, streams: int, sublayer_index: int, dynamic: bool):
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

    def coefficients(self, streams: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(into the sublayer (..., n), among the streams (..., n, n), back from it (..., n))``."""
        raise NotImplementedError

    def dynamic_logits(self, streams: Tensor) -> Tuple[Tensor, Tensor]:
        """``(RMSNorm(H) W_alpha, RMSNorm(H) w_beta)`` per stream, ``(..., n, 1+n)`` and ``(..., n)``, from one
        product of the streams with both maps: the norm's per-stream scale goes onto the ``2 + n`` numbers that
        product gives, so the normalised streams are never written out."""
        weight = self.norm.weight.unsqueeze(-1) * torch.cat([self.dynamic_alpha, self.dynamic_beta.unsqueeze(-1)], -1)
        mean_square = torch.linalg.vector_norm(streams, dim=-1, keepdim=True).square() / streams.shape[-1]
        if torch.jit.is_scripting():
            product = streams @ weight
        else:
            product = self.logit_product(streams, weight)
        logits = product * torch.rsqrt(mean_square + self.norm.eps)
        return logits[..., :-1], logits[..., -1]

    @torch.jit.unused
    def logit_product(self, streams: Tensor, weight: Tensor) -> Tensor:
        """:class:`FewColumnProduct` where autograd records, else :func:`few_column_product` (FX, inference)."""
        if autograd_records():
            return FewColumnProduct.apply(streams, weight)
        return few_column_product(streams, weight)

    def forward(self, streams: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(sublayer input (B, T, D), mixed streams (B, T, n, D), beta (..., n))`` of ``streams (B, T, n, D)``.

        Eager: one product of the streams with ``[into | among]``. Compiled: the same sums written elementwise,
        which inductor fuses into loops over the streams; the product would compile to a batch of tiny ``(1+n) x n``
        matrix products per token, slower than those loops (docs/benchmarks.md)."""
        into, among, beta = self.coefficients(streams)
        if not torch.jit.is_scripting() and torch.compiler.is_compiling():
            h, mixed = self.mix_elementwise(streams, into, among)
            return h, mixed, beta
        mixed = torch.cat([into.unsqueeze(-1), among], dim=-1).transpose(-1, -2) @ streams  # (..., 1+n, D)
        return mixed[..., 0, :], mixed[..., 1:, :], beta

    @torch.jit.unused
    def mix_elementwise(self, streams: Tensor, into: Tensor, among: Tensor) -> Tuple[Tensor, Tensor]:
        h = (into.unsqueeze(-1) * streams).sum(-2)                                  # (B, T, D)
        mixed = (among.unsqueeze(-1) * streams.unsqueeze(-2)).sum(-3)               # (B, T, n, D)
        return h, mixed

    def extra_repr(self) -> str:
        return f"streams={self.streams}, dynamic={self.dynamic}"


class HyperConnection(StreamConnection):
    """Hyper-Connections: the coefficients are the logits; dynamic (the paper's DHC) adds
    ``s_alpha tanh(norm(H) W_alpha)`` and ``s_beta tanh(norm(H) w_beta)`` with ``s = 0.01`` at init."""

    def __init__(self, dim: int, streams: int, sublayer_index: int, dynamic: bool):
        super().__init__(dim, streams, sublayer_index, dynamic)
        if dynamic:
            self.alpha_scale = nn.Parameter(torch.full((), 0.01))
            self.beta_scale = nn.Parameter(torch.full((), 0.01))

    def coefficients(self, streams: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        alpha, beta = self.static_alpha, self.static_beta
        if self.dynamic:
            alpha_logits, beta_logits = self.dynamic_logits(streams)
            alpha = alpha + self.alpha_scale * torch.tanh(alpha_logits)
            beta = beta + self.beta_scale * torch.tanh(beta_logits)
        return alpha[..., 0], alpha[..., 1:], beta


class ManifoldHyperConnection(StreamConnection):
    """mHC: the maps constrained, ``H_pre = sigmoid(.)``, ``H_post = 2 sigmoid(.)`` and ``H_res = SinkhornKnopp(.)``
    doubly stochastic, so the stream mixing neither grows nor shrinks a signal across depth. The logits are
    ``static + scale * (norm(H) W)`` (no tanh), with one scale for the pre map and one for the residual map, as the
    hyper-connections package computes them, in float32."""

    def __init__(self, dim: int, streams: int, sublayer_index: int, dynamic: bool, sinkhorn_iters: int):
        super().__init__(dim, streams, sublayer_index, dynamic)
        self.sinkhorn_iters = sinkhorn_iters
        if dynamic:
            self.beta_scale = nn.Parameter(torch.full((), 0.01))
            self.pre_scale = nn.Parameter(torch.full((1,), 0.01))
            self.residual_scale = nn.Parameter(torch.full((1,), 0.01))

    def coefficients(self, streams: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        alpha, beta = self.static_alpha, self.static_beta
        if self.dynamic:
            alpha_logits, beta_logits = self.dynamic_logits(streams.float())
            scale = torch.cat([self.pre_scale, self.residual_scale.expand(self.streams)])
            alpha = alpha + alpha_logits * scale
            beta = beta + self.beta_scale * beta_logits
        into, among = torch.sigmoid(alpha[..., 0]), sinkhorn_knopp(alpha[..., 1:], self.sinkhorn_iters)
        return into.to(streams.dtype), among.to(streams.dtype), (2.0 * torch.sigmoid(beta)).to(streams.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sinkhorn_iters={self.sinkhorn_iters}"


class StreamMixingBlock(ResidualBlock):
    """A Pre-Norm sublayer on ``n`` mixed streams, per sublayer ``k`` (``2l`` attention, ``2l+1`` MLP of block ``l``)::

        h, H' = alpha_k(H);  Z <- F(LN(h));  H <- H' + beta_k Z

    Connections ``hc{1,2}`` (a :attr:`connection`), norms ``norm{1,2}`` as Pre-Norm's.
    """

    connection: Type[StreamConnection] = StreamConnection

    def __init__(self, dim: int, layer_index: int = 0, *, streams: int, dynamic: bool,
                 norm_layer: NormLayer = default_norm, input_norm_layer: Optional[NormLayer] = None,
                 drop_path: float = 0.0, **connection_options):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.norm1 = (input_norm_layer or norm_layer)(dim)
        self.norm2 = (input_norm_layer or norm_layer)(dim)
        self.hc1 = self.connection(dim, streams, 2 * layer_index, dynamic, **connection_options)
        self.hc2 = self.connection(dim, streams, 2 * layer_index + 1, dynamic, **connection_options)

    def forward(self, streams: Tensor, ctx: Optional[Tensor] = None) -> Tensor:
        h, streams, beta = self.hc1(streams)
        streams = torch.addcmul(streams, beta.unsqueeze(-1), self.drop_path(self.sublayer1(self.norm1(h), ctx)).unsqueeze(-2))
        h, streams, beta = self.hc2(streams)
        return torch.addcmul(streams, beta.unsqueeze(-1), self.drop_path(self.sublayer2(self.norm2(h), ctx)).unsqueeze(-2))


class HyperConnectionBlock(StreamMixingBlock):
    """Hyper-Connections (:class:`HyperConnection`) around a Pre-Norm sublayer."""

    topology = "hc"
    connection = HyperConnection


class ManifoldHyperConnectionBlock(StreamMixingBlock):
    """mHC (:class:`ManifoldHyperConnection`) around a Pre-Norm sublayer."""

    topology = "mhc"
    connection = ManifoldHyperConnection


class ExpandStreams(StreamStart):
    """The first state: ``n`` copies of the embedding, ``(B, T, D) -> (B, T, n, D)``."""

    def __init__(self, streams: int):
        super().__init__()
        self.streams = streams

    def forward(self, x: Tensor, cond: Optional[Tensor] = None) -> Tensor:
        return x.unsqueeze(-2).expand(-1, -1, self.streams, -1)

    def accumulated(self, state: Tensor) -> Tensor:
        """The streams' mean: each stream is the embedding plus every update at init."""
        return state.mean(dim=-2)

    def named_streams(self, state: Tensor) -> Dict[str, Tensor]:
        return {f"s{i}": state[..., i, :] for i in range(state.shape[-2])}

    def extra_repr(self) -> str:
        return f"streams={self.streams}"


class StreamSum(StreamFusion):
    """The output: the sum of the ``n`` streams, then ``LN_out`` (``final_norm=False``: none, DiT)."""

    def __init__(self, dim: int, norm_layer: NormLayer = default_norm, final_norm: bool = True):
        super().__init__()
        self.norm_out = norm_layer(dim) if final_norm else nn.Identity()

    def forward(self, streams: Tensor, final_norm: bool = True) -> Tensor:
        h = streams.sum(dim=-2)
        return self.norm_out(h) if final_norm else h


def _stream_mixing(name: str, summary: str, block: Type[StreamMixingBlock], color: str, **own_options) -> Topology:
    options = dict(hc_streams=4, hc_dynamic=True, **own_options)

    def blocks(depth, options):
        if int(options["hc_streams"]) < 1:
            raise InputError(f"hc_streams={options['hc_streams']} must be at least 1 (the streams carried)")
        own = {k.removeprefix(f"{name}_"): options[k] for k in own_options}
        return [(block, dict(streams=int(options["hc_streams"]), dynamic=bool(options["hc_dynamic"]), **own))] * depth

    return Topology(name, summary, blocks, color=color, options=options,
                    streams=lambda plan, dim: ExpandStreams(int(plan.options["hc_streams"])),
                    output=lambda plan, dim, norm_layer, final_norm: StreamSum(dim, norm_layer, final_norm))


register(_stream_mixing("hc", "Hyper-Connections: n streams mixed by learned width and depth connections",
                        HyperConnectionBlock, color="gold"))
register(_stream_mixing("mhc", "mHC: Hyper-Connections with a doubly stochastic residual map (Sinkhorn-Knopp)",
                        ManifoldHyperConnectionBlock, color="darkgoldenrod", mhc_sinkhorn_iters=20))
