"""diffusion.repa against a re-statement of REPA's projector and loss (tests/sit_reference.py), the hidden state
it aligns for each topology, and the frozen encoder read from a DINOv2 weights file."""
import pytest
import torch

from diffusion.checkpoints import load_dit
from diffusion.models import DiT
from diffusion.repa import FrozenEncoder, RepaDiT, alignment_loss, projector
from tests import sit_reference as ref

torch.set_num_threads(1)


def test_projector_and_loss_equal_repas():
    torch.manual_seed(0)
    mlp = projector(32, 48, 24)
    hidden = torch.randn(3, 16, 32)
    weights = {k: v for k, v in mlp.state_dict().items()}
    assert sorted(weights) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]  # REPA's Sequential
    projected = mlp(hidden)
    torch.testing.assert_close(projected, ref.repa_projector_forward(weights, hidden), rtol=1e-6, atol=1e-6)
    features = torch.randn(3, 16, 24)
    ours = alignment_loss(features, projected)
    assert ours.shape == (3,) and (ours.abs() > 0).all()
    want = ref.repa_projection_loss([features], [projected])
    torch.testing.assert_close(ours.mean(), want, rtol=1e-6, atol=0)
    # aligned tokens reach the minimum -1
    torch.testing.assert_close(alignment_loss(features, 3 * features), torch.full((3,), -1.0))


@pytest.mark.parametrize("topology", ["pre", "siamese", "post", "hc", "attnres_block"])
def test_hidden_after_block_k_is_the_stream_repa_aligns(topology):
    """The embedding plus the updates so far: Pre-Norm's and Post-Norm's one stream after block k; SiameseNorm's Y;
    the mean of Hyper-Connections' streams (each that sum at init); the sum of Attention Residuals' sources."""
    torch.manual_seed(0)
    model = DiT(input_size=8, patch_size=4, in_channels=2, hidden_size=32, depth=3, num_heads=2, num_classes=5,
                topology=topology).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    x, t, y = torch.randn(2, 2, 8, 8), torch.rand(2), torch.tensor([1, 4])
    out, hidden = model(x, t, y, hidden_after=2)
    torch.testing.assert_close(out, model(x, t, y))
    c = model.t_embedder(t) + model.y_embedder(y, False)
    state = model.streams(model.x_embedder(x) + model.pos_embed)
    for block in model.blocks[:2]:
        state = block(state, c)
    want = {"siamese": lambda s: s[1], "hc": lambda s: s.mean(dim=2), "attnres_block": lambda s: sum(s)}
    assert hidden.shape == (2, 4, 32)
    torch.testing.assert_close(hidden, want.get(topology, lambda s: s)(state))


def test_repa_dit_aligns_in_training_and_its_weights_sample_as_a_plain_dit(tmp_path):
    from common.checkpoint import save_weights

    torch.manual_seed(0)
    kwargs = dict(input_size=8, patch_size=4, in_channels=2, hidden_size=32, depth=3, num_heads=2, num_classes=5,
                  topology="siamese")
    model = RepaDiT(align_depth=2, projector_dim=16, feature_dim=12, **kwargs)
    x, t, y = torch.randn(2, 2, 8, 8), torch.rand(2), torch.tensor([1, 4])
    out, projected = model(x, t, y, align=True)
    _, hidden = DiT.forward(model, x, t, y, hidden_after=2)
    torch.testing.assert_close(projected, model.projectors[0](hidden))
    assert projected.shape == (2, 4, 12) and torch.equal(out, model(x, t, y))
    meta = {"model": "DiT-S/4", "topology": "siamese", "in_channels": 2, "input_size": 8, "num_classes": 5,
            "learn_sigma": True, "model_kwargs": '{"hidden_size": 32, "depth": 3, "num_heads": 2}', "autoencoder": "none"}
    save_weights(model, tmp_path / "ema.safetensors", metadata=meta)  # projector keys included, as training saves
    plain, _, _ = load_dit(tmp_path / "ema.safetensors")
    assert not hasattr(plain, "projectors")
    torch.testing.assert_close(plain(x, t, y), model(x, t, y))
    with pytest.raises(ValueError, match="repa.depth=4"):
        RepaDiT(align_depth=4, projector_dim=16, feature_dim=12, **kwargs)


def test_frozen_encoder_reads_a_dinov2_hub_file_as_repa_prepares_it(tmp_path):
    """A DINOv2 ViT-S/14 file in torch.hub's layout (518 px position grid, mask_token) serves 112 px inputs: the grid
    resampled as REPA resamples it, images normalised then resized bicubically, patch tokens after the final norm."""
    import timm
    from timm.layers import resample_abs_pos_embed

    from common.checkpoint import save_weights

    torch.manual_seed(0)
    hub = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0, img_size=518)
    state = {**hub.state_dict(), "mask_token": torch.zeros(1, 384)}
    save_weights(state, tmp_path / "dinov2_vits14.pth")
    encoder = FrozenEncoder("vit_small_patch14_dinov2", str(tmp_path / "dinov2_vits14.pth"), 112)
    assert encoder.num_tokens == 64 and encoder.feature_dim == 384 and not encoder.training
    images = torch.randint(0, 256, (2, 3, 128, 128), dtype=torch.uint8)

    want_model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0, img_size=112).eval()
    weights = {k: v for k, v in hub.state_dict().items()}
    weights["pos_embed"] = resample_abs_pos_embed(weights["pos_embed"], [8, 8])  # REPA's load_encoders
    want_model.load_state_dict(weights)
    x = images / 255.0
    x = (x - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    x = torch.nn.functional.interpolate(x, 112, mode="bicubic")
    with torch.no_grad():
        want = want_model.forward_features(x)[:, 1:]  # x_norm_patchtokens
    torch.testing.assert_close(encoder(images), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        FrozenEncoder("vit_small_patch14_dinov2", str(tmp_path / "missing.pth"), 112)


def test_repa_costs_prints_the_figures_docs_quote(capsys):
    """scripts.repa_costs: bytes from the shapes, FLOPs counted on meta tensors (the numbers of docs/dit.md)."""
    from scripts.repa_costs import main

    result = main(["--images", "1000"])
    per = result["bytes_per_image"]
    assert per["images (uint8)"] == 3 * 256 * 256 and per["features (fp16, 2 views)"] == 2 * 256 * 768 * 2
    assert result["gigabytes"]["images (uint8)"] == pytest.approx(1000 * 196608 / 1e9)
    share = result["encoder_share_of_a_step"]
    assert share["DiT-XL/2"] == pytest.approx(result["encoder_gflops"] / result["training_example_gflops"]["DiT-XL/2"])
    assert round(result["encoder_gflops"], 1) == 46.3 and round(100 * share["DiT-XL/2"], 1) == 6.5
    assert round(100 * share["DiT-B/2"], 1) == 33.6
    assert "the encoder adds 6.5%" in capsys.readouterr().out
