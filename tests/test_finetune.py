"""Fine-tuning (DeiT's --finetune): another resolution (position embeddings resampled as timm does), another class
count (heads reset), layer-wise lr decay (timm's param groups), the 384 px recipe, a run."""
from pathlib import Path

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed

import vision  # noqa: F401  (registers our DeiTs)
from common.checkpoint import CheckpointError, save_weights
from common.cli import InputNotFoundError
from common.config import check_registered, load_config
from vision.deit import load_finetune

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(patch_size=8, embed_dim=32, depth=2, num_heads=2)
torch.set_num_threads(1)


@pytest.mark.parametrize("name, prefix", [("deit_tiny_siamese_patch16_224", 1), ("deit_tiny_patch16_224", 1),
                                          ("deit_tiny_siamese_distilled_patch16_224", 2)])
def test_a_32_px_model_continues_at_48_px_with_the_position_embedding_resampled_as_timm_does(tmp_path, name, prefix):
    torch.manual_seed(0)
    source = timm.create_model(name, img_size=32, num_classes=5, **TINY)
    save_weights(source, tmp_path / "w.safetensors")
    target = timm.create_model(name, img_size=48, num_classes=5, **TINY)
    assert load_finetune(target, tmp_path / "w.safetensors") == []
    # by hand: the 4x4 grid (plus the prefix tokens, kept) resampled to 6x6 with timm's function
    want = dict(source.state_dict())
    want["pos_embed"] = resample_abs_pos_embed(want["pos_embed"], new_size=(6, 6), old_size=(4, 4),
                                               num_prefix_tokens=prefix, verbose=False)
    reference = timm.create_model(name, img_size=48, num_classes=5, **TINY)
    reference.load_state_dict(want, strict=True)
    for k, v in target.state_dict().items():
        assert torch.equal(v, want[k]), k
    x = torch.randn(2, 3, 48, 48)
    torch.testing.assert_close(target.eval()(x), reference.eval()(x), rtol=0, atol=1e-6)
    assert target.pos_embed.shape[1] == 36 + prefix


def test_another_class_count_keeps_the_fresh_heads_and_loads_the_rest(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model("deit_tiny_siamese_distilled_patch16_224", img_size=32, num_classes=5, **TINY)
    save_weights(source, tmp_path / "w.safetensors")
    target = timm.create_model("deit_tiny_siamese_distilled_patch16_224", img_size=32, num_classes=3, **TINY)
    fresh = {k: v.clone() for k, v in target.state_dict().items()}
    assert load_finetune(target, tmp_path / "w.safetensors") == ["head.weight", "head.bias", "head_dist.weight",
                                                                  "head_dist.bias"]
    for k, v in target.state_dict().items():
        assert torch.equal(v, fresh[k] if k.startswith("head") else source.state_dict()[k]), k
    save_weights(timm.create_model("deit_tiny_siamese_patch16_224", img_size=32, **TINY), tmp_path / "s.safetensors")
    other = timm.create_model("deit_tiny_post_patch16_224", img_size=32, num_classes=5, **TINY)
    with pytest.raises(CheckpointError, match="does not fit .* beyond its resolution and class count: missing"):
        load_finetune(other, tmp_path / "s.safetensors")


def test_layer_decay_scales_each_blocks_lr_as_timm(tmp_path):
    from timm.scheduler import CosineLRScheduler

    from common.trainer import build_optimizer
    from vision.config import OptimConfig

    model = timm.create_model("deit_tiny_siamese_patch16_224", img_size=32, num_classes=5, **TINY)
    optim = OptimConfig(batch_size=8, base_lr=1e-3, lr_base_batch=8, epochs=1, weight_decay=0.05, layer_decay=0.5)
    optimizer = build_optimizer(model, optim, optim.lr)
    CosineLRScheduler(optimizer, t_initial=10, t_in_epochs=False).step_update(0)
    lr_of = {id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    # layers: 0 the embeddings, 1..2 the blocks, 3 the final fusion and the head: lr * 0.5^(3 - layer)
    assert lr_of[id(named["cls_token"])] == (1e-3 * 0.5 ** 3, 0.0)
    assert lr_of[id(named["patch_embed.proj.weight"])] == (1e-3 * 0.5 ** 3, 0.05)
    assert lr_of[id(named["blocks.0.attn.qkv.weight"])] == (1e-3 * 0.5 ** 2, 0.05)
    assert lr_of[id(named["blocks.1.mlp.fc1.weight"])] == (1e-3 * 0.5, 0.05)
    assert lr_of[id(named["blocks.1.mlp.fc1.bias"])] == (1e-3 * 0.5, 0.0)
    assert lr_of[id(named["head.weight"])] == (1e-3, 0.05)
    assert len(lr_of) == len(named)


@pytest.mark.parametrize("topology, name", [("pre", "deit_base_patch16_384"), ("siamese", "deit_base_siamese_patch16_224")])
def test_the_384_recipe_is_deits_fine_tune(tmp_path, topology, name):
    from vision.train import TrainConfig

    cfg = load_config(TrainConfig, ROOT / f"configs/deit_base_{topology}_384.yaml",
                      ["data.path=/x", f"train.finetune={tmp_path / 'none.safetensors'}"])
    o = cfg.optim
    assert cfg.model.name == name and cfg.data.input_size == 384
    assert (o.batch_size, o.lr, o.weight_decay, o.epochs, o.min_lr, o.layer_decay) == (512, 5e-6, 1e-8, 30, 5e-6, None)
    with pytest.raises(InputNotFoundError, match="train.finetune=.*none.safetensors: no such file"):
        check_registered(cfg)


@pytest.mark.fashion_mnist
def test_a_run_fine_tunes_a_32_px_run_at_48_px_with_layer_decay(tmp_path, capsys):
    from common.logging import read_metrics
    from vision.train import TrainConfig, train

    common = ["model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.num_workers=0",
              "data.max_train_samples=16", "data.max_val_samples=20", "optim.batch_size=8", "optim.epochs=1",
              "train.tensorboard=false", "train.threads=1", "train.log_every=1"]
    recipe = ROOT / "configs/fmnist_deit_siamese.yaml"
    train(load_config(TrainConfig, recipe, [*common, "data.input_size=32", f"train.output_dir={tmp_path / 'a'}"]))
    final = train(load_config(TrainConfig, recipe, [
        *common, "data.input_size=48", f"train.finetune={tmp_path / 'a' / 'model.safetensors'}",
        "optim.layer_decay=0.75", f"train.output_dir={tmp_path / 'b'}"]))
    assert final["steps"] == 2 and final["nonfinite_steps"] == 0
    assert len([r for r in read_metrics(tmp_path / "b") if "train/loss" in r]) == 2
    assert (f"fine-tuning from {tmp_path / 'a' / 'model.safetensors'}: position embedding resampled from a 4x4 grid to "
            "6x6\n") in capsys.readouterr().out


@pytest.mark.parametrize("source, target, said", [
    (dict(img_size=32, num_classes=5), dict(img_size=48, num_classes=5),
     "position embedding resampled from a 4x4 grid to 6x6"),
    (dict(img_size=32, num_classes=5), dict(img_size=32, num_classes=5, patch_size=4),
     "position embedding resampled from a 4x4 grid to 8x8; patch embedding resampled from 8x8 to 4x4 pixels"),
    (dict(img_size=32, num_classes=5), dict(img_size=32, num_classes=3),
     "head.weight, head.bias, head_dist.weight, head_dist.bias reset to their initialisation (5 classes in the file, "
     "3 here)"),
    (dict(img_size=32, num_classes=5), dict(img_size=32, num_classes=5),
     "every weight loaded as it is (the same grid, patch size and classes)")])
def test_fine_tuning_says_what_it_resampled_and_reset(tmp_path, source, target, said):
    from common.checkpoint import weight_shapes
    from vision.task import finetune_changes

    name = "deit_tiny_siamese_distilled_patch16_224"
    save_weights(timm.create_model(name, **{**TINY, **source}), tmp_path / "w.safetensors")
    torch.save({"model": timm.create_model(name, **{**TINY, **source}).state_dict()}, tmp_path / "step.pt")
    for path in (tmp_path / "w.safetensors", tmp_path / "step.pt"):  # read from the header / mapped, not loaded
        model = timm.create_model(name, **{**TINY, **target})
        reset = load_finetune(model, path)
        assert finetune_changes(model, weight_shapes(path), reset) == said
