"""Hyper-Connections, mHC and Attention Residuals (common.topologies) in DeiT and DiT: equal to the hyper-connections
package on the same weights, equal to a re-statement of the Attention Residuals equations, initialised as the papers
say, and compiled, saved and loaded like the other topologies."""
import math

import hyper_connections  # the reference HC and mHC (the test extra)
import pytest
import timm
import torch

import vision  # noqa: F401  (registers our models)
from common.checkpoint import load_weights, save_weights
from common.topologies.depth_routing import DepthAttention, SoleSource
from common.topologies.stream_mixing import FewColumnProduct, HyperConnection, few_column_product, sinkhorn_knopp
from diffusion.models import DiT
from tests.test_deit import SMALL, randomize_


DIT_SMALL = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=4, num_heads=4, num_classes=10)


def perturb_connections_(model, seed=4):
    """Static connections near their structure (read one stream, pass the streams on, write to every stream) plus
    noise; :func:`randomize_` leaves the dynamic weights, scales and norms at 0.1 N(0, 1) and 1 + 0.2 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, HyperConnection):
                n = module.streams
                structure = torch.cat([torch.eye(n)[:, :1], torch.eye(n)], dim=1)
                module.static_alpha.copy_(structure + 0.1 * torch.randn(structure.shape, generator=gen))
                module.static_beta.copy_(1 + 0.1 * torch.randn(n, generator=gen))
    return model


def deit(topology, **kw):
    torch.manual_seed(0)
    model = randomize_(timm.create_model(f"deit_tiny_{topology}_patch16_224", **{**SMALL, **kw}))
    return perturb_connections_(model).eval()


def dit(topology, **kw):
    torch.manual_seed(0)
    return perturb_connections_(randomize_(DiT(**{**DIT_SMALL, "topology": topology, **kw}))).eval()


# ---------------------------------------------------------------- HC and mHC against the hyper-connections package


def package_connection(ours, topology, dim):
    """The package's module for one of our connections, holding the same weights (its RMSNorm is
    ``normalize(x) sqrt(d) (gamma + 1)``, ours ``x / rms(x) weight``: ``gamma = weight - 1``; its dynamic weights
    start at zero, so a static connection of ours is its module with those left at zero)."""
    n = ours.streams
    if topology == "hc":
        ref = hyper_connections.HyperConnections(n, dim=dim, layer_index=0, tanh=True)
    else:
        ref = hyper_connections.ManifoldConstrainedHyperConnections(n, dim=dim, layer_index=0, sinkhorn_iters=20)
    with torch.no_grad():
        ref.static_alpha.copy_(ours.static_alpha)
        ref.static_beta.copy_(ours.static_beta)
        if ours.dynamic:
            ref.norm.gamma.copy_(ours.norm.weight - 1)
            ref.dynamic_alpha_fn.copy_(ours.dynamic_alpha.view(ref.dynamic_alpha_fn.shape))
            ref.dynamic_beta_fn.copy_(ours.dynamic_beta)
            if topology == "hc":
                ref.dynamic_alpha_scale.copy_(ours.alpha_scale)
                ref.dynamic_beta_scale.copy_(ours.beta_scale)
            else:
                ref.pre_branch_scale.copy_(ours.pre_scale)
                ref.residual_scale.copy_(ours.residual_scale)
                ref.h_post_scale.copy_(ours.beta_scale)
    return ref


def package_blocks(blocks, x, topology, streams, ctx=None):
    """The blocks' sublayers wired by the package: streams folded into the batch (``(b s) t d``) as it keeps
    them, each sublayer ``F(LN(h))`` its branch; returns the sum of the streams, as the package reduces them."""
    batch = x.shape[0]
    residuals = x.unsqueeze(1).expand(-1, streams, -1, -1).reshape(batch * streams, *x.shape[1:])
    for block in blocks:
        for i, (norm, sublayer) in enumerate(((block.norm1, block.sublayer1), (block.norm2, block.sublayer2))):
            connection = package_connection(getattr(block, f"hc{i + 1}"), topology, x.shape[-1])
            branch_input, add_residual = connection(residuals)
            residuals = add_residual(sublayer(norm(branch_input), ctx))
    return residuals.reshape(batch, streams, *x.shape[1:]).sum(1)


@pytest.mark.parametrize("topology", ["hc", "mhc"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_deit_equals_the_hyper_connections_package(topology, dynamic, images):
    model = deit(topology, hc_dynamic=dynamic, hc_streams=3)
    with torch.no_grad():
        ours = model(images)
        features = model.norm.norm_out(package_blocks(model.blocks, model._embed(images), topology, 3))
        ref = model.forward_head(features)
    assert (ours - ref).abs().max().item() <= 1e-5
    if dynamic:  # the switch is real: the static model with the same static weights differs
        static = deit(topology, hc_dynamic=False, hc_streams=3)
        static.load_state_dict(model.state_dict(), strict=False)
        with torch.no_grad():
            assert (static(images) - ours).abs().max().item() > 1e-4


@pytest.mark.parametrize("topology", ["hc", "mhc"])
def test_dit_equals_the_hyper_connections_package(topology, latents):
    model = dit(topology)
    x, t, y = latents
    with torch.no_grad():
        ours = model(x, t, y)
        c = model.t_embedder(t) + model.y_embedder(y, False)
        tokens = model.x_embedder(x) + model.pos_embed
        blocks = [_Modulated(block, c) for block in model.blocks]
        ref = model.unpatchify(model.final_layer(package_blocks(blocks, tokens, topology, 4), c))
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


class _Modulated:
    """A DiT block whose sublayers get the block's adaLN modulation of ``c`` (what DiTBlock.forward hands them)."""

    def __init__(self, block, c):
        self.block, self.mod = block, block.adaLN_modulation(c)
        self.norm1, self.norm2, self.hc1, self.hc2 = block.norm1, block.norm2, block.hc1, block.hc2

    def sublayer1(self, h, ctx):
        return self.block.sublayer1(h, self.mod)

    def sublayer2(self, h, ctx):
        return self.block.sublayer2(h, self.mod)


def test_hyper_connection_init_is_the_papers():
    """HC's static init (Appendix of arXiv 2409.19606): sublayer k reads stream k mod n, the streams pass through
    (identity), every stream takes the output (beta = 1); the dynamic weights start at zero, their scales at 0.01."""
    model = timm.create_model("deit_tiny_hc_patch16_224", **SMALL)
    for l, block in enumerate(model.blocks):
        for i, hc in ((0, block.hc1), (1, block.hc2)):
            expected = torch.zeros(4)
            expected[(2 * l + i) % 4] = 1.0
            assert torch.equal(hc.static_alpha[:, 0], expected)
            assert torch.equal(hc.static_alpha[:, 1:], torch.eye(4))
            assert torch.equal(hc.static_beta, torch.ones(4))
            assert not hc.dynamic_alpha.any() and not hc.dynamic_beta.any()
            assert hc.alpha_scale.item() == pytest.approx(0.01) and torch.equal(hc.norm.weight, torch.ones(48))
    mhc = timm.create_model("deit_tiny_mhc_patch16_224", **SMALL).blocks[1].hc2
    assert mhc.pre_scale.item() == mhc.residual_scale.item() == pytest.approx(0.01)
    assert not hasattr(mhc, "alpha_scale")
    static = timm.create_model("deit_tiny_hc_patch16_224", hc_dynamic=False, **SMALL).blocks[0].hc1
    assert {n for n, _ in static.named_parameters()} == {"static_alpha", "static_beta"}


def test_sinkhorn_knopp_is_doubly_stochastic_and_the_packages():
    logits = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(3))
    m = sinkhorn_knopp(logits, 20)
    assert (m > 0).all()
    torch.testing.assert_close(m.sum(-1), torch.ones(5, 4), rtol=0, atol=1e-6)
    torch.testing.assert_close(m.sum(-2), torch.ones(5, 4), rtol=0, atol=1e-4)
    from hyper_connections.manifold_constrained_hyper_connections import sinkhorn_knopps

    torch.testing.assert_close(m, sinkhorn_knopps(logits, 20), rtol=0, atol=1e-6)


def test_the_dynamic_logits_product_and_its_gradients_equal_the_plain_product():
    """The logits' ``streams @ weight`` runs transposed, with a gradient of its own: equal to the plain product in
    value (1e-12) and gradients (gradcheck, float64), also for the first layer's expanded streams (stride 0)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(5, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    torch.testing.assert_close(few_column_product(x, weight), x @ weight, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(FewColumnProduct.apply, (x, weight))
    embedding = torch.randn(2, 3, 1, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    grad = torch.randn(2, 3, 4, 6, dtype=torch.float64, generator=gen)
    ours = torch.autograd.grad((FewColumnProduct.apply(embedding.expand(-1, -1, 4, -1), weight) * grad).sum(),
                               (embedding, weight))
    plain = torch.autograd.grad(((embedding.expand(-1, -1, 4, -1) @ weight) * grad).sum(), (embedding, weight))
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("topology, dynamic", [("hc", True), ("mhc", False)])  # per-token and shared coefficients
def test_the_compiled_elementwise_mixing_equals_the_eager_product(topology, dynamic):
    """Under torch.compile a connection mixes the streams elementwise (which inductor fuses);
    the eager product is the reference: the same sublayer input, mixed streams and gradients to 1e-5."""
    torch._dynamo.reset()
    connection = deit(topology, depth=1, hc_dynamic=dynamic).blocks[0].hc2
    streams = torch.randn(2, 5, 4, 48, generator=torch.Generator().manual_seed(5))
    results = []
    for mix in (connection, torch.compile(connection, fullgraph=True, backend="aot_eager")):
        leaf = streams.clone().requires_grad_()
        h, mixed, beta = mix(leaf)
        (h.sin().sum() + (mixed * beta.unsqueeze(-1)).cos().sum()).backward()
        results.append((h, mixed, leaf.grad))
    torch._dynamo.reset()
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- Attention Residuals against its equations


def rms_norm(v, weight, eps=1e-6):
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight


def depth_attention(sources, attn):
    """h = sum_i softmax_i(w . RMSNorm(v_i)) v_i (arXiv 2603.15031, Eq. 2-4), stacked as the paper's pseudo-code;
    one source has weight 1 whatever ``w`` (the first sublayer's input is the embedding)."""
    if len(sources) == 1:
        return sources[0]
    values = torch.stack(sources)                                    # (N, B, T, D)
    logits = torch.einsum("d,nbtd->nbt", attn.query, rms_norm(values, attn.key_weight))
    return torch.einsum("nbt,nbtd->btd", logits.softmax(0), values)


def attnres_reference(blocks, x, final, block_size=None, ctx_of=lambda block: None):
    """Full AttnRes (every sublayer output a source) or, with ``block_size`` transformer blocks per block, the
    paper's Block AttnRes pseudo-code: the block list and the partial sum, a new block before the attention
    sublayer of every ``block_size``-th transformer block."""
    if block_size is None:
        sources = [x]
        for block in blocks:
            for norm, attn, sublayer in ((block.norm1, block.depth_attn1, block.sublayer1),
                                         (block.norm2, block.depth_attn2, block.sublayer2)):
                sources.append(sublayer(norm(depth_attention(sources, attn)), ctx_of(block)))
        return depth_attention(sources, final)
    completed, partial = [], x
    for l, block in enumerate(blocks):
        h = depth_attention(completed + [partial], block.depth_attn1)
        if l % block_size == 0:
            completed, partial = completed + [partial], None
        out = block.sublayer1(block.norm1(h), ctx_of(block))
        partial = out if partial is None else partial + out
        h = depth_attention(completed + [partial], block.depth_attn2)
        partial = partial + block.sublayer2(block.norm2(h), ctx_of(block))
    return depth_attention(completed + [partial], final)


@pytest.mark.parametrize("topology,block_size", [("attnres", None), ("attnres_block", 1), ("attnres_block", 2)])
def test_deit_attnres_equals_the_equations(topology, block_size, images):
    kw = {} if block_size is None else {"attnres_block_size": block_size}
    model = deit(topology, **kw)
    with torch.no_grad():
        ours = model(images)
        h = attnres_reference(model.blocks, model._embed(images), model.norm.depth_attn, block_size)
        ref = model.forward_head(model.norm.norm_out(h))
    assert (ours - ref).abs().max().item() <= 1e-5
    sources = model.streams(model._embed(images))
    for block in model.blocks:
        sources = block(sources)
    sublayers = 2 * SMALL["depth"]
    assert len(sources) == 1 + (sublayers if block_size is None else math.ceil(SMALL["depth"] / block_size))


def test_dit_attnres_block_equals_the_equations(latents):
    model = dit("attnres_block", attnres_block_size=2)
    x, t, y = latents
    with torch.no_grad():
        ours = model(x, t, y)
        c = model.t_embedder(t) + model.y_embedder(y, False)
        tokens = model.x_embedder(x) + model.pos_embed
        h = attnres_reference(model.blocks, tokens, model.fusion.depth_attn, 2,
                              ctx_of=lambda block: block.adaLN_modulation(c))
        ref = model.unpatchify(model.final_layer(h, c))
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_attnres_init_reads_the_mean_of_the_sources():
    """The pseudo-queries start at zero (the paper's init), so every sublayer first reads the mean of its sources;
    the default block size keeps at most 8 blocks."""
    attn = DepthAttention(8)
    sources = [torch.randn(2, 3, 8) for _ in range(5)]
    torch.testing.assert_close(attn(sources), torch.stack(sources).mean(0), rtol=0, atol=1e-6)
    model = timm.create_model("deit_tiny_attnres_block_patch16_224", **{**SMALL, "depth": 12})
    assert [b.source_sublayers for b in model.blocks] == [4] * 12  # 2 blocks per AttnRes block: 6 blocks
    assert not any(b.depth_attn1.query.any() for b in model.blocks[1:]) and not model.norm.depth_attn.query.any()
    assert isinstance(model.blocks[0].depth_attn1, SoleSource)  # reads the embedding alone: nothing to learn
    assert DiT(**{**DIT_SMALL, "depth": 24}, topology="attnres_block").blocks[0].source_sublayers == 6


# ---------------------------------------------------------------- what every topology has


@pytest.mark.parametrize("topology", ["mhc", "attnres_block"])
def test_compiles_without_graph_breaks(topology, images):
    torch._dynamo.reset()
    model = deit(topology, depth=2)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(images), model(images), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("topology", ["hc", "attnres", "attnres_block"])
def test_weights_round_trip_and_gradients_reach_every_parameter(topology, images, tmp_path):
    model = deit(topology).train()
    model(images).logsumexp(-1).sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()] == []
    save_weights(model, tmp_path / "w.safetensors")
    other = timm.create_model(f"deit_tiny_{topology}_patch16_224", **SMALL).eval()
    load_weights(other, tmp_path / "w.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(other(images), model.eval()(images), rtol=0, atol=0)


def test_dit_starts_at_zero_output_for_every_new_topology(latents):
    """adaLN-Zero: every block adds nothing at init, whatever the wiring."""
    x, t, y = latents
    for topology in ("hc", "mhc", "attnres", "attnres_block"):
        torch.manual_seed(0)
        out = DiT(**DIT_SMALL, topology=topology).eval()(x, t, y)
        assert torch.equal(out, torch.zeros_like(out)), topology


def test_a_block_size_below_one_is_refused():
    with pytest.raises(ValueError, match="attnres_block_size=0 must be at least 1"):
        timm.create_model("deit_tiny_attnres_block_patch16_224", attnres_block_size=0, **SMALL)
