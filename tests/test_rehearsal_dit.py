"""Rehearsal of the latent-DiT chain the README promises, with the DiT-B/2 recipe as shipped
(configs/dit_b2_siamese.yaml + dit_recipe.yaml):

    a randomly initialised AutoencoderKL written with save_pretrained
    -> python -m diffusion.extract_latents at 256 px on an ImageNet-like folder with the real thing's oddities
    -> python -m diffusion.train (and torchrun with 2 processes) for a few steps, sample grids on
    -> python -m diffusion.sample (respaced DDPM, learned variance, classifier-free guidance)
    -> python -m diffusion.fid against reference statistics, with an Inception weights file written here.

Only data paths, sizes (model width, class count, grid size) and step counts are changed on the command line:
learned sigma, label dropout, EMA, horizontal flips and TensorBoard stay as the recipe has them, and every data
loader uses worker processes. The VAE downsamples by 8 like the SD VAE, so 256 px images give the recipe's 32x32x4
latents. Inception features are taken at its 64-d first pooling layer (the code path of layer 2048, much cheaper).
"""
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from diffusion.evaluation.features import write_random_inception
from common.logging import read_metrics
from tests.rehearsal import ROOT, check, recipe_changes, run, write_image_folder

CLASSES, PER_CLASS, BATCH, STEPS, SAMPLES = 3, 6, 8, 4, 6
pytestmark = pytest.mark.filterwarnings("ignore:.*covariance is singular:UserWarning")
torch.set_num_threads(1)


def shrunk(latents, vae, out):
    return ["--config", ROOT / "configs/dit_b2_siamese.yaml", f"data.path={latents}", f"data.autoencoder={vae}",
            f"data.num_classes={CLASSES}", "data.num_workers=2", "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}",
            f"optim.batch_size={BATCH}", f"optim.steps={STEPS}", "train.log_every=1", "train.sample_every=2",
            "train.sample_count=4", "train.sample_steps=5", f"train.output_dir={out}"]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Images -> VAE -> latents -> one-process training run (each command's exit status and output kept for the
    tests)."""
    from diffusers import AutoencoderKL

    root = tmp_path_factory.mktemp("dit_chain")
    images = write_image_folder(root / "imagenet" / "train", CLASSES, PER_CLASS, seed=2)
    torch.manual_seed(0)
    AutoencoderKL(block_out_channels=(8, 8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, latent_channels=4, norm_num_groups=4,
                  sample_size=256).save_pretrained(root / "vae")
    extract = run("diffusion.extract_latents", "--data-path", root / "imagenet" / "train", "--vae", root / "vae",
                  "--out", root / "latents", "--num-workers", 2)
    trained = run("diffusion.train", *shrunk(root / "latents", root / "vae", root / "run")) if extract.returncode == 0 else None
    return {"root": root, "images": images, "extract": extract, "train": trained}


def test_extract_latents_at_256px_skips_the_truncated_file(chain):
    proc = check(chain["extract"])
    images, root = chain["images"], chain["root"]
    assert f"skipping unreadable image {images['truncated']}" in proc.stderr
    meta = json.loads((root / "latents" / "metadata.json").read_text())
    assert meta["skipped"] == [images["truncated"]]
    assert (meta["count"], meta["num_listed"], meta["image_size"]) == (images["files"] - 1, images["files"], 256)
    assert meta["latent_shape"] == [4, 32, 32] and len(meta["classes"]) == CLASSES
    with safe_open(str(root / "latents" / meta["shards"][0]["file"]), "pt") as f:
        mean, logvar = f.get_tensor("mean"), f.get_tensor("logvar")
    assert mean.shape == (images["files"] - 1, 2, 4, 32, 32) and mean.dtype == torch.float16
    assert torch.isfinite(mean).all() and torch.isfinite(logvar).all()


def test_extract_latents_under_torchrun_from_a_dataset_splits_the_shards(chain, tmp_path):
    """Two processes (gloo on a CPU) share the shards out and give the one-process latents, reading the folder
    converted to a Hugging Face dataset (python -m vision.shard --format hf): the same images, labels and order."""
    from vision import shard

    check(chain["extract"])
    root, images = chain["root"], chain["images"]
    shard.main(["--data-path", str(root / "imagenet" / "train"), "--out", str(tmp_path / "hf"), "--format", "hf",
                "--shard-size", "7"])
    proc = check(run("diffusion.extract_latents", "--data-path", tmp_path / "hf", "--data-format", "hf", "--vae",
                     root / "vae", "--out", tmp_path / "latents", "--num-workers", 1, "--shard-size", 8, nproc=2))
    # Each process takes every 2nd shard and rank 0 alone writes the summary (two processes that each ran alone
    # would each encode every shard and print it).
    assert "-> 3 shards of 8 over 2 process(es)" in proc.stdout and proc.stdout.count("wrote ") == 1, proc.stdout
    one = json.loads((root / "latents" / "metadata.json").read_text())
    two = json.loads((tmp_path / "latents" / "metadata.json").read_text())
    assert (two["count"], two["classes"], two["num_listed"]) == (one["count"], one["classes"], one["num_listed"])
    truncated = images["truncated"].rsplit("/", 1)[-1]
    assert len(two["skipped"]) == 1 and two["skipped"][0].endswith(f" ({truncated})"), two["skipped"]
    with safe_open(str(root / "latents" / one["shards"][0]["file"]), "pt") as f:
        want, labels, indices = f.get_tensor("mean").float(), f.get_tensor("label"), f.get_tensor("index")
    got = [load_file(tmp_path / "latents" / s["file"]) for s in two["shards"]]
    torch.testing.assert_close(torch.cat([g["mean"].float() for g in got]), want, atol=2e-3, rtol=2e-3)  # float16
    assert torch.equal(torch.cat([g["label"] for g in got]), labels)
    assert torch.equal(torch.cat([g["index"] for g in got]), indices)  # the folder's order


def test_train_the_recipe_on_the_latents_with_sample_grids(chain):
    check(chain["extract"])
    check(chain["train"])
    out = chain["root"] / "run"
    # The command line changed data, sizes and step counts only: learned sigma, label dropout, EMA, flips, the
    # diffusion schedule and TensorBoard are the recipe's.
    assert set(recipe_changes(ROOT / "configs/dit_b2_siamese.yaml", out)) == {
        "data.autoencoder", "data.num_classes", "data.num_workers", "optim.batch_size", "optim.steps",
        "train.log_every", "train.sample_every", "train.sample_count", "train.sample_steps", "train.output_dir"}

    records = [r for r in read_metrics(out) if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["train/loss"]) and r["train/vb"] > 0 for r in records)  # MSE + VLB (learned sigma)
    assert list((out / "tb").rglob("events.out.tfevents.*"))
    for step in (2, 4):  # 4 decoded 256 px images, 2 per row, 4 px padding, a class caption under each
        with Image.open(out / "samples" / f"step_{step:09d}.png") as grid:
            assert grid.size == (2 * (256 + 4) + 4, 2 * (256 + 4 + 18) + 4)
    with safe_open(str(out / "ema.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["input_size"], meta["in_channels"], meta["learn_sigma"], meta["autoencoder"]) == \
           ("32", "4", "True", str(chain["root"] / "vae"))


def test_train_under_torchrun_matches_one_process(chain, tmp_path):
    """Every random draw of a training example is seeded per sample: 2 processes train the same weights."""
    check(chain["extract"])
    check(chain["train"])
    root = chain["root"]
    check(run("diffusion.train", *shrunk(root / "latents", root / "vae", tmp_path), nproc=2))
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert [r for r in read_metrics(tmp_path) if "world_size" in r][0]["world_size"] == 2
    one = [r["train/loss"] for r in read_metrics(root / "run") if "train/loss" in r]
    two = [r["train/loss"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert two == pytest.approx(one, rel=1e-5)
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = load_file(root / "run" / name), load_file(tmp_path / name)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5, msg=f"{name}: {k}")
    assert (tmp_path / "samples" / f"step_{STEPS:09d}.png").is_file()


def test_sample_then_fid_against_reference_statistics(chain, tmp_path):
    check(chain["extract"])
    check(chain["train"])
    root = chain["root"]
    samples = tmp_path / "samples"
    check(run("diffusion.sample", "--checkpoint", root / "run" / "ema.safetensors", "--num-samples", SAMPLES,
              "--out-dir", samples, "--steps", 5, "--cfg-scale", 4.0, "--batch-size", 4, "--quiet"))
    with np.load(samples / "samples.npz") as npz:
        images, labels = npz["arr_0"], npz["arr_1"]
    assert images.shape == (SAMPLES, 256, 256, 3) and images.dtype == np.uint8
    assert labels.tolist() == [i % CLASSES for i in range(SAMPLES)]
    protocol = json.loads((samples / "protocol.json").read_text())
    assert (protocol["sampler"], protocol["steps"], protocol["cfg_scale"], protocol["guided_channels"]) == \
           ("ddpm", 5, 4.0, "3")
    assert protocol["vae"] == str(root / "vae")

    # The reference statistics, as ADM's VIRTUAL_imagenet256_labeled.npz holds them for ImageNet: from the raw
    # training folder (odd sizes, a truncated file) with ADM's centre crop, through the user command.
    readable = [p for p in sorted((root / "imagenet" / "train").rglob("*.JPEG")) if p.name != "truncated.JPEG"]
    weights = write_random_inception(tmp_path / "inception.pth")
    check(run("diffusion.fid", "--samples", root / "imagenet" / "train", "--save-stats", tmp_path / "ref.npz",
              "--center-crop", 256, "--extractor-weights", weights, "--feature-layer", 64, "--device", "cpu",
              "--quiet"))
    check(run("diffusion.fid", "--samples", samples / "samples.npz", "--reference", tmp_path / "ref.npz",
              "--num-samples", SAMPLES, "--out", tmp_path / "fid.json", "--extractor-weights", weights,
              "--feature-layer", 64, "--device", "cpu", "--quiet"))
    result = json.loads((tmp_path / "fid.json").read_text())
    assert math.isfinite(result["metrics"]["fid"]) and result["metrics"]["fid"] > 0
    assert result["protocol"]["samples"]["count"] == SAMPLES
    assert result["protocol"]["samples"]["sampling"]["cfg_scale"] == 4.0
    assert result["protocol"]["reference"]["statistics"]["count"] == len(readable)
