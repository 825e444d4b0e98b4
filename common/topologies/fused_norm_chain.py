"""SiameseNorm's norm chain as one autograd node, which keeps less for backward than the three norm modules.

In front of each sublayer SiameseNorm computes ``X' = LN_post(X)`` and ``H = LN_in(X' + LN_pre(Y))``; autograd
would keep ``X' + LN_pre(Y)`` for ``LN_in``'s backward, one stream tensor per sublayer. :class:`SiameseNormChain`
keeps the streams and the norms' statistics instead and rebuilds that input in backward, written with aten's
LayerNorm kernels because no library offers a chain of norms with recomputation.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from common.topologies.base import autograd_records

Tensor = torch.Tensor


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


def siamese_norm_chain(x: Tensor, y: Tensor, post: nn.Module, pre: nn.Module, inp: nn.Module,
                       recompute: bool = False) -> Tuple[Tensor, Tensor]:
    """SiameseNorm's norm chain in front of a sublayer: ``X' = LN_post(X)`` and the input ``LN_in(X' + LN_pre(Y))``.

    ``recompute`` runs it as :class:`SiameseNormChain` when autograd records (not while FX traces), which keeps
    less for backward; otherwise the three norm modules run as they are.
    """
    if recompute and autograd_records():
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

