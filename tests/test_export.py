"""A trained DeiT in timm's Hub format: exported from a run, loaded back by timm's own ``create_model``."""
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.fashion_mnist
def test_a_trained_deit_round_trips_through_timms_hub_format(tmp_path):
    import timm
    from safetensors.torch import load_file

    from common.config import load_config
    from vision import train as deit_train
    from vision.export import main as export_main

    cfg = load_config(deit_train.TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml", [
        "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 7}", "data.num_workers=0",
        "train.tensorboard=false", "train.threads=1", "data.max_train_samples=64", "data.max_val_samples=20",
        "optim.batch_size=16", "optim.epochs=1", "train.ema_decay=0.5", f"train.output_dir={tmp_path / 'run'}"])
    deit_train.train(cfg)
    out = export_main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "hub")])
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "deit_tiny_siamese_patch16_224" and config["num_classes"] == 10
    assert config["model_args"]["depth"] == 2 and config["label_names"][9] == "Ankle boot"
    pretrained = config["pretrained_cfg"]
    assert pretrained["input_size"] == [3, 28, 28] and pretrained["mean"] == [0.286] * 3 and pretrained["crop_pct"] == 1.0

    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    ema = timm.create_model("deit_tiny_siamese_patch16_224", embed_dim=32, depth=2, num_heads=2, patch_size=7,
                            img_size=28, num_classes=10).eval()
    ema.load_state_dict(load_file(tmp_path / "run" / "ema.safetensors"))
    x = torch.randn(3, 3, 28, 28)
    assert torch.equal(model(x), ema(x))
    data = timm.data.resolve_data_config(model=model)
    assert data["input_size"] == (3, 28, 28) and data["interpolation"] == "bilinear"
    with pytest.raises(SystemExit, match="is not a finished vision.train run with ema.safetensors .* --weights model"):
        export_main(["--run", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
