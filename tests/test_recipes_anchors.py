"""The size recipes past the paper's table (DeiT-B, DiT-XL/2): each loads through the trainers' loader, picks its
model over the shared recipe and nothing else, and runs a training step with only sizes (and, for DiT, the data)
shrunk on the command line."""
from pathlib import Path

import pytest
import torch

from common.config import config_to_dict, load_config
from tests.rehearsal import recipe_changes, write_image_folder

ROOT = Path(__file__).resolve().parents[1]
TINY_DEIT = ["model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
             "data.num_workers=0", "train.tensorboard=false", "train.threads=1"]
torch.set_num_threads(1)


@pytest.mark.parametrize("topology, name", [("pre", "deit_base_patch16_224"), ("post", "deit_base_post_patch16_224"),
                                            ("siamese", "deit_base_siamese_patch16_224")])
def test_deit_base_recipes_pick_deit_b_over_the_shared_recipe(topology, name):
    from vision.train import TrainConfig

    cfg = load_config(TrainConfig, ROOT / f"configs/deit_base_{topology}.yaml", ["data.path=/nonexistent"])
    tiny = load_config(TrainConfig, ROOT / f"configs/deit_tiny_{topology}.yaml", ["data.path=/nonexistent"])
    cfg.model.check_registered()
    assert cfg.model.name == name and cfg.train.output_dir == f"runs/deit_base_{topology}"
    base, other = config_to_dict(cfg), config_to_dict(tiny)
    for d in (base, other):
        d["model"].pop("name"), d["train"].pop("output_dir")
    assert base == other  # every other number is the shared recipe's
    import timm
    import vision  # noqa: F401  (registers our DeiTs)

    with torch.device("meta"):
        model = timm.create_model(name)
    assert (model.embed_dim, len(model.blocks), model.blocks[0].attn.num_heads) == (768, 12, 12)


@pytest.mark.filterwarnings("ignore:skipping unreadable image")
def test_deit_base_recipe_trains_a_step_with_sizes_shrunk(tmp_path):
    from vision.train import TrainConfig, train

    write_image_folder(tmp_path / "data" / "train", 2, 4, seed=0)
    write_image_folder(tmp_path / "data" / "val", 2, 3, seed=1)
    out = tmp_path / "run"
    cfg = load_config(TrainConfig, ROOT / "configs/deit_base_siamese.yaml",
                      [*TINY_DEIT, f"data.path={tmp_path / 'data'}", "data.num_classes=2", "optim.batch_size=8",
                       "optim.epochs=1", "optim.warmup_epochs=0", f"train.output_dir={out}"])
    final = train(cfg)
    assert final["steps"] >= 1 and final["nonfinite_steps"] == 0
    assert set(recipe_changes(ROOT / "configs/deit_base_siamese.yaml", out)) == {
        "data.num_classes", "data.input_size", "data.num_workers", "optim.batch_size", "optim.epochs",
        "optim.warmup_epochs", "train.output_dir"}  # the recipe's keys the command line changed: sizes only


@pytest.mark.parametrize("topology", ["pre", "siamese"])
def test_dit_xl2_recipes_build_the_official_network(topology):
    """The recipe's model is DiT-XL/2 as the official DiT-XL-2-256x256.pt describes it (the published DiT's values),
    with only the topology chosen: that file loads into the Pre-Norm one."""
    from diffusion.spec import DiTSpec
    from diffusion.train import TrainConfig

    cfg = load_config(TrainConfig, ROOT / f"configs/dit_xl2_{topology}.yaml", ["data.path=/nonexistent"])
    b2 = load_config(TrainConfig, ROOT / f"configs/dit_b2_{topology}.yaml", ["data.path=/nonexistent"])
    spec = DiTSpec(**DiTSpec.from_train_config(config_to_dict(cfg), (4, 32, 32)))  # the SD VAE's latents of 256 px
    assert spec.dit_kwargs() == DiTSpec.published("DiT-XL/2", topology=topology).dit_kwargs()
    assert cfg.train.output_dir == f"runs/dit_xl2_{topology}"
    xl, other = config_to_dict(cfg), config_to_dict(b2)
    for d in (xl, other):
        d["model"].pop("name"), d["train"].pop("output_dir")
    assert xl == other  # every other number is the shared recipe's


@pytest.mark.fashion_mnist
def test_dit_xl2_recipe_trains_a_step_with_sizes_shrunk(tmp_path):
    from diffusion.train import TrainConfig, train

    cfg = load_config(TrainConfig, ROOT / "configs/dit_xl2_siamese.yaml", [
        "data.dataset=fashion_mnist", "data.path=null", "data.autoencoder=none", "data.image_size=32",
        "data.num_classes=10", "data.max_samples=8", "data.num_workers=0",
        "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "optim.batch_size=4", "optim.steps=1",
        "train.sample_every=0", "train.tensorboard=false", "train.threads=1", f"train.output_dir={tmp_path}"])
    final = train(cfg)
    assert final["steps"] == 1 and final["loss"] > 0


@pytest.mark.parametrize("topology, name", [("pre", "deit_base_distilled_patch16_384"),
                                            ("siamese", "deit_base_siamese_distilled_patch16_224")])
def test_the_384_distillation_recipes_are_the_384_fine_tune_with_deits_distillation(topology, name):
    """docs/deit.md's 384 px fine-tune combined with distillation: the 384 recipe's numbers, deit_distill.yaml's
    teacher and weights, a distilled DeiT-B; nothing else."""
    from vision.train import TrainConfig

    paths = ["data.path=/nonexistent", "distill.teacher_weights=/x"]
    cfg = load_config(TrainConfig, ROOT / f"configs/deit_base_{topology}_distilled_384.yaml", paths)
    plain = load_config(TrainConfig, ROOT / f"configs/deit_base_{topology}_384.yaml", paths)
    d = cfg.distill
    assert cfg.model.name == name and cfg.train.output_dir == f"runs/deit_base_{topology}_distilled_384"
    assert (d.type, d.teacher, d.alpha, d.tau, cfg.data.input_size) == ("hard", "regnety_160", 0.5, 1.0, 384)
    distilled, other = config_to_dict(cfg), config_to_dict(plain)
    for c in (distilled, other):
        c.pop("distill"), c["model"].pop("name"), c["train"].pop("output_dir")
    assert distilled == other  # the 384 fine-tune's numbers, unchanged
    cfg.model.check_registered()


@pytest.mark.filterwarnings("ignore:skipping unreadable image")
def test_the_384_distillation_recipe_fine_tunes_a_distilled_run_with_sizes_shrunk(tmp_path, capsys):
    import timm

    import vision  # noqa: F401  (registers our DeiTs)
    from common.checkpoint import save_weights
    from vision.train import TrainConfig, train

    write_image_folder(tmp_path / "data" / "train", 2, 4, seed=0)
    write_image_folder(tmp_path / "data" / "val", 2, 3, seed=1)
    torch.manual_seed(0)
    tiny = dict(embed_dim=32, depth=2, num_heads=2, patch_size=8, num_classes=2)
    save_weights(timm.create_model("deit_base_siamese_distilled_patch16_224", img_size=32, **tiny),
                 tmp_path / "224.safetensors")  # the run at the lower resolution
    torch.save({"model": timm.create_model("regnety_002", num_classes=2).state_dict()}, tmp_path / "teacher.pth")
    out = tmp_path / "run"
    capsys.readouterr()
    final = train(load_config(TrainConfig, ROOT / "configs/deit_base_siamese_distilled_384.yaml", [
        *TINY_DEIT, "data.input_size=48", f"data.path={tmp_path / 'data'}", "data.num_classes=2", "optim.batch_size=8",
        "optim.epochs=1", "optim.warmup_epochs=0", f"train.finetune={tmp_path / '224.safetensors'}",
        "distill.teacher=regnety_002", f"distill.teacher_weights={tmp_path / 'teacher.pth'}", f"train.output_dir={out}"]))
    assert final["steps"] >= 1 and final["nonfinite_steps"] == 0
    assert "position embedding resampled from a 4x4 grid to 6x6" in capsys.readouterr().out
    assert set(recipe_changes(ROOT / "configs/deit_base_siamese_distilled_384.yaml", out)) == {
        "data.num_classes", "data.input_size", "data.num_workers", "optim.batch_size", "optim.epochs",
        "optim.warmup_epochs", "train.output_dir", "distill.teacher"}  # sizes, and a teacher of a test's size
