"""A DiT in the Hugging Face stack, offline: save_pretrained / from_pretrained round trips, the export of a Pre-Norm DiT
to diffusers' DiTTransformer2DModel, and the pipeline that keeps the learned variance, against diffusion.sample."""
import json

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, DiTTransformer2DModel

from common.checkpoint import save_weights
from diffusion.export import main as export_main
from diffusion.hub import DiTModel, exact_timesteps, to_diffusers_transformer
from diffusion.checkpoints import load_dit
from diffusion.spec import DiTSpec
from diffusion.pipeline import DiTSamplingPipeline, remote_code
from diffusion.sample import main as sample_main
from diffusion.sampling.chains import sample_loop
from diffusion.sampling.guidance import model_fn_for
from diffusion.sampling.noise import sample_generators

TINY = {"hidden_size": 32, "depth": 2, "num_heads": 2}
torch.set_num_threads(1)


def tiny_dit(topology="siamese", in_channels=1, class_dropout_prob=0.1, learn_sigma=True, **values):
    """A tiny DiT and its spec, weights moved off the adaLN-Zero init (whose output is identically zero)."""
    spec = DiTSpec.published("DiT-S/4", topology=topology, input_size=8, in_channels=in_channels, num_classes=5,
                             class_dropout_prob=class_dropout_prob, learn_sigma=learn_sigma,
                             **{"autoencoder": "none", "kwargs": TINY, **values})
    torch.manual_seed(0)
    model = spec.build()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval(), spec


def tiny_vae(path):
    torch.manual_seed(0)
    vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                        block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=4)
    vae.save_pretrained(path)
    return path


def inputs(channels=1, n=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, channels, 8, 8, generator=g), torch.tensor([0, 500, 999])[:n], torch.tensor([0, 3, 4])[:n]


def test_save_pretrained_round_trip_keeps_weights_outputs_and_spec(tmp_path):
    model, spec = tiny_dit(class_names=["a", "b", "c", "d", "e"], num_timesteps=500, beta_end=0.03)
    DiTModel.from_dit(model, spec).save_pretrained(tmp_path / "shared")
    config = json.loads((tmp_path / "shared" / "config.json").read_text())
    assert config["_class_name"] == "DiTModel" and config["model_kwargs"] == TINY and config["num_timesteps"] == 500
    loaded = DiTModel.from_pretrained(tmp_path / "shared")
    assert loaded.spec == spec and not loaded.training
    x, t, y = inputs()
    assert torch.equal(loaded(x, t, y), model(x, t, y))
    assert loaded.state_dict().keys() == model.state_dict().keys()
    # the folder is a checkpoint diffusion.sample (and every other reader of DiT checkpoints) takes
    again, read_spec, _ = load_dit(tmp_path / "shared")
    assert read_spec == spec and torch.equal(again(x, t, y), model(x, t, y))


def test_pre_norm_dit_exports_to_diffusers_dit_transformer(tmp_path):
    for class_dropout_prob in (0.1, 0.0):  # without label dropout diffusers still keeps a null row: a zero row
        model, spec = tiny_dit("pre", in_channels=4, class_dropout_prob=class_dropout_prob)
        transformer = to_diffusers_transformer(model)
        x, t, y = inputs(channels=4)
        ours = model(x, t, y)
        assert ours.shape == (3, 8, 8, 8) and ours.abs().max() > 0.1  # epsilon and the learned-variance channels
        theirs = transformer(x, timestep=t, class_labels=y).sample
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
        # saved and loaded by diffusers itself; its own timestep projection (frequencies over 127, not 128) differs
        transformer.save_pretrained(tmp_path / f"t{class_dropout_prob}")
        plain = DiTTransformer2DModel.from_pretrained(tmp_path / f"t{class_dropout_prob}")
        assert (plain(x, timestep=t, class_labels=y).sample - ours).abs().max() > 1e-3
        torch.testing.assert_close(exact_timesteps(plain)(x, timestep=t, class_labels=y).sample, ours, atol=1e-5,
                                   rtol=1e-5)
    with pytest.raises(ValueError, match="Pre-Norm DiT; a 'siamese' DiT is shared as DiTModel"):
        to_diffusers_transformer(tiny_dit("siamese")[0])
    with pytest.raises(ValueError, match="published Pre-Norm DiT; a DiT with norm=rmsnorm, rope is shared as DiTModel"):
        to_diffusers_transformer(tiny_dit("pre", kwargs={**TINY, "norm": "rmsnorm", "rope": True})[0])


# LightningDiT's per-channel normalisation of the latents, which the pipeline undoes before the VAE as diffusion.sample
LATENT_NORM = {"mean": [0.5, -0.2, 0.1, 0.0], "std": [2.0, 0.5, 1.5, 1.0], "multiplier": 0.8}


@pytest.mark.parametrize("topology, cfg_scale, latent_norm", [("pre", 1.0, None), ("pre", 2.0, None),
                                                               ("siamese", 2.0, None), ("pre", 2.0, LATENT_NORM)])
def test_exported_pipeline_samples_as_diffusion_sample_on_the_same_noise(tmp_path, topology, cfg_scale, latent_norm):
    """Export (CLI) -> DiTSamplingPipeline.from_pretrained -> 4 DDPM steps with the learned variance, through a tiny
    VAE: latents equal diffusion.sampling's chain on the same per-sample streams, images equal diffusion.sample's."""
    vae = tiny_vae(tmp_path / "vae")
    model, spec = tiny_dit(topology, in_channels=4, autoencoder=str(vae), latent_norm=latent_norm)
    ckpt = save_weights(model, tmp_path / "ema.safetensors", metadata=spec.metadata(step=3))
    export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "pipe"), "--format", "diffusers", "--quiet"])
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    shipped, _ = remote_code()  # the module file the folder carries (the pipeline class and DiTModel)
    assert index["_class_name"] == [shipped, "DiTSamplingPipeline"] and index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["transformer"] == (["diffusers", "DiTTransformer2DModel"] if topology == "pre"
                                    else [shipped, "DiTModel"])
    assert (tmp_path / "pipe" / f"{shipped}.py").is_file()
    assert (tmp_path / "pipe" / "transformer" / f"{shipped}.py").is_file() == (topology != "pre")
    pipe = DiTSamplingPipeline.from_pretrained(tmp_path / "pipe", trust_remote_code=True)
    labels, seed = [0, 1, 2, 3], 7  # the classes diffusion.sample --num-samples 4 gives samples 0..3
    got = pipe(labels, num_inference_steps=4, guidance_scale=cfg_scale, generator=sample_generators(seed, range(4)),
               output_type="latent").images
    fn = model_fn_for(model, torch.tensor(labels), cfg_scale)
    expected = sample_loop(fn, spec.diffusion(sampling_steps=4), sample_generators(seed, range(4)), spec.shape)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    images = pipe(labels, num_inference_steps=4, guidance_scale=cfg_scale, generator=sample_generators(seed, range(4)),
                  output_type="np").images
    sample_main(["--checkpoint", str(ckpt), "--num-samples", "4", "--out-dir", str(tmp_path / "s"), "--steps", "4",
                 "--seed", str(seed), "--cfg-scale", str(cfg_scale), "--batch-size", "4", "--quiet"])
    ours = np.load(tmp_path / "s" / "samples.npz")
    assert ours["arr_1"].tolist() == labels and ours["arr_0"].shape == images.shape == (4, 8, 8, 3)
    quantised = np.clip(np.round(images * 255), 0, 255)  # [0, 1] floats rounded vs DiT's 127.5 x + 128
    assert np.abs(quantised - ours["arr_0"]).max() <= 1 and ours["arr_0"].std() > 5
    assert pipe.config.latent_norm == latent_norm


ISOLATED_LOAD = """
import importlib.util, json, sys
import numpy as np, torch
missing = [name for name in ("diffusion", "common") if importlib.util.find_spec(name) is not None]
assert not missing, f"the project is importable here: {missing} on {sys.path}"
from diffusers import DiffusionPipeline
for case in json.loads(sys.argv[1]):
    pipe = DiffusionPipeline.from_pretrained(case["folder"], trust_remote_code=True)
    out = pipe(case["labels"], num_inference_steps=4, guidance_scale=case["cfg"],
               generator=torch.Generator().manual_seed(case["seed"]), output_type="latent").images
    np.save(case["folder"] + "_latents.npy", out.numpy())
    if pipe.vae is not None:
        images = pipe(case["labels"], num_inference_steps=4, guidance_scale=case["cfg"],
                      generator=torch.Generator().manual_seed(case["seed"]), output_type="pt").images
        np.save(case["folder"] + "_images.npy", images.numpy())
    print(case["topology"], type(pipe).__module__, type(pipe.transformer).__name__, flush=True)
"""


def test_diffusers_export_loads_and_samples_where_the_project_is_not_installed(tmp_path):
    """Every topology exported with --format diffusers, copied elsewhere and loaded by a fresh interpreter that
    cannot import this project (-S: no .pth files, only site-packages on the path) with
    DiffusionPipeline.from_pretrained(folder, trust_remote_code=True): its latents (and, through a VAE, its images)
    equal the in-project model's on the same noise."""
    import shutil
    import subprocess
    import sys
    import sysconfig

    from diffusion.models import DIT_TOPOLOGIES

    vae = tiny_vae(tmp_path / "vae")
    exported, cases, expected = tmp_path / "exported", [], {}
    elsewhere = tmp_path / "elsewhere"
    for i, topology in enumerate(DIT_TOPOLOGIES):
        latent = topology == "siamese"  # one through a VAE, the rest in pixel space
        model, spec = tiny_dit(topology, in_channels=4 if latent else 3,
                               **({"autoencoder": str(vae)} if latent else {}))
        ckpt = save_weights(model, tmp_path / f"{topology}.safetensors", metadata=spec.metadata())
        export_main(["--checkpoint", str(ckpt), "--out", str(exported / topology), "--format", "diffusers", "--quiet"])
        labels, cfg, seed = [0, 3, 4], (2.0 if i % 2 else 1.0), 10 + i
        stream = int(torch.randint(2 ** 32, (1,), generator=torch.Generator().manual_seed(seed)))  # as the pipeline
        fn = model_fn_for(model, torch.tensor(labels), cfg)
        latents = sample_loop(fn, spec.diffusion(sampling_steps=4), sample_generators(stream, range(3)), spec.shape)
        assert latents.abs().max() > 0.1
        expected[topology] = latents
        if latent:
            decoded = AutoencoderKL.from_pretrained(vae).decode(latents / 0.18215).sample
            expected[topology + " images"] = (decoded / 2 + 0.5).clamp(0, 1)
        cases.append({"folder": str(elsewhere / topology), "topology": topology, "labels": labels, "cfg": cfg,
                      "seed": seed})
    shutil.copytree(exported, elsewhere)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1",  # the arithmetic of this process (one thread), so the sums round alike
           "PYTHONPATH": sysconfig.get_paths()["purelib"]}  # site-packages alone: no project, no editable install
    done = subprocess.run([sys.executable, "-S", "-c", ISOLATED_LOAD, json.dumps(cases)], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    for topology in DIT_TOPOLOGIES:
        line = next(line for line in lines if line.startswith(topology + " "))
        assert line.split()[1].startswith("diffusers_modules.local.siamesenorm_dit_"), line
        assert line.split()[2] == ("DiTTransformer2DModel" if topology == "pre" else "DiTModel"), line
        got = torch.from_numpy(np.load(elsewhere / f"{topology}_latents.npy"))
        torch.testing.assert_close(got, expected[topology], atol=1e-5, rtol=1e-5)
    got = torch.from_numpy(np.load(elsewhere / "siamese_images.npy"))
    torch.testing.assert_close(got, expected["siamese images"], atol=1e-5, rtol=1e-5)


def test_pixel_pipeline_has_no_vae_and_ddim_is_offered(tmp_path):
    model, spec = tiny_dit("siamese")
    ckpt = save_weights(model, tmp_path / "ema.safetensors", metadata=spec.metadata())
    export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "pipe"), "--format", "diffusers", "--quiet"])
    pipe = DiTSamplingPipeline.from_pretrained(tmp_path / "pipe", trust_remote_code=True)
    assert pipe.vae is None and pipe.scheduler.config.variance_type == "learned_range"
    got = pipe([1, 2], num_inference_steps=10, sampler="ddim", eta=0.5, generator=sample_generators(0, [0, 1]),
               output_type="latent").images
    expected = sample_loop(model_fn_for(model, torch.tensor([1, 2])), spec.diffusion(sampling_steps=10, spacing="ddim"),
                           sample_generators(0, [0, 1]), spec.shape, "ddim", 0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    pil = pipe([1], num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images
    assert pil[0].size == (8, 8)


def test_export_refusals_are_one_line(tmp_path, monkeypatch, capsys):
    model, spec = tiny_dit("siamese")
    ckpt = save_weights(model, tmp_path / "ema.safetensors", metadata=spec.metadata())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "full")])
    assert exit_info.value.code == 2 and "is not empty" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "hub"), "--push-to-hub", "someone/dit",
                     "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "--push-to-hub someone/dit" in err[0]
    assert (tmp_path / "hub" / "config.json").is_file()  # the folder is written either way
    (tmp_path / "other").mkdir()
    to_diffusers_transformer(tiny_dit("pre")[0]).save_pretrained(tmp_path / "other")
    with pytest.raises(SystemExit, match="describes a DiTTransformer2DModel, not a DiTModel"):
        sample_main(["--checkpoint", str(tmp_path / "other"), "--grid", str(tmp_path / "g.png")])


@pytest.mark.parametrize("topology", ["pre", "siamese"])
def test_the_documented_guided_pipeline_call_works_on_a_one_channel_model(tmp_path, topology):
    """``pipe(labels, guidance_scale=1.5)`` as docs/models.md shows it, on an exported DiT with one channel
    (Fashion-MNIST's): the default guides that channel, as diffusion.sample does; a count the model has not is
    refused, naming guided_channels."""
    model, spec = tiny_dit(topology)
    ckpt = save_weights(model, tmp_path / "ema.safetensors", metadata=spec.metadata())
    export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "pipe"), "--format", "diffusers", "--quiet"])
    pipe = DiTSamplingPipeline.from_pretrained(tmp_path / "pipe", trust_remote_code=True)
    labels, generators = [0, 3], lambda: sample_generators(0, range(2))
    got = pipe(labels, num_inference_steps=3, guidance_scale=1.5, generator=generators(), output_type="latent").images
    expected = sample_loop(model_fn_for(model, torch.tensor(labels), 1.5), spec.diffusion(sampling_steps=3),
                           generators(), spec.shape)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="guided_channels 3: this model has 1 output channel to guide"):
        pipe(labels, num_inference_steps=3, guidance_scale=1.5, guided_channels=3)
