"""DeiT III's recipe and models (configs/deit3_*.yaml, docs/deit.md "DeiT III"): 3-Augment and the BCE targets against
re-statements of DeiT III's code on fixed seeds (tests/deit3_reference.py), LAMB as timm builds it, the recipes'
numbers, timm's deit3_* in our Pre-Norm model, LayerScale inside SiameseNorm, and the shipped recipe shrunk, trained
and resumed on one process and resumed on two."""
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file
from timm.data import Mixup

from common.config import ConfigError, load_config
from common.logging import read_metrics
from common.trainer import build_optimizer
from tests import deit3_reference as deit3
from tests.rehearsal import ROOT, check, run, write_image_folder
from vision.augment import NormalizeErase, build_mixup, build_transform
from vision.config import AugmentConfig, DataConfig, OptimConfig
from vision.deit import MODEL_TOPOLOGIES, SiameseNormVisionTransformer
from vision.task import build_criterion
from vision.train import TrainConfig, train

torch.set_num_threads(1)


def photo(width=40, height=30, seed=0) -> Image.Image:
    """Colourful and not square, so that the crop, the flip, grayscale and solarization each change it."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def seeded(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)


def rng_states():
    return random.getstate(), torch.get_rng_state()


# ------------------------------------------------------------------------------------------- 3-Augment

@pytest.mark.parametrize("src", [False, True])
def test_three_augment_draws_and_pixels_equal_deit3_on_fixed_seeds(src):
    """Our 3-Augment, as training runs it (the worker half, then the device half) and whole, gives DeiT III's image
    for every seed: the same crop, flip, operation, blur radius and jitter. The random-resized crop of the worker half
    resamples with torch's kernel (tests/test_vision_data.py), so there the draws must be equal and the pixels close."""
    data = DataConfig(dataset="fashion_mnist", input_size=24, interpolation="bicubic")
    augment = AugmentConfig(three_augment=True, simple_random_crop=src, color_jitter=0.3)
    whole = build_transform(data, augment, training=True)
    halves = build_transform(data, augment, training=True, use_prefetcher=True), NormalizeErase(data, augment)
    chosen = []
    theirs = deit3.three_augment(24, 0.3, src, data.mean, data.std, chosen)
    image = photo()
    tensor_image = torch.from_numpy(np.asarray(image)).permute(2, 0, 1)  # as vision.data.load_rgb_tensor gives it
    for seed in range(60):
        seeded(seed)
        expected, expected_states = theirs(image), rng_states()
        seeded(seed)
        assert torch.equal(whole(image), expected), seed
        seeded(seed)
        uint8, boxes = halves[0](tensor_image)
        states = rng_states()
        assert states[0] == expected_states[0] and torch.equal(states[1], expected_states[1]), seed
        got = halves[1].images(uint8[None], boxes[None])[0]
        if src:
            assert torch.equal(got, expected), seed
        else:
            assert (got - expected).abs().mean() < 0.05, seed
    assert all(chosen.count(name) >= 10 for name in ("grayscale", "solarize", "blur")), chosen  # each one tested


@pytest.mark.parametrize("overrides, line", [
    (["augment.auto_augment=rand-m9-mstd0.5-inc1"], "augment.three_augment=true replaces timm's pipeline, and with it "
     "augment.auto_augment='rand-m9-mstd0.5-inc1': set augment.auto_augment=null (DeiT III trains without it)"),
    (["data.backend=dali"], "augment.three_augment=true runs in the DataLoader workers, which data.backend=dali "
     "replaces: set data.backend=torch"),
    (["augment.three_augment=false"], "augment.simple_random_crop=true is 3-Augment's crop (DeiT III's --src): set "
     "augment.three_augment=true as well, or leave simple_random_crop false"),
    (["augment.label_smoothing=0.1"], "augment.bce_loss=true makes every target above 0 a positive (DeiT III's rule), "
     "and augment.label_smoothing=0.1 puts every class above 0: set augment.label_smoothing=0 (DeiT III trains its "
     "BCE without smoothing)"),
])
def test_deit3_settings_that_would_be_ignored_or_give_nonsense_are_one_line(overrides, line, capsys):
    """docs/training.md's row, through the command line (one line, exit 2)."""
    from tests.refusals import refusal
    from vision.train import main

    said = refusal(main, ["--config", ROOT / "configs/deit3_small_siamese.yaml", "data.path=/x",
                          "augment.simple_random_crop=true", *overrides], capsys)
    assert line in said, said


# ------------------------------------------------------------------------------------------- BCE

@pytest.mark.parametrize("mixup, cutmix", [(0.8, 1.0), (0.8, 0.0), (0.0, 1.0)])
def test_bce_on_mixed_targets_equals_deit3(mixup, cutmix):
    """DeiT III's main.py mixes with timm's Mixup (no smoothing), engine.py binarises the targets at > 0 and
    BCEWithLogitsLoss scores them; ours (PairwiseMixup, build_criterion) gives the same images and loss per seed."""
    augment = AugmentConfig(mixup=mixup, cutmix=cutmix, bce_loss=True)
    ours, criterion = build_mixup(augment, 10), build_criterion(augment)
    theirs = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=0.0, num_classes=10)
    g = torch.Generator().manual_seed(0)
    positives = set()
    for seed in range(20):
        images, labels = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
        logits = 3 * torch.randn(8, 10, generator=g)
        np.random.seed(seed)
        mixed, targets = ours(images.clone(), labels)
        np.random.seed(seed)
        their_mixed, their_targets = theirs(images.clone(), labels)
        assert torch.equal(mixed, their_mixed)
        assert criterion(logits, targets).item() == pytest.approx(deit3.bce_loss(logits, their_targets).item(),
                                                                  rel=1e-6, abs=0)
        positives |= set(deit3.binarised_targets(their_targets).sum(1).tolist())
    assert positives >= {2.0}  # both images of a pair are positives of a mixed image


def test_bce_with_label_smoothing_is_refused_as_deit3s_rule_makes_every_class_positive():
    smoothed = Mixup(mixup_alpha=0.8, label_smoothing=0.1, num_classes=10)(torch.randn(4, 3, 8, 8),
                                                                            torch.arange(4))[1]
    assert deit3.binarised_targets(smoothed).eq(1).all()  # what the refusal prevents
    with pytest.raises(ConfigError, match=r"augment.bce_loss=true .* set augment.label_smoothing=0"):
        AugmentConfig(bce_loss=True, mixup=0.8, label_smoothing=0.1)


# ------------------------------------------------------------------------------------------- LAMB, lr

def test_lamb_is_timms_with_its_weight_decay_groups_and_the_unscaled_lr():
    """optim.optimizer=lamb builds timm's Lamb over the groups timm's own factory makes (no decay on biases, norms,
    position embedding, class token): one step moves every weight as timm's create_optimizer_v2('lamb') does."""
    models = [timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                                num_heads=2, num_classes=4, init_values=1e-4, no_embed_class=True) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optim = OptimConfig(batch_size=64, base_lr=4e-3, lr_base_batch=None, epochs=1, weight_decay=0.05,
                        optimizer="lamb")
    assert optim.lr == 4e-3  # --unscale-lr: base_lr at any batch
    ours = build_optimizer(models[0], optim, optim.lr)
    theirs = timm.optim.create_optimizer_v2(models[1], opt="lamb", lr=4e-3, weight_decay=0.05, eps=1e-8)
    assert type(ours) is timm.optim.Lamb
    assert sorted(g["weight_decay"] for g in ours.param_groups) == [0.0, 0.05]
    images = torch.randn(4, 3, 32, 32)
    for model, optimizer in zip(models, (ours, theirs)):
        for _ in range(2):
            model(images).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name
    adamw = build_optimizer(models[0], OptimConfig(batch_size=64, base_lr=1e-3, lr_base_batch=512, epochs=1,
                                                   weight_decay=0.05), 1e-3)
    decayed = {id(p) for g in adamw.param_groups if g["weight_decay"] for p in g["params"]}
    names = {name for name, p in models[0].named_parameters() if id(p) in decayed}
    assert names and not names & {"cls_token", "pos_embed"} and all(n.endswith(".weight") for n in names), names


# ------------------------------------------------------------------------------------------- recipes

def recipe(name, *overrides):
    return load_config(TrainConfig, ROOT / f"configs/{name}.yaml", ["data.path=/nonexistent", *overrides])


@pytest.mark.parametrize("size, lr, drop_path, input_size", [("small", 4e-3, 0.05, 224), ("base", 3e-3, 0.2, 192)])
def test_deit3_recipes_state_readme_revenge(size, lr, drop_path, input_size):
    for topology, name in (("pre", f"deit3_{size}_patch16_224"), ("siamese", f"deit3_{size}_siamese_patch16_224")):
        cfg = recipe(f"deit3_{size}_{topology}")
        o, a, m, d = cfg.optim, cfg.augment, cfg.model, cfg.data
        assert m.name == name and (m.drop_path, m.drop_path_schedule, m.kwargs) == \
               (drop_path, "uniform", {"init_values": 1e-4})
        assert (o.optimizer, o.batch_size, o.lr, o.weight_decay, o.epochs, o.warmup_epochs, o.warmup_lr, o.min_lr) == \
               ("lamb", 2048, lr, 0.05, 800, 5, 1e-6, 1e-5)
        assert recipe(f"deit3_{size}_{topology}", "optim.batch_size=256").optim.lr == lr  # --unscale-lr
        assert (a.three_augment, a.simple_random_crop, a.auto_augment, a.color_jitter, a.re_prob, a.bce_loss,
                a.label_smoothing, a.mixup, a.cutmix, a.repeated_aug, a.scale, a.hflip) == \
               (True, False, None, 0.3, 0.0, True, 0.0, 0.8, 1.0, 3, (0.08, 1.0), 0.5)
        assert (d.input_size, d.crop_pct, d.interpolation) == (input_size, 1.0, "bicubic")


def test_deit3_base_fine_tune_at_224_states_readme_revenge():
    for topology, name in (("pre", "deit3_base_patch16_224"), ("siamese", "deit3_base_siamese_patch16_224")):
        cfg = recipe(f"deit3_base_{topology}_224")
        o, a, m = cfg.optim, cfg.augment, cfg.model
        assert m.name == name and (m.drop_path, m.drop_path_schedule) == (0.2, "uniform")
        assert (o.optimizer, o.batch_size, o.lr, o.weight_decay, o.epochs, o.warmup_epochs, o.min_lr) == \
               ("adamw", 512, 1e-5, 0.1, 20, 5, 1e-5)
        assert (a.three_augment, a.auto_augment, a.bce_loss, a.label_smoothing, a.repeated_aug, a.re_prob, a.mixup,
                a.cutmix) == (False, "rand-m9-mstd0.5-inc1", False, 0.1, 1, 0.0, 0.8, 1.0)
        assert (cfg.data.input_size, cfg.data.crop_pct) == (224, 1.0)


# ------------------------------------------------------------------------------------------- models

def randomised(model: torch.nn.Module, seed: int = 0) -> dict:
    """The model's state dict with every tensor random (LayerScale gains around 0.5, so that they matter)."""
    g = torch.Generator().manual_seed(seed)
    return {k: (0.5 + 0.2 * torch.randn(v.shape, generator=g)) if k.endswith("gamma") else
            0.1 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("size", ["small", "base"])
def test_timms_deit3_weights_load_into_our_pre_norm_model_with_equal_outputs(size):
    kwargs = dict(img_size=48, num_classes=7, depth=3)
    theirs = timm.create_model(f"deit3_{size}_patch16_224", **kwargs).eval()
    ours = SiameseNormVisionTransformer(topology="pre", patch_size=16, embed_dim=theirs.embed_dim,
                                        num_heads=theirs.blocks[0].attn.num_heads, no_embed_class=True,
                                        init_values=1e-6, **kwargs).eval()
    state = randomised(theirs)
    theirs.load_state_dict(state)
    ours.load_state_dict(state)  # strict: the same keys
    images = torch.randn(2, 3, 48, 48)
    torch.testing.assert_close(ours(images), theirs(images), rtol=1e-5, atol=1e-5)


def test_every_deit3_model_is_a_layerscale_model_and_the_uniform_drop_path_reaches_every_block():
    from timm.layers import DropPath, LayerScale

    from vision.deit import MODEL_NAMES
    from vision.task import uniform_drop_path

    names = [n for n in MODEL_NAMES if n.startswith("deit3_")]
    assert len(names) == 2 * (len(MODEL_TOPOLOGIES) - 2)  # every topology but pre (timm's) and layerscale
    for name in names:
        model = timm.create_model(name, img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3)
        assert model.no_embed_class and model.pos_embed.shape[1] == 4, name
        assert all(isinstance(b.ls1, LayerScale) and isinstance(b.ls2, LayerScale) for b in model.blocks), name
    for model in (timm.create_model("deit3_small_patch16_224", depth=3, drop_path_rate=0.05),
                  timm.create_model("deit3_small_siamese_patch16_224", depth=3, drop_path_rate=0.05)):
        uniform_drop_path(model, 0.05)
        rates = [m.drop_prob for b in model.blocks for n, m in b.named_children() if n.startswith("drop_path")]
        assert rates and all(isinstance(m, DropPath) for b in model.blocks for n, m in b.named_children()
                             if n.startswith("drop_path")) and set(rates) == {0.05}


def test_layerscale_scales_the_update_both_siamese_streams_take():
    model = timm.create_model("deit3_small_siamese_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=3,
                              num_heads=2, num_classes=5).eval()
    assert model.no_embed_class and float(model.blocks[0].ls1.gamma[0]) == pytest.approx(1e-6)
    state = randomised(model, seed=1)
    model.load_state_dict(state)
    images = torch.randn(2, 3, 32, 32)
    expected = deit3.siamese_layerscale_forward(state, images, depth=3, num_heads=2, patch_size=8)
    torch.testing.assert_close(model(images), expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- training

@pytest.mark.fashion_mnist
def test_a_non_finite_step_leaves_lamb_and_the_weights_untouched(tmp_path, monkeypatch):
    """LAMB takes no found_inf: the trainer skips its step from the host. Step 2's loss is made NaN: after it the
    weights and LAMB's step count are those after step 1, and step 3 trains on."""
    from common.trainer import Trainer
    from vision.task import DeiTTask

    cfg = load_config(TrainConfig, ROOT / "configs/fmnist_deit3.yaml", [
        "model.name=deit_tiny_siamese_patch16_224", "model.kwargs={embed_dim: 16, depth: 2, num_heads: 2}",
        "data.num_workers=0", "data.max_train_samples=48", "data.max_val_samples=16", "optim.batch_size=16",
        "train.tensorboard=false", "train.eval_every=0", f"train.output_dir={tmp_path}"])
    calls, after = [], []
    loss = DeiTTask.loss

    def nan_at_step_2(self, model, batch):
        calls.append(1)
        value, parts = loss(self, model, batch)
        return (value * math.nan if len(calls) == 2 else value), parts

    step = Trainer.train_step

    def recording(self, batches):
        step(self, batches)
        after.append(([p.detach().clone() for p in self.model.parameters()],
                      int(self.optimizer.param_groups[0]["step"])))

    monkeypatch.setattr(DeiTTask, "loss", nan_at_step_2)
    monkeypatch.setattr(Trainer, "train_step", recording)
    final = train(cfg)
    assert final["nonfinite_steps"] == 1 and len(after) == 3
    (first, count1), (second, count2), (third, count3) = after
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and (count1, count2, count3) == (1, 1, 2)
    assert not all(torch.equal(a, b) for a, b in zip(second, third))


TRAIN_PER_CLASS, VAL_PER_CLASS, CLASSES, BATCH, EPOCHS = 12, 3, 4, 16, 2


def shrunk(data, out, *more):
    """configs/deit3_small_siamese.yaml with data, sizes and step counts made small; every DeiT III setting stays."""
    return ["--config", ROOT / "configs/deit3_small_siamese.yaml", f"data.path={data}", f"data.num_classes={CLASSES}",
            "data.input_size=32", "data.num_workers=0", "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, "
            "patch_size: 8}", f"optim.batch_size={BATCH}", f"optim.epochs={EPOCHS}", "optim.warmup_epochs=1",
            "train.log_every=1", "train.ckpt_every=2", "train.tensorboard=false", "train.threads=1",
            f"train.output_dir={out}", *more]


def in_process(argv):
    """The command line's run in this process (``train`` returns what a stopped run's exit status 3 says)."""
    return train(load_config(TrainConfig, argv[1], [str(a) for a in argv[2:]]))


def test_shrunk_recipe_trains_and_resumes_on_one_process_and_resumes_on_two(tmp_path):
    """One process: a run stopped mid-epoch and resumed ends with the weights and EMA of the run never stopped (LAMB's
    moments and step counts, the BCE targets, 3-Augment's draws and the uniform drop path all resume). Two processes
    (torchrun, gloo) resume that stopped run to its end: the data order and lr schedule are the same, and the global
    random draws (mixup, drop path) are re-seeded, as a change of process count says."""
    data = tmp_path / "imagenet"
    train_files = write_image_folder(data / "train", CLASSES, TRAIN_PER_CLASS, seed=0)["files"]
    write_image_folder(data / "val", CLASSES, VAL_PER_CLASS, seed=1)
    steps = EPOCHS * (train_files // BATCH)
    full = in_process(shrunk(data, tmp_path / "full"))
    assert full["steps"] == steps and full["nonfinite_steps"] == 0
    assert in_process(shrunk(data, tmp_path / "resumed", "train.stop_at_step=4")) == {"stopped_at": 4}
    shutil.copytree(tmp_path / "resumed", tmp_path / "two")
    in_process(shrunk(data, tmp_path / "resumed"))
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = load_file(tmp_path / "full" / name), load_file(tmp_path / "resumed" / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    config = (tmp_path / "full" / "config.yaml").read_text()
    assert "optimizer: lamb" in config and "bce_loss: true" in config and "three_augment: true" in config

    proc = check(run("vision.train", *shrunk(data, tmp_path / "two"), nproc=2))
    assert "was written by 1 processes, this run has 2" in proc.stderr
    two = json.loads((tmp_path / "two" / "final_metrics.json").read_text())
    assert two["steps"] == steps and two["nonfinite_steps"] == 0 and math.isfinite(two["val/top1"])
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(tmp_path / "full") if "train/lr" in r}
    resumed = {r["step"]: r["train/lr"] for r in read_metrics(tmp_path / "two") if "train/lr" in r}
    assert sorted(resumed) == list(range(1, steps + 1)) and resumed == lrs
    assert f"at step 4/{steps}" in proc.stdout and [r["step"] for r in read_metrics(tmp_path / "two")
                                                  if r.get("event") == "resumed"] == [4]
