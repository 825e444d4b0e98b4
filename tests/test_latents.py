"""Latent extraction on a generated JPEG ImageFolder with a tiny AutoencoderKL saved by the test."""
import json
import os

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image
from safetensors.torch import load_file

from common.data import center_crop_arr
from diffusion.extract_latents import main as extract_main
from diffusion.latents import (
    LatentDataset,
    VAENotFoundError,
    encode_moments,
    image_to_tensor,
    latent_from_moments,
    load_vae,
    shard_name,
)

SIZES = [(40, 50), (70, 33), (32, 32), (97, 64)]


def sample_latents(mean, logvar, flip, noise, scale):
    """The reference of draw_latent, batched: view ``flip`` (bool, B) of the stored moments (B, 2, C, h, w),
    ``scale * (mean + exp(logvar / 2) * noise)``."""
    rows = torch.arange(mean.shape[0], device=mean.device)
    view = flip.long().to(mean.device)
    return latent_from_moments(mean[rows, view].float(), logvar[rows, view].float(), noise, scale)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("latents")
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8, sample_size=32,
    )
    vae.save_pretrained(root / "vae")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / "images" / c).mkdir(parents=True)
        for i, (w, h) in enumerate(SIZES):
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / "images" / c / f"{i}.jpg")
    (root / "images" / "dog" / "2_broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return root


def run(setup, out, *extra):
    return extract_main([
        "--data-path", str(setup / "images"), "--vae", str(setup / "vae"), "--out", str(out), "--image-size", "32",
        "--shard-size", "3", "--batch-size", "2", "--num-workers", "0", *extra,
    ])


def test_extraction_round_trips_moments_and_skips_corrupt_image(setup, tmp_path, capsys):
    meta = run(setup, tmp_path / "lat", "--dtype", "float32")
    err = capsys.readouterr().err
    assert "dog/2_broken.jpg" in err and "skipping unreadable image" in err
    assert meta["skipped"] == ["dog/2_broken.jpg"]
    assert meta["count"] == 8 and meta["num_listed"] == 9 and meta["classes"] == ["cat", "dog"]
    assert meta["scaling_factor"] == pytest.approx(0.18215) and meta["latent_shape"] == [4, 16, 16]
    assert json.loads((tmp_path / "lat" / "metadata.json").read_text()) == meta

    ds = LatentDataset(tmp_path / "lat")
    assert len(ds) == 8 and ds.labels.tolist() == [0] * 4 + [1] * 4
    vae = load_vae(str(setup / "vae"))
    # Item 7 is dog/3.jpg: dog/2_broken.jpg, listed between dog/2.jpg and dog/3.jpg, was skipped.
    for item, path in ((0, "cat/0.jpg"), (7, "dog/3.jpg")):
        image = Image.open(setup / "images" / path)
        x = image_to_tensor(center_crop_arr(image, 32))[None]
        want_mean, want_logvar = encode_moments(vae, x)
        mean, logvar, label = ds[item]
        torch.testing.assert_close(mean, want_mean[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logvar, want_logvar[0], atol=1e-5, rtol=1e-5)
        assert label == (path.startswith("dog"))
    # View 1 is the encoding of the mirrored image.
    flipped = vae.encode(x.flip(-1)).latent_dist.mean
    torch.testing.assert_close(mean[1], flipped[0], atol=1e-5, rtol=1e-5)


def test_shard_resume_recomputes_only_missing_shards(setup, tmp_path):
    out = tmp_path / "lat"
    run(setup, out)
    files = [out / shard_name(k) for k in range(3)]
    before = {f: (f.stat().st_mtime_ns, load_file(f)) for f in files}
    files[1].unlink()
    (out / "metadata.json").unlink()
    run(setup, out)
    assert files[0].stat().st_mtime_ns == before[files[0]][0] and files[2].stat().st_mtime_ns == before[files[2]][0]
    recomputed = load_file(files[1])
    for key, value in before[files[1]][1].items():
        assert torch.equal(recomputed[key], value), key  # deterministic recomputation
    assert LatentDataset(out).metadata["count"] == 8
    with pytest.raises(SystemExit, match="other settings"):
        run(setup, out, "--dtype", "float32")


def test_a_stop_signal_ends_the_extraction_with_exit_4_after_a_shard_and_the_same_command_finishes_it(setup, tmp_path):
    """A real SIGTERM after the first shard is written (as a scheduler sends before its kill): exit 4, which
    train.sbatch requeues on, that shard kept; the same command writes the shards an uninterrupted run writes."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = ["--data-path", str(setup / "images"), "--vae", str(setup / "vae"), "--image-size", "32",
            "--shard-size", "3", "--batch-size", "2", "--num-workers", "0"]
    reference, out = tmp_path / "reference", tmp_path / "stopped"
    run(setup, reference)
    proc = subprocess.run([sys.executable, "-m", "tests.faults", "sigterm_output", "1", "--", "-m",
                           "diffusion.extract_latents", *args, "--out", str(out)], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "SIGTERM received: stopped after 1 of 3 rounds of shards" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [shard_name(0)]  # no metadata.json: not a finished set

    run(setup, out)
    for k in range(3):
        a, b = load_file(out / shard_name(k)), load_file(reference / shard_name(k))
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_latents_from_tars_and_from_a_dataset_equal_the_folders(setup, tmp_path, capsys):
    """The folder converted by vision.shard (the broken file copied as it is) extracts to the same latents, labels,
    order and settings; the broken image is skipped and named by its shard and member, or its row."""
    from vision import shard

    reference = run(setup, tmp_path / "folder")
    for fmt in ("wds", "hf"):
        shard.main(["--data-path", str(setup / "images"), "--out", str(tmp_path / fmt), "--format", fmt,
                    "--shard-size", "4"])
        meta = run(setup, tmp_path / f"lat_{fmt}", "--data-format", fmt, "--data-path", str(tmp_path / fmt))
        unskipped = lambda m: {k: v for k, v in m.items() if k != "skipped"}  # noqa: E731
        assert unskipped(meta) == unskipped(reference)
        for k in range(3):
            a, b = load_file(tmp_path / "folder" / shard_name(k)), load_file(tmp_path / f"lat_{fmt}" / shard_name(k))
            assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), (fmt, k)
        assert len(meta["skipped"]) == 1
    assert meta["skipped"] == [f"{tmp_path / 'hf'}#7 (2_broken.jpg)"]  # dog/2.jpg, then dog/2_broken.jpg
    broken = f"{tmp_path / 'wds' / 'shard-000001.tar'}:dog/2_broken.jpg"
    assert f"skipping unreadable image {broken}" in capsys.readouterr().err


def test_missing_vae_and_bad_folder_errors(setup, tmp_path):
    with pytest.raises(VAENotFoundError, match="--vae DIR"):
        load_vae(str(tmp_path / "no-such-vae"))
    with pytest.raises(VAENotFoundError, match="Hugging Face cache"):
        load_vae("nobody/no-such-vae")
    with pytest.raises(SystemExit, match="not an ImageFolder") as exit_info:
        extract_main(["--data-path", str(setup / "images" / "cat"), "--vae", str(setup / "vae"), "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    with pytest.raises(FileNotFoundError, match="extract_latents"):
        LatentDataset(tmp_path)


def test_center_crop_and_latent_sampling():
    wide = Image.fromarray(np.tile(np.arange(200, dtype=np.uint8)[None, :, None], (100, 1, 3)))
    out = center_crop_arr(wide, 32)
    assert out.size == (32, 32)
    row = np.asarray(out)[16, :, 0].astype(int)
    assert abs(row.mean() - 100) < 2 and np.all(np.diff(row) >= 0)  # central columns, order kept

    g = torch.Generator().manual_seed(0)
    mean, logvar = torch.randn(3, 2, 4, 2, 2, generator=g), torch.randn(3, 2, 4, 2, 2, generator=g)
    noise = torch.randn(3, 4, 2, 2, generator=g)
    flip = torch.tensor([False, True, True])
    z = sample_latents(mean, logvar, flip, noise, 0.5)
    for i in range(3):
        v = int(flip[i])
        torch.testing.assert_close(z[i], 0.5 * (mean[i, v] + torch.exp(0.5 * logvar[i, v]) * noise[i]))


def test_dit_training_on_latents_draws_fresh_latents_and_decodes_grids(setup, tmp_path):
    from common.config import load_config
    from common.data import seeded_rng
    from diffusion.data import LatentImages
    from diffusion.train import TrainConfig, train

    run(setup, tmp_path / "lat")
    images = LatentImages(str(tmp_path / "lat"))
    with seeded_rng(1):
        a, label = images[7]
    with seeded_rng(1):
        b, _ = images[7]
    with seeded_rng(2):
        c, _ = images[7]
    assert label == 1 and a.shape == (4, 16, 16)
    assert torch.equal(a, b) and not torch.allclose(a, c), "a fresh latent per draw, reproducible per seed"

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(TrainConfig, os.path.join(root, "configs/dit_b2_siamese.yaml"), [
        f"data.path={tmp_path / 'lat'}", f"data.autoencoder={setup / 'vae'}", "data.image_size=32", "data.num_classes=2",
        "data.num_workers=0", "model.name=DiT-S/4", "model.kwargs={hidden_size: 32, depth: 1, num_heads: 2}",
        "optim.batch_size=4", "optim.steps=2", "train.sample_every=2", "train.sample_count=2", "train.sample_steps=2",
        "train.tensorboard=false", f"train.output_dir={tmp_path / 'run'}",
    ])
    final = train(cfg)
    assert final["steps"] == 2 and final["loss"] > 0
    grid = Image.open(tmp_path / "run" / "samples" / "step_000000002.png")
    # two decoded 32 px RGB images, upscaled x4, 4 px padding, each captioned with its class
    assert grid.size == (2 * (128 + 4) + 4, 128 + 4 + 18 + 4)
    with pytest.raises(ValueError, match="data.num_classes=10"):
        train(load_config(TrainConfig, os.path.join(root, "configs/dit_b2_siamese.yaml"), [
            f"data.path={tmp_path / 'lat'}", "data.image_size=32", "data.num_classes=10", "train.sample_every=0",
            f"train.output_dir={tmp_path / 'bad'}"]))
    assert not (tmp_path / "bad").exists(), "nothing is written for a config that does not fit the data"
    # A missing VAE for the grids is an error before any step, naming the setting and the download command.
    with pytest.raises(FileNotFoundError, match=r"data\.autoencoder=DIR.*hf download.*train\.sample_every=0"):
        train(load_config(TrainConfig, os.path.join(root, "configs/dit_b2_siamese.yaml"), [
            f"data.path={tmp_path / 'lat'}", "data.image_size=32", "data.num_classes=2", "data.autoencoder=/no/vae",
            f"train.output_dir={tmp_path / 'novae'}"]))
    assert not (tmp_path / "novae" / "checkpoints").exists()


def test_one_view_read_equals_the_two_view_read(setup, tmp_path):
    """draw_latent (what LatentImages uses) reads only the drawn view and gives, seed for seed, the latent of
    reading both views and choosing with sample_latents (the loader as it was, re-stated here)."""
    from common.data import seeded_rng
    from diffusion.data import LatentImages
    from diffusion.latents import draw_latent

    def two_views(i):
        mean, logvar, label = ds[i]
        flip = torch.rand(1) < 0.5
        noise = torch.randn(mean.shape[1:])
        return sample_latents(mean[None], logvar[None], flip, noise[None], ds.scaling_factor)[0], label

    run(setup, tmp_path / "lat")
    images = LatentImages(str(tmp_path / "lat"))
    ds = images.moments
    for i in range(len(ds)):
        mean, logvar, label = ds[i]
        for view in (0, 1):
            m, lv, lab = ds.read_view(i, view)
            assert torch.equal(m, mean[view]) and torch.equal(lv, logvar[view]) and lab == label
    flips = set()
    for seed in range(16):
        i = seed % len(ds)
        with seeded_rng(seed):
            want, want_label = two_views(i)
        with seeded_rng(seed):
            got, label = draw_latent(ds, i)
        with seeded_rng(seed):
            assert torch.equal(images[i][0], got)
        with seeded_rng(seed):
            flips.add(bool(torch.rand(1) < 0.5))
        assert torch.equal(got, want) and label == want_label
    assert flips == {False, True}  # both views were read
    with seeded_rng(0):
        unflipped, _ = draw_latent(ds, 0, hflip=False)
    with seeded_rng(0):
        noise = torch.randn(4, 16, 16)
    mean, logvar, _ = ds[0]
    torch.testing.assert_close(unflipped, ds.scaling_factor * (mean[0] + torch.exp(0.5 * logvar[0]) * noise))
    with pytest.raises(ValueError, match="view 2"):
        ds.read_view(0, 2)


def test_images_stored_beside_the_latents_reach_repas_encoder_with_the_latents_flip(setup, tmp_path):
    """--images keeps the exact uint8 pixels the VAE encoded; a drawn example carries the pixels of its own view (the
    mirror with the mirrored latent), with the same latent as without them; REPA trains on latents through them."""
    import timm

    from common.checkpoint import save_weights
    from common.config import load_config
    from common.data import seeded_rng
    from diffusion.data import LatentImages
    from diffusion.train import TrainConfig, train

    meta = run(setup, tmp_path / "lat", "--images")
    assert meta["images"] is True
    ds = LatentDataset(tmp_path / "lat")
    crop = np.array(center_crop_arr(Image.open(setup / "images" / "dog" / "3.jpg").convert("RGB"), 32))
    assert torch.equal(ds.read_image(7, 0), torch.from_numpy(crop).permute(2, 0, 1))
    assert torch.equal(ds.read_image(7, 1), torch.from_numpy(crop).permute(2, 0, 1).flip(-1))
    with_images, plain = LatentImages(str(tmp_path / "lat"), with_image=True), LatentImages(str(tmp_path / "lat"))
    views = set()
    for seed in range(8):
        with seeded_rng(seed):
            latent, label, image = with_images[7]
        with seeded_rng(seed):
            flip = bool(torch.rand(1) < 0.5)
        with seeded_rng(seed):
            assert torch.equal(latent, plain[7][0])
        assert torch.equal(image, ds.read_image(7, int(flip)))
        views.add(flip)
    assert views == {False, True}
    with pytest.raises(ValueError, match="--images"):
        run(setup, tmp_path / "plain")
        LatentImages(str(tmp_path / "plain"), with_image=True)

    torch.manual_seed(0)
    save_weights(timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=64),
                 tmp_path / "encoder.safetensors")  # 4 x 4 patches: DiT-S/4's tokens on 16 x 16 latents
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(TrainConfig, os.path.join(root, "configs/repa_xl2_siamese.yaml"), [
        f"data.path={tmp_path / 'lat'}", f"data.autoencoder={setup / 'vae'}", "data.image_size=32",
        "data.num_classes=2", "data.num_workers=0", "model.name=DiT-S/4",
        "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "repa.depth=1",
        "repa.encoder=vit_tiny_patch16_224", f"repa.encoder_weights={tmp_path / 'encoder.safetensors'}",
        "repa.encoder_image_size=64", "repa.projector_dim=16", "optim.batch_size=4", "optim.steps=2",
        "train.sample_every=0", "train.tensorboard=false", f"train.output_dir={tmp_path / 'run'}"])
    final = train(cfg)
    assert final["steps"] == 2 and -1 <= final["repa"] <= 1
