"""Bad input, each as a user meets it: a refusal in one line naming the problem and the fix, or a run that goes on,
never a silent wrong run, a traceback or lost data.

Folder oddities (symlink loops, empty classes, train/val class names that differ), latents paired with another
VAE, a VAE replaced in place under a resumed extraction, non-finite settings, sample grids and FIDs of NaN weights,
a full disk, damaged weights files, missing optional pieces (classifier weights, DALI), several processes. A command
runs as its entry point's ``main(argv)`` in this process (``tests/refusals.py``), except under torchrun.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.config import ConfigError, load_config
from common.data import ImageFolderError, image_files, scan_image_folder
from common.durable import DiskWriteError
from common.logging import NonFiniteLossError, read_metrics
from tests.refusals import refusal, refused
from tests.rehearsal import free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DEIT = ["model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
        "data.num_workers=0", "train.tensorboard=false", "train.threads=1", "optim.batch_size=4", "optim.epochs=1",
        "train.log_every=1"]
TINY_DIT = ["model.name=DiT-S/4", "model.kwargs={hidden_size: 32, depth: 1, num_heads: 2}", "data.image_size=32",
            "data.num_workers=0", "optim.batch_size=4", "optim.steps=2", "train.sample_count=2", "train.sample_steps=2",
            "train.tensorboard=false", "train.threads=1"]


def write_folder(root: Path, classes, per_class: int = 4, size: int = 20) -> Path:
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    return root


def tiny_vae(path: Path, scaling_factor: float = 0.18215, seed: int = 0) -> Path:
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8, sample_size=32,
                  scaling_factor=scaling_factor).save_pretrained(path)
    return path


def extract(images: Path, vae: Path, out: Path):
    from diffusion.extract_latents import main

    return main(["--data-path", str(images), "--vae", str(vae), "--out", str(out), "--image-size", "32",
                 "--shard-size", "4", "--batch-size", "4", "--num-workers", "0"])


def dit_cfg(*overrides):
    from diffusion.train import TrainConfig

    return load_config(TrainConfig, ROOT / "configs/dit_b2_siamese.yaml", [*TINY_DIT, *overrides])


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    """Latents of a 2-class folder named like ImageNet-21k WordNet ids (not ImageNet-1k ones), and their VAE."""
    root = tmp_path_factory.mktemp("bad_input_latents")
    images = write_folder(root / "images", ["n99999999", "n88888888"], per_class=4, size=40)
    vae = tiny_vae(root / "vae")
    meta = extract(images, vae, root / "lat")
    return root, meta


# ------------------------------------------------------------------------------------------- folders

def test_a_symlink_loop_is_refused_naming_the_link(tmp_path):
    train = write_folder(tmp_path / "data" / "train", ["c0", "c1"])
    write_folder(tmp_path / "data" / "val", ["c0", "c1"])
    (train / "c0" / "loop").symlink_to("..")
    with pytest.raises(ImageFolderError, match=r"c0/loop is a symlink loop"):
        image_files(train)
    with pytest.raises(ImageFolderError, match=r"c0/loop is a symlink loop"):
        scan_image_folder(train)
    from vision.data import DataConfig, build_dataset

    with pytest.raises(ImageFolderError, match=r"c0/loop is a symlink loop.*expected the layout"):
        build_dataset(DataConfig(path=str(tmp_path / "data"), num_classes=2), "train")
    from diffusion.evaluation.images import FolderImages, MetricsError

    with pytest.raises(MetricsError, match="symlink loop"):
        FolderImages(train)


def test_a_loop_through_two_links_is_refused_and_a_plain_link_is_followed(tmp_path):
    folder = write_folder(tmp_path / "train", ["c0"])
    other = write_folder(tmp_path / "other", ["x"])
    (folder / "c0" / "more").symlink_to(other / "x")  # a link to images elsewhere: followed, as torchvision does
    assert len(image_files(folder)) == 8
    classes, samples = scan_image_folder(folder)
    from torchvision.datasets.folder import find_classes, make_dataset

    assert (classes, samples) == (find_classes(str(folder))[0], make_dataset(str(folder), {"c0": 0}, (".png",)))
    (other / "x" / "back").symlink_to(folder / "c0")  # c0 -> more -> back -> c0 ...
    with pytest.raises(ImageFolderError, match="more/back is a symlink loop"):
        image_files(folder)


def test_an_empty_class_folder_is_named_with_its_split(tmp_path, capsys):
    from vision import train as deit_train

    write_folder(tmp_path / "data" / "train", ["c0", "c1"])
    write_folder(tmp_path / "data" / "val", ["c0", "c1"])
    (tmp_path / "data" / "train" / "c2").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        deit_train.main(["--config", str(ROOT / "configs/deit_tiny_siamese.yaml"), *DEIT,
                         f"data.path={tmp_path / 'data'}", "data.num_classes=3", f"train.output_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"class folder {tmp_path / 'data' / 'train' / 'c2'} and its sub-folders hold no images" in err
    assert not (tmp_path / "run").exists()


def test_train_and_val_with_other_class_names_are_refused(tmp_path, capsys):
    from vision import train as deit_train

    write_folder(tmp_path / "data" / "train", ["c0", "c1", "c2"])
    write_folder(tmp_path / "data" / "val", ["c0", "c1", "c3"])
    with pytest.raises(SystemExit) as exit_info:
        deit_train.main(["--config", str(ROOT / "configs/deit_tiny_siamese.yaml"), *DEIT,
                         f"data.path={tmp_path / 'data'}", "data.num_classes=3", f"train.output_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "train and val class folders differ (only in train: c2; only in val: c3)" in err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------- latents and VAEs

def test_grids_of_classes_imagenet_1k_does_not_know_use_the_folder_names(latents, tmp_path):
    from diffusion.sampling.grids import class_names
    from diffusion.train import train

    assert class_names(3, names=["n99999999", "n01440764", "cat"]) == ["n99999999", "tench", "cat"]
    root, meta = latents
    final = train(dit_cfg(f"data.path={root / 'lat'}", f"data.autoencoder={root / 'vae'}", "data.num_classes=2",
                          "train.sample_every=1", f"train.output_dir={tmp_path / 'run'}"))
    assert final["steps"] == 2
    assert sorted(p.name for p in (tmp_path / "run" / "samples").iterdir()) == ["step_000000001.png", "step_000000002.png"]


@pytest.mark.parametrize("grids", ["train.sample_every=1", "train.sample_every=0"])
def test_latents_refuse_a_vae_other_than_theirs(latents, tmp_path, grids):
    """Refused before any work, with or without grids: the weights record data.autoencoder as their VAE."""
    from diffusion.sampling.decoder import VAEMismatchError

    root, meta = latents
    assert len(meta["vae_sha256"]) == 64
    other_scale = tiny_vae(tmp_path / "sdxl_like", scaling_factor=0.13025)
    other_weights = tiny_vae(tmp_path / "retrained", seed=1)
    from diffusion.train import train

    for vae, differs in ((other_scale, "scaling factor 0.13025"), (other_weights, "weights sha256")):
        with pytest.raises(VAEMismatchError, match=rf"data.autoencoder={vae} is not the VAE the latents in .* were "
                                                   rf"encoded with .*this one: .*{differs}"):
            train(dit_cfg(f"data.path={root / 'lat'}", f"data.autoencoder={vae}", "data.num_classes=2", grids,
                          "train.fid_every=0", f"train.output_dir={tmp_path / 'run'}"))
        assert not (tmp_path / "run" / "checkpoints").exists()


def test_weights_trained_on_latents_refuse_another_vae_when_sampled(latents, tmp_path, capsys):
    """Trained without grids (no VAE loaded), the weights still record the latents' VAE; sampling checks it."""
    from diffusion.sample import main as sample
    from diffusion.train import train

    root, meta = latents
    train(dit_cfg(f"data.path={root / 'lat'}", "data.autoencoder=none", "data.num_classes=2", "train.sample_every=0",
                  f"train.output_dir={tmp_path / 'run'}"))
    other = tiny_vae(tmp_path / "other", seed=1)
    ema = tmp_path / "run" / "ema.safetensors"
    err = refusal(sample, ["--checkpoint", ema, "--vae", other, "--grid", tmp_path / "g.png", "--steps", "2"], capsys)
    assert "is not the VAE the model was trained on" in err and meta["vae_sha256"][:16] in err
    sample([str(a) for a in ("--checkpoint", ema, "--vae", root / "vae", "--grid", tmp_path / "g.png", "--steps", "2",
                             "--quiet")])
    assert (tmp_path / "g.png").is_file()


def train_on_latents(folder: Path, out: Path, capsys) -> str:
    """``diffusion.train`` on the latents in ``folder`` without a VAE, which must refuse them: its one line."""
    from diffusion.train import main

    return refusal(main, ["--config", ROOT / "configs/dit_b2_siamese.yaml", *TINY_DIT, f"data.path={folder}",
                          "data.autoencoder=none", "data.num_classes=2", "train.sample_every=0",
                          f"train.output_dir={out}"], capsys)


def test_a_truncated_latent_shard_is_one_line_naming_it_and_its_fix(latents, tmp_path, capsys):
    import shutil

    from diffusion.latents import LatentDataset

    root, meta = latents
    folder = Path(shutil.copytree(root / "lat", tmp_path / "lat"))
    shard = folder / "shard_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    err = train_on_latents(folder, tmp_path / "run", capsys)
    assert f"{shard} is damaged or truncated" in err and "re-run the extraction that made them" in err, err
    assert f"--out {folder}" in err and "it rewrites the damaged shards only" in err
    assert not (tmp_path / "run").exists()
    extract(root / "images", root / "vae", folder)  # the fix the line names
    assert len(LatentDataset(folder)) == meta["count"]


def test_latents_carry_their_scale_and_a_metadata_that_disagrees_is_refused(latents, tmp_path, capsys):
    """The shards record the scaling factor they were made with; an edited metadata.json, or a shard of another
    extraction, stops the run before it trains at a scale its latents were not made with."""
    import shutil

    from safetensors import safe_open

    root, meta = latents
    for entry in meta["shards"]:
        with safe_open(str(root / "lat" / entry["file"]), "pt") as f:
            assert json.loads(f.metadata()["scaling_factor"]) == meta["scaling_factor"] == pytest.approx(0.18215)
    folder = Path(shutil.copytree(root / "lat", tmp_path / "lat"))
    edited = {**meta, "scaling_factor": 1.0}
    (folder / "metadata.json").write_text(json.dumps(edited))
    err = train_on_latents(folder, tmp_path / "run", capsys)
    assert "says scaling_factor 1.0 but shard_00000.safetensors was made with 0.18215" in err, err
    assert "Restore metadata.json" in err and not (tmp_path / "run").exists()
    (folder / "metadata.json").write_text(json.dumps(meta))
    other = tmp_path / "other_lat"
    extract(root / "images", tiny_vae(tmp_path / "sdxl_like", scaling_factor=0.13025), other)
    shutil.copy(other / "shard_00001.safetensors", folder / "shard_00001.safetensors")  # a shard of another extraction
    err = train_on_latents(folder, tmp_path / "run", capsys)
    assert "but shard_00001.safetensors was made with" in err and "belongs to another extraction" in err, err
    # (latents whose shards and metadata agree train: test_grids_of_classes_imagenet_1k_does_not_know_... above)


def test_latents_of_the_first_format_are_refused_saying_why(latents, tmp_path, capsys):
    import shutil

    root, meta = latents
    folder = Path(shutil.copytree(root / "lat", tmp_path / "lat"))
    (folder / "metadata.json").write_text(json.dumps({**meta, "format": "siamesenorm-latents-v1"}))
    err = train_on_latents(folder, tmp_path / "run", capsys)
    assert "do not record the VAE scaling factor they were made with" in err and "extract the latents again" in err


def test_repa_on_latents_extracted_without_images_is_one_line(latents, tmp_path, capsys):
    from diffusion.train import main

    root, _ = latents
    repa = ["repa.weight=0.5", "repa.depth=1", "repa.encoder=vit_tiny_patch16_224",
            f"repa.encoder_weights={tmp_path / 'encoder.safetensors'}", "repa.encoder_image_size=64",
            "repa.projector_dim=16"]
    err = refusal(main, ["--config", ROOT / "configs/dit_b2_siamese.yaml", *TINY_DIT, f"data.path={root / 'lat'}",
                         "data.autoencoder=none", "data.num_classes=2", "train.sample_every=0", *repa,
                         f"train.output_dir={tmp_path / 'run'}"], capsys)
    assert f"the latents in {root / 'lat'} hold no images" in err and "extract them again with --images" in err
    assert "repa.weight=0" in err and not (tmp_path / "run").exists()


def test_extraction_resume_refuses_a_vae_replaced_in_place(tmp_path):
    from diffusion.extract_latents import main as extract_main

    images = write_folder(tmp_path / "images", ["a", "b"], per_class=4, size=40)
    vae = tiny_vae(tmp_path / "vae")
    extract(images, vae, tmp_path / "lat")
    (tmp_path / "lat" / "shard_00001.safetensors").unlink()  # an interrupted extraction
    tiny_vae(vae, seed=1)  # other weights at the same path
    with pytest.raises(SystemExit, match="encoded by other VAE weights than --vae .* replaced in place") as exit_info:
        extract_main(["--data-path", str(images), "--vae", str(vae), "--out", str(tmp_path / "lat"), "--image-size",
                      "32", "--shard-size", "4", "--batch-size", "4", "--num-workers", "0"])
    assert exit_info.value.code == 2


# ------------------------------------------------------------------------------------------- sampling

@pytest.fixture(scope="module")
def tiny_dits(tmp_path_factory):
    """``{"ddpm", "flow"}``: a 1-channel pixel DiT as Fashion-MNIST's, and the same weights as a flow-matching model."""
    from diffusion.transport import Transport
    from tests.test_sample import save_tiny, save_with

    root = tmp_path_factory.mktemp("tiny_dits")
    ddpm = save_tiny(root / "ddpm.safetensors")
    return {"ddpm": ddpm, "flow": save_with(ddpm, root / "flow.safetensors",
                                            transport=json.dumps(Transport().description()))}


@pytest.mark.parametrize("model, options, says", [
    ("ddpm", ["--cfg-scale", "-1.5"], "--cfg-scale -1.5 would reverse the guidance: give a scale >= 0 (1: no guidance"),
    ("ddpm", ["--cfg-scale", "1.5", "--guided-channels", "3"],
     "--guided-channels 3: this model has 1 output channel to guide; give 1 or 'all', or leave it out"),
    ("ddpm", ["--eta", "0.5"], "--eta 0.5 is the noise of --sampler ddim, and this command samples with ddpm: add "
                               "--sampler ddim, or drop --eta"),
    ("flow", ["--eta", "0.5"], "this command samples with sde-euler: drop --eta (this model was trained with SiT's "
                               "transport, whose samplers have no eta)"),
    ("flow", ["--sampler", "euler", "--atol", "1e-5"], "--atol: --sampler euler does not read it (--atol and --rtol set "
                                                       "dopri5's adaptive steps"),
    ("flow", ["--sampler", "heun", "--rtol", "1e-2", "--last-step", "euler"],
     "--rtol, --last-step: --sampler heun does not read them"),
], ids=["negative cfg", "guided channels", "eta ddpm", "eta flow", "atol euler", "rtol last-step heun"])
def test_sampling_options_that_would_be_ignored_or_reverse_guidance_are_refused(tiny_dits, tmp_path, capsys, model,
                                                                                options, says):
    from diffusion.sample import main

    err = refusal(main, ["--checkpoint", tiny_dits[model], "--grid", tmp_path / "g.png", "--steps", "3", *options],
                  capsys)
    assert says in err, err
    assert not (tmp_path / "g.png").exists()


def test_a_misspelt_fashion_mnist_split_is_one_line(tmp_path, capsys):
    from diffusion.fid import main

    np.savez(tmp_path / "s.npz", np.zeros((4, 28, 28, 1), np.uint8))
    for argv in (["--samples", tmp_path / "s.npz", "--reference", "fashion-mnist:tset"],
                 ["--samples", "fashion-mnist:tset", "--reference", tmp_path / "s.npz"]):
        err = refusal(main, [*argv, "--feature-extractor", "fmnist-cnn", "--quiet"], capsys)
        assert err == "error: Fashion-MNIST has no split 'tset': choose train or test"


def test_a_split_name_fashion_mnist_would_ignore_is_refused_naming_its_splits(capsys):
    """Fashion-MNIST's splits are fixed, so a split name there would be ignored: it is refused instead."""
    from vision.evaluate import main

    err = refusal(main, ["--config", "configs/fmnist_deit3.yaml", "model.name=deit_tiny_patch16_224",
                          "data.val_split=train"], capsys)
    assert err == ("error: data.val_split=train: data.dataset=fashion_mnist has fixed splits (training on its 60,000 "
                   "train images, evaluation on its 10,000 test images); the split names are folders of an "
                   "imagefolder data.path: leave them out")


# ------------------------------------------------------------------------------------------- settings

@pytest.mark.parametrize("override", ["optim.base_lr=.nan", "optim.base_lr=.inf", "optim.min_lr=-.inf",
                                      "augment.mixup=.nan", "optim.betas=[0.9, .nan]"])
def test_non_finite_numbers_are_refused_for_every_float_setting(override):
    from vision.train import TrainConfig

    with pytest.raises(ConfigError, match="must be a finite number"):
        load_config(TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml", [override])


def test_a_yaml_file_with_a_tab_is_one_line(tmp_path, capsys):
    from vision.train import main

    recipe = tmp_path / "tab.yaml"
    recipe.write_text("optim:\n\tbatch_size: 8\n")
    err = refusal(main, ["--config", recipe], capsys)
    assert err == f"error: {recipe} is not valid YAML: found character '\\t' that cannot start any token at line 2, " \
                  "column 1 (YAML indents with spaces, never tabs)"


@pytest.mark.fashion_mnist
def test_grids_and_fids_of_nan_weights_do_not_stop_the_run_before_the_non_finite_guard(tmp_path, capsys):
    """At lr 1e20 the first step blows the weights up; the grid and the FID of the next steps see NaN samples. The
    run must end as documented: the non-finite guard's error, after drawing the grids (black) and logging NaN FIDs."""
    from diffusion.train import TrainConfig, train

    weights = tmp_path / "fmnist_cnn.safetensors"
    from scripts import train_fmnist_classifier

    train_fmnist_classifier.main(["--out", str(weights), "--epochs", "1", "--limit", "256", "--batch-size", "64"])
    cfg = load_config(TrainConfig, ROOT / "configs/fmnist_dit_siamese.yaml", [
        "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "data.num_workers=0", "train.tensorboard=false",
        "train.threads=1", "data.max_samples=32", "optim.batch_size=8", "optim.steps=8", "optim.lr=1e20",
        "train.ema_decay=0.5", "train.log_every=1", "train.max_nonfinite=3", "train.sample_every=1",
        "train.sample_count=2", "train.sample_steps=2", "train.fid_every=1", "train.fid_samples=4", "train.fid_steps=2",
        f"train.fid_extractor_weights={weights}", f"train.output_dir={tmp_path / 'run'}"])
    with pytest.raises(NonFiniteLossError):
        train(cfg)
    out = capsys.readouterr().out
    assert "samples are not finite (drawn black)" in out and "fid/fd is NaN" in out
    assert (tmp_path / "run" / "samples" / "step_000000002.png").is_file()
    fids = [r["fid/fd"] for r in read_metrics(tmp_path / "run") if "fid/fd" in r]
    assert "nan" in fids


# ------------------------------------------------------------------------------------------- files

@pytest.fixture
def small_disk(tmp_path):
    """A 1200 KiB file system (tmpfs): two checkpoints of the tiny DeiT fit, a third does not. Skipped where this
    process may not mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.decode().strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.fashion_mnist
def test_a_full_disk_is_one_line_naming_the_file_and_keeps_the_checkpoint_before(small_disk, capsys):
    from vision.train import main

    run_dir = small_disk / "run"
    err = refusal(main, ["--config", ROOT / "configs/fmnist_deit_siamese.yaml", *DEIT, "data.max_train_samples=64",
                         "data.max_val_samples=16", "optim.batch_size=16", "optim.epochs=40", "train.ckpt_every=1",
                         f"train.output_dir={run_dir}"], capsys)
    assert err.startswith(f"error: could not write {run_dir}") and "No space left on device" in err, err
    from common.train_state import CheckpointManager, load_training_checkpoint

    kept = CheckpointManager(run_dir / "checkpoints").steps()
    assert kept and load_training_checkpoint(CheckpointManager(run_dir / "checkpoints").path_for(kept[-1]))["step"]
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_a_read_only_run_directory_is_one_line_before_any_work(small_disk, capsys):
    from common.train_state import RunDirectoryError, RunLock
    from vision.train import main

    (small_disk / "runs" / "old").mkdir(parents=True)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    for out in (small_disk / "runs" / "old", small_disk / "runs" / "new"):  # an existing directory, one to be made
        err, stdout, stderr = refused(main, ["--config", ROOT / "configs/fmnist_deit_siamese.yaml", *DEIT,
                                             f"train.output_dir={out}"], capsys)
        assert err == (f"error: cannot write the run directory {out} (read-only file system): give train.output_dir "
                       "a place this process may write to, or fix the permissions"), err
        assert "epoch" not in stdout and "train:" not in stderr  # no data read, no step
    with pytest.raises(RunDirectoryError, match=r"cannot write the run directory .*runs/old \(Read-only file system\)"):
        RunLock(small_disk / "runs" / "old").acquire()  # the lock's own check, should the directory turn read-only


def test_a_read_only_file_system_is_one_line_and_keeps_the_file(small_disk):
    from common.checkpoint import save_weights
    from common.durable import atomic_write_text

    target = small_disk / "metrics.json"
    atomic_write_text(target, "old")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(DiskWriteError, match=rf"could not write {target}: Read-only file system. metrics.json keeps"):
        atomic_write_text(target, "new")
    with pytest.raises(DiskWriteError, match="Read-only file system"):
        save_weights(torch.nn.Linear(2, 2), small_disk / "w.safetensors")
    assert target.read_text() == "old"


def test_a_damaged_safetensors_checkpoint_is_one_line_for_the_sampler(tmp_path, capsys):
    from safetensors.torch import save_file

    from diffusion.sample import main

    good = tmp_path / "ema.safetensors"
    save_file({"w": torch.zeros(1000)}, str(good), metadata={"model": "DiT-S/4"})
    data = good.read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "bad_header.safetensors").write_bytes(b"\xff" * 8 + data[8:])
    for name in ("truncated", "bad_header"):
        err = refusal(main, ["--checkpoint", tmp_path / f"{name}.safetensors", "--grid", tmp_path / "g.png"], capsys)
        assert f"{name}.safetensors is damaged or not a weights file" in err


# ------------------------------------------------------------------------------------------- optional pieces

@pytest.mark.fashion_mnist
def test_in_training_fid_without_classifier_weights_names_the_training_setting(tmp_path, capsys, monkeypatch):
    from diffusion.train import main

    monkeypatch.setenv("SIAMESENORM_CACHE", str(tmp_path / "empty_cache"))
    err = refusal(main, ["--config", ROOT / "configs/fmnist_dit_siamese.yaml", "train.fid_every=2",
                         f"train.output_dir={tmp_path / 'run'}"], capsys)
    assert "scripts.train_fmnist_classifier" in err and "train.fid_extractor_weights=PATH" in err
    assert "--extractor-weights" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.fashion_mnist
def test_the_dali_backend_without_dali_says_how_to_install_it(tmp_path, capsys):
    pytest.importorskip("torch")  # keeps the import order of the other tests
    try:
        import nvidia.dali  # noqa: F401

        pytest.skip("DALI is installed here")
    except ImportError:
        pass
    from vision.train import main

    err = refusal(main, ["--config", ROOT / "configs/fmnist_deit_siamese.yaml", "data.backend=dali",
                         f"train.output_dir={tmp_path / 'run'}"], capsys)
    assert "pip install -e '.[dali]'" in err and "data.backend=torch" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.fashion_mnist
def test_a_batch_two_processes_cannot_split_is_said_once(tmp_path):
    proc = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "vision.train", "--config", "configs/fmnist_deit_siamese.yaml",
                           "optim.batch_size=127", f"train.output_dir={tmp_path / 'run'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: global batch size 127 is not divisible by processes (2) x gradient accumulation (1); "
                      "change optim.batch_size or optim.grad_accum"], proc.stderr[-3000:]


# ------------------------------------------------------------------------------------------- durability

@pytest.mark.fashion_mnist
def test_evaluation_results_and_metrics_lines_are_flushed_to_disk(tmp_path, monkeypatch):
    import common.durable as durable
    import common.logging as logging_module

    synced = []
    real = os.fsync
    record = lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))  # noqa: E731
    monkeypatch.setattr(durable.os, "fsync", record)
    monkeypatch.setattr(logging_module.os, "fsync", record)
    from vision import train as deit_train

    cfg = load_config(deit_train.TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml",
                      [*DEIT, "data.max_train_samples=8", "data.max_val_samples=8", f"train.output_dir={tmp_path / 'r'}"])
    deit_train.train(cfg)
    assert synced.count(str(tmp_path / "r" / "metrics.jsonl")) == len(read_metrics(tmp_path / "r"))
    from vision import evaluate

    synced.clear()
    evaluate.main(["--config", str(tmp_path / "r" / "config.yaml"), f"checkpoint={tmp_path / 'r' / 'model.safetensors'}",
                   f"output={tmp_path / 'eval.json'}"])
    assert str(tmp_path / "eval.json.tmp") in synced and json.loads((tmp_path / "eval.json").read_text())["images"] == 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="a torch that can use the GPU has nothing to say")
def test_nvidia_gpus_this_torch_cannot_use_are_said_once_and_the_run_goes_on_on_the_cpu(tmp_path, monkeypatch, capsys):
    """A CPU-only torch, or a CUDA build newer than the driver, on a GPU machine: one line from local rank 0 naming
    the cause and the fix, then the CPU; nothing where the GPUs are hidden on purpose or there is no NVIDIA driver."""
    from common import distributed

    gpus = tmp_path / "gpus"  # the layout of /proc/driver/nvidia/gpus: a folder per GPU, named by its PCI address
    for address in ("0000:3b:00.0", "0000:86:00.0"):
        (gpus / address).mkdir(parents=True)
    monkeypatch.setattr(distributed, "NVIDIA_GPUS", str(gpus))
    monkeypatch.setattr(distributed, "_said_unusable_gpu", False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    accelerator = distributed.build_accelerator(precision="auto", tensorboard=False)
    assert accelerator.device.type == "cpu" and not distributed.cuda_available()
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "2 NVIDIA GPU(s)" in err and f"torch {torch.__version__}" in err
    assert "pytorch.org/get-started" in err and "CUDA_VISIBLE_DEVICES=" in err
    for env, path in ((("CUDA_VISIBLE_DEVICES", ""), gpus), (("LOCAL_RANK", "1"), gpus), (None, tmp_path / "none")):
        monkeypatch.setattr(distributed, "_said_unusable_gpu", False)
        monkeypatch.setattr(distributed, "NVIDIA_GPUS", str(path))
        if env:
            monkeypatch.setenv(*env)
        assert not distributed.cuda_available()
        assert capsys.readouterr().err == "", env
        if env:
            monkeypatch.delenv(env[0])
