"""Any VAE as the tokenizer: a random diffusers AutoencoderKL that downsamples 16x into 32 channels (LightningDiT's
VA-VAE f16d32 geometry), written with save_pretrained, through the whole chain with the LightningDiT recipe as
shipped (configs/lightningdit_b1_siamese.yaml, shrunk):

    python -m diffusion.extract_latents (per-channel statistics in metadata.json)
    -> python -m diffusion.train (LightningDiT's per-channel normalisation, cosine term, logit-normal t)
    -> python -m diffusion.sample from checkpoints/step_*.pt and from ema.safetensors
    -> python -m diffusion.fid -> python -m diffusion.export

each an in-process ``main(argv)`` call. The geometry and the normalisation travel with the run's files; the
normalisation is LightningDiT's datasets/img_latent_dataset.py and inference.py, re-stated in the tests.
"""
import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffusion.checkpoints import load_dit
from diffusion.export import main as export_main
from diffusion.extract_latents import main as extract_main
from diffusion.fid import main as fid_main
from diffusion.latents import LatentScaling
from diffusion.sample import main as sample_main
from diffusion.train import main as train_main
from tests.rehearsal import ROOT, write_image_folder

CLASSES, PER_CLASS, IMAGE, CHANNELS, LATENT = 2, 4, 64, 32, 4  # 64 px -> 4 x 4 x 32 latents
STEPS, SAMPLES = 4, 4
pytestmark = pytest.mark.filterwarnings("ignore:.*covariance is singular:UserWarning")
torch.set_num_threads(1)


def shrunk(root, out, *extra, recipe="lightningdit_b1_siamese"):
    """A LightningDiT recipe with only data, sizes and step counts changed."""
    return ["--config", str(ROOT / f"configs/{recipe}.yaml"), f"data.path={root / 'latents'}",
            f"data.autoencoder={root / 'vae'}", f"data.image_size={IMAGE}", f"data.num_classes={CLASSES}",
            "data.num_workers=0", "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "optim.batch_size=4",
            f"optim.steps={STEPS}", "train.ckpt_every=2", "train.log_every=1", f"train.sample_every={STEPS}",
            "train.sample_count=2", "train.sample_steps=3", "train.tensorboard=false", "train.threads=1",
            f"train.output_dir={out}", *extra]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Images -> a 16x, 32-channel VAE -> latents -> a LightningDiT run."""
    from diffusers import AutoencoderKL

    root = tmp_path_factory.mktemp("any_vae")
    write_image_folder(root / "images", CLASSES, PER_CLASS, seed=3)
    torch.manual_seed(0)
    AutoencoderKL(block_out_channels=(8,) * 5, down_block_types=("DownEncoderBlock2D",) * 5,
                  up_block_types=("UpDecoderBlock2D",) * 5, layers_per_block=1, latent_channels=CHANNELS,
                  norm_num_groups=4, sample_size=IMAGE).save_pretrained(root / "vae")
    meta = extract_main(["--data-path", str(root / "images"), "--vae", str(root / "vae"), "--out",
                         str(root / "latents"), "--image-size", str(IMAGE), "--shard-size", "3", "--batch-size", "4",
                         "--num-workers", "0"])
    final = train_main(shrunk(root, root / "run"))
    return {"root": root, "meta": meta, "final": final}


def stored_moments(latents):
    """Every shard's mean and log-variance, as training reads them (float32 of the stored float16)."""
    meta = json.loads((latents / "metadata.json").read_text())
    shards = [load_file(latents / s["file"]) for s in meta["shards"] if s["count"]]
    return torch.cat([s["mean"] for s in shards]).float(), torch.cat([s["logvar"] for s in shards]).float()


def test_extraction_states_the_16x_geometry_and_the_per_channel_statistics_of_the_posterior_draws(chain):
    meta, latents = chain["meta"], chain["root"] / "latents"
    assert meta["latent_shape"] == [CHANNELS, LATENT, LATENT] and meta["count"] == CLASSES * PER_CLASS
    mean, logvar = stored_moments(latents)
    assert mean.shape == (CLASSES * PER_CLASS, 2, CHANNELS, LATENT, LATENT)
    # A draw z = mean + exp(logvar / 2) eps: E z per channel is the mean of the means; Var z is the spread of the
    # means plus the posteriors' own variance (all images, both views, every position).
    per_channel = lambda t: t.double().transpose(0, 2).reshape(CHANNELS, -1)  # noqa: E731
    want_mean = per_channel(mean).mean(1)
    want_var = per_channel(mean).var(1, unbiased=False) + per_channel(logvar).exp().mean(1)
    torch.testing.assert_close(torch.tensor(meta["latent_mean"], dtype=torch.float64), want_mean, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.tensor(meta["latent_std"], dtype=torch.float64), want_var.sqrt(), rtol=1e-9,
                               atol=1e-12)
    # ... which is what many draws give
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([mean + (0.5 * logvar).exp() * torch.randn(mean.shape, generator=g) for _ in range(200)])
    torch.testing.assert_close(per_channel(draws).std(1), want_var.sqrt(), rtol=0.05, atol=0)


def test_latent_norm_is_lightningdits_normalisation_applied_in_training_and_undone_before_decoding(chain):
    from common.data import seeded_rng
    from diffusion.data import LatentImages

    latents = chain["root"] / "latents"
    meta = json.loads((latents / "metadata.json").read_text())
    images = LatentImages(str(latents), latent_norm=True, latent_multiplier=0.5)
    assert images.normalization == {"mean": meta["latent_mean"], "std": meta["latent_std"], "multiplier": 0.5}
    plain = LatentImages(str(latents))  # the VAE's scaling factor
    mean, std = torch.tensor(meta["latent_mean"]).view(-1, 1, 1), torch.tensor(meta["latent_std"]).view(-1, 1, 1)
    for i in range(len(images)):
        with seeded_rng(i):
            got, label = images[i]
        with seeded_rng(i):
            scaled, same_label = plain[i]
        draw = scaled / meta["scaling_factor"]
        # LightningDiT's ImgLatentDataset: (feature - mean) / std, then * latent_multiplier
        torch.testing.assert_close(got, (draw - mean) / std * 0.5, rtol=1e-5, atol=1e-5)
        assert label == same_label
    scaling = LatentScaling(meta["scaling_factor"], images.normalization)
    z = torch.randn(3, CHANNELS, LATENT, LATENT)
    x = scaling.apply(z)
    assert torch.equal(x, (z - mean) / std * 0.5)
    assert torch.equal(scaling.undo(x), (x * std) / 0.5 + mean)  # LightningDiT's inference.py
    torch.testing.assert_close(scaling.undo(x), z, rtol=1e-6, atol=1e-6)


def test_the_run_trains_the_recipe_with_the_cosine_term_and_records_geometry_and_normalisation(chain):
    from common.logging import read_metrics

    out = chain["root"] / "run"
    records = [r for r in read_metrics(out) if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:  # the logged parts: the velocity MSE and the cosine term, weight 1
        assert r["train/loss"] == pytest.approx(r["train/mse"] + r["train/cos"], rel=1e-5)
    assert (out / "samples" / f"step_{STEPS:09d}.png").is_file()
    meta = json.loads((chain["root"] / "latents" / "metadata.json").read_text())
    with safe_open(str(out / "ema.safetensors"), "pt") as f:
        recorded = f.metadata()
    assert (recorded["in_channels"], recorded["input_size"]) == (str(CHANNELS), str(LATENT))
    assert json.loads(recorded["latent_norm"]) == {"mean": meta["latent_mean"], "std": meta["latent_std"],
                                                   "multiplier": 1.0}
    transport = json.loads(recorded["transport"])
    assert (transport["time_distribution"], transport["cosine_loss_weight"]) == ("logit_normal", 1.0)
    step = torch.load(out / "checkpoints" / f"step_{STEPS:09d}.pt", weights_only=True)
    assert step["weights_metadata"] == {**recorded, "step": str(STEPS)}


def sample(checkpoint, out_dir, *extra):
    return sample_main(["--checkpoint", str(checkpoint), "--num-samples", str(SAMPLES), "--out-dir", str(out_dir),
                        "--steps", "3", "--sampler", "euler", "--batch-size", str(SAMPLES), "--quiet", *extra])


def test_step_checkpoints_sample_as_the_ema_file_and_the_samples_score_and_export(chain, tmp_path):
    root, out = chain["root"], chain["root"] / "run"
    for step in (2, STEPS):  # each holds 16 tokens of 32 channels, which "8x, 4 channels" would make 64 of 4
        result = sample_main(["--checkpoint", str(out / "checkpoints" / f"step_{step:09d}.pt"), "--grid",
                              str(tmp_path / f"grid{step}.png"), "--steps", "3", "--sampler", "euler", "--quiet"])
        assert result["labels"] == list(range(CLASSES))
    model, spec, weights = load_dit(out / "checkpoints" / f"step_{STEPS:09d}.pt")
    assert (weights, spec.in_channels, spec.input_size) == ("ema", CHANNELS, LATENT)
    assert spec.latent_norm["multiplier"] == 1.0
    # The last checkpoint's EMA weights are ema.safetensors: the same samples, decoded through the same undoing.
    sample(out / "checkpoints" / f"step_{STEPS:09d}.pt", tmp_path / "from_step")
    sample(out / "ema.safetensors", tmp_path / "from_ema")
    from_step, from_ema = (np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("from_step", "from_ema"))
    assert from_step.shape == (SAMPLES, IMAGE, IMAGE, 3) and np.array_equal(from_step, from_ema)
    # Decoded without undoing the normalisation (the VAE's factor instead), the images differ.
    from common.checkpoint import save_weights

    unnormalised = {k: v for k, v in spec.metadata(step=STEPS).items() if k != "latent_norm"}
    sample(save_weights(model, tmp_path / "plain.safetensors", metadata=unnormalised), tmp_path / "plain")
    assert not np.array_equal(np.load(tmp_path / "plain" / "samples.npz")["arr_0"], from_ema)

    from diffusion.evaluation.features import write_random_inception

    inception = write_random_inception(tmp_path / "inception.pth")
    layer = ["--extractor-weights", str(inception), "--feature-layer", "64", "--device", "cpu", "--num-workers", "0",
             "--quiet"]
    fid_main(["--samples", str(root / "images"), "--save-stats", str(tmp_path / "ref.npz"), "--center-crop",
              str(IMAGE), *layer], echo=False)
    scores = fid_main(["--samples", str(tmp_path / "from_ema" / "samples.npz"), "--reference",
                       str(tmp_path / "ref.npz"), "--metrics", "fid", "--num-samples", str(SAMPLES), *layer],
                      echo=False)
    assert math.isfinite(scores["metrics"]["fid"]) and scores["metrics"]["fid"] > 0

    export_main(["--checkpoint", str(out / "ema.safetensors"), "--out", str(tmp_path / "hub"), "--quiet"])
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert (config["in_channels"], config["input_size"], config["latent_norm"]) == (CHANNELS, LATENT, spec.latent_norm)
    sample(tmp_path / "hub", tmp_path / "from_hub")
    assert np.array_equal(np.load(tmp_path / "from_hub" / "samples.npz")["arr_0"], from_ema)


def test_latent_stats_in_lightningdits_layout_give_the_normalisation_to_undo(chain, tmp_path, capsys):
    """diffusion.sample --latent-stats (LightningDiT's latents_stats.pt, whose checkpoints record no statistics): the
    run's own statistics sample as the recorded ones do; others decode otherwise, and the set records them."""
    from tests.refusals import refusal

    out = chain["root"] / "run"
    meta = json.loads((chain["root"] / "latents" / "metadata.json").read_text())
    as_lightningdit = lambda mean, std: {"mean": torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1),  # noqa: E731
                                         "std": torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)}
    torch.save(as_lightningdit(meta["latent_mean"], meta["latent_std"]), tmp_path / "own.pt")
    torch.save(as_lightningdit([0.0] * CHANNELS, [2.0] * CHANNELS), tmp_path / "other.pt")
    sample(out / "ema.safetensors", tmp_path / "recorded")
    sample(out / "ema.safetensors", tmp_path / "own", "--latent-stats", str(tmp_path / "own.pt"))
    sample(out / "ema.safetensors", tmp_path / "other", "--latent-stats", str(tmp_path / "other.pt"))
    images = {d: np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("recorded", "own", "other")}
    assert np.array_equal(images["recorded"], images["own"]) and not np.array_equal(images["own"], images["other"])
    settings = json.loads((tmp_path / "other" / "settings.json").read_text())
    assert settings["model"]["latent_norm"] == {"mean": [0.0] * CHANNELS, "std": [2.0] * CHANNELS, "multiplier": 1.0}
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    line = refusal(sample_main, ["--checkpoint", out / "ema.safetensors", "--grid", tmp_path / "g.png",
                                 "--latent-stats", tmp_path / "bad.pt"], capsys)
    assert line.startswith(f"error: --latent-stats {tmp_path / 'bad.pt'}: not LightningDiT's latents_stats.pt"), line


def test_a_step_checkpoint_that_records_no_spec_takes_the_latents_geometry_from_its_weights(chain, tmp_path):
    """Checkpoints written before they recorded the model's description hold only the run's config, which does not
    say the VAE's downsampling or channels: the weights' patch embedding and position table do."""
    step = torch.load(chain["root"] / "run" / "checkpoints" / f"step_{STEPS:09d}.pt", weights_only=True)
    del step["weights_metadata"]
    step["config"]["data"]["latent_norm"] = False  # as such a run trained
    torch.save(step, tmp_path / "step_old.pt")
    model, spec, _ = load_dit(tmp_path / "step_old.pt")
    assert (spec.in_channels, spec.input_size, spec.latent_norm) == (CHANNELS, LATENT, None)
    assert tuple(model.pos_embed.shape) == (1, LATENT * LATENT, 32)


def test_the_image_size_of_a_plain_state_dict_goes_through_the_vaes_downsampling(chain, tmp_path):
    """--image-size of a latent model is divided by its VAE's 2^(blocks - 1), not by 8."""
    model, spec, _ = load_dit(chain["root"] / "run" / "ema.safetensors")
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    overrides = {"name": "LightningDiT-B/1", "image_size": IMAGE, "autoencoder": str(chain["root"] / "vae"),
                 "num_classes": CLASSES}
    again, plain_spec, _ = load_dit(tmp_path / "plain.pt", {**overrides, "topology": spec.topology,
                                                            "kwargs": spec.kwargs})
    assert (plain_spec.in_channels, plain_spec.input_size, plain_spec.learn_sigma) == (CHANNELS, LATENT, False)


@pytest.mark.parametrize("recipe, name, topology", [
    ("lightningdit_b1_pre", "LightningDiT-B/1", "pre"), ("lightningdit_b1_siamese", "LightningDiT-B/1", "siamese"),
    ("lightningdit_xl1_pre", "LightningDiT-XL/1", "pre"), ("lightningdit_xl1_siamese", "LightningDiT-XL/1", "siamese")])
def test_lightningdit_recipes_hold_its_64_epoch_schedule_and_step_on_the_latents(chain, tmp_path, recipe, name,
                                                                                 topology):
    from common.config import load_config
    from diffusion.train import TrainConfig

    cfg = load_config(TrainConfig, ROOT / f"configs/{recipe}.yaml", ["data.path=/nonexistent"])
    o, t, r = cfg.optim, cfg.transport, cfg.train
    assert (cfg.model.name, cfg.model.topology, cfg.model.learn_sigma) == (name, topology, False)
    assert (o.batch_size, o.lr, o.betas, o.weight_decay, o.clip_grad, o.steps) == (1024, 2e-4, (0.9, 0.95), 0, None,
                                                                                    80_000)
    assert (t.enabled, t.path, t.prediction, t.time_distribution, t.logit_normal_mean, t.logit_normal_std,
            t.cosine_loss_weight) == (True, "linear", "velocity", "logit_normal", 0.0, 1.0, 1.0)
    assert (cfg.data.latent_norm, cfg.data.latent_multiplier, cfg.data.image_size) == (True, 1.0, 256)
    assert (r.sampler, r.sample_timestep_shift, r.sample_cfg_scale, r.sample_guidance_interval, r.fid_steps,
            r.ema_decay) == ("euler", 0.3, 10.0, (0.1, 1.0), 250, 0.9999)
    final = train_main(shrunk(chain["root"], tmp_path, "optim.steps=1", "train.sample_every=0", recipe=recipe))
    assert final["steps"] == 1 and math.isfinite(final["loss"])


def test_statistics_are_recomputed_for_older_latents_and_refused_when_edited_or_missing(chain, tmp_path, capsys):
    """Latents extracted before the statistics existed (no sums in the shard headers, none in metadata.json) get them
    from the same extraction command, which encodes nothing again; a normalised run on latents without them, or on an
    edited metadata.json, is refused; an image size the VAE's 16x does not divide is refused."""
    import shutil

    from safetensors.torch import save_file

    from diffusion.data import LatentImages
    from diffusion.latents import CHANNEL_SUMS, LatentsError

    src, old = chain["root"] / "latents", tmp_path / "old"
    shutil.copytree(src, old)
    meta = json.loads((old / "metadata.json").read_text())
    for shard in meta["shards"]:
        with safe_open(str(old / shard["file"]), "pt") as f:
            header = {k: v for k, v in (f.metadata() or {}).items() if k != CHANNEL_SUMS}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, str(old / shard["file"]), metadata=header)
    stats = {k: meta.pop(k) for k in ("latent_mean", "latent_std")}
    (old / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(LatentsError, match="re-run the extraction that made them"):
        LatentImages(str(old), latent_norm=True)
    written = {s["file"]: (old / s["file"]).stat().st_mtime_ns for s in meta["shards"]}
    again = extract_main(["--data-path", str(chain["root"] / "images"), "--vae", str(chain["root"] / "vae"), "--out",
                          str(old), "--image-size", str(IMAGE), "--shard-size", "3", "--batch-size", "4",
                          "--num-workers", "0"])
    assert {k: again[k] for k in stats} == stats
    assert {f: (old / f).stat().st_mtime_ns for f in written} == written  # no shard encoded again
    edited = tmp_path / "edited"  # shards that record their sums, a metadata.json whose std was doubled
    shutil.copytree(src, edited)
    (edited / "metadata.json").write_text(json.dumps({**chain["meta"],
                                                      "latent_std": [2 * v for v in chain["meta"]["latent_std"]]}))
    with pytest.raises(LatentsError, match="states other per-channel latent statistics than its shards give"):
        LatentImages(str(edited), latent_norm=True)
    with pytest.raises(SystemExit):
        extract_main(["--data-path", str(chain["root"] / "images"), "--vae", str(chain["root"] / "vae"), "--out",
                      str(tmp_path / "odd"), "--image-size", "72", "--num-workers", "0"])
    assert "--image-size 72 is not a multiple of 16, the downsampling of --vae" in capsys.readouterr().err
