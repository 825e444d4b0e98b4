"""DeiT on the shared residual block: equality with timm, with the docs/method.md re-statement, and its invariants."""
import math

import pytest
import timm
import torch

import vision  # noqa: F401  (registers our models)
from common.checkpoint import load_weights
from common.topologies import ResidualBlock, resolve_topology
from tests.deit_reference import siamese_deit_forward

SMALL = dict(img_size=32, patch_size=4, num_classes=10, embed_dim=48, depth=4, num_heads=3)
TOP_MAP = {"norm.norm_x.": "pre_norm.", "norm.norm_y.": "post_norm.", "norm.norm_out.": "final_norm."}


def to_public_layout(state_dict):
    """Our Siamese DeiT keys -> the public file's keys (the test's own statement of the naming quirk)."""
    out = {}
    for k, v in state_dict.items():
        for ours, theirs in TOP_MAP.items():
            if k.startswith(ours):
                k = theirs + k[len(ours):]
        out[k] = v
    return out


def randomize_(model, seed=0):
    """Move every parameter off its init so that swapped or skipped norms change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture
def images():
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_pre_topology_equals_timm_deit(size, images):
    torch.manual_seed(0)
    kw = dict(img_size=32, patch_size=4, num_classes=10)
    reference = timm.create_model(f"deit_{size}_patch16_224", **kw).eval()
    ours = timm.create_model(f"deit_{size}_siamese_patch16_224", topology="pre", **kw).eval()
    randomize_(reference)
    load_weights(ours, reference.state_dict())
    assert sorted(ours.state_dict()) == sorted(reference.state_dict())
    with torch.no_grad():
        diff = (ours(images) - reference(images)).abs().max().item()
    assert diff <= 1e-6


@pytest.mark.parametrize("normalized_input", [True, False])
@pytest.mark.parametrize("depth_scaling", [True, False])
def test_siamese_equals_functional_restatement(normalized_input, depth_scaling, images):
    model = timm.create_model(
        "deit_tiny_siamese_patch16_224", normalized_input=normalized_input, depth_scaling=depth_scaling, **SMALL
    ).eval()
    randomize_(model)
    public = to_public_layout(model.state_dict())
    with torch.no_grad():
        ours = model(images)
        ref = siamese_deit_forward(
            public, images, depth=4, num_heads=3, patch_size=4,
            normalized_input=normalized_input, depth_scaling=depth_scaling,
        )
    assert (ours - ref).abs().max().item() <= 1e-5
    # The ablations are real switches: each changes the function.
    if normalized_input and depth_scaling:
        with torch.no_grad():
            other = siamese_deit_forward(public, images, depth=4, num_heads=3, patch_size=4, depth_scaling=False)
        assert (ours - other).abs().max().item() > 1e-3


def test_depth_scale_per_block():
    model = timm.create_model("deit_tiny_siamese_patch16_224", **SMALL)
    assert [b.depth_scale for b in model.blocks] == pytest.approx([math.sqrt(2 * (l + 1)) for l in range(4)])
    off = timm.create_model("deit_tiny_siamese_patch16_224", depth_scaling=False, **SMALL)
    assert [b.depth_scale for b in off.blocks] == [1.0] * 4


def test_block_indices_come_from_timm():
    """timm (>= 1.0.23) passes each block its index; it sets the depth scale and the Mix-LN topology."""
    siamese = timm.create_model("deit_tiny_siamese_patch16_224", **{**SMALL, "depth": 6})
    assert [b.layer_index for b in siamese.blocks] == list(range(6))
    assert [b.depth_scale for b in siamese.blocks] == pytest.approx([math.sqrt(2 * (l + 1)) for l in range(6)])
    mixln = timm.create_model("deit_tiny_mixln_patch16_224", **{**SMALL, "depth": 8})
    assert [b.topology for b in mixln.blocks] == ["post"] * 2 + ["pre"] * 6


class OneSublayer(ResidualBlock):
    """A block whose first sublayer is a linear map and whose second adds nothing."""

    def __init__(self, dim, layer_index=0, **kwargs):
        super().__init__(dim, layer_index, **kwargs)
        self.linear = torch.nn.Linear(dim, dim)

    def sublayer1(self, h, ctx):
        return self.linear(h)

    def sublayer2(self, h, ctx):
        return torch.zeros_like(h)


def test_both_streams_receive_the_same_droppath_mask():
    torch.manual_seed(0)
    block = resolve_topology("siamese", 3).build_block(OneSublayer, 2, 16, layer_index=2, drop_path=0.5).train()
    x, y = torch.randn(64, 5, 16), torch.randn(64, 5, 16)
    after_first = []  # X after the first sublayer is what LN_post of the second reads
    block.post_norm2.register_forward_hook(lambda m, args, out: after_first.append(args[0]))
    _, new_y = block((x, y))
    z_x = (after_first[0] - block.post_norm1(x)) * block.depth_scale
    z_y = new_y - y
    torch.testing.assert_close(z_x, z_y, rtol=1e-5, atol=1e-5)
    dropped = z_y.flatten(1).abs().sum(1) == 0
    assert 0 < dropped.sum() < 64  # some samples dropped, some kept: the mask really was drawn


def test_init_norms_and_parameter_overhead():
    pre = timm.create_model("deit_tiny_patch16_224")
    siamese = timm.create_model("deit_tiny_siamese_patch16_224")
    for name, p in siamese.named_parameters():
        if "norm" in name:
            expected = 1.0 if name.endswith("weight") else 0.0
            assert torch.all(p == expected), name
    n_pre = sum(p.numel() for p in pre.parameters())
    n_siamese = sum(p.numel() for p in siamese.parameters())
    assert n_siamese - n_pre == 19_200
    assert n_pre == 5_717_416  # DeiT-T, 5.7M


@pytest.mark.parametrize("topology", ["siamese", "post", "mixln", "pre"])
def test_gradients_reach_every_parameter(topology, images):
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_siamese_patch16_224", topology=topology, **SMALL)
    randomize_(model)
    loss = model(images).logsumexp(-1).sum()
    loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert dead == []


def test_mixln_block_topologies():
    model = timm.create_model("deit_tiny_mixln_patch16_224", **{**SMALL, "depth": 8})
    assert [b.topology for b in model.blocks] == ["post"] * 2 + ["pre"] * 6
    assert resolve_topology("mixln", 8, mixln_post_blocks=3).block_topologies == ["post"] * 3 + ["pre"] * 5
    post = timm.create_model("deit_tiny_post_patch16_224", **SMALL)
    assert isinstance(post.norm, torch.nn.Identity)  # a Post-Norm stream is already normalised


def test_timm_keyword_overrides_and_unknown_topology():
    model = timm.create_model(
        "deit_small_siamese_patch16_224", img_size=64, patch_size=8, num_classes=7, embed_dim=96, depth=3,
        num_heads=2, drop_path_rate=0.1,
    )
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 7)
    assert len(model.blocks) == 3 and model.blocks[2].drop_path.drop_prob == pytest.approx(0.1)
    with pytest.raises(ValueError, match="valid topologies are pre, post, siamese, mixln, residual"):
        timm.create_model("deit_tiny_siamese_patch16_224", topology="bogus", **SMALL)


@pytest.mark.parametrize("topology", ["siamese", "post"])
def test_gradient_checkpointing_gives_same_gradients(topology, images):
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_siamese_patch16_224", topology=topology, **SMALL).train()
    grads = []
    for enable in (False, True):
        model.zero_grad()
        model.set_grad_checkpointing(enable)
        model(images).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiles_without_graph_breaks(images):
    """fullgraph=True fails on any graph break; aot_eager keeps the test fast on CPU."""
    torch._dynamo.reset()
    model = timm.create_model("deit_tiny_siamese_patch16_224", **{**SMALL, "depth": 2}).eval()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(images), model(images), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("topology", ["residual", "sandwich", "deepnorm", "layerscale", "dyt", "post", "pre"])
def test_baseline_topologies_equal_their_restatement(topology, images):
    from tests.deit_reference import baseline_deit_forward

    model = timm.create_model(f"deit_tiny_{topology}_patch16_224" if topology != "pre" else "deit_tiny_patch16_224",
                              **SMALL).eval()
    randomize_(model)
    with torch.no_grad():
        ours = model(images)
        ref = baseline_deit_forward(model.state_dict(), images, topology, depth=4, num_heads=3, patch_size=4)
    assert (ours - ref).abs().max().item() <= 1e-5


def test_baseline_inits():
    ls = timm.create_model("deit_tiny_layerscale_patch16_224", **SMALL)
    assert torch.all(ls.blocks[0].ls1.gamma == 1e-5)
    deep = timm.create_model("deit_tiny_deepnorm_patch16_224", **SMALL)
    assert deep.blocks[0].residual_scale == pytest.approx(8 ** 0.25)
    torch.manual_seed(0)
    pre = timm.create_model("deit_tiny_post_patch16_224", **SMALL)
    torch.manual_seed(0)
    deep = timm.create_model("deit_tiny_deepnorm_patch16_224", **SMALL)
    beta = 32 ** -0.25
    torch.testing.assert_close(deep.blocks[1].mlp.fc2.weight, beta * pre.blocks[1].mlp.fc2.weight)
    torch.testing.assert_close(deep.blocks[1].attn.qkv.weight[:96], pre.blocks[1].attn.qkv.weight[:96])  # q, k kept
    torch.testing.assert_close(deep.blocks[1].attn.qkv.weight[96:], beta * pre.blocks[1].attn.qkv.weight[96:])
    dyt = timm.create_model("deit_tiny_dyt_patch16_224", **SMALL)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in dyt.modules())
    assert torch.all(dyt.blocks[0].norm1.alpha == 0.5)
