"""The topology registry: every list derives from it, an option a topology does not read is refused (not silently
ignored), and a new topology is one block class plus one registration, which both families then build."""
import pytest
import timm
import torch

import vision  # noqa: F401  (registers our DeiTs with timm)
from common.cli import InputError
from common.plots import TOPOLOGY_COLORS
from common.topologies import TOPOLOGIES, ResidualBlock, Topology, register, resolve_topology, topology_names
from common.topologies.base import default_norm
from diffusion.models import DIT_TOPOLOGIES, DiT
from diffusion.spec import check_dit_arguments
from tests.test_deit import SMALL
from vision.deit import MODEL_NAMES, MODEL_TOPOLOGIES, check_model_kwargs

DIT_SMALL = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=3, num_heads=4, num_classes=10)


def test_every_list_of_topologies_is_the_registry():
    assert MODEL_TOPOLOGIES == topology_names("deit") == tuple(t for t in TOPOLOGIES if "deit" in TOPOLOGIES[t].families)
    assert DIT_TOPOLOGIES == topology_names("dit") == tuple(t for t in TOPOLOGIES if "dit" in TOPOLOGIES[t].families)
    assert set(TOPOLOGY_COLORS) == set(TOPOLOGIES)
    registered = {name.split("_", 2)[2].removesuffix("_patch16_224").removesuffix("_distilled") for name in MODEL_NAMES}
    assert registered == set(MODEL_TOPOLOGIES) - {"pre"}  # Pre-Norm DeiT is timm's own
    assert {"sandwich", "layerscale", "dyt"} == set(MODEL_TOPOLOGIES) - set(DIT_TOPOLOGIES)
    assert {"dar", "siamese_dar"} == set(DIT_TOPOLOGIES) - set(MODEL_TOPOLOGIES)


def test_an_option_of_another_topology_is_refused_naming_its_topologies():
    with pytest.raises(InputError, match=r"the siamese topology has no option hc_streams \(hc_streams is an option of "
                                         r"hc, mhc\); its options: normalized_input, depth_scaling, recompute_norms"):
        timm.create_model("deit_tiny_siamese_patch16_224", hc_streams=2, **SMALL)
    with pytest.raises(InputError, match="the pre topology has no option mhc_sinkhorn_iters"):
        DiT(**DIT_SMALL, topology="pre", mhc_sinkhorn_iters=3)
    with pytest.raises(InputError, match="model.kwargs: the hc topology has no option mhc_sinkhorn_iters"):
        check_model_kwargs("deit_tiny_hc_patch16_224", {"mhc_sinkhorn_iters": 3})
    with pytest.raises(InputError, match="model.kwargs: the siamese topology has no option hc_streams"):
        check_dit_arguments("DiT-S/2", "siamese", 0.1, {"hc_streams": 2})
    with pytest.raises(InputError, match="mixln_post_blocks=13 must lie in"):  # checked for the depth the model gets
        check_model_kwargs("deit_tiny_mixln_patch16_224", {"mixln_post_blocks": 13})
    with pytest.raises(InputError, match="the sandwich topology is not offered for DiT"):
        resolve_topology("sandwich", 4, "dit")
    with pytest.raises(InputError, match=r"unknown residual topology 'siamse' \(did you mean 'siamese'\?\)"):
        resolve_topology("siamse", 4)
    check_model_kwargs("deit_tiny_hc_patch16_224", {"hc_streams": 2, "topology": "mhc", "mhc_sinkhorn_iters": 3})


def test_options_take_their_one_default():
    plan = resolve_topology("mhc", 8)
    assert plan.options == {"hc_streams": 4, "hc_dynamic": True, "mhc_sinkhorn_iters": 20}
    block = DiT(**DIT_SMALL, topology="mhc").blocks[0]
    assert (block.hc1.streams, block.hc1.dynamic, block.hc1.sinkhorn_iters) == (4, True, 20)
    assert resolve_topology("attnres_block", 24).blocks[0][1] == {"source_sublayers": 6}  # ceil(24 / 8) blocks
    assert resolve_topology("mixln", 12).block_topologies == ["post"] * 3 + ["pre"] * 9


class ScaledPreNormBlock(ResidualBlock):
    """A topology the tests define: ``Y <- Y + s F(LN(Y))``."""

    topology = "scaled_pre"

    def __init__(self, dim, layer_index=0, *, scale, norm_layer=default_norm, input_norm_layer=None, drop_path=0.0):
        super().__init__(dim, layer_index, drop_path=drop_path)
        self.scale = scale
        self.norm1 = (input_norm_layer or norm_layer)(dim)
        self.norm2 = (input_norm_layer or norm_layer)(dim)

    def forward(self, y, ctx=None):
        y = y + self.scale * self.sublayer1(self.norm1(y), ctx)
        return y + self.scale * self.sublayer2(self.norm2(y), ctx)


@pytest.fixture
def scaled_pre():
    """One registration, nothing else: both families build it and the model checks know its option."""
    register(Topology("scaled_pre", "Pre-Norm with scaled updates", color="black", options={"update_scale": 0.5},
                      blocks=lambda depth, o: [(ScaledPreNormBlock, {"scale": o["update_scale"]})] * depth))
    yield
    del TOPOLOGIES["scaled_pre"]


def test_a_new_topology_is_one_registration(scaled_pre, images, latents):
    assert "scaled_pre" in topology_names("deit") and "scaled_pre" in topology_names("dit")
    torch.manual_seed(0)
    pre = timm.create_model("deit_tiny_patch16_224", **SMALL).eval()
    one = timm.create_model("deit_tiny_siamese_patch16_224", topology="scaled_pre", update_scale=1.0, **SMALL).eval()
    half = timm.create_model("deit_tiny_siamese_patch16_224", topology="scaled_pre", **SMALL).eval()
    one.load_state_dict(pre.state_dict())  # Pre-Norm's keys
    half.load_state_dict(pre.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(one(images), pre(images), rtol=0, atol=0)
        assert not torch.allclose(half(images), pre(images))
    dit = DiT(**DIT_SMALL, topology="scaled_pre", update_scale=0.25)
    assert [b.scale for b in dit.blocks] == [0.25] * 3 and dit(*latents).shape == (4, 8, 8, 8)
    check_dit_arguments("DiT-S/2", "scaled_pre", 0.1, {"update_scale": 2.0})
