"""DeiT distillation: the distilled models (every topology, timm's weights), DeiT's loss, the teacher, a run."""
from pathlib import Path

import pytest
import timm
import torch

import vision  # noqa: F401  (registers our DeiTs)
from common.cli import InputNotFoundError
from common.config import ConfigError, check_registered, load_config
from vision.config import DistillConfig
from vision.deit import MODEL_TOPOLOGIES
from vision.distill import DistillationLoss, build_teacher

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
torch.set_num_threads(1)


def test_timms_distilled_deit_weights_load_into_our_pre_norm_variant_with_equal_outputs():
    torch.manual_seed(0)
    reference = timm.create_model("deit_tiny_distilled_patch16_224", **TINY)
    ours = timm.create_model("deit_tiny_siamese_distilled_patch16_224", topology="pre", **TINY)
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(4, 3, 32, 32)
    reference.eval(), ours.eval()
    torch.testing.assert_close(ours(x), reference(x), rtol=0, atol=1e-5)
    for model in (reference, ours):
        model.set_distilled_training(True)
        model.train()
    for a, b in zip(ours(x), reference(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("topology", [t for t in MODEL_TOPOLOGIES if t != "pre"])
def test_every_topology_trains_two_heads_and_evaluates_their_average(topology):
    torch.manual_seed(0)
    model = timm.create_model(f"deit_tiny_{topology}_distilled_patch16_224", **TINY)
    assert model.num_prefix_tokens == 2 and model.pos_embed.shape[1] == 16 + 2
    x = torch.randn(2, 3, 32, 32)
    model.set_distilled_training(True)
    cls_logits, dist_logits = model.train()(x)  # no dropout or drop path: train and eval compute the same
    assert not torch.allclose(cls_logits, dist_logits)  # two tokens, two heads
    torch.testing.assert_close(model.eval()(x), (cls_logits + dist_logits) / 2, rtol=0, atol=1e-6)
    # the distillation token is a token of the network (in every stream): changing it changes the output
    with torch.no_grad():
        model.dist_token.add_(1.0)
    assert not torch.allclose(model(x), (cls_logits + dist_logits) / 2)


def deit_loss_by_hand(outputs, outputs_dist, teacher_logits, targets, kind, alpha, tau):
    """DeiT's DistillationLoss written out: soft-target CE on the class head; on the distillation head either
    sum_ij p_t,ij (log p_t,ij - log p_s,ij) * tau^2 / (batch * classes) at temperature tau, or CE with argmax p_t."""
    base = -(targets * outputs.log_softmax(1)).sum(1).mean()
    if kind == "soft":
        log_s, log_t = (outputs_dist / tau).log_softmax(1), (teacher_logits / tau).log_softmax(1)
        distill = (log_t.exp() * (log_t - log_s)).sum() * tau ** 2 / outputs_dist.numel()
    else:
        labels = teacher_logits.argmax(1)
        distill = -outputs_dist.log_softmax(1)[torch.arange(len(labels)), labels].mean()
    return (1 - alpha) * base + alpha * distill


@pytest.mark.parametrize("kind, alpha, tau", [("hard", 0.5, 1.0), ("soft", 0.5, 1.0), ("soft", 0.3, 3.0)])
def test_the_loss_is_deits_hard_and_soft_distillation(kind, alpha, tau):
    from timm.loss import SoftTargetCrossEntropy

    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 7))
    images = torch.randn(6, 3, 2, 2)
    outputs, outputs_dist = torch.randn(6, 7, dtype=torch.float64), torch.randn(6, 7, dtype=torch.float64)
    targets = torch.softmax(torch.randn(6, 7), 1).double()  # mixup's soft targets
    loss = DistillationLoss(SoftTargetCrossEntropy(), teacher.double(), kind, alpha, tau)
    got = loss(images.double(), (outputs, outputs_dist), targets)
    want = deit_loss_by_hand(outputs, outputs_dist, teacher(images.double()), targets, kind, alpha, tau)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="set_distilled_training"):
        loss(images.double(), outputs, targets)


def test_the_teacher_is_built_by_name_loaded_from_a_file_frozen_and_kept_in_eval(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model("regnety_002", num_classes=3)
    torch.save({"model": source.state_dict()}, tmp_path / "teacher.pth")  # DeiT's teacher file layout
    cfg = DistillConfig(type="hard", teacher="regnety_002", teacher_weights=str(tmp_path / "teacher.pth"), alpha=0.5)
    teacher = build_teacher(cfg, num_classes=3)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(teacher(x), source.eval()(x), rtol=0, atol=0)
    loss = DistillationLoss(torch.nn.CrossEntropyLoss(), teacher, "hard", 0.5).train()
    assert not loss.teacher.training


def test_distillation_settings_are_checked_before_any_work(tmp_path):
    from vision.train import TrainConfig

    recipe = ROOT / "configs/deit_tiny_siamese_distilled.yaml"
    with pytest.raises(ConfigError, match="distill.type=hard needs distill.teacher_weights"):
        load_config(TrainConfig, recipe, ["data.path=/nonexistent"])
    with pytest.raises(ConfigError, match=r"distill.type=soft needs distill.tau"):
        load_config(TrainConfig, recipe, ["data.path=/x", "distill.teacher_weights=/x", "distill.type=soft",
                                          "distill.tau=null"])
    with pytest.raises(ConfigError, match=r"distill.alpha=2 must lie in \[0, 1\]"):
        load_config(TrainConfig, recipe, ["data.path=/x", "distill.teacher_weights=/x", "distill.alpha=2"])
    cfg = load_config(TrainConfig, recipe, ["data.path=/x", f"distill.teacher_weights={tmp_path / 'none.pth'}"])
    with pytest.raises(InputNotFoundError, match="none.pth: no such file"):
        check_registered(cfg)
    (tmp_path / "t.pth").write_bytes(b"")
    cfg = load_config(TrainConfig, recipe, ["data.path=/x", f"distill.teacher_weights={tmp_path / 't.pth'}",
                                            "model.name=deit_tiny_siamese_patch16_224"])
    with pytest.raises(ConfigError, match="model.name must be a distilled model, e.g. "
                                          "deit_tiny_siamese_distilled_patch16_224"):
        check_registered(cfg)
    cfg = load_config(TrainConfig, recipe, ["data.path=/x", f"distill.teacher_weights={tmp_path / 't.pth'}",
                                            "distill.teacher=regnety_nosuch"])
    with pytest.raises(ConfigError, match="distill.teacher='regnety_nosuch' is not a timm model"):
        check_registered(cfg)


@pytest.mark.parametrize("size, topology, name", [("tiny", "pre", "deit_tiny_distilled_patch16_224"),
                                                  ("small", "siamese", "deit_small_siamese_distilled_patch16_224"),
                                                  ("base", "siamese", "deit_base_siamese_distilled_patch16_224")])
def test_distilled_recipes_are_deits(size, topology, name):
    from common.config import config_to_dict
    from vision.train import TrainConfig

    cfg = load_config(TrainConfig, ROOT / f"configs/deit_{size}_{topology}_distilled.yaml",
                      ["data.path=/x", "distill.teacher_weights=/x"])
    d = cfg.distill
    assert cfg.model.name == name and (d.type, d.teacher, d.alpha, d.tau) == ("hard", "regnety_160", 0.5, 1.0)
    plain = config_to_dict(load_config(TrainConfig, ROOT / f"configs/deit_{size}_{topology}.yaml", ["data.path=/x"]))
    distilled = config_to_dict(cfg)
    for c in (plain, distilled):
        c.pop("distill"), c["model"].pop("name"), c["train"].pop("output_dir")
    assert distilled == plain  # the DeiT recipe, unchanged


@pytest.mark.fashion_mnist
def test_vision_train_distils_from_a_teacher_file_and_evaluates_the_two_heads(tmp_path):
    from safetensors.torch import load_file

    from vision import evaluate as vision_evaluate
    from vision.train import TrainConfig, train

    torch.manual_seed(0)
    torch.save({"model": timm.create_model("regnety_002", num_classes=10).state_dict()}, tmp_path / "teacher.pth")
    cfg = load_config(TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml", [
        "model.name=deit_tiny_siamese_distilled_patch16_224",
        "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
        "data.num_workers=0", "data.max_train_samples=16", "data.max_val_samples=20", "optim.batch_size=8",
        "optim.epochs=1", "train.tensorboard=false", "train.threads=1", "train.log_every=1",
        f"train.output_dir={tmp_path / 'run'}", "distill.type=soft", "distill.teacher=regnety_002",
        f"distill.teacher_weights={tmp_path / 'teacher.pth'}", "distill.alpha=0.5", "distill.tau=2.0"])
    final = train(cfg)
    assert final["steps"] == 2 and final["nonfinite_steps"] == 0
    weights = load_file(tmp_path / "run" / "model.safetensors")
    assert "dist_token" in weights and "head_dist.weight" in weights
    from common.logging import read_metrics

    records = [r for r in read_metrics(tmp_path / "run") if "train/loss" in r]  # the two heads' terms, and their sum
    assert len(records) == 2 and all(r["train/loss_cls"] > 0 and r["train/loss_dist"] > 0 for r in records)
    for r in records:
        assert r["train/loss"] == pytest.approx(0.5 * r["train/loss_cls"] + 0.5 * r["train/loss_dist"], rel=1e-6)
    result = vision_evaluate.main(["--config", str(tmp_path / "run" / "config.yaml"),
                                   f"checkpoint={tmp_path / 'run' / 'model.safetensors'}"])
    assert result["top1"] == pytest.approx(final["val/top1"], abs=1e-9)


def test_a_distilled_file_into_a_model_without_the_head_names_the_model_to_use():
    from common.checkpoint import load_weights

    state = timm.create_model("deit_tiny_distilled_patch16_224", **TINY).state_dict()
    with pytest.raises(ValueError, match="deit_<size>_<topology>_distilled_patch16_224"):
        load_weights(timm.create_model("deit_tiny_siamese_patch16_224", **TINY), state)


def train_distilled(run_dir: Path, teacher: Path, *overrides) -> dict:
    """A tiny SiameseNorm distilled DeiT on Fashion-MNIST, soft distillation from a tiny RegNetY file."""
    from vision.train import TrainConfig, train

    cfg = load_config(TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml", [
        "model.name=deit_tiny_siamese_distilled_patch16_224",
        "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
        "data.num_workers=0", "data.max_train_samples=16", "data.max_val_samples=20", "optim.batch_size=8",
        "optim.epochs=1", "train.tensorboard=false", "train.threads=1", f"train.output_dir={run_dir}",
        "distill.type=soft", "distill.teacher=regnety_002", f"distill.teacher_weights={teacher}", "distill.alpha=0.5",
        "distill.tau=2.0", *overrides])
    return train(cfg)


@pytest.mark.fashion_mnist
def test_a_distilled_run_exports_reloads_with_equal_outputs_and_fine_tunes_at_another_resolution(tmp_path):
    """vision.export of a distilled run: timm's create_model reloads it (two tokens, two heads, their average in
    eval); train.finetune with distillation on continues it at 48 px (DeiT's distilled 384 px fine-tune)."""
    from safetensors.torch import load_file

    from vision.export import main as export_main

    torch.manual_seed(0)
    torch.save({"model": timm.create_model("regnety_002", num_classes=10).state_dict()}, tmp_path / "teacher.pth")
    train_distilled(tmp_path / "run", tmp_path / "teacher.pth")
    out = export_main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "hub")])
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    trained = timm.create_model("deit_tiny_siamese_distilled_patch16_224", img_size=32, num_classes=10,
                                **{k: v for k, v in TINY.items() if k not in ("img_size", "num_classes")}).eval()
    trained.load_state_dict(load_file(tmp_path / "run" / "model.safetensors"))
    x = torch.randn(3, 3, 32, 32)
    assert loaded.num_prefix_tokens == 2 and torch.equal(loaded(x), trained(x))

    final = train_distilled(tmp_path / "fine", tmp_path / "teacher.pth", "data.input_size=48",
                            f"train.finetune={tmp_path / 'run' / 'model.safetensors'}")
    assert final["steps"] == 2 and final["nonfinite_steps"] == 0
    weights = load_file(tmp_path / "fine" / "model.safetensors")
    assert weights["pos_embed"].shape == (1, 36 + 2, 32)  # 6 x 6 patches and the two tokens, resampled
    source = load_file(tmp_path / "run" / "model.safetensors")
    for key in ("blocks.1.attn.qkv.weight", "dist_token", "head_dist.weight"):  # two warm-up steps from those weights
        torch.testing.assert_close(weights[key], source[key], rtol=0, atol=1e-3)
