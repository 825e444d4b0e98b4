"""Our DeiTs through timm's feature API: what an intermediate of a two-stream model is, features_only,
attention masks, TorchScript and FX."""
import pytest
import timm
import torch
from timm.models import get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import create_feature_extractor

import vision  # noqa: F401  (registers our models)
from tests.test_deit import SMALL, randomize_

TOPOLOGIES = ["siamese", "residual", "post", "mixln", "sandwich", "deepnorm", "layerscale", "dyt", "hc", "mhc",
              "attnres", "attnres_block"]


def model(name, **kw):
    torch.manual_seed(0)
    return randomize_(timm.create_model(f"deit_tiny_{name}_patch16_224", **{**SMALL, **kw})).eval()


@pytest.fixture
def images():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("topology", ["siamese", "residual", "mixln", "hc", "attnres"])
def test_an_intermediate_is_what_the_head_reads_of_the_network_cut_there(topology, images):
    """Intermediate ``l`` with ``norm=True`` equals the features of the same network cut after block ``l``;
    without ``norm`` it lacks only the final norm (SiameseNorm's LN_out), as the model pruned with prune_norm."""
    full = model(topology)
    with torch.no_grad():
        final, normed = full.forward_intermediates(images, norm=True, output_fmt="NLC", return_prefix_tokens=True)
        raw = full.forward_intermediates(images, output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True)
        torch.testing.assert_close(final, full.forward_features(images), rtol=0, atol=0)
        for layer in range(SMALL["depth"]):
            for norm, taps in ((True, normed), (False, raw)):
                cut = model(topology)
                cut.prune_intermediate_layers([layer], prune_norm=not norm, prune_head=False)
                features = cut.forward_features(images)
                spatial, prefix = taps[layer]
                torch.testing.assert_close(torch.cat([prefix, spatial], 1), features, rtol=0, atol=0)
                assert len(cut.blocks) == layer + 1
    if topology == "siamese":  # the readout is LN_out(LN_x(X) + LN_y(Y)), not one of the streams
        x, y = full.blocks[0]((full._embed(images),) * 2)
        fusion = full.norm
        torch.testing.assert_close(torch.cat([raw[0][1], raw[0][0]], 1), fusion.norm_x(x) + fusion.norm_y(y))
    if topology == "hc":  # the readout of n streams is their sum
        streams = full.blocks[0](full.streams(full._embed(images)))
        torch.testing.assert_close(torch.cat([raw[0][1], raw[0][0]], 1), streams.sum(2))


def test_single_stream_intermediates_are_timms(images):
    """Pre-Norm built here and timm's own DeiT with the same weights give the same intermediates."""
    ours = model("siamese", topology="pre")
    reference = timm.create_model("deit_tiny_patch16_224", **SMALL).eval()
    reference.load_state_dict(ours.state_dict())
    with torch.no_grad():
        for kw in (dict(norm=True), dict(indices=2, stop_early=True), dict(output_fmt="NLC", return_prefix_tokens=True)):
            out, taps = ours.forward_intermediates(images, **kw)
            ref_out, ref_taps = reference.forward_intermediates(images, **kw)
            torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
            for a, b in zip(taps, ref_taps):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("topology", ["siamese", "post"])
def test_features_only_returns_the_intermediates(topology, images):
    torch.manual_seed(0)
    features = timm.create_model(f"deit_tiny_{topology}_patch16_224", features_only=True, out_indices=(1, 3),
                                 **SMALL).eval()
    full = model(topology)
    loaded = features.model.load_state_dict(full.state_dict(), strict=False)  # features_only drops the head
    assert loaded.missing_keys == [] and all(k.startswith(("head.", "norm.norm_out.")) for k in loaded.unexpected_keys)
    with torch.no_grad():
        got = features(images)
        expected = full.forward_intermediates(images, indices=[1, 3], intermediates_only=True)
    assert features.feature_info.channels() == [SMALL["embed_dim"]] * 2
    assert [tuple(t.shape) for t in got] == [(2, SMALL["embed_dim"], 8, 8)] * 2
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_token_no_query_attends_to_changes_no_other_token(topology, images):
    net = model(topology)
    tokens = 1 + (32 // 4) ** 2
    mask = torch.ones(tokens, tokens, dtype=torch.bool)
    mask[:, -1] = False  # no token reads the last patch
    mask[-1, -1] = True
    other = images.clone()
    other[:, :, -4:, -4:] += 1.0  # the last patch only
    with torch.no_grad():
        a = net.forward_features(images, attn_mask=mask)
        b = net.forward_features(other, attn_mask=mask)
        unmasked = net.forward_features(images)
        torch.testing.assert_close(net.forward_features(images, attn_mask=torch.ones_like(mask)), unmasked)
    torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=0, atol=1e-6)
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-3
    assert (a - unmasked).abs().max() > 1e-4


def test_is_causal_is_the_lower_triangular_mask(images):
    net = model("siamese")
    tril = torch.ones(65, 65, dtype=torch.bool).tril()
    with torch.no_grad():
        torch.testing.assert_close(net(images, is_causal=True), net(images, attn_mask=tril), rtol=0, atol=0)
        _, taps = net.forward_intermediates(images, is_causal=True)
        _, masked = net.forward_intermediates(images, attn_mask=tril)
    torch.testing.assert_close(taps[-1], masked[-1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="exclude each other"):
        net(images, attn_mask=tril, is_causal=True)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # timm's contract still has it
@pytest.mark.parametrize("topology", ["siamese", "residual", "mixln", "mhc", "attnres_block"])
def test_torchscript_and_fx_equal_eager(topology, images):
    net = model(topology)
    with torch.no_grad():
        expected = net(images)
        torch.testing.assert_close(torch.jit.script(net)(images), expected, rtol=1e-5, atol=1e-6)
        tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
        fx = create_feature_extractor(net, return_nodes={"head": "out"}, tracer_kwargs=tracer_kwargs)
        torch.testing.assert_close(fx(images)["out"], expected, rtol=1e-5, atol=1e-6)
    # backward through the traced graph: the same gradients as eager (timm's test_model_backward_fx in small)
    eager, traced = dict(net.named_parameters()), dict(fx.named_parameters())
    assert traced.keys() == eager.keys()
    names = sorted(traced)
    eager_grads = torch.autograd.grad(net(images).square().sum(), [eager[n] for n in names], allow_unused=True)
    traced_grads = torch.autograd.grad(fx(images)["out"].square().sum(), [traced[n] for n in names],
                                       allow_unused=True)
    for name, e, t in zip(names, eager_grads, traced_grads):
        assert (e is None) == (t is None), name
        if e is not None:
            torch.testing.assert_close(t, e, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("topology", ["pre", *TOPOLOGIES])
def test_torch_export_equals_eager(topology, images):
    """torch.export, what torch 2.14 names in place of the deprecated TorchScript: every topology exports whole (no
    python fallback exists in an exported program) and it gives eager's logits."""
    net = randomize_(timm.create_model("deit_tiny_patch16_224", **SMALL)).eval() if topology == "pre" else model(topology)
    with torch.no_grad():
        exported = torch.export.export(net, (images,))
        torch.testing.assert_close(exported.module()(images), net(images), rtol=1e-5, atol=1e-6)
