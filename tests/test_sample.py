"""diffusion.sample: reverse steps against direct restatements, guidance, exact distributed sample sets, resume."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.checkpoint import load_weights, save_weights
from diffusion.evaluation.images import open_images, read_sampling_protocol
from diffusion.checkpoints import load_dit
from diffusion.models import DIT_TOPOLOGIES, DiT
from diffusion.sample import main
from diffusion.sampling.chains import reverse_chain, sample_loop
from diffusion.sampling.guidance import guided_model_fn, model_fn_for
from diffusion.sampling.noise import draw_noise, sample_generators
from tests.test_gaussian_diffusion import adm_space_timesteps, dit_diffusion


def sample_generator(seed: int, index: int) -> torch.Generator:
    """The noise stream of one global sample index (the library hands out one per sample of a batch)."""
    return sample_generators(seed, [index])[0]

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 32, "depth": 2, "num_heads": 2}
SHAPE = (1, 8, 8)
torch.set_num_threads(1)


def tiny_model(learn_sigma=True, class_dropout_prob=0.1, in_channels=1, topology="siamese") -> DiT:
    """A tiny pixel-space DiT, weights perturbed away from the adaLN-Zero init (whose output is identically zero)
    so that samples depend on them."""
    torch.manual_seed(0)
    model = DiT(input_size=8, patch_size=4, in_channels=in_channels, num_classes=5, learn_sigma=learn_sigma,
                class_dropout_prob=class_dropout_prob, topology=topology, **TINY)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def save_tiny(path, learn_sigma=True, class_dropout_prob=0.1, in_channels=1, autoencoder="none", topology="siamese"):
    """:func:`tiny_model` with metadata as diffusion.train writes it."""
    model = tiny_model(learn_sigma, class_dropout_prob, in_channels, topology)
    meta = {"model": "DiT-S/4", "topology": topology, "learn_sigma": learn_sigma, "class_dropout_prob": class_dropout_prob,
            "in_channels": in_channels, "input_size": 8, "num_classes": 5, "model_kwargs": json.dumps(TINY),
            "autoencoder": autoencoder, "step": 7}
    return save_weights(model, path, metadata=meta)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("ckpt") / "ema.safetensors")


def restated_chain(model_fn, steps, indices, sampler, eta=0.0, seed=0):
    """DDPM with learned range variance / DDIM, written out in float64 from the DiT/ADM formulas."""
    betas_train = np.linspace(1e-4, 0.02, 1000, dtype=np.float64)
    abar_train = np.cumprod(1.0 - betas_train)
    kept = np.array(sorted(adm_space_timesteps(1000, str(steps))))  # ADM's "N" rule
    abar = abar_train[kept]
    abar_prev = np.append(1.0, abar[:-1])
    beta = 1.0 - abar / abar_prev
    post_var = beta * (1.0 - abar_prev) / (1.0 - abar)
    log_post = np.log(np.append(post_var[1], post_var[1:]))
    gens = [sample_generator(seed, i) for i in indices]
    x = draw_noise(gens, SHAPE).double()
    for i in reversed(range(steps)):
        out = model_fn(x.float(), torch.full((len(indices),), int(kept[i]))).double()
        eps, v = out[:, :1], out[:, 1:]
        noise = draw_noise(gens, SHAPE).double()
        x0 = np.sqrt(1.0 / abar[i]) * x - np.sqrt(1.0 / abar[i] - 1.0) * eps
        if sampler == "ddpm":
            mean = (beta[i] * np.sqrt(abar_prev[i]) / (1.0 - abar[i])) * x0 \
                + ((1.0 - abar_prev[i]) * np.sqrt(1.0 - beta[i]) / (1.0 - abar[i])) * x
            frac = (v + 1.0) / 2.0
            log_var = frac * np.log(beta[i]) + (1.0 - frac) * log_post[i]
            x = mean + (i > 0) * torch.exp(0.5 * log_var) * noise
        else:
            sigma = eta * np.sqrt((1 - abar_prev[i]) / (1 - abar[i])) * np.sqrt(1 - abar[i] / abar_prev[i])
            x = np.sqrt(abar_prev[i]) * x0 + np.sqrt(1 - abar_prev[i] - sigma ** 2) * eps + (i > 0) * sigma * noise
    return x


@pytest.mark.parametrize("topology", DIT_TOPOLOGIES)
def test_loaded_models_equal_initialised_then_loaded_ones_in_every_topology(topology, tmp_path):
    """load_dit builds on the meta device and skips the initialisation: in every topology the loaded model holds
    exactly the saved weights and computes, bit for bit, what a model initialised and then loaded computes."""
    path = save_tiny(tmp_path / "ema.safetensors", topology=topology)
    model, spec, _ = load_dit(path, {})
    initialised = spec.build()
    load_weights(initialised, path)
    initialised.eval().requires_grad_(False)
    assert model.state_dict().keys() == initialised.state_dict().keys()
    assert all(torch.equal(v, initialised.state_dict()[k]) for k, v in model.state_dict().items())
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    x, t, y = torch.randn(3, *SHAPE), torch.tensor([5, 500, 999]), torch.tensor([0, 4, 5])
    with torch.no_grad():
        assert torch.equal(model(x, t, y), initialised(x, t, y))


@pytest.mark.parametrize("sampler,eta", [("ddpm", 0.0), ("ddim", 0.0), ("ddim", 0.7)])
def test_reverse_chain_matches_direct_restatement(tiny, sampler, eta):
    model, spec, weights = load_dit(tiny, {})
    assert (spec.name, spec.topology, spec.num_classes, weights) == ("DiT-S/4", "siamese", 5, "weights")
    labels, indices = torch.tensor([0, 3, 4]), [0, 7, 12]
    fn = model_fn_for(model, labels)
    diffusion = dit_diffusion(learn_sigma=True, sampling_steps=6)
    ours = sample_loop(fn, diffusion, [sample_generator(0, i) for i in indices], SHAPE, sampler, eta)
    direct = restated_chain(fn, 6, indices, sampler, eta)
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(ours.double(), direct, atol=2e-4, rtol=1e-4)


def adm_ddim_chain(model_fn, respacing, indices, eta, seed):
    """ADM's DDIM sampler re-stated in float64, every state of the chain: SpacedDiffusion (betas recomputed
    from abar at the kept steps, abar re-accumulated from them), then per step ``ddim_sample`` with
    ``clip_denoised=False`` as DiT samples: pred_xstart from the model's eps, eps re-derived from pred_xstart,
    ``sigma = eta sqrt((1 - abar_prev) / (1 - abar)) sqrt(1 - abar / abar_prev)``,
    ``x = pred_xstart sqrt(abar_prev) + sqrt(1 - abar_prev - sigma^2) eps + [t > 0] sigma noise``.
    The model sees the training timestep ``timestep_map[i]``; noise comes from the same per-sample streams."""
    abar_train = np.cumprod(1.0 - np.linspace(1e-4, 0.02, 1000, dtype=np.float64))
    timestep_map, new_betas, last = [], [], 1.0
    kept = adm_space_timesteps(1000, respacing)
    for i, abar in enumerate(abar_train):
        if i in kept:
            new_betas.append(1 - abar / last)
            last = abar
            timestep_map.append(i)
    alphas_cumprod = np.cumprod(1.0 - np.array(new_betas))
    alphas_cumprod_prev = np.append(1.0, alphas_cumprod[:-1])
    gens = [sample_generator(seed, i) for i in indices]
    x = draw_noise(gens, SHAPE).double()
    states = [x]
    for i in reversed(range(len(timestep_map))):
        eps_model = model_fn(x.float(), torch.full((len(indices),), timestep_map[i])).double()[:, :1]
        pred_xstart = np.sqrt(1.0 / alphas_cumprod[i]) * x - np.sqrt(1.0 / alphas_cumprod[i] - 1) * eps_model
        eps = (np.sqrt(1.0 / alphas_cumprod[i]) * x - pred_xstart) / np.sqrt(1.0 / alphas_cumprod[i] - 1)
        abar, abar_prev = alphas_cumprod[i], alphas_cumprod_prev[i]
        sigma = eta * np.sqrt((1 - abar_prev) / (1 - abar)) * np.sqrt(1 - abar / abar_prev)
        noise = draw_noise(gens, SHAPE).double()
        mean_pred = pred_xstart * np.sqrt(abar_prev) + np.sqrt(1 - abar_prev - sigma ** 2) * eps
        x = mean_pred + (i != 0) * sigma * noise
        states.append(x)
    return timestep_map, states


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_sampling_matches_adm_ddim_chain_step_for_step(tiny, tmp_path, eta):
    """``--sampler ddim --steps 10`` is ADM's ddim10 (stride 100 from 0) and every state of its chain equals ADM's
    DDIM chain; the command records the steps and writes the same final images."""
    model, spec, _ = load_dit(tiny, {})
    labels, indices = torch.tensor([0, 1, 2]), [0, 1, 2]
    fn = model_fn_for(model, labels)
    timestep_map, adm_states = adm_ddim_chain(fn, "ddim10", indices, eta, seed=3)
    assert timestep_map == list(range(0, 1000, 100))

    out = main(["--checkpoint", str(tiny), "--num-samples", "3", "--out-dir", str(tmp_path / "s"), "--batch-size", "3",
                "--sampler", "ddim", "--steps", "10", "--eta", str(eta), "--seed", "3", "--quiet"])
    protocol = out["protocol"]
    assert (protocol["spacing"], protocol["respacing"], protocol["timesteps"]) == ("ddim", "ddim10", timestep_map)
    diffusion = dit_diffusion(learn_sigma=True, sampling_steps=10, spacing=protocol["spacing"])
    ours = list(reverse_chain(fn, diffusion, [sample_generator(3, i) for i in indices], SHAPE, "ddim", eta))
    assert len(ours) == len(adm_states) == 11
    for step, (a, b) in enumerate(zip(ours, adm_states)):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=f"state {step}")
    assert (ours[-1] - ours[0]).abs().max() > 0.1
    # the written images are the final states, quantized
    images = np.load(tmp_path / "s" / "samples.npz")["arr_0"].astype(np.float64)
    expected = np.clip(np.round((adm_states[-1].clamp(-1, 1).numpy() + 1) * 127.5), 0, 255).transpose(0, 2, 3, 1)
    assert np.abs(images - expected).max() <= 1


def test_step_counts_the_spacing_cannot_give_are_refused(tiny, tmp_path):
    with pytest.raises(SystemExit, match="no integer stride gives exactly 300 .*use 250 or 334 steps"):
        main(["--checkpoint", str(tiny), "--grid", str(tmp_path / "g.png"), "--sampler", "ddim", "--steps", "300"])
    # the evenly spaced rule, chosen explicitly, takes any count
    out = main(["--checkpoint", str(tiny), "--num-samples", "2", "--out-dir", str(tmp_path / "even"), "--steps", "7",
                "--sampler", "ddim", "--spacing", "even", "--quiet"])
    assert out["protocol"]["respacing"] == "7"
    assert out["protocol"]["timesteps"] == sorted(adm_space_timesteps(1000, "7"))
    assert out["protocol"]["timesteps"] == read_sampling_protocol(tmp_path / "even" / "samples.npz")["timesteps"]


@pytest.mark.parametrize("sampler,eta", [("ddpm", 0.0), ("ddim", 0.0), ("ddim", 1.0)])
def test_exact_denoiser_of_a_point_mass_lands_on_it(sampler, eta):
    """With the exact epsilon of data that is a single point c, every sampler must end exactly at c."""
    diffusion = dit_diffusion(learn_sigma=True, sampling_steps=10)
    abar_train = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0)
    c = torch.linspace(-0.8, 0.8, 64, dtype=torch.float64).reshape(1, 1, 8, 8)

    def exact_eps(x, t):
        a = abar_train[t].reshape(-1, 1, 1, 1)
        eps = (x.double() - a.sqrt() * c) / (1 - a).sqrt()
        return torch.cat([eps, torch.zeros_like(eps)], 1).float()  # v = 0: mid-range variance

    out = sample_loop(exact_eps, diffusion, [sample_generator(1, i) for i in range(3)], SHAPE, sampler, eta)
    torch.testing.assert_close(out.double(), c.expand(3, -1, -1, -1), atol=1e-4, rtol=0)


def test_guidance_at_scale_one_equals_unguided_and_guides_only_the_chosen_channels(tiny):
    model, _, _ = load_dit(tiny, {})
    x = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(0))
    t, labels = torch.tensor([10, 500, 999]), torch.tensor([1, 2, 3])
    plain = model(x, t, labels)
    assert torch.equal(model_fn_for(model, labels, 1.0)(x, t), plain)
    torch.testing.assert_close(guided_model_fn(model, labels, 1.0, "all")(x, t), plain, atol=1e-5, rtol=1e-5)
    strong = guided_model_fn(model, labels, 4.0, "all")(x, t)
    assert not torch.allclose(strong[:, :1], plain[:, :1], atol=1e-3)
    torch.testing.assert_close(strong[:, 1:], plain[:, 1:])  # the variance channel is not guided
    no_null = save_tiny(tiny.parent / "no_null.safetensors", class_dropout_prob=0.0)
    model, _, _ = load_dit(no_null, {})
    with pytest.raises(Exception, match="needs a null class"):
        model_fn_for(model, labels, 1.5)


def sample_args(ckpt, out_dir, *extra):
    return ["--checkpoint", str(ckpt), "--num-samples", "10", "--out-dir", str(out_dir), "--batch-size", "4",
            "--steps", "4", "--seed", "3", "--quiet", *map(str, extra)]


def test_two_processes_give_the_same_exact_balanced_set_and_runs_resume(tiny, tmp_path):
    one = main(sample_args(tiny, tmp_path / "one", "--format", "both"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29561",
           "-m", "diffusion.sample", *sample_args(tiny, tmp_path / "two")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    a, b = np.load(tmp_path / "one" / "samples.npz"), np.load(tmp_path / "two" / "samples.npz")
    assert a["arr_0"].shape == (10, 8, 8, 1) and a["arr_0"].dtype == np.uint8
    np.testing.assert_array_equal(a["arr_0"], b["arr_0"])
    np.testing.assert_array_equal(a["arr_1"], b["arr_1"])
    assert np.bincount(a["arr_1"], minlength=5).tolist() == [2] * 5
    assert len({img.tobytes() for img in a["arr_0"]}) == 10  # no duplicates
    protocol = read_sampling_protocol(tmp_path / "two" / "samples.npz")
    assert protocol["num_processes"] == 2 and protocol["num_samples"] == 10 and protocol["steps"] == 4
    assert one["protocol"]["num_processes"] == 1
    # the PNG folder holds the same images, and its protocol is where diffusion.fid looks for it
    pngs = torch.cat(list(open_images(tmp_path / "one" / "images").batches(10)))
    assert torch.equal(pngs[:, :1], torch.from_numpy(a["arr_0"]).permute(0, 3, 1, 2))
    assert read_sampling_protocol(tmp_path / "one" / "images")["seed"] == 3

    # resume: finished chunks are kept (not rewritten), a lost one is regenerated identically
    chunks = sorted((tmp_path / "one" / "chunks").glob("chunk_*.npz"))
    assert len(chunks) == 3
    kept = chunks[0].stat().st_mtime_ns
    chunks[1].unlink()
    (tmp_path / "one" / "samples.npz").unlink()
    main(sample_args(tiny, tmp_path / "one"))
    assert chunks[0].stat().st_mtime_ns == kept
    np.testing.assert_array_equal(np.load(tmp_path / "one" / "samples.npz")["arr_0"], a["arr_0"])
    with pytest.raises(SystemExit, match="other settings.*cfg_scale"):
        main(sample_args(tiny, tmp_path / "one", "--cfg-scale", "2"))


def test_a_stop_signal_to_one_process_stops_every_process_of_a_sample_set_at_the_same_round(tiny, tmp_path):
    """A real SIGTERM to rank 0 of two, after its first chunk (a signal one task of a job gets): both processes stop
    after the same round of chunks (torchrun reports their exit 4 as its own failure; the one-process exit 4 is
    test_latents'); the same command then writes the set an uninterrupted run writes."""
    reference = main(sample_args(tiny, tmp_path / "reference", "--batch-size", "2"))  # 5 chunks: 3 rounds of 2
    out = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29563",
           "-m", "tests.faults", "sigterm_output", "1", "--", "-m", "diffusion.sample",
           *sample_args(tiny, out, "--batch-size", "2")]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "FAULT_RANK": "0"},
                          capture_output=True, text=True, timeout=300)
    assert "SIGTERM received: stopped after 1 of 3 rounds of chunks" in proc.stdout, proc.stderr[-3000:]
    chunks = sorted(p.name for p in (out / "chunks").glob("chunk_*.npz"))
    assert len(chunks) == 2 and not (out / "samples.npz").exists()  # one round: one chunk per process

    main(sample_args(tiny, out, "--batch-size", "2"))
    np.testing.assert_array_equal(np.load(out / "samples.npz")["arr_0"], np.load(reference["outputs"]["npz"])["arr_0"])


def test_grid_through_a_tiny_vae_and_clear_errors(tmp_path):
    from diffusers import AutoencoderKL
    from PIL import Image

    torch.manual_seed(0)
    vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                        block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=4)
    vae.save_pretrained(tmp_path / "vae")
    ckpt = save_tiny(tmp_path / "latent.safetensors", in_channels=4, autoencoder=str(tmp_path / "vae"))
    out = main(["--checkpoint", str(ckpt), "--grid", str(tmp_path / "grid.png"), "--labels", "0,1,2,3,4,4",
                "--steps", "3", "--cfg-scale", "1.5", "--nrow", "3", "--quiet"])
    assert out["labels"] == [0, 1, 2, 3, 4, 4]
    with Image.open(tmp_path / "grid.png") as grid:  # 2 rows x 3 images of 8 px upscaled x16, 4 px padding, captions
        assert grid.size == (3 * (128 + 4) + 4, 2 * (128 + 4 + 18) + 4)

    with pytest.raises(SystemExit, match=r"--labels \[7\] are outside \[0, 5\)"):
        main(["--checkpoint", str(ckpt), "--grid", str(tmp_path / "g.png"), "--labels", "7", "--steps", "2"])
    plain = tmp_path / "plain.pt"
    torch.save(DiT(input_size=8, patch_size=4, in_channels=1, num_classes=5, **TINY).state_dict(), plain)
    with pytest.raises(SystemExit, match="pass --model"):
        main(["--checkpoint", str(plain), "--grid", str(tmp_path / "g.png")])
    with pytest.raises(SystemExit, match="checkpoint does not match DiT"):  # right name, wrong sizes
        main(["--checkpoint", str(plain), "--model", "DiT-S/4", "--image-size", "8", "--vae", "none",
              "--num-classes", "5", "--grid", str(tmp_path / "g.png")])
    with pytest.raises(SystemExit, match="choose one output") as exit_info:
        main(["--checkpoint", str(ckpt)])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit, match="cannot load the VAE"):
        main(["--checkpoint", str(ckpt), "--vae", str(tmp_path / "no_vae"), "--grid", str(tmp_path / "g.png")])


def test_training_checkpoints_sample_their_ema_weights(tiny, tmp_path):
    from safetensors.torch import load_file

    ema = load_file(tiny)
    raw = {k: v + 1.0 for k, v in ema.items()}
    config = {"model": {"name": "DiT-S/4", "topology": "siamese", "learn_sigma": True, "class_dropout_prob": 0.1,
                        "kwargs": TINY},
              "data": {"dataset": "fashion_mnist", "autoencoder": "none", "image_size": 8, "num_classes": 5}}
    torch.save({"model": raw, "ema": ema, "config": config, "step": 7}, tmp_path / "step_0000007.pt")
    model, spec, weights = load_dit(tmp_path / "step_0000007.pt", {})
    assert weights == "ema" and (spec.in_channels, spec.input_size, spec.autoencoder) == (1, 8, "none")
    assert torch.equal(model.state_dict()["final_layer.linear.weight"], ema["final_layer.linear.weight"])
    model, _, weights = load_dit(tmp_path / "step_0000007.pt", {}, weights="model")
    assert weights == "model"
    assert torch.equal(model.state_dict()["final_layer.linear.weight"], raw["final_layer.linear.weight"])


def test_resume_refuses_replaced_weights_but_follows_a_moved_file(tiny, tmp_path):
    """A checkpoint replaced between a kill and the rerun (same path, other weights) is refused; the same weights
    under another path resume."""
    import shutil

    ckpt = tmp_path / "ema.safetensors"
    shutil.copy(tiny, ckpt)
    first = main(sample_args(ckpt, tmp_path / "out"))
    assert len(first["protocol"]["weights_sha256"]) == 64
    images = np.load(tmp_path / "out" / "samples.npz")["arr_0"]
    chunks = sorted((tmp_path / "out" / "chunks").glob("chunk_*.npz"))
    chunks[1].unlink()  # as if killed before the second chunk was finished
    (tmp_path / "out" / "samples.npz").unlink()
    # ... and the file replaced in between, as a training run refreshing ema.safetensors does
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    weights = load_file(ckpt)
    weights["final_layer.linear.bias"] = weights["final_layer.linear.bias"] + 1.0
    with safe_open(str(tiny), "pt") as f:
        save_file(weights, str(ckpt), metadata=f.metadata())
    with pytest.raises(SystemExit, match="holds samples from other weights.*Use a new --out-dir"):
        main(sample_args(ckpt, tmp_path / "out"))
    assert not (tmp_path / "out" / "samples.npz").exists()

    moved = tmp_path / "moved" / "ema.safetensors"
    moved.parent.mkdir()
    shutil.copy(tiny, moved)
    kept = chunks[0].stat().st_mtime_ns
    again = main(sample_args(moved, tmp_path / "out"))
    assert chunks[0].stat().st_mtime_ns == kept
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "samples.npz")["arr_0"], images)
    assert again["protocol"]["weights_sha256"] == first["protocol"]["weights_sha256"]
    assert again["protocol"]["checkpoint"] == str(moved)
    # chunks without the settings that made them are never trusted
    (tmp_path / "out" / "settings.json").unlink()
    with pytest.raises(SystemExit, match="no settings.json"):
        main(sample_args(moved, tmp_path / "out"))


def test_pngs_are_rewritten_atomically_and_every_output_is_fsynced(tiny, tmp_path, monkeypatch):
    """A 0-byte PNG or a temporary file left by a kill is replaced on the rerun; chunks, settings, the npz and
    the PNGs are flushed to disk, file and directory."""
    from PIL import Image

    import common.durable as durable

    synced = []
    real_file, real_dir = durable.fsync_file, durable.fsync_dir
    monkeypatch.setattr(durable, "fsync_file", lambda p: (synced.append(("file", Path(p).name)), real_file(p)))
    monkeypatch.setattr(durable, "fsync_dir", lambda p: (synced.append(("dir", Path(p).name)), real_dir(p)))
    out = tmp_path / "out"
    main(sample_args(tiny, out, "--format", "both"))
    for name in ("chunk_000000.npz.tmp", "chunk_000002.npz.tmp", "settings.json.tmp", "samples.npz.tmp",
                 "000009.png.tmp", "protocol.json.tmp"):
        assert ("file", name) in synced, name
    assert ("dir", "chunks") in synced and ("dir", "images") in synced and ("dir", "out") in synced

    png = out / "images" / "000003.png"
    good = png.read_bytes()
    png.write_bytes(b"")  # what a kill during a non-atomic PNG write left behind
    (out / "images" / "000004.png.tmp").write_bytes(b"partial")
    main(sample_args(tiny, out, "--format", "png"))
    assert png.read_bytes() == good
    assert not list((out / "images").glob("*.tmp"))
    with Image.open(png) as img:
        assert np.array_equal(np.asarray(img), np.load(out / "samples.npz")["arr_0"][3, ..., 0])


def test_grids_are_upscaled_and_labelled_with_class_names(tmp_path):
    from PIL import Image

    from diffusion.sampling.grids import class_names, write_grid

    assert class_names(10, pixel=True)[9] == "Ankle boot"
    assert class_names(1000)[207] == "golden retriever"
    assert class_names(2, names=["n01440764", "n02099601"]) == ["tench", "golden retriever"]
    assert class_names(3) == ["0", "1", "2"]
    images = torch.zeros(6, 1, 28, 28, dtype=torch.uint8)
    images[:, :, 10:18, 10:18] = 255  # a white square in each tile
    by_row = write_grid(images, [0, 0, 0, 9, 9, 9], tmp_path / "rows.png", class_names(10, pixel=True), nrow=3)
    with Image.open(by_row) as grid:
        width, height = grid.size
        pixels = np.asarray(grid.convert("L"))
    assert height == 2 * (140 + 4) + 4  # 28 px tiles upscaled x5 to 140 >= 128, no captions
    left = pixels[:, : width - 3 * 144 - 4]  # the label margin holds dark text in both rows
    assert (left[:144] < 128).any() and (left[144:] < 128).any()
    assert (pixels > 250).sum() > 6 * (8 * 5) ** 2  # the white squares, upscaled
    tiles = write_grid(images, [0, 1, 2, 3, 4, 5], tmp_path / "tiles.png", class_names(10, pixel=True), nrow=3)
    with Image.open(tiles) as grid:
        assert grid.size[1] == 2 * (140 + 4 + 18) + 4  # a caption under every tile


# ------------------------------------------------------------------------------ noise streams, bit for bit

def todays_generator(seed, index):
    """A sample's noise stream as the sampler has always seeded it: numpy's SeedSequence per sample."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, index]).generate_state(1)[0]))


def todays_chain(model_fn, diffusion, indices, sampler, eta, seed):
    """The reverse chain as diffusion.sample ran it: one draw per sample and step, DDIM written out as before."""
    gens = [todays_generator(seed, i) for i in indices]
    x = draw_noise(gens, SHAPE)
    for i in reversed(range(diffusion.num_timesteps)):
        t = torch.full((x.shape[0],), i, dtype=torch.long)
        out = model_fn(x, diffusion.model_timesteps(t))
        noise = draw_noise(gens, SHAPE)
        if sampler == "ddpm":
            x = diffusion.p_sample(out, x, t, noise)["sample"]
            continue
        eps = out[:, :1]
        x0 = diffusion.predict_xstart_from_eps(x, t, eps)
        abar = diffusion.alphas_cumprod[t].float().reshape(-1, 1, 1, 1)
        abar_prev = diffusion.alphas_cumprod_prev[t].float().reshape(-1, 1, 1, 1)
        sigma = eta * torch.sqrt((1 - abar_prev) / (1 - abar)) * torch.sqrt(1 - abar / abar_prev)
        mean = x0 * torch.sqrt(abar_prev) + torch.sqrt(1 - abar_prev - sigma ** 2) * eps
        x = mean + (t != 0).float().reshape(-1, 1, 1, 1) * sigma * noise
    return x


@pytest.mark.parametrize("sampler,eta", [("ddpm", 0.0), ("ddim", 0.6)])
def test_samples_are_bit_identical_to_the_per_step_draws(tiny, sampler, eta):
    """Windows of noise per sample (one torch call for 32 steps) and vectorised seeds change no number."""
    model, _, _ = load_dit(tiny, {})
    indices = [0, 5, 9, 123456]
    fn = model_fn_for(model, torch.tensor([0, 1, 2, 3]))
    diffusion = dit_diffusion(sampling_steps=40, spacing="even")  # 41 draws: more than one window
    ours = sample_loop(fn, diffusion, [sample_generator(3, i) for i in indices], SHAPE, sampler, eta)
    assert torch.equal(ours, todays_chain(fn, diffusion, indices, sampler, eta, seed=3))


def test_vectorised_seeds_equal_numpys_seed_sequence():
    from diffusion.sampling.noise import sample_seeds

    rng = np.random.default_rng(0)
    for seed in (0, 1, 2020, 2 ** 32 - 1, 2 ** 40 + 3):  # the last one: numpy's own path
        indices = np.concatenate([np.arange(300), rng.integers(0, 2 ** 32, 300), [2 ** 33]])
        expected = [np.random.SeedSequence([seed, int(i)]).generate_state(1)[0] for i in indices]
        assert sample_seeds(seed, indices).tolist() == [int(e) for e in expected]


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 5, 5), (2, 3)])
def test_chain_noise_equals_one_draw_per_step(shape):
    from diffusion.sampling.noise import chain_noise

    gens, again = ([torch.Generator().manual_seed(s) for s in (4, 8)] for _ in range(2))
    windows = list(chain_noise(gens, shape, 70, "cpu"))
    assert len(windows) == 70
    for drawn in windows:
        assert torch.equal(drawn, draw_noise(again, shape))


# ------------------------------------------------------------------------------ what the weights record

def save_with(source, path, **meta):
    """A copy of a checkpoint with more (or other) metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(source), "pt") as f:
        save_file(load_file(source), str(path), metadata={**f.metadata(), **meta})
    return path


def test_the_sampler_uses_the_schedule_the_weights_record(tiny, tmp_path):
    from diffusion.gaussian_diffusion import GaussianDiffusion

    ckpt = save_with(tiny, tmp_path / "short.safetensors", num_timesteps="200", beta_start="0.0005", beta_end="0.03")
    out = main(sample_args(ckpt, tmp_path / "short"))
    assert out["protocol"]["timesteps"] == sorted(adm_space_timesteps(200, "4"))
    assert out["protocol"]["model"]["num_timesteps"] == 200 and out["protocol"]["model"]["beta_end"] == 0.03
    model, spec, _ = load_dit(ckpt)
    labels = torch.arange(10) % 5
    direct = sample_loop(model_fn_for(model, labels[:4]), GaussianDiffusion(200, 5e-4, 0.03, learn_sigma=True,
                                                                            sampling_steps=4),
                         [sample_generator(3, i) for i in range(4)], SHAPE)
    images = np.load(tmp_path / "short" / "samples.npz")["arr_0"][:4]
    expected = np.clip(np.round((direct.clamp(-1, 1).numpy() + 1) * 127.5), 0, 255).transpose(0, 2, 3, 1)
    assert np.abs(images - expected).max() <= 1
    # a file without a schedule (older ones, the official DiT weights) samples with DiT's
    old = main(sample_args(tiny, tmp_path / "old"))
    assert old["protocol"]["timesteps"][-1] == 999 and old["protocol"]["model"]["num_timesteps"] == 1000


def test_grids_name_the_classes_the_weights_record(tiny, tmp_path):
    """WordNet ids in the metadata become ImageNet's names on the grid; ids ImageNet-1k does not know stay."""
    from PIL import Image

    from diffusion.sampling.grids import class_names, write_grid

    wnids = ["n01440764", "n02099601", "n99999999", "n01443537", "n01484850"]
    ckpt = save_with(tiny, tmp_path / "named.safetensors", class_names=json.dumps(wnids))
    main(["--checkpoint", str(ckpt), "--grid", str(tmp_path / "grid.png"), "--labels", "0,1,2,3,4", "--nrow", "5",
          "--steps", "3", "--seed", "2", "--quiet"])
    main(["--checkpoint", str(ckpt), "--num-samples", "5", "--out-dir", str(tmp_path / "s"), "--steps", "3",
          "--seed", "2", "--quiet"])
    images = torch.from_numpy(np.load(tmp_path / "s" / "samples.npz")["arr_0"]).permute(0, 3, 1, 2)
    names = class_names(5, names=wnids)
    assert names == ["tench", "golden retriever", "n99999999", "goldfish", "great white shark"]
    write_grid(images, [0, 1, 2, 3, 4], tmp_path / "expected.png", names, nrow=5)
    write_grid(images, [0, 1, 2, 3, 4], tmp_path / "numbers.png", class_names(5), nrow=5)
    pixels = {n: np.asarray(Image.open(tmp_path / f"{n}.png")) for n in ("grid", "expected", "numbers")}
    assert np.array_equal(pixels["grid"], pixels["expected"]) and not np.array_equal(pixels["grid"], pixels["numbers"])


def test_bf16_sampling_is_a_recorded_switch(tiny, tmp_path):
    fp32 = main(sample_args(tiny, tmp_path / "fp32"))
    bf16 = main(sample_args(tiny, tmp_path / "bf16", "--precision", "bf16"))
    assert (fp32["protocol"]["precision"], bf16["protocol"]["precision"]) == ("fp32", "bf16")
    a = np.load(tmp_path / "fp32" / "samples.npz")["arr_0"].astype(int)
    b = np.load(tmp_path / "bf16" / "samples.npz")["arr_0"].astype(int)
    assert 0 < np.abs(a - b).mean() < 1  # bfloat16 matmuls move a few pixels; the chain stays in float32
    with pytest.raises(SystemExit, match="other settings.*precision"):
        main(sample_args(tiny, tmp_path / "fp32", "--precision", "bf16"))


# ------------------------------------------------------------------------------------------- first-time traps

def test_guidance_defaults_to_dits_3_of_4_channels_and_to_every_channel_of_a_smaller_model(tiny, tmp_path):
    """DiT's and SiT's official code guide the first 3 of 4 latent channels; a Fashion-MNIST DiT has one, which the
    default guides (the command line, the trainer's grid sampler and forward_with_cfg alike)."""
    from diffusion.sampling.decoder import Decoder
    from diffusion.sampling.guidance import resolve_guided_channels
    from diffusion.sampling.sampler import Sampler

    assert [resolve_guided_channels(None, c) for c in (1, 2, 3, 4, 16)] == ["1", "2", "3", "3", "3"]
    out = main(sample_args(tiny, tmp_path / "guided", "--cfg-scale", "1.5"))
    assert out["protocol"]["guided_channels"] == "1" and out["protocol"]["cfg_scale"] == 1.5
    model, spec, _ = load_dit(tiny, {})
    grids = Sampler(model, spec, Decoder("none", "cpu"), spec.diffusion(sampling_steps=2), cfg_scale=1.5)  # as the trainer
    assert grids.guided_channels == "1" and grids(torch.arange(2), torch.tensor([0, 1])).shape == (2, 1, 8, 8)
    t, y = torch.tensor([3, 700, 3, 700]), torch.tensor([1, 2, 5, 5])  # [labels; null class], as DiT calls it
    for net, same in ((model, "all"), (tiny_model(in_channels=4), 3)):
        x = torch.randn(2, net.in_channels, 8, 8).repeat(2, 1, 1, 1)
        default = net.forward_with_cfg(x, t, y, 2.0)
        torch.testing.assert_close(default, net.forward_with_cfg(x, t, y, 2.0, same), rtol=0, atol=0)
        assert not torch.allclose(default[:2, :1], net(x, t, y)[:2, :1], atol=1e-3)  # guided
    assert not torch.allclose(default, net.forward_with_cfg(x, t, y, 2.0, "all"), atol=1e-3)  # not DiT's 4th channel


def test_a_command_that_failed_before_its_first_sample_leaves_the_folder_to_the_corrected_one(tmp_path, capsys):
    """Guidance on a model without a null class is refused at its first chunk, after settings.json was written, with
    "use --cfg-scale 1"; that command then runs in the same folder. A folder that holds samples stays bound to
    their settings, also when only samples.npz is left of them."""
    import shutil

    from tests.refusals import refusal

    no_null = save_tiny(tmp_path / "no_null.safetensors", class_dropout_prob=0.0)
    out = tmp_path / "set"
    err = refusal(main, sample_args(no_null, out, "--cfg-scale", "1.5"), capsys)
    assert "use --cfg-scale 1" in err and (out / "settings.json").is_file() and not list(out.glob("chunks/*"))
    done = main(sample_args(no_null, out))
    assert done["protocol"]["cfg_scale"] == 1.0 and len(np.load(out / "samples.npz")["arr_0"]) == 10
    shutil.rmtree(out / "chunks")
    kept = (out / "samples.npz").read_bytes()
    with pytest.raises(SystemExit, match="holds samples made with other settings.*steps"):
        main(sample_args(no_null, out, "--steps", "5"))
    assert (out / "samples.npz").read_bytes() == kept


def test_a_plain_sit_state_dict_without_learned_sigma_loads_by_its_shapes(tmp_path):
    """SiT's sample.py builds its models with or without the learned-sigma outputs; a plain state dict says which by
    its final layer's size (p p C or 2 p p C), so ``--model SiT-S/8`` reads both."""
    from diffusion.models import DiT_models

    for learn_sigma in (False, True):
        with torch.device("meta"):
            sit = DiT_models["DiT-S/8"](input_size=16, in_channels=4, num_classes=5, learn_sigma=learn_sigma)
        sit = sit.to_empty(device="cpu")
        with torch.no_grad():
            for i, tensor in enumerate(sit.state_dict().values()):
                tensor.copy_(0.02 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(i)))
        plain = tmp_path / f"sit_{learn_sigma}.pt"
        torch.save(sit.state_dict(), plain)
        out = main(["--checkpoint", str(plain), "--model", "SiT-S/8", "--image-size", "16", "--vae", "none",
                    "--num-classes", "5", "--num-samples", "2", "--out-dir", str(tmp_path / f"s_{learn_sigma}"),
                    "--sampler", "euler", "--steps", "3", "--quiet"])
        assert out["protocol"]["model"]["learn_sigma"] is learn_sigma
        assert out["protocol"]["objective"]["prediction"] == "velocity"
