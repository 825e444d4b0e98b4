"""common.diagnostics against hand computations on tiny models."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vision  # noqa: F401
from common.diagnostics import (grad_norm_trace, hidden_state_norms, layer_removal, stream_contribution,
                                write_diagnostic)
from vision.deit import SiameseNormVisionTransformer


def tiny_deit(topology: str, depth: int = 3) -> SiameseNormVisionTransformer:
    torch.manual_seed(0)
    return SiameseNormVisionTransformer(topology=topology, img_size=28, patch_size=7, embed_dim=16, depth=depth,
                                        num_heads=2, num_classes=4).eval()


def embed(model, images):
    return model.norm_pre(model._pos_embed(model.patch_embed(images)))


def token_norm(t):
    return float(t.norm(dim=-1).mean())


def named_streams(topology, state):
    """The test's own naming of a state's streams (docs/models.md)."""
    if topology == "siamese":
        return {"x": state[0], "y": state[1]}
    if topology == "hc":
        return {f"s{i}": state[:, :, i] for i in range(state.shape[2])}
    if topology == "attnres":
        return {"v": state[-1]}
    return {"h": state}


@pytest.mark.parametrize("topology", ["siamese", "pre", "post", "hc", "attnres"])
def test_hidden_state_norms_match_a_hand_loop(topology):
    model = tiny_deit(topology)
    images = torch.randn(5, 3, 28, 28)
    found = hidden_state_norms(model, images)
    state = model.streams(embed(model, images))
    expected = {}
    with torch.no_grad():
        for i in range(len(model.blocks) + 1):
            if i:
                state = model.blocks[i - 1](state)
            streams = named_streams(topology, state)
            for name, t in streams.items():
                expected.setdefault(name, []).append(token_norm(t))
    assert found["layers"] == [0, 1, 2, 3]
    assert found["norms"].keys() == expected.keys()
    for name in expected:
        assert found["norms"][name] == pytest.approx(expected[name], rel=1e-5)
    if topology == "post":  # a LayerNorm with unit weight, zero bias: every token has norm sqrt(dim)
        assert found["norms"]["h"][1:] == pytest.approx([4.0] * 3, rel=1e-3)


class Doubler(nn.Module):
    def forward(self, x):
        return 2 * x


def test_hidden_state_norms_of_doubling_blocks():
    model = nn.Module()
    model.blocks = nn.Sequential(Doubler(), Doubler())
    model.forward = lambda x: model.blocks(x)
    x = torch.tensor([[[3.0, 4.0], [0.0, 1.0]]])  # token norms 5 and 1 -> mean 3
    assert hidden_state_norms(model, x)["norms"]["h"] == pytest.approx([3.0, 6.0, 12.0])


def ce_on(images, labels):
    return lambda m: {"loss": float(F.cross_entropy(m(images), labels)), "top1": float((m(images).argmax(1) == labels).float().mean())}


def test_layer_removal_of_identity_blocks_changes_nothing():
    model = tiny_deit("pre")
    model.blocks = nn.Sequential(*[nn.Identity() for _ in range(3)])
    images, labels = torch.randn(6, 3, 28, 28), torch.tensor([0, 1, 2, 3, 0, 1])
    r = layer_removal(model, ce_on(images, labels))
    assert r["loss_increase"] == [0.0, 0.0, 0.0]
    assert r["removed_loss"] == [r["intact_loss"]] * 3
    assert r["removed_top1"] == [r["intact_top1"]] * 3


@pytest.mark.parametrize("topology", ["siamese", "pre", "hc", "attnres_block"])
def test_layer_removal_equals_skipping_the_block_by_hand(topology):
    model = tiny_deit(topology)
    images, labels = torch.randn(6, 3, 28, 28), torch.tensor([0, 1, 2, 3, 0, 1])
    r = layer_removal(model, lambda m: float(F.cross_entropy(m(images), labels)))
    with torch.no_grad():
        intact = float(F.cross_entropy(model(images), labels))
        for dropped in range(3):
            state = model.streams(embed(model, images))
            for i, block in enumerate(model.blocks):
                if i != dropped:
                    state = block(state)
            loss = float(F.cross_entropy(model.head(model.norm(state)[:, 0]), labels))
            assert r["removed_loss"][dropped] == pytest.approx(loss, rel=1e-5)
            assert r["loss_increase"][dropped] == pytest.approx(loss - intact, abs=1e-5)
    assert r["intact_loss"] == pytest.approx(intact, rel=1e-6)
    assert any(abs(d) > 1e-4 for d in r["loss_increase"])  # the hooks were really removed and really applied
    with torch.no_grad():  # the hooks are gone again
        assert float(F.cross_entropy(model(images), labels)) == pytest.approx(intact, rel=1e-6)


def test_stream_contribution_reads_the_fusion_norm_scales():
    model = tiny_deit("siamese")
    with torch.no_grad():
        model.blocks[1].post_norm2.weight.copy_(torch.tensor([2.0, -4.0] * 8))  # mean |w| = 3
        model.blocks[2].pre_norm1.weight.fill_(-0.5)
        model.norm.norm_y.weight.copy_(torch.arange(16.0) - 8)  # mean |w| = 64 / 16
    r = stream_contribution(model)
    assert r["layers"] == [0, 1, 2]
    assert r["x_scale"] == [[1.0, 1.0], [1.0, 3.0], [1.0, 1.0]]
    assert r["y_scale"] == [[1.0, 1.0], [1.0, 1.0], [0.5, 1.0]]
    assert r["output_x_scale"] == 1.0 and r["output_y_scale"] == 4.0
    with pytest.raises(ValueError, match="only defined for topology=siamese"):
        stream_contribution(tiny_deit("pre"))


def test_grad_norm_trace_reads_the_metrics_file(tmp_path):
    lines = [{"step": 0, "params": 10}, {"step": 5, "train/loss": 2.0, "train/grad_norm": 1.5},
             {"step": 10, "train/loss": "nan", "train/grad_norm": "inf"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    r = grad_norm_trace(tmp_path)
    assert r["steps"] == [5, 10] and r["grad_norm"][0] == 1.5 and math.isinf(r["grad_norm"][1])
    assert r["loss"][0] == 2.0 and math.isnan(r["loss"][1])
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="does not log gradient norms"):
        grad_norm_trace(tmp_path)


def test_write_diagnostic_writes_json_and_png(tmp_path):
    model = tiny_deit("siamese")
    images = torch.randn(2, 3, 28, 28)
    results = {
        "hidden_state_norms": {"siamese": hidden_state_norms(model, images)},
        "layer_removal": {"siamese": layer_removal(model, lambda m: float(m(images).square().mean()))},
        "stream_contribution": {"siamese": stream_contribution(model)},
        "grad_norm": {"a": {"steps": [1, 2], "grad_norm": [1.0, float("inf")], "loss": [1.0, 2.0]}},
    }
    for kind, r in results.items():
        png = write_diagnostic(kind, r, tmp_path, title="tiny")
        assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
        assert json.loads((tmp_path / f"{kind}.json").read_text()).keys() == r.keys()
    with pytest.raises(ValueError, match="unknown diagnostic"):
        write_diagnostic("nope", {}, tmp_path)


def test_a_gradient_norm_of_one_logged_point_is_drawn(tmp_path):
    import numpy as np
    from PIL import Image

    write_diagnostic("grad_norm", {"pre": {"steps": [4], "grad_norm": [0.7], "loss": [1.0]}}, tmp_path)
    pixels = np.asarray(Image.open(tmp_path / "grad_norm.png").convert("RGB")).reshape(-1, 3).astype(int)
    coloured = (pixels.max(1) - pixels.min(1) > 60).sum()  # anything not grey: the dot and the legend swatch
    assert coloured > 60, coloured
