"""A trained DeiT in timm's Hub format: exported from a run, loaded back by timm's own ``create_model``."""
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def train_tiny(run_dir, *overrides) -> dict:
    """The Fashion-MNIST SiameseNorm recipe shrunk to 64 images, 4 steps of 16 an epoch, with an EMA."""
    from common.config import load_config
    from vision import train as deit_train

    cfg = load_config(deit_train.TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml", [
        "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 7}", "data.num_workers=0",
        "train.tensorboard=false", "train.threads=1", "data.max_train_samples=64", "data.max_val_samples=20",
        "optim.batch_size=16", "train.ema_decay=0.5", f"train.output_dir={run_dir}", *overrides])
    return deit_train.train(cfg)


def tiny_deit(state_dict):
    """The tiny run's network, built by timm, holding ``state_dict``."""
    import timm

    model = timm.create_model("deit_tiny_siamese_patch16_224", embed_dim=32, depth=2, num_heads=2, patch_size=7,
                              img_size=28, num_classes=10).eval()
    model.load_state_dict(state_dict)
    return model


@pytest.mark.fashion_mnist
def test_a_trained_deit_round_trips_through_timms_hub_format(tmp_path):
    import timm
    from safetensors.torch import load_file

    from vision.export import main as export_main

    final = train_tiny(tmp_path / "run", "optim.epochs=1")
    out = export_main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "hub"), "--weights", "ema"])
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "deit_tiny_siamese_patch16_224" and config["num_classes"] == 10
    assert config["model_args"]["depth"] == 2 and config["label_names"][9] == "Ankle boot"
    pretrained = config["pretrained_cfg"]
    assert pretrained["input_size"] == [3, 28, 28] and pretrained["mean"] == [0.286] * 3 and pretrained["crop_pct"] == 1.0

    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    ema = tiny_deit(load_file(tmp_path / "run" / "ema.safetensors"))
    x = torch.randn(3, 3, 28, 28)
    assert torch.equal(model(x), ema(x))
    data = timm.data.resolve_data_config(model=model)
    assert data["input_size"] == (3, 28, 28) and data["interpolation"] == "bilinear"
    assert config["siamesenorm_export"]["weights"] == "ema" and config["siamesenorm_export"]["top1_metric"] == "val_ema/top1"
    without_ema = tmp_path / "no_ema"
    without_ema.mkdir()
    (without_ema / "config.yaml").write_text((tmp_path / "run" / "config.yaml").read_text())
    (without_ema / "final_metrics.json").write_text(json.dumps(final))
    with pytest.raises(SystemExit, match="is not a finished vision.train run with ema.safetensors .* --weights model"):
        export_main(["--run", str(without_ema), "--out", str(tmp_path / "x"), "--weights", "ema"])


@pytest.mark.fashion_mnist
def test_export_takes_the_weights_the_run_reports_and_refuses_an_unfinished_run(tmp_path, capsys):
    """DeiT's recipe reports the raw model's Top-1 (val/top1): the default export is model.safetensors, said and
    recorded. A run paused at step 1 of 8 is refused in one line naming the step and the flag; with the flag its
    step-1 checkpoint is exported and recorded as unfinished."""
    import timm
    from safetensors.torch import load_file

    from common.checkpoint import unwrap_state_dict
    from common.train_state import load_training_checkpoint
    from vision.export import main as export_main

    final = train_tiny(tmp_path / "done", "optim.epochs=1")
    capsys.readouterr()
    out = export_main(["--run", str(tmp_path / "done"), "--out", str(tmp_path / "hub")])
    said = capsys.readouterr().out
    assert said.startswith("exporting the raw model's weights (the run's reported metric) from step 4 of the finished "
                           f"run: val/top1 = {final['val/top1']:.4g}"), said
    record = json.loads((out / "config.json").read_text())["siamesenorm_export"]
    assert record["weights"] == "model" and record["finished"] and record["step"] == 4 == final["steps"]
    assert record["reported_metric"] == "val/top1" and record["top1"] == final["val/top1"]
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    raw = tiny_deit(load_file(tmp_path / "done" / "model.safetensors"))
    x = torch.randn(2, 3, 28, 28)
    assert torch.equal(model(x), raw(x))
    ema = load_file(tmp_path / "done" / "ema.safetensors")
    assert any(not torch.equal(v, raw.state_dict()[k]) for k, v in ema.items())  # the choice matters

    train_tiny(tmp_path / "paused", "optim.epochs=2", "train.stop_at_step=1")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--run", str(tmp_path / "paused"), "--out", str(tmp_path / "refused")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert "is not finished (it is at step 1 of 8" in err[0] and "--allow-unfinished" in err[0], err
    assert not (tmp_path / "refused").exists()
    out = export_main(["--run", str(tmp_path / "paused"), "--out", str(tmp_path / "partial"), "--allow-unfinished"])
    assert "from step 1 of 8: an UNFINISHED run" in capsys.readouterr().out
    record = json.loads((out / "config.json").read_text())["siamesenorm_export"]
    assert (record["weights"], record["step"], record["finished"], record["total_steps"]) == ("model", 1, False, 8)
    checkpoint = load_training_checkpoint(tmp_path / "paused" / "checkpoints" / "step_000000001.pt")
    step1 = tiny_deit(unwrap_state_dict(checkpoint, key="model"))
    assert torch.equal(timm.create_model(f"local-dir:{out}", pretrained=True).eval()(x), step1(x))
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--run", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2 and "is not a vision.train run (it has no config.yaml)" in capsys.readouterr().err
