"""Depth routing's fused autograd node (AttnRes and DAR) against the plain ops it replaces: the same outputs, the
same gradients (gradcheck in float64), for a query per model, per sample and per token."""
import pytest
import torch

from common.topologies.fused_routing import RoutedMix, dot, mix_sources

QUERIES = {"vector": (6,), "per_sample": (2, 1, 6), "per_token": (2, 5, 6)}


def inputs(query_shape, dtype=torch.float64, sources=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vs = [torch.randn(2, 5, 6, generator=gen, dtype=dtype).requires_grad_() for _ in range(sources)]
    return vs, torch.randn(*query_shape, generator=gen, dtype=dtype).requires_grad_()


@pytest.mark.parametrize("query", sorted(QUERIES))
@pytest.mark.parametrize("scale", [1.0, 0.4])
def test_gradcheck(query, scale):
    vs, q = inputs(QUERIES[query])
    assert torch.autograd.gradcheck(lambda q, *v: RoutedMix.apply(q, 1e-6, scale, *v), (q, *vs))


@pytest.mark.parametrize("query", sorted(QUERIES))
def test_equals_the_plain_ops(query):
    """float32: outputs bit for bit, gradients of sources and query to round-off."""
    vs, q = inputs(QUERIES[query], torch.float32, sources=7)
    grad = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(9))
    plain = mix_sources(vs, [dot(v, q) for v in vs], 1e-6, 0.4)
    expected = torch.autograd.grad(plain, [q, *vs], grad)
    fused = RoutedMix.apply(q, 1e-6, 0.4, *vs)
    got = torch.autograd.grad(fused, [q, *vs], grad)
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
