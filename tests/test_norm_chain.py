"""common.topologies.fused_norm_chain.SiameseNormChain, SiameseNorm's fused norm chain, against the three norm modules it replaces."""
import pytest
import torch
from torch import nn

from common.topologies import DyT
from common.topologies.fused_norm_chain import siamese_norm_chain

DIM = 12
# DeiT: affine LN_in; DiT: non-affine LN_in (adaLN modulates outside); the "Normalized Input" ablation: no LN_in.
CASES = {"deit": dict(affine_in=True), "dit": dict(affine_in=False), "no_input_norm": dict(normalized_input=False)}


def norms(affine_in=True, normalized_input=True, dtype=torch.float32, seed=0):
    """LN_post, LN_pre, LN_in with weights moved off their init."""
    post = nn.LayerNorm(DIM, eps=1e-6, dtype=dtype)
    pre = nn.LayerNorm(DIM, eps=1e-5, dtype=dtype)
    inp = nn.LayerNorm(DIM, eps=1e-6, elementwise_affine=affine_in, dtype=dtype) if normalized_input else nn.Identity()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (*post.parameters(), *pre.parameters(), *inp.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype))
    return post, pre, inp


def streams(dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(2, 5, DIM, generator=gen, dtype=dtype) + 1).requires_grad_()
    y = (10 * torch.randn(2, 5, DIM, generator=gen, dtype=dtype)).requires_grad_()
    return x, y


def values_and_grads(x, y, modules, recompute, seed=2):
    """The chain's two outputs and the gradients of a random projection of them, for X, Y and every parameter."""
    out = siamese_norm_chain(x, y, *modules, recompute=recompute)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in out)
    leaves = [t for t in dict.fromkeys([x, y]) if t.requires_grad] + [p for m in modules for p in m.parameters()]
    return out, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradcheck_float64(case):
    modules = norms(**CASES[case], dtype=torch.float64)
    x, y = streams(torch.float64)
    params = [p for m in modules for p in m.parameters()]
    assert torch.autograd.gradcheck(lambda x, y, *p: siamese_norm_chain(x, y, *modules, recompute=True),
                                    (x, y, *params))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("same_tensor", [False, True], ids=["x_y", "x_is_y"])
def test_values_and_grads_equal_the_three_norms(case, same_tensor):
    """fp32, to 1e-5: both outputs and the gradients of X, Y and every norm weight and bias; X is Y in a model's
    first sublayer."""
    modules = norms(**CASES[case])
    x, y = streams()
    if same_tensor:
        y = x
    fused, fused_grads = values_and_grads(x, y, modules, recompute=True)
    ref, ref_grads = values_and_grads(x, y, modules, recompute=False)
    assert len(fused_grads) == len(ref_grads) == (1 if same_tensor else 2) + sum(
        1 for m in modules for _ in m.parameters())
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(fused_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_keeps_the_chain_fp32():
    """Under autocast the streams stay fp32 and so does the chain, as the LayerNorm modules are."""
    modules = norms(affine_in=False)
    x, y = streams()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, fused_grads = values_and_grads(x, y, modules, recompute=True)
        ref, ref_grads = values_and_grads(x, y, modules, recompute=False)
    assert [t.dtype for t in fused] == [torch.float32] * 2
    for a, b in zip([*fused, *fused_grads], [*ref, *ref_grads]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_no_autograd_runs_the_modules_and_other_norms_are_refused():
    modules = norms()
    x, y = streams()
    with torch.no_grad():
        out = siamese_norm_chain(x, y, *modules, recompute=True)
    assert out[0].grad_fn is None
    with pytest.raises(TypeError, match="fuses LayerNorms"):
        siamese_norm_chain(x, y, DyT(DIM), modules[1], modules[2], recompute=True)


@pytest.mark.parametrize("torch_api", ["is_fx_symbolic_tracing", "is_fx_tracing_only"])
def test_fx_symbolic_trace_runs_the_modules_on_every_torch(torch_api, monkeypatch):
    """torch.fx cannot trace Function.apply, so under symbolic tracing the chain runs the three modules; torch 2.6
    has only ``is_fx_tracing`` to say so (the floor), later releases ``is_fx_symbolic_tracing``."""
    if torch_api == "is_fx_tracing_only":
        monkeypatch.delattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", raising=False)

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.post, self.pre, self.inp = norms()

        def forward(self, x, y):
            return siamese_norm_chain(x, y, self.post, self.pre, self.inp, recompute=True)

    chain = Chain()
    x, y = streams()
    traced = torch.fx.symbolic_trace(chain)
    assert {n.target for n in traced.graph.nodes if n.op == "call_module"} == {"post", "pre", "inp"}
    eager = chain(x, y)
    assert type(eager[0].grad_fn).__name__ == "SiameseNormChainBackward"
    for a, b in zip(traced(x, y), eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
