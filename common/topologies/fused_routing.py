"""Depth routing's softmax mix as one autograd node: ``h = sum_i softmax_i(s (v_i . q) / rms(v_i)) v_i``.

Autograd over the plain ops writes several source-sized tensors per source and reader in backward (the products'
temporaries, the norm's gradient, each accumulation); on a CPU a written tensor costs several times a read one. This
backward writes each source's gradient once and reads each source twice, from the few numbers per token the
forward keeps (weights, norms, dot products). No library has it; the routing of AttnRes and DAR share it.
"""
from typing import List, Optional

import torch

from common.topologies.base import autograd_records

Tensor = torch.Tensor


def inverse_rms(v: Tensor, eps: float) -> Tensor:
    """``1 / rms(v)`` over the last dimension, in one pass over ``v`` (no squared copy of it is written)."""
    return torch.rsqrt(torch.linalg.vector_norm(v, dim=-1).square() / v.shape[-1] + eps)


def dot(v: Tensor, query: Tensor) -> Tensor:
    """``v . query`` per token, ``(B, T)``, for a query ``(D,)``, one per sample ``(B, 1, D)`` or per token ``(B, T, D)``."""
    if query.dim() == 1:
        return v @ query
    if query.shape[-2] == 1:
        return (v @ query.transpose(-1, -2)).squeeze(-1)
    return torch.linalg.vecdot(v, query)


def mix_sources(sources: List[Tensor], dots: List[Tensor], eps: float, scale: float = 1.0) -> Tensor:
    """The routing with plain ops, from each source's ``v_i . q`` (no autograd, TorchScript, FX): one read of each
    source for its norm, one write for its share of the sum."""
    logits = torch.stack([d * inverse_rms(v, eps) for v, d in zip(sources, dots)])
    weights = torch.softmax(logits * scale if scale != 1.0 else logits, dim=0).unsqueeze(-1)
    h = weights[0] * sources[0]
    for i in range(1, len(sources)):
        h = torch.addcmul(h, weights[i], sources[i])
    return h


class RoutedMix(torch.autograd.Function):
    """:func:`mix_sources` with a backward of its own. The outputs are the plain ops' bit for bit, the gradients to
    float round-off (gradcheck in float64)."""

    @staticmethod
    def forward(ctx, query: Tensor, eps: float, scale: float, *sources: Tensor) -> Tensor:
        inv = torch.stack([inverse_rms(v, eps) for v in sources])                  # (N, B, T)
        dots = torch.stack([dot(v, query) for v in sources])
        logits = dots * inv
        weights = torch.softmax(logits * scale if scale != 1.0 else logits, dim=0)
        h = weights[0].unsqueeze(-1) * sources[0]
        for i in range(1, len(sources)):
            h = torch.addcmul(h, weights[i].unsqueeze(-1), sources[i])
        ctx.save_for_backward(query, weights, inv, dots, *sources)
        ctx.scale = scale
        return h

    @staticmethod
    def backward(ctx, grad_h: Tensor):
        query, weights, inv, dots, *sources = ctx.saved_tensors
        dim = grad_h.shape[-1]
        grad_weights = torch.stack([torch.linalg.vecdot(v, grad_h) for v in sources])
        # softmax, then logit_i = s dot_i inv_i: d/dv_i = s (inv_i q - dot_i inv_i^3 v_i / D)
        grad_logits = weights * (grad_weights - (weights * grad_weights).sum(0, keepdim=True)) * ctx.scale
        along_query = grad_logits * inv
        along_source = -along_query * dots * inv.square() / dim
        grads = []
        for i, v in enumerate(sources):
            g = grad_h * weights[i].unsqueeze(-1)
            g.addcmul_(along_query[i].unsqueeze(-1), query)
            g.addcmul_(along_source[i].unsqueeze(-1), v)
            grads.append(g)
        grad_query: Optional[Tensor] = None
        if ctx.needs_input_grad[0]:
            if query.dim() == 1:
                parts = [c.reshape(-1) @ v.reshape(-1, dim) for c, v in zip(along_query, sources)]
            elif query.shape[-2] == 1:
                parts = [c.unsqueeze(-2) @ v for c, v in zip(along_query, sources)]
            else:
                parts = [c.unsqueeze(-1) * v for c, v in zip(along_query, sources)]
            grad_query = torch.stack(parts).sum(0)
        return (grad_query, None, None, *grads)


def routed_mix(sources: List[Tensor], query: Tensor, eps: float, scale: float = 1.0) -> Tensor:
    """:class:`RoutedMix` where autograd records (outside FX tracing), else the plain ops."""
    if autograd_records():
        return RoutedMix.apply(query, eps, scale, *sources)
    return mix_sources(sources, [dot(v, query) for v in sources], eps, scale)
