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
    spec = DiTSpec(**DiTSpec.from_train_config(config_to_dict(cfg)))
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
