"""The DiT trainer end to end on tiny pixel-space Fashion-MNIST runs (CPU)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from common.config import load_config
from common.data import FASHION_MNIST_CLASSES
from common.logging import NonFiniteLossError, read_metrics
from common.train_state import CheckpointManager
from diffusion.train import TrainConfig, main, train
from tests.rehearsal import free_port

pytestmark = pytest.mark.fashion_mnist

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "data.num_workers=0", "train.tensorboard=false",
        "train.threads=1", "train.sample_every=0"]
# 24 examples, batch 8: 3 steps per epoch, so 6 steps cross an epoch boundary.
SMALL = ["data.max_samples=24", "optim.batch_size=8", "optim.steps=6", "optim.lr=1e-3", "train.log_every=1",
         "train.ema_decay=0.5"]
torch.set_num_threads(1)


def config(out, *overrides, topology="siamese"):
    return load_config(TrainConfig, ROOT / f"configs/fmnist_dit_{topology}.yaml",
                       [*TINY, f"train.output_dir={out}", *overrides])


def same_weights(a_dir, b_dir, exact=True, atol=1e-6):
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = load_file(Path(a_dir) / name), load_file(Path(b_dir) / name)
        assert a.keys() == b.keys()
        for k in a:
            if exact:
                assert torch.equal(a[k], b[k]), f"{name}: {k}"
            else:
                torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=atol, msg=f"{name}: {k}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted one-process run of SMALL."""
    out = tmp_path_factory.mktemp("reference")
    train(config(out, *SMALL))
    return out


@pytest.mark.parametrize("topology", ["pre", "siamese"])
def test_short_run_loss_decreases_and_writes_outputs(tmp_path, topology):
    final = train(config(tmp_path, "data.max_samples=512", "optim.batch_size=32", "optim.steps=48", "optim.lr=2e-3",
                         "train.log_every=8", "train.sample_every=48", "train.sample_count=4", "train.sample_steps=4",
                         topology=topology))
    records = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    losses = [r["train/loss"] for r in records]
    assert len(losses) == 6 and losses[-1] < 0.75 * losses[0], losses
    assert all(r["train/vb"] > 0 and r["train/mse"] < r["train/loss"] for r in records)  # learned sigma: MSE + VLB
    assert final["steps"] == 48 and final["nonfinite_steps"] == 0 and final["steps_per_s"] > 0
    assert (tmp_path / "samples" / "step_000000048.png").is_file()
    with safe_open(str(tmp_path / "ema.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["topology"] == topology and meta["in_channels"] == "1" and meta["input_size"] == "32"
    # the schedule it was trained with and its class names, for the sampler and the grids
    assert (meta["num_timesteps"], meta["beta_start"], meta["beta_end"]) == ("1000", "0.0001", "0.02")
    assert json.loads(meta["class_names"]) == list(FASHION_MNIST_CLASSES)


def test_killed_run_resumes_to_the_same_weights(reference, tmp_path):
    """SIGKILL a run after its first checkpoint, leave a torn newer checkpoint file, resume: same weights."""
    args = ["--config", str(ROOT / "configs/fmnist_dit_siamese.yaml"), *TINY, *SMALL, f"train.output_dir={tmp_path}",
            "train.ckpt_every=2", "train.keep_last=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # optim.steps=100000: the run cannot finish before it is killed; train.compile=false: so long a run would compile
    # under auto on a CPU, the 6-step reference does not (the resumed run keeps the choice its checkpoint records).
    proc = subprocess.Popen([sys.executable, "-m", "diffusion.train", *args, "optim.steps=100000",
                             "train.compile=false"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpts = CheckpointManager(tmp_path / "checkpoints")
    deadline = time.time() + 120
    while not ckpts.steps() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert ckpts.steps(), f"no checkpoint before the kill: {err.decode()[-2000:]}"
    killed_at = ckpts.steps()[-1]
    assert 2 <= killed_at < 6, killed_at
    ckpts.path_for(killed_at + 1).write_bytes(b"torn write")  # a newer, unreadable checkpoint: skipped
    with pytest.warns(UserWarning, match="skipping unreadable checkpoint"):
        main(args)
    records = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    assert records[-1]["step"] == 6
    same_weights(reference, tmp_path)


def test_two_processes_and_grad_accum_match_one_process(reference, tmp_path):
    """Two processes (torchrun, gloo; TensorBoard on, as users get it) train the reference's weights and log its
    losses. Each samples its share of the in-training FID (chunks k, k + 2, ...) and the main one scores the gathered
    features: the number diffusion.sample + diffusion.fid give on the run's EMA, up to the batching of the feature
    pass. Gradient accumulation and recomputation (one process) train the same weights too."""
    from common.checkpoint import save_weights
    from diffusion.evaluation.features import FashionMNISTClassifier
    from diffusion.fid import sample_and_score

    torch.manual_seed(0)
    weights = tmp_path / "fmnist_cnn.safetensors"
    save_weights(FashionMNISTClassifier(), weights)
    args = ["--config", str(ROOT / "configs/fmnist_dit_siamese.yaml"), *TINY, *SMALL, "train.tensorboard=true"]
    fid = ["train.fid_every=6", "train.fid_samples=24", "train.fid_batch_size=4", "train.fid_steps=3",
           "train.fid_reference=fashion-mnist:test", "train.fid_feature_extractor=fmnist-cnn",
           f"train.fid_extractor_weights={weights}"]  # at step 6, the last: the weights are final
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "diffusion.train", *args, *fid, f"train.output_dir={tmp_path / 'two'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "two" / "tb").rglob("events.out.tfevents.*"))
    assert [r for r in read_metrics(tmp_path / "two") if "world_size" in r][0]["world_size"] == 2
    same_weights(reference, tmp_path / "two", exact=False)
    one = [r["train/loss"] for r in read_metrics(reference) if "train/loss" in r]
    two = [r["train/loss"] for r in read_metrics(tmp_path / "two") if "train/loss" in r]
    assert two == pytest.approx(one, rel=1e-5)  # the logged loss is the global-batch mean
    (logged,) = [r for r in read_metrics(tmp_path / "two") if "fid/fd" in r]
    with pytest.warns(UserWarning, match="covariance is singular"):
        direct = sample_and_score(tmp_path / "two" / "ema.safetensors", tmp_path / "direct", num_samples=24, steps=3,
                                  extractor_weights=weights, seed=0)
    assert (logged["step"], logged["fid/samples"]) == (6, 24)
    assert logged["fid/fd"] == pytest.approx(direct["metrics"]["fid"], rel=1e-4)
    main([*args, "optim.grad_accum=2", f"train.output_dir={tmp_path / 'accum'}"])
    same_weights(reference, tmp_path / "accum", exact=False)
    main([*args, "model.grad_checkpointing=true", f"train.output_dir={tmp_path / 'recompute'}"])
    same_weights(reference, tmp_path / "recompute", exact=False)


@pytest.mark.parametrize("topology", ["hc", "attnres_block"])
def test_multistream_topologies_train_the_same_on_two_processes(tmp_path, topology):
    """Hyper-Connections' n streams and Attention Residuals' list of sources through the trainer: one process and
    two (torchrun, gloo) reach the same weights, and the checkpoint records the topology."""
    args = ["--config", str(ROOT / "configs/fmnist_dit_siamese.yaml"), *TINY, *SMALL, f"model.topology={topology}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "diffusion.train", *args, f"train.output_dir={tmp_path / 'two'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    main([*args, f"train.output_dir={tmp_path / 'one'}"])
    # AttnRes' depth query starts at zero and its gradient is a difference of near-equal terms: the all-reduce's
    # summation order moves it by ~2e-6 after 6 Adam steps of lr 1e-3 (on some CPUs), 0.2% of one step.
    same_weights(tmp_path / "one", tmp_path / "two", exact=False, atol=1e-5)
    with safe_open(str(tmp_path / "one" / "ema.safetensors"), "pt") as f:
        assert f.metadata()["topology"] == topology


def test_nonfinite_losses_are_skipped_then_stop_the_run(tmp_path):
    # An absurd learning rate makes the weights overflow after the first update; every later loss is NaN.
    with pytest.raises(NonFiniteLossError, match="last 3 steps in a row.*No checkpoint from before the divergence"):
        train(config(tmp_path, *SMALL, "optim.lr=1e30", "train.max_nonfinite=3", "train.ckpt_every=1"))
    # The step-1 checkpoint holds the weights that diverged: set aside, not resumed from, not deleted.
    assert CheckpointManager(tmp_path / "checkpoints").steps() == []
    assert [p.name for p in (tmp_path / "checkpoints" / "diverged").iterdir()] == ["step_000000001.pt"]
    records = [r for r in read_metrics(tmp_path) if "train/nonfinite_steps" in r]
    assert [r["train/nonfinite_steps"] for r in records] == [0, 1, 2, 3]
    assert [r["train/loss"] for r in records][1:] == ["nan"] * 3


def test_plain_mse_and_config_errors(tmp_path, capsys):
    train(config(tmp_path, *SMALL, "optim.steps=2", "model.learn_sigma=false", "model.class_dropout_prob=0"))
    records = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    assert all(r["train/vb"] == 0 and r["train/loss"] == r["train/mse"] for r in records)
    with pytest.raises(SystemExit):
        main(["--config", str(ROOT / "configs/fmnist_dit_pre.yaml"), "diffusion.numtimesteps=10"])
    err = capsys.readouterr().err
    assert "did you mean 'num_timesteps'" in err and "beta_start" in err
    with pytest.raises(SystemExit):
        main(["--config", str(ROOT / "configs/dit_b2_siamese.yaml")])
    assert "data.path is required" in capsys.readouterr().err


@pytest.mark.parametrize("name, topology, model", [("dit_b2_pre", "pre", "DiT-B/2"), ("dit_l4_siamese", "siamese", "DiT-L/4")])
def test_imagenet_recipes_state_method_section_4(name, topology, model):
    cfg = load_config(TrainConfig, ROOT / f"configs/{name}.yaml", ["data.path=/nonexistent"])
    o, d = cfg.optim, cfg.diffusion
    assert (cfg.model.name, cfg.model.topology, cfg.model.learn_sigma) == (model, topology, True)
    assert (o.batch_size, o.lr, o.weight_decay, o.steps, cfg.train.ema_decay) == (256, 1e-4, 0.0, 400_000, 0.9999)
    assert (d.num_timesteps, d.beta_start, d.beta_end) == (1000, 1e-4, 0.02)
    assert (cfg.data.dataset, cfg.data.image_size, cfg.data.hflip, cfg.data.num_classes) == ("latents", 256, True, 1000)


def test_in_training_fid_equals_sample_then_fid_of_the_saved_ema(tmp_path):
    """fid/fd logged at steps 2 and 3 (the end); at step 3 it is diffusion.sample + diffusion.fid of ema.safetensors."""
    from common.checkpoint import save_weights
    from diffusion.evaluation.features import FashionMNISTClassifier
    from diffusion.fid import sample_and_score

    torch.manual_seed(0)
    weights = tmp_path / "fmnist_cnn.safetensors"
    save_weights(FashionMNISTClassifier(), weights)  # random features: the pipeline, not the quality, is tested
    fid = ["train.fid_every=2", "train.fid_samples=16", "train.fid_steps=3", "train.fid_reference=fashion-mnist:test",
           "train.fid_feature_extractor=fmnist-cnn", f"train.fid_extractor_weights={weights}"]
    with pytest.warns(UserWarning, match="covariance is singular"):  # 16 samples, 128-d features
        final = train(config(tmp_path / "run", *SMALL, "optim.steps=3", "train.seed=5", *fid))
    logged = [r for r in read_metrics(tmp_path / "run") if "fid/fd" in r]
    assert [(r["step"], r["fid/samples"], r["fid/steps"]) for r in logged] == [(2, 16, 3), (3, 16, 3)]
    assert logged[0]["fid/fd"] != logged[1]["fid/fd"] and final["fid"] == logged[1]["fid/fd"]
    with pytest.warns(UserWarning, match="covariance is singular"):
        direct = sample_and_score(tmp_path / "run" / "ema.safetensors", tmp_path / "direct", num_samples=16, steps=3,
                                  extractor_weights=weights, seed=5)
    assert direct["metrics"]["fid"] == logged[1]["fid/fd"]


def test_in_training_fid_in_bf16_equals_sample_in_bf16_then_fid(tmp_path):
    """train.fid_precision=bf16 is diffusion.sample --precision bf16: the same number, and another than fp32's."""
    from common.checkpoint import save_weights
    from diffusion.evaluation.features import FashionMNISTClassifier
    from diffusion.fid import sample_and_score

    torch.manual_seed(0)
    weights = tmp_path / "fmnist_cnn.safetensors"
    save_weights(FashionMNISTClassifier(), weights)
    fid = ["train.fid_every=2", "train.fid_samples=16", "train.fid_steps=3", "train.fid_reference=fashion-mnist:test",
           "train.fid_feature_extractor=fmnist-cnn", f"train.fid_extractor_weights={weights}", "train.fid_precision=bf16"]
    with pytest.warns(UserWarning, match="covariance is singular"):
        train(config(tmp_path / "run", *SMALL, "optim.steps=2", "train.seed=5", *fid))
    (logged,) = [r for r in read_metrics(tmp_path / "run") if "fid/fd" in r]
    scores = {}
    for precision in ("bf16", "fp32"):
        with pytest.warns(UserWarning, match="covariance is singular"):
            scores[precision] = sample_and_score(tmp_path / "run" / "ema.safetensors", tmp_path / precision,
                                                 num_samples=16, steps=3, extractor_weights=weights, seed=5,
                                                 extra_sample_args=["--precision", precision])["metrics"]["fid"]
    assert logged["fid/fd"] == scores["bf16"] != scores["fp32"]


def test_in_training_fid_config_errors(tmp_path, capsys):
    # Tiny settings: a case that wrongly passes validation fails fast instead of training the whole recipe.
    base = ["--config", str(ROOT / "configs/fmnist_dit_pre.yaml"), *TINY, *SMALL, "optim.steps=1",
            f"train.output_dir={tmp_path}"]
    for overrides, message in ((["train.fid_every=10", "train.fid_reference=null"],
                                "train.fid_every > 0 needs train.fid_reference"),
                               (["train.fid_feature_extractor=inception"], "choose one of"),
                               (["train.fid_every=10", "train.fid_reference=fashion-mnist:test", "train.fid_samples=1"],
                                "must be >= 2")):
        with pytest.raises(SystemExit):
            main([*base, *overrides])
        assert message in capsys.readouterr().err


def flow_config(out, *overrides, topology="siamese"):
    return load_config(TrainConfig, ROOT / f"configs/fmnist_sit_{topology}.yaml",
                       [*TINY, f"train.output_dir={out}", *overrides])


def tiny_encoder(path):
    """A small random timm ViT whose 8 x 8 patch grid at 64 px matches the micro-DiT's 64 tokens."""
    import timm

    from common.checkpoint import save_weights

    torch.manual_seed(0)
    save_weights(timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=128), path)
    return ["repa.weight=0.5", "repa.depth=1", "repa.encoder=vit_tiny_patch16_224", f"repa.encoder_weights={path}",
            "repa.encoder_image_size=128", "repa.projector_dim=32"]


def test_flow_matching_recipe_trains_and_its_in_training_fid_is_sample_then_fid(tmp_path):
    """The shipped SiT recipe on Fashion-MNIST: the velocity loss falls, the weights record the transport, and fid/fd
    with the Euler ODE is diffusion.sample --sampler euler + diffusion.fid of that ema.safetensors."""
    from common.checkpoint import save_weights
    from diffusion.evaluation.features import FashionMNISTClassifier
    from diffusion.fid import sample_and_score

    torch.manual_seed(0)
    weights = tmp_path / "fmnist_cnn.safetensors"
    save_weights(FashionMNISTClassifier(), weights)
    fid = ["train.fid_every=24", "train.fid_samples=16", "train.fid_steps=4", "train.sampler=euler",
           "train.fid_reference=fashion-mnist:test", "train.fid_feature_extractor=fmnist-cnn",
           f"train.fid_extractor_weights={weights}"]
    with pytest.warns(UserWarning, match="covariance is singular"):
        final = train(flow_config(tmp_path / "run", "data.max_samples=256", "optim.batch_size=16", "optim.steps=24",
                                  "optim.lr=2e-3", "train.log_every=8", "train.seed=3", *fid, topology="pre"))
    records = [r for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert len(records) == 3 and records[-1]["train/loss"] < 0.8 * records[0]["train/loss"]
    assert all("train/vb" not in r and r["train/mse"] == r["train/loss"] for r in records)
    with safe_open(str(tmp_path / "run" / "ema.safetensors"), "pt") as f:
        transport = json.loads(f.metadata()["transport"])
    assert (transport["path"], transport["prediction"], transport["time_distribution"]) == ("linear", "velocity",
                                                                                          "uniform")
    with pytest.warns(UserWarning, match="covariance is singular"):
        direct = sample_and_score(tmp_path / "run" / "ema.safetensors", tmp_path / "direct", num_samples=16, steps=4,
                                  extractor_weights=weights, seed=3, extra_sample_args=["--sampler", "euler"])
    assert direct["metrics"]["fid"] == final["fid"]
    with pytest.raises(SystemExit):
        main(["--config", str(ROOT / "configs/fmnist_sit_pre.yaml"), "train.sampler=ddpm"])


def test_flow_and_repa_on_two_processes_match_one_process(tmp_path):
    """SiT's objective with REPA, logit-normal times: 1 process and 2 processes (gloo) train the same weights and log
    the same in-training FID with the Heun ODE; the projector is saved with the EMA and left out when sampling it."""
    from common.checkpoint import save_weights
    from diffusion.evaluation.features import FashionMNISTClassifier

    import numpy as np

    from common.data import load_fashion_mnist

    repa = tiny_encoder(tmp_path / "encoder.safetensors")
    torch.manual_seed(0)
    save_weights(FashionMNISTClassifier(), tmp_path / "fmnist_cnn.safetensors")
    reference = tmp_path / "reference.npz"  # 64 test images: a reference that is quick to read on two processes
    np.savez(reference, arr_0=np.pad(load_fashion_mnist("test")[0][:64], ((0, 0), (2, 2), (2, 2))))
    args = ["--config", str(ROOT / "configs/fmnist_sit_siamese.yaml"), *TINY, *SMALL, *repa,
            "transport.time_distribution=logit_normal", "transport.logit_normal_mean=0.0",
            "transport.logit_normal_std=1.0", "train.fid_every=6", "train.fid_samples=12", "train.fid_batch_size=4",
            "train.fid_steps=3", "train.sampler=heun", f"train.fid_reference={reference}",
            "train.fid_feature_extractor=fmnist-cnn", f"train.fid_extractor_weights={tmp_path / 'fmnist_cnn.safetensors'}"]
    with pytest.warns(UserWarning, match="covariance is singular"):
        main([*args, f"train.output_dir={tmp_path / 'one'}"])
    records = [r for r in read_metrics(tmp_path / "one") if "train/loss" in r]
    assert all(r["train/loss"] == pytest.approx(r["train/mse"] + 0.5 * r["train/repa"], rel=1e-5) for r in records)
    assert all(-1 <= r["train/repa"] <= 1 for r in records) and records[-1]["train/repa"] < records[0]["train/repa"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "diffusion.train", *args, f"train.output_dir={tmp_path / 'two'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_weights(tmp_path / "one", tmp_path / "two", exact=False)
    two = [r["train/loss"] for r in read_metrics(tmp_path / "two") if "train/loss" in r]
    assert two == pytest.approx([r["train/loss"] for r in records], rel=1e-5)
    (fid_one,), (fid_two,) = ([r["fid/fd"] for r in read_metrics(tmp_path / d) if "fid/fd" in r] for d in ("one", "two"))
    assert fid_two == pytest.approx(fid_one, rel=1e-4)  # each process samples its chunks, the main one scores
    assert any(k.startswith("projectors.") for k in load_file(tmp_path / "one" / "ema.safetensors"))
    from diffusion.checkpoints import load_dit

    model, spec, _ = load_dit(tmp_path / "one" / "ema.safetensors")
    assert not hasattr(model, "projectors") and spec.transport["time_distribution"] == "logit_normal"


def test_flow_and_repa_config_errors(tmp_path, capsys):
    base = ["--config", str(ROOT / "configs/fmnist_sit_pre.yaml"), *TINY, *SMALL, f"train.output_dir={tmp_path}"]
    for overrides, message in ((["transport.time_distribution=logit_normal"],
                                "transport.time_distribution=logit_normal needs transport.logit_normal_mean"),
                               (["repa.weight=0.5"], "repa.weight > 0 needs repa.depth"),
                               (["transport.train_eps=0.01"], "stable at both ends")):
        with pytest.raises(SystemExit):
            main([*base, *overrides])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "checkpoints").exists()


def test_transport_enabled_alone_trains_sits_objective_and_the_run_says_its_size_per_checkpoint(tmp_path, capsys):
    """``transport.enabled=true`` takes SiT's linear path, velocity prediction and uniform times, as docs/dit.md
    says. A line at the start of a run gives its folder's size per checkpoint, which the written checkpoint matches."""
    from common.train_state import checkpoint_size
    from diffusion.checkpoints import load_dit
    from diffusion.transport import Transport

    final = train(config(tmp_path, "transport.enabled=true", "data.max_samples=16", "optim.batch_size=8",
                         "optim.steps=2", "train.ema_decay=0.5"))
    assert final["steps"] == 2
    with safe_open(str(tmp_path / "ema.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["transport"]) == Transport("linear", "velocity").description()
    _, spec, _ = load_dit(tmp_path / "model.safetensors")
    estimate, weights = checkpoint_size(spec.build(), ema=True)
    said = next(line for line in capsys.readouterr().out.splitlines() if "per checkpoint" in line)
    assert f": {estimate / 1e6:.1f} MB per checkpoint (the weights, their EMA and the optimizer's moments), " \
           f"{weights / 1e6:.1f} MB each for model.safetensors and ema.safetensors" in said, said
    assert "the newest train.keep_last=2 checkpoints are kept" in said
    written = (tmp_path / "checkpoints" / "step_000000002.pt").stat().st_size
    assert estimate < written < estimate + 200_000  # beside the tensors: random states, config, zip entries


def test_lightningdit_recipe_on_fashion_mnist_logs_its_loss_parts_and_its_fid_samples_the_shifted_grid(tmp_path):
    """configs/fmnist_lightningdit_pre.yaml (the backbone switches, the cosine term, logit-normal t, beta2 0.95): the
    loss is the MSE plus the cosine term, the weights record the switches, and fid/fd with the Euler ODE on the
    shifted grid is diffusion.sample --sampler euler --timestep-shift 0.3 + diffusion.fid of that ema.safetensors."""
    from common.checkpoint import save_weights
    from diffusion.checkpoints import load_dit
    from diffusion.evaluation.features import FashionMNISTClassifier
    from diffusion.fid import sample_and_score
    from diffusion.hub import backbone_switches

    torch.manual_seed(0)
    weights = tmp_path / "fmnist_cnn.safetensors"
    save_weights(FashionMNISTClassifier(), weights)
    cfg = load_config(TrainConfig, ROOT / "configs/fmnist_lightningdit_pre.yaml", [
        "model.kwargs.hidden_size=32", "model.kwargs.depth=2", "model.kwargs.num_heads=2", "data.num_workers=0",
        "train.tensorboard=false", "train.threads=1", "train.sample_every=0", *SMALL, "optim.steps=3", "train.seed=3",
        "train.fid_every=3", "train.fid_samples=16", "train.fid_steps=4", "train.fid_reference=fashion-mnist:test",
        "train.fid_feature_extractor=fmnist-cnn", f"train.fid_extractor_weights={weights}",
        f"train.output_dir={tmp_path / 'run'}"])
    assert (cfg.optim.betas, cfg.transport.cosine_loss_weight, cfg.train.sample_timestep_shift) == \
           ((0.9, 0.95), 1.0, 0.3)
    with pytest.warns(UserWarning, match="covariance is singular"):
        final = train(cfg)
    records = [r for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert all(r["train/loss"] == pytest.approx(r["train/mse"] + r["train/cos"], rel=1e-5) for r in records)
    model, spec, _ = load_dit(tmp_path / "run" / "ema.safetensors")
    assert backbone_switches(model) == ["norm=rmsnorm", "mlp=swiglu", "rope"] and not spec.learn_sigma
    with pytest.warns(UserWarning, match="covariance is singular"):
        direct = sample_and_score(tmp_path / "run" / "ema.safetensors", tmp_path / "direct", num_samples=16, steps=4,
                                  extractor_weights=weights, seed=3,
                                  extra_sample_args=["--sampler", "euler", "--timestep-shift", "0.3"])
    assert direct["metrics"]["fid"] == final["fid"]


def test_lightningdit_backbone_and_objective_train_the_same_on_two_processes(tmp_path):
    """configs/fmnist_lightningdit_siamese.yaml (RMSNorm in both streams, SwiGLU, RoPE, the cosine term, logit-normal
    t), TensorBoard on: one process and two (torchrun, gloo) reach the same weights and log the same loss parts."""
    args = ["--config", str(ROOT / "configs/fmnist_lightningdit_siamese.yaml"), *TINY, *SMALL,
            "train.tensorboard=true"]
    main([*args, f"train.output_dir={tmp_path / 'one'}"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "diffusion.train", *args, f"train.output_dir={tmp_path / 'two'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r for r in read_metrics(tmp_path / "two") if "world_size" in r][0]["world_size"] == 2
    same_weights(tmp_path / "one", tmp_path / "two", exact=False)
    one, two = ([(r["train/loss"], r["train/mse"], r["train/cos"]) for r in read_metrics(tmp_path / d)
                 if "train/loss" in r] for d in ("one", "two"))
    assert len(one) == 6 and all(cos > 0 for _, _, cos in one)
    assert [x for r in two for x in r] == pytest.approx([x for r in one for x in r], rel=1e-5)
    from diffusion.checkpoints import load_dit
    from diffusion.hub import backbone_switches

    model, _, _ = load_dit(tmp_path / "two" / "ema.safetensors")
    assert backbone_switches(model) == ["norm=rmsnorm", "mlp=swiglu", "rope"]
    assert {type(m).__name__ for n, m in model.blocks[0].named_children() if "norm" in n} == {"RMSNorm"}  # both streams


def test_lightningdit_settings_are_refused_where_they_do_nothing(tmp_path, capsys):
    base = ["--config", str(ROOT / "configs/fmnist_lightningdit_pre.yaml"), *SMALL, f"train.output_dir={tmp_path}"]
    for overrides, message in (
            (["train.sampler=sde-euler"], "train.sample_timestep_shift warps an ODE's time grid"),
            (["transport.enabled=false", "train.sampler=null"], "transport.cosine_loss_weight is a term of the "
                                                                 "transport's velocity loss"),
            (["transport.cosine_loss_weight=0", "transport.enabled=false", "train.sampler=null"],
             "train.sample_timestep_shift: a transport model's sampling settings"),
            (["transport.prediction=noise"], "only with prediction=velocity"),
            (["data.latent_norm=true"], "dataset=fashion_mnist trains on pixels"),
            (["data.latent_multiplier=0.5"], "data.latent_multiplier=0.5 scales the normalised latents"),
            (["train.sample_guidance_interval=[0.9, 0.1]"], "LOW must not exceed HIGH")):
        with pytest.raises(SystemExit):
            main([*base, *overrides])
        assert message in capsys.readouterr().err, overrides
    assert not (tmp_path / "checkpoints").exists()
