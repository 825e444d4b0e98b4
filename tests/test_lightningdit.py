"""LightningDiT's backbone switches on our DiT: a state dict in LightningDiT's own layout loads into our Pre-Norm model
and computes LightningDiT's forward (a re-statement, 1e-5) for each switch; every switch composes with every
topology."""
import pytest
import torch

from common.checkpoint import load_weights
from diffusion.models import DIT_CONFIGS, DIT_TOPOLOGIES, DiT_models
from diffusion.spec import DiTSpec
from tests.lightningdit_reference import lightningdit_forward, rope_tables
from tests.test_deit import randomize_

SMALL = dict(depth=2, hidden_size=64, num_heads=4, input_size=8, in_channels=4, num_classes=10)
# ours -> LightningDiT's keyword
SWITCHES = {"norm": "use_rmsnorm", "mlp": "use_swiglu", "rope": "use_rope", "qk_norm": "use_qknorm",
            "wo_shift": "wo_shift"}
PUBLISHED = dict(norm="rmsnorm", mlp="swiglu", rope=True, qk_norm=False, wo_shift=False)
CASES = {"published": PUBLISHED, "all": dict(PUBLISHED, qk_norm=True, wo_shift=True),
         "layernorm_qk": dict(PUBLISHED, norm="layernorm", qk_norm=True), "none": dict(norm="layernorm", mlp="gelu",
                                                                                      rope=False)}


def lightningdit_layout(state_dict, switches, head_dim, grid):
    """Our keys -> LightningDiT's: its SwiGLU's ``w12``/``w3``, and the rotary tables its checkpoints carry."""
    out = {}
    for k, v in state_dict.items():
        if switches.get("mlp") == "swiglu":
            k = k.replace(".mlp.fc1.", ".mlp.w12.").replace(".mlp.fc2.", ".mlp.w3.")
        out[k] = v
    if switches.get("rope"):
        out["feat_rope.freqs_cos"], out["feat_rope.freqs_sin"] = rope_tables(head_dim, grid)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("learn_sigma", [False, True])
def test_a_lightningdit_state_dict_computes_lightningdits_forward(case, learn_sigma, latents):
    switches = CASES[case]
    torch.manual_seed(0)
    source = randomize_(DiT_models["LightningDiT-B/2"](**SMALL, learn_sigma=learn_sigma, **switches))
    theirs = lightningdit_layout(source.state_dict(), switches, 16, 4)
    model = DiT_models["LightningDiT-B/2"](**SMALL, learn_sigma=learn_sigma, **switches).eval()
    load_weights(model, theirs)  # strict: every key of LightningDiT's layout has its place
    x, t, y = latents
    flags = {SWITCHES[k]: (v == "rmsnorm" if k == "norm" else v == "swiglu" if k == "mlp" else v)
             for k, v in {**dict(qk_norm=False, wo_shift=False), **switches}.items()}
    with torch.no_grad():
        ours = model(x, t, y)
        ref = lightningdit_forward(theirs, x, t, y, num_heads=4, patch_size=2, learn_sigma=learn_sigma, **flags)
    torch.testing.assert_close(ours[:, :4], ref, rtol=0, atol=1e-5)


def test_the_published_models_are_lightningdits():
    config = DIT_CONFIGS["LightningDiT-XL/1"]
    assert (config["depth"], config["hidden_size"], config["num_heads"], config["patch_size"]) == (28, 1152, 16, 1)
    model = DiT_models["LightningDiT-B/1"](depth=1)
    assert (model.in_channels, model.learn_sigma, model.input_size, model.patch_size) == (32, False, 16, 1)
    assert model.blocks[0].mlp.fc1.out_features == 2 * 2048  # int(2/3 * 4 * 768), both halves in one map
    assert type(model.blocks[0].norm1).__name__ == "RMSNorm" and model.rope is not None
    spec = DiTSpec.published("LightningDiT-XL/1")  # what a plain LightningDiT state dict is read as
    assert (spec.learn_sigma, spec.in_channels, spec.input_size) == (False, 32, 16)
    assert {k: spec.dit_kwargs()[k] for k in ("norm", "mlp", "rope")} == dict(norm="rmsnorm", mlp="swiglu", rope=True)


@pytest.mark.parametrize("topology", DIT_TOPOLOGIES)
@pytest.mark.parametrize("switch", [dict(norm="rmsnorm"), dict(mlp="swiglu"), dict(rope=True), dict(qk_norm=True),
                                    dict(wo_shift=True)], ids=lambda s: next(iter(s)))
def test_every_switch_composes_with_every_topology(topology, switch, latents):
    """A training step of the pair lowers the loss on its batch, and every parameter gets a gradient."""
    torch.manual_seed(0)
    model = randomize_(DiT_models["DiT-S/2"](**{**SMALL, "depth": 2}, topology=topology, **switch), seed=1)
    x, t, y = latents
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        loss = model(x, t, y).square().mean()
        optimizer.zero_grad()
        loss.backward()
        losses.append(loss.item())
        dead = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
        optimizer.step()
    assert losses[1] < losses[0] and not dead, dead
