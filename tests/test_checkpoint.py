"""common.checkpoint: our files round-trip, public layouts convert by name, bad files are refused clearly."""
import argparse

import pytest
import timm
import torch

import vision  # noqa: F401
from common.checkpoint import CheckpointError, load_weights, save_weights
from tests.deit_reference import public_siamese_deit_state_dict, siamese_deit_forward
from tests.test_deit import SMALL, randomize_


def small(topology="siamese", **kw):
    return timm.create_model("deit_tiny_siamese_patch16_224", topology=topology, **{**SMALL, **kw}).eval()


@pytest.fixture
def images():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".pth"])
def test_round_trip(tmp_path, images, suffix):
    src = randomize_(small())
    path = save_weights(src, tmp_path / f"w{suffix}")
    dst = small()
    load_weights(dst, path)
    with torch.no_grad():
        torch.testing.assert_close(dst(images), src(images), rtol=0, atol=0)


def test_wrapped_training_checkpoint_and_prefixes(tmp_path, images):
    src = randomize_(small())
    wrapped = {"model": {f"module.{k}": v for k, v in src.state_dict().items()}, "step": torch.tensor(7)}
    torch.save(wrapped, tmp_path / "train.pt")
    dst = small()
    load_weights(dst, tmp_path / "train.pt")
    with torch.no_grad():
        torch.testing.assert_close(dst(images), src(images), rtol=0, atol=0)
    ema = {"model": small().state_dict(), "ema": src.state_dict()}
    load_weights(dst, ema, key="ema")
    with torch.no_grad():
        torch.testing.assert_close(dst(images), src(images), rtol=0, atol=0)


def test_public_siamese_layout_converts_strictly(images):
    public = public_siamese_deit_state_dict(depth=4, dim=48, num_heads=3, patch_size=4, img_size=32, num_classes=10)
    model = small()
    load_weights(model, public, strict=True)
    # The quirk: the public top-level `pre_norm` normalises X, i.e. our norm_x.
    torch.testing.assert_close(model.norm.norm_x.weight, public["pre_norm.weight"])
    torch.testing.assert_close(model.norm.norm_y.weight, public["post_norm.weight"])
    with torch.no_grad():
        ref = siamese_deit_forward(public, images, depth=4, num_heads=3, patch_size=4)
        torch.testing.assert_close(model(images), ref, rtol=1e-5, atol=1e-5)


def test_public_siamese_layout_through_timm_pretrained_file(tmp_path, images):
    public = public_siamese_deit_state_dict(depth=4, dim=48, num_heads=3, patch_size=4, img_size=32, num_classes=10)
    torch.save(public, tmp_path / "siamese_deit.pth")
    model = timm.create_model(
        "deit_tiny_siamese_patch16_224", pretrained=True,
        pretrained_cfg_overlay=dict(file=str(tmp_path / "siamese_deit.pth"), num_classes=10), **SMALL,
    ).eval()
    with torch.no_grad():
        ref = siamese_deit_forward(public, images, depth=4, num_heads=3, patch_size=4)
        torch.testing.assert_close(model(images), ref, rtol=1e-5, atol=1e-5)


def test_timm_deit_into_pre_norm_deit(tmp_path, images):
    timm_model = randomize_(timm.create_model("deit_tiny_patch16_224", **{k: SMALL[k] for k in SMALL})).eval()
    save_weights(timm_model, tmp_path / "deit.safetensors")
    ours = small("pre")
    load_weights(ours, tmp_path / "deit.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(ours(images), timm_model(images), rtol=0, atol=1e-6)


def test_mismatch_lists_missing_and_unexpected_keys():
    sd = small().state_dict()
    sd.pop("blocks.0.pre_norm1.weight")
    sd["blocks.0.bogus.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"1 missing keys \[blocks\.0\.pre_norm1\.weight\].*1 unexpected keys \[blocks\.0\.bogus\.weight\]"):
        load_weights(small(), sd)
    with pytest.raises(CheckpointError, match="missing keys"):
        load_weights(small("pre"), small("siamese").state_dict())  # wrong topology is a clear error
    wrong_shape = small().state_dict()
    wrong_shape["head.weight"] = torch.zeros(3, 48)
    with pytest.raises(CheckpointError, match="head.weight"):
        load_weights(small(), wrong_shape)


def test_refuses_pickles_that_are_not_plain_state_dicts(tmp_path):
    torch.save({"model": small().state_dict(), "args": argparse.Namespace(lr=1)}, tmp_path / "args.pt")
    with pytest.raises(CheckpointError, match="not a plain state dict"):
        load_weights(small(), tmp_path / "args.pt")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")
    with pytest.raises(CheckpointError, match="not a plain state dict"):
        load_weights(small(), tmp_path / "module.pt")
    torch.save({"weights": [1, 2]}, tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="not tensors"):
        load_weights(small(), tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(small(), tmp_path / "missing.safetensors")
