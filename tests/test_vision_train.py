"""The DeiT trainer end to end on small Fashion-MNIST runs (tiny models, a few hundred images, CPU)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.config import load_config
from common.logging import NonFiniteLossError, read_metrics
from common.train_state import CheckpointManager
from vision import evaluate as vision_evaluate
from vision.train import TrainConfig, main, train

pytestmark = pytest.mark.fashion_mnist

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32", "data.num_workers=0",
        "train.tensorboard=false", "train.eval_batch_size=200", "train.threads=1"]
torch.set_num_threads(1)  # tiny models: one thread is faster, and immune to a busy machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(tmp_path, *overrides, topology="siamese"):
    return load_config(TrainConfig, ROOT / f"configs/fmnist_deit_{topology}.yaml",
                       [*TINY, f"train.output_dir={tmp_path}", *overrides])


def test_short_run_learns_and_evaluate_matches(tmp_path):
    cfg = config(tmp_path, "data.max_train_samples=1024", "data.max_val_samples=400", "optim.batch_size=32",
                 "optim.epochs=3", "optim.base_lr=2e-3", "optim.lr_base_batch=32", "train.log_every=16",
                 "train.ema_decay=0.9", "augment.label_smoothing=0", "augment.scale=[1, 1]")
    final = train(cfg)
    losses = [r["train/loss"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.25, losses
    assert final["val/top1"] > 35.0, final  # chance is 10%
    assert "val_ema/top1" in final and (tmp_path / "ema.safetensors").is_file()
    # The stand-alone evaluator on the saved weights reproduces the trainer's number.
    out = tmp_path / "eval.json"
    result = vision_evaluate.main(["--config", str(tmp_path / "config.yaml"),
                                   f"checkpoint={tmp_path / 'model.safetensors'}", f"output={out}"])
    assert result["top1"] == pytest.approx(final["val/top1"], abs=1e-9)
    assert json.loads(out.read_text())["images"] == 400
    ckpt = CheckpointManager(tmp_path / "checkpoints").steps()[-1]
    ema_result = vision_evaluate.main(["--config", str(tmp_path / "config.yaml"), "weights=ema",
                                       f"checkpoint={tmp_path / 'checkpoints' / f'step_{ckpt:09d}.pt'}"])
    assert ema_result["top1"] == pytest.approx(final["val_ema/top1"], abs=1e-9)


def test_kill_and_resume_reaches_the_same_weights(tmp_path):
    # mixup/cutmix, random erasing, drop path and EMA all draw random numbers: resume must restore them.
    common = ["data.max_train_samples=96", "data.max_val_samples=50", "optim.batch_size=16", "optim.epochs=2",
              "augment.mixup=0.8", "augment.cutmix=1.0", "augment.re_prob=0.5", "augment.repeated_aug=3",
              "model.drop_path=0.1", "train.ema_decay=0.5", "train.ckpt_every=4", "train.eval_every=0"]
    train(config(tmp_path / "full", *common))
    interrupted = config(tmp_path / "resumed", *common, "train.stop_at_step=5")  # mid-epoch (6 steps/epoch)
    assert train(interrupted) == {"stopped_at": 5}
    assert CheckpointManager(tmp_path / "resumed" / "checkpoints").steps() == [4, 5]
    train(config(tmp_path / "resumed", *common))
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = load_file(tmp_path / "full" / name), load_file(tmp_path / "resumed" / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_divergence_stops_keeps_a_good_checkpoint_and_a_lower_lr_recovers(tmp_path):
    common = ["data.max_train_samples=64", "data.max_val_samples=20", "optim.batch_size=16", "optim.epochs=2",
              "train.eval_every=0", "train.log_every=1", "train.ckpt_every=1"]
    train(config(tmp_path / "reference", *common))
    run = tmp_path / "run"
    assert train(config(run, *common, "train.stop_at_step=2")) == {"stopped_at": 2}
    # lr 1e30: step 3 is still finite (the loss is computed before the update) but its weights overflow, so every
    # later step is NaN; the run stops at the third NaN in a row (step 6).
    with pytest.raises(NonFiniteLossError, match=r"last 3 steps in a row \(up to step 6.*newest checkpoint is now step 2"):
        train(config(run, *common, "optim.base_lr=1e30", "train.max_nonfinite=3"))
    assert CheckpointManager(run / "checkpoints").steps() == [2]  # none written during the streak (keep_last=2)
    assert [p.name for p in (run / "checkpoints" / "diverged").iterdir()] == ["step_000000003.pt"]  # kept aside
    logged = {r["step"]: r for r in read_metrics(run) if "train/loss" in r}
    assert all(logged[s]["train/loss"] == "nan" for s in (4, 5, 6))  # never a made-up 0.0
    assert [logged[s]["train/nonfinite_steps"] for s in (3, 4, 5, 6)] == [0, 1, 2, 3]
    # The advice works: the original lr, the same command again, continues from step 2 to the reference weights.
    final = train(config(run, *common))
    assert final["steps"] == 8 and final["nonfinite_steps"] == 0
    a, b = load_file(tmp_path / "reference" / "model.safetensors"), load_file(run / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_metrics(run) if "train/loss" in r]
    assert steps == sorted(set(steps)) == list(range(1, 9))  # the log was cut back to the resumed step


@pytest.mark.parametrize("topology", ["siamese", "mhc", "attnres"])
def test_two_processes_match_one_process(tmp_path, topology):
    common = ["data.max_train_samples=64", "data.max_val_samples=20", "optim.batch_size=16", "optim.epochs=1",
              "augment.re_prob=0.5", "augment.repeated_aug=2", "train.eval_every=0", "train.log_every=1",
              "optim.warmup_epochs=0", "train.tensorboard=true"]  # TensorBoard on, as users get it
    args = ["--config", str(ROOT / "configs/fmnist_deit_siamese.yaml"), *TINY, *common,
            f"model.name=deit_tiny_{topology}_patch16_224"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "vision.train", *args, f"train.output_dir={tmp_path / 'two'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "two" / "tb").rglob("events.out.tfevents.*"))
    main([*args, f"train.output_dir={tmp_path / 'one'}"])
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    logged = [r for r in read_metrics(tmp_path / "two") if "world_size" in r]
    assert logged[0]["world_size"] == 2


def test_cli_reports_config_errors(capsys):
    with pytest.raises(SystemExit):
        main(["--config", str(ROOT / "configs/fmnist_deit_pre.yaml"), "optim.batchsize=8"])
    err = capsys.readouterr().err
    assert "unknown config key 'batchsize'" in err and "did you mean 'batch_size'" in err and "grad_accum" in err
    with pytest.raises(SystemExit):
        main(["--config", str(ROOT / "configs/deit_tiny_siamese.yaml")])
    assert "data.path is required" in capsys.readouterr().err


@pytest.mark.parametrize("size, topo, name", [("tiny", "pre", "deit_tiny_patch16_224"),
                                              ("small", "siamese", "deit_small_siamese_patch16_224")])
def test_imagenet_recipes_state_method_section_4(size, topo, name):
    cfg = load_config(TrainConfig, ROOT / f"configs/deit_{size}_{topo}.yaml", ["data.path=/nonexistent"])
    o, a = cfg.optim, cfg.augment
    assert cfg.model.name == name and cfg.model.drop_path == 0.1
    assert (o.batch_size, o.lr, o.weight_decay, o.epochs, o.warmup_epochs, o.warmup_lr, o.min_lr) == \
           (1024, 1e-3, 0.05, 300, 5, 1e-6, 1e-5)
    assert (a.auto_augment, a.mixup, a.cutmix, a.mixup_switch_prob, a.label_smoothing, a.re_prob, a.repeated_aug) == \
           ("rand-m9-mstd0.5-inc1", 0.8, 1.0, 0.5, 0.1, 0.25, 3)
    assert (cfg.data.interpolation, cfg.data.input_size, round(cfg.data.input_size / cfg.data.crop_pct)) == \
           ("bicubic", 224, 256)
