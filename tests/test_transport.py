"""diffusion.transport and its samplers against a re-statement of SiT's transport package (tests/sit_reference.py):
losses to 1e-6 relative on the same x0, x1, t; sampler chains to 1e-5 on the same noise and model; REPA's and
LightningDiT's guidance rules; SiT's checkpoint layout through diffusion.sample."""
import json

import pytest
import torch

from diffusion.models import DiT
from diffusion.sampling.chains import FlowSampling, transport_chain, transport_predict
from diffusion.sampling.noise import draw_noise
from diffusion.sampling.options import SamplingError
from diffusion.transport import DIFFUSION_FORMS, LAST_STEPS, Transport, times
from tests import sit_reference as sit
from tests.test_sample import sample_generator

torch.set_num_threads(1)
SHAPE = (2, 8, 8)  # two channels: a learned-sigma model outputs four, and guiding "3" of them is meaningful


def tiny_dit(learn_sigma=True):
    torch.manual_seed(0)
    model = DiT(input_size=8, patch_size=4, in_channels=2, hidden_size=32, depth=2, num_heads=2, num_classes=5,
                learn_sigma=learn_sigma, class_dropout_prob=0.1)
    with torch.no_grad():  # away from adaLN-Zero's init, whose output is identically zero
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_dit()


LABELS = torch.tensor([0, 3, 4])
COMBOS = [(p, q, w) for p in ("linear", "gvp", "vp") for q in ("velocity", "noise", "score")
          for w in (("none",) if q == "velocity" else ("none", "velocity", "likelihood"))]


@pytest.mark.parametrize("path,prediction,weight", COMBOS)
def test_loss_equals_sits_on_the_same_x0_x1_t(model, path, prediction, weight):
    torch.manual_seed(1)
    x1, x0, u = torch.randn(3, *SHAPE), torch.randn(3, *SHAPE), torch.rand(3)
    ours = Transport(path, prediction, weight)
    ref = sit.SiTTransport(path, prediction, None if weight == "none" else weight)
    t0, t1 = ref.check_interval()
    assert ours.interval(ours.train_eps) == pytest.approx((t0, t1))
    t = ours.training_times(u)
    torch.testing.assert_close(t, u * (t1 - t0) + t0, rtol=0, atol=0)
    with torch.no_grad():
        got = ours.training_losses(model, x1, t, x0, {"y": LABELS})["loss"]
        want = ref.loss(lambda x, s: model(x, s, LABELS)[:, :2], x1, t, x0)  # SiT's forward keeps half of 2C
    assert got.shape == (3,) and (got > 0).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_logit_normal_times_are_lightningdits_and_the_loss_trains_only_the_first_half(model):
    ours = Transport("linear", "velocity", time_distribution="logit_normal", logit_normal_mean=0.3,
                     logit_normal_std=0.8)
    normal = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours.training_times(normal), 1 / (1 + torch.exp(-(0.3 + 0.8 * normal))))
    trainable = tiny_dit()
    x1 = torch.randn(3, *SHAPE)
    ours.training_losses(trainable, x1, torch.rand(3), torch.randn(3, *SHAPE), {"y": LABELS})["loss"].sum().backward()
    grad = trainable.final_layer.linear.weight.grad.reshape(4 * 4, 4, -1)  # (p*p, out channels, hidden)
    assert grad[:, :2].abs().sum() > 0 and grad[:, 2:].abs().sum() == 0  # SiT's learned-sigma half is unused


def test_cosine_term_is_lightningdits_and_its_weight_scales_it_in_the_loss():
    """LightningDiT's use_cosine_loss: 1 - cosine similarity over the channels of prediction and velocity, averaged
    over the positions, added to the MSE (weight 1 in LightningDiT; here a setting)."""
    from tests.lightningdit_reference import velocity_losses

    model = tiny_dit(learn_sigma=False)
    torch.manual_seed(2)
    x1, x0, t = torch.randn(3, *SHAPE), torch.randn(3, *SHAPE), torch.rand(3)
    with torch.no_grad():
        mse, cos, total = velocity_losses(model, x1, x0, t, LABELS)
        for weight in (1.0, 0.25):
            got = Transport("linear", "velocity", cosine_loss_weight=weight).training_losses(model, x1, t, x0,
                                                                                             {"y": LABELS})
            torch.testing.assert_close(got["mse"], mse, rtol=1e-6, atol=0)
            torch.testing.assert_close(got["cos"], cos, rtol=1e-6, atol=0)
            torch.testing.assert_close(got["loss"], mse + weight * cos, rtol=1e-6, atol=0)
        torch.testing.assert_close(got["loss"].mean(), (mse + 0.25 * cos).mean())
        torch.testing.assert_close((mse + cos).mean(), total)
    assert 0 < float(cos.min()) and float(cos.max()) < 2
    plain = Transport("linear", "velocity")
    assert "cos" not in plain.training_losses(model, x1, t, x0, {"y": LABELS})
    assert "cosine_loss_weight" not in plain.description()  # a checkpoint records the term only when it is on
    assert Transport.from_description(Transport(cosine_loss_weight=0.5).description()).cosine_loss_weight == 0.5
    with pytest.raises(ValueError, match="only with prediction=velocity"):
        Transport("linear", "noise", cosine_loss_weight=1.0)


def test_velocity_on_linear_paths_refuses_an_eps_sit_would_ignore():
    with pytest.raises(ValueError, match="stable at both ends"):
        Transport("linear", "velocity", train_eps=1e-3)


def chain(model, transport, options, indices=(0, 7, 12), labels=LABELS, cfg_scale=1.0, guided_channels="3"):
    predict = transport_predict(model, labels, cfg_scale, guided_channels, options.guidance_interval)
    states = list(transport_chain(predict, transport, options, [sample_generator(0, i) for i in indices], SHAPE))
    return states


def same_noise(indices=(0, 7, 12)):
    gens = [sample_generator(0, i) for i in indices]
    first = draw_noise(gens, SHAPE)
    return first, iter(lambda: draw_noise(gens, SHAPE), None)


SDE_GRID = [(f, last, p, q) for f in DIFFUSION_FORMS for last in LAST_STEPS for p in ("linear", "gvp", "vp")
            for q in ("velocity", "noise", "score")]


def toy_network(x, t):
    """A fixed nonlinear field of ``(x_t, t)`` standing in for the network where only the chain's arithmetic is
    tested: it mixes pixels and channels and costs a fraction of the tiny DiT's forward."""
    return torch.tanh(x.flip(-1) + x.roll(1, -2)) * (1 + t.view(-1, 1, 1, 1)) - 0.5 * x.mean(1, keepdim=True)


@pytest.mark.parametrize("form,last,path,prediction", SDE_GRID)
def test_sde_chains_equal_sits_to_the_bit_on_the_same_noise(form, last, path, prediction):
    """Both SDE samplers, 10 steps, on every diffusion form, last step, path and prediction: equal to the bit, as
    both round as SiT's integrator does (another order of the same float32 operations differs by about 1e-7
    relative, which a noise or score model's 1/t near t0 makes 1e-3 absolute). Refused exactly where SiT's chain
    is not finite."""
    ours = Transport(path, prediction)
    for sampler in ("sde-euler", "sde-heun"):
        options = FlowSampling(sampler=sampler, steps=10, diffusion_form=form, diffusion_norm=0.8, last_step=last,
                               last_step_size=0.05)
        x, noises = same_noise()
        want = sit.SiTTransport(path, prediction).sample_sde(
            x, toy_network, noises, method="Euler" if sampler == "sde-euler" else "Heun", form=form, norm=0.8,
            last={"none": None}.get(last, last.capitalize()), last_size=0.05, num_steps=10)

        def got():
            generators = [sample_generator(0, i) for i in (0, 7, 12)]
            return list(transport_chain(lambda x, t: toy_network(x, times(x, t)), ours, options, generators, SHAPE))

        if not torch.isfinite(want).all():
            with pytest.raises(SamplingError, match="SiT returns NaN"):
                got()
            continue
        states = got()
        assert len(states) == 1 + 9 + (last != "none")  # x at t0, nine steps, the last step
        assert states[-1].abs().max() > 0.1
        torch.testing.assert_close(states[-1], want, rtol=0, atol=0)


ODE_CASES = [("linear", "velocity", "euler", 0.0), ("linear", "velocity", "heun", 0.0), ("gvp", "noise", "heun", 0.0),
             ("vp", "score", "euler", 0.0), ("linear", "velocity", "dopri5", 0.0), ("gvp", "velocity", "euler", 0.3),
             ("linear", "velocity", "heun", 0.3)]


@pytest.mark.parametrize("path,prediction,sampler,shift", ODE_CASES)
def test_ode_chain_equals_sits_torchdiffeq_on_the_same_start(model, path, prediction, sampler, shift):
    ours = Transport(path, prediction)
    options = FlowSampling(sampler=sampler, steps=7, timestep_shift=shift, atol=1e-6, rtol=1e-4)
    got = chain(model, ours, options)
    x, _ = same_noise()
    want = sit.SiTTransport(path, prediction).sample_ode(
        x, lambda x, t: model(x, t, LABELS)[:, :2], method={"heun": "heun2"}.get(sampler, sampler), num_steps=7,
        atol=1e-6, rtol=1e-4, shift=shift)
    assert len(got) == 7 and got[-1].abs().max() > 0.1
    torch.testing.assert_close(got[-1], want, rtol=1e-5, atol=1e-5)


def test_guidance_interval_on_all_channels_equals_repas_euler_sampler(model):
    """REPA's euler_sampler runs its time from 1 (noise) to 0 with v = noise - data; SiT's time is 1 - REPA's and
    its velocity the negative. Guidance on every channel where guidance_low <= t_REPA <= guidance_high."""
    steps, cfg, low, high = 8, 2.5, 0.05, 0.66  # boundaries off the grid
    ours = chain(model, Transport("linear", "velocity"), FlowSampling(sampler="euler", steps=steps + 1,
                 guidance_interval=(1 - high, 1 - low)), cfg_scale=cfg, guided_channels="all")[-1]
    x_next, _ = same_noise()
    x_next = x_next.double()
    null = torch.full_like(LABELS, 5)
    t_steps = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    for t_cur, t_next in zip(t_steps[:-1], t_steps[1:]):
        t_in = torch.full((3,), 1 - float(t_cur))
        if low <= t_cur <= high:
            both = -model(torch.cat([x_next.float()] * 2), torch.cat([t_in] * 2), torch.cat([LABELS, null]))[:, :2]
            cond, uncond = both.double().chunk(2)
            d_cur = uncond + cfg * (cond - uncond)
        else:
            d_cur = -model(x_next.float(), t_in, LABELS)[:, :2].double()
        x_next = x_next + (t_next - t_cur) * d_cur
    torch.testing.assert_close(ours, x_next.float(), rtol=1e-5, atol=1e-5)


def test_lightningdit_interval_shift_and_three_channels_equal_its_forward_with_cfg(model):
    """LightningDiT: ODE on the shifted grid, forward_with_cfg guiding the first channels (its 3; here 1 of the
    toy's 2) unless t < start."""
    cfg, start, shift = 3.0, 0.27, 0.4
    ours = chain(model, Transport("linear", "velocity"),
                 FlowSampling(sampler="euler", steps=9, timestep_shift=shift, guidance_interval=(start, 1.0)),
                 cfg_scale=cfg, guided_channels="1")[-1]
    null = torch.full_like(LABELS, 5)

    def lightningdit_cfg(x, t):
        out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([LABELS, null]))
        eps, rest = out[:, :1], out[:, 1:]
        cond, uncond = eps.chunk(2)
        half = cond if t[0] < start else uncond + cfg * (cond - uncond)
        return torch.cat([half, rest[:3]], dim=1)[:, :2]

    x, _ = same_noise()
    want = sit.SiTTransport("linear", "velocity").sample_ode(x, lightningdit_cfg, method="euler", num_steps=9,
                                                              shift=shift)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


def test_flow_sampling_refuses_what_it_cannot_do():
    with pytest.raises(SamplingError, match="ODE"):
        FlowSampling(sampler="sde-euler", timestep_shift=0.3)
    with pytest.raises(SamplingError, match="low <= high"):
        FlowSampling(guidance_interval=(0.8, 0.2))
    with pytest.raises(SamplingError, match="choose one of"):
        FlowSampling(sampler="ddpm")
    with pytest.raises(SamplingError, match="infinite"):  # SiT starts this SDE at t = 0 and returns NaN
        FlowSampling(sampler="sde-euler", diffusion_form="SBDM").time_grid(Transport("linear", "velocity"))


def sit_layout_keys(depth):
    """The state-dict names of SiT's models.py for a model of ``depth`` blocks (SiTBlock: norm1, norm2 hold none)."""
    keys = ["pos_embed", "x_embedder.proj.weight", "x_embedder.proj.bias", "t_embedder.mlp.0.weight",
            "t_embedder.mlp.0.bias", "t_embedder.mlp.2.weight", "t_embedder.mlp.2.bias",
            "y_embedder.embedding_table.weight"]
    for i in range(depth):
        keys += [f"blocks.{i}.{m}.{p}" for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "adaLN_modulation.1")
                 for p in ("weight", "bias")]
    keys += [f"final_layer.{m}.{p}" for m in ("linear", "adaLN_modulation.1") for p in ("weight", "bias")]
    return sorted(keys)


def test_a_plain_sit_checkpoint_samples_through_diffusion_sample(tmp_path):
    """SiT's published file is a plain state dict of the DiT layout with learned sigma's 2C output channels;
    ``--model SiT-S/4`` samples it with SiT's transport (linear, velocity) and SDE sampler, using C of them."""
    from diffusion.evaluation.images import read_sampling_protocol
    from diffusion.models import DiT_models
    from diffusion.sample import main

    torch.manual_seed(0)
    model = DiT_models["DiT-S/4"](input_size=8, num_classes=5)  # SiT-S/4's sizes, SiT's 4-channel latents
    assert sorted(model.state_dict()) == sit_layout_keys(12)
    assert model.final_layer.linear.out_features == 4 * 4 * 8  # p * p * 2C: learn_sigma's channels
    torch.save(model.state_dict(), tmp_path / "SiT-S-4.pt")
    result = main(["--checkpoint", str(tmp_path / "SiT-S-4.pt"), "--model", "SiT-S/4", "--image-size", "8",
                   "--vae", "none", "--num-classes", "5", "--quiet", "--steps", "4", "--num-samples", "2",
                   "--out-dir", str(tmp_path / "s")])
    protocol = read_sampling_protocol(tmp_path / "s" / "samples.npz")
    assert protocol["objective"]["path"] == "linear" and protocol["objective"]["prediction"] == "velocity"
    assert protocol["sampler"] == "sde-euler" and protocol["last_step"] == "mean"
    assert protocol["time_grid"] == pytest.approx([0.0, 0.32, 0.64, 0.96], abs=1e-6)
    assert result["protocol"]["model"]["name"] == "DiT-S/4"


def transport_weights(model, path, transport: Transport):
    """The tiny model's weights file with the metadata diffusion.train writes for a ``transport`` model."""
    from common.checkpoint import save_weights

    meta = {"model": "DiT-S/4", "topology": "pre", "in_channels": 2, "input_size": 8, "num_classes": 5,
            "autoencoder": "none", "model_kwargs": json.dumps({"hidden_size": 32, "depth": 2, "num_heads": 2}),
            "transport": json.dumps(transport.description())}
    return save_weights(model, path, metadata=meta)


def test_sample_refuses_the_sde_that_sit_ends_in_nan_before_any_sample(model, tmp_path, capsys):
    """sde-heun without a last step evaluates a linear-path velocity model's score at t = 1 (0/0)."""
    from diffusion.sample import main
    from tests.refusals import refusal

    ckpt = transport_weights(model, tmp_path / "ema.safetensors", Transport("linear", "velocity"))
    line = refusal(main, ["--checkpoint", ckpt, "--num-samples", "2", "--out-dir", tmp_path / "s", "--steps", "5",
                          "--sampler", "sde-heun", "--last-step", "none", "--quiet"], capsys)
    assert "0/0 (SiT returns NaN there); use last step mean or sampler sde-euler" in line
    assert not (tmp_path / "s" / "samples.npz").exists()


def test_a_transport_model_shares_as_a_hub_folder_and_refuses_the_ddpm_pipeline(model, tmp_path):
    from diffusion.export import main as export_main
    from diffusion.checkpoints import load_dit

    transport = Transport("gvp", "noise")
    transport_weights(model, tmp_path / "ema.safetensors", transport)
    export_main(["--checkpoint", str(tmp_path / "ema.safetensors"), "--out", str(tmp_path / "hub"), "--format", "hub"])
    shared, spec, _ = load_dit(tmp_path / "hub")
    assert spec.transport == transport.description()
    x, t = torch.randn(3, *SHAPE), torch.rand(3)
    torch.testing.assert_close(shared(x, t, LABELS), model(x, t, LABELS))
    with pytest.raises(SystemExit):
        export_main(["--checkpoint", str(tmp_path / "ema.safetensors"), "--out", str(tmp_path / "pipe"),
                     "--format", "diffusers"])
    assert not (tmp_path / "pipe" / "model_index.json").exists()


def test_two_processes_sample_a_transport_model_as_one_and_record_its_sampler(model, tmp_path):
    """diffusion.sample on a transport model (SiT's SDE with guidance on an interval): 2 processes (gloo) give the
    same sample set as 1; the protocol records the sampler, its options and grid; a rerun with another interval is
    refused."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    from diffusion.evaluation.images import read_sampling_protocol
    from diffusion.sample import main
    from tests.test_diffusion_train import free_port

    root = Path(__file__).resolve().parents[1]
    ckpt = transport_weights(model, tmp_path / "ema.safetensors", Transport("linear", "velocity"))

    def args(out, *extra):
        return ["--checkpoint", str(ckpt), "--num-samples", "6", "--out-dir", str(out), "--batch-size", "2",
                "--steps", "5", "--seed", "3", "--quiet", "--cfg-scale", "2", "--guided-channels", "all",
                "--guidance-interval", "0.3,1", *extra]

    main(args(tmp_path / "one"))
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "diffusion.sample", *args(tmp_path / "two")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = np.load(tmp_path / "one" / "samples.npz"), np.load(tmp_path / "two" / "samples.npz")
    np.testing.assert_array_equal(a["arr_0"], b["arr_0"])
    protocol = read_sampling_protocol(tmp_path / "two" / "samples.npz")
    assert (protocol["sampler"], protocol["steps"], protocol["guidance_interval"], protocol["num_processes"]) == (
        "sde-euler", 5, [0.3, 1.0], 2)
    assert protocol["diffusion_form"] == "sigma" and len(protocol["time_grid"]) == 5
    with pytest.raises(SystemExit, match="other settings.*guidance_interval"):
        main(args(tmp_path / "one", "--guidance-interval", "0.5,1"))
