"""The training step itself: no host sync outside logging steps, and torch.compile equal to eager.

A host sync is a read of a tensor's value by the host (``aten._local_scalar_dense``: ``.item()``, ``bool()``,
``float()``, ``.tolist()`` of a device tensor); on a GPU each one stalls the host until the device has caught up.
The counter sees them on the CPU too, so the step can be checked here.
"""
from pathlib import Path

import pytest
import torch

from common.config import load_config
from common.instrument import HostSyncCounter, count_step_syncs
from common.trainer import Trainer
from diffusion import train as dit_train
from diffusion.task import DiTTask
from vision import train as deit_train
from vision.task import DeiTTask

pytestmark = pytest.mark.fashion_mnist
ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


def count_syncs_per_step(cfg, task_cls):
    """Run a training and return the host reads inside ``train_step`` of every step that is not a logging step."""
    with count_step_syncs(Trainer, cuda=False) as steps:
        Trainer(cfg, task_cls(cfg)).fit()
    return {step: s.project_reads for step, s in steps.items() if not s.logging}


@pytest.mark.parametrize("clip", [None, 1.0])
def test_deit_steps_never_wait_for_the_device(tmp_path, clip):
    # The recipe's pieces that touch a step: mixup/cutmix, drop path, EMA, label smoothing, grad accumulation.
    cfg = load_config(deit_train.TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml", [
        "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
        "data.num_workers=1", "train.tensorboard=false", "data.max_train_samples=64", "data.max_val_samples=16",
        "optim.batch_size=16", "optim.epochs=1", "optim.grad_accum=2", "train.log_every=3", "train.ema_decay=0.9",
        "model.drop_path=0.1", "augment.mixup=0.8", "augment.cutmix=1.0", f"optim.clip_grad={clip or 'null'}",
        f"train.output_dir={tmp_path}"])
    counts = count_syncs_per_step(cfg, DeiTTask)
    assert sorted(counts) == [1, 2] and all(reads == [] for reads in counts.values()), counts


def test_dit_steps_never_wait_for_the_device(tmp_path):
    cfg = load_config(dit_train.TrainConfig, ROOT / "configs/fmnist_dit_siamese.yaml", [
        "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "data.num_workers=1", "train.tensorboard=false",
        "data.max_samples=32", "optim.batch_size=8", "optim.steps=4", "train.log_every=4", "train.sample_every=0",
        f"train.output_dir={tmp_path}"])
    counts = count_syncs_per_step(cfg, DiTTask)
    assert sorted(counts) == [1, 2, 3] and all(reads == [] for reads in counts.values()), counts


def test_train_compile_auto_compiles_on_cuda_and_on_a_cpu_runs_long_enough_to_repay_it():
    from common.trainer import resolve_compile

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile("auto", cpu, 3000, pays_after=3000) and not resolve_compile("auto", cpu, 2999, 3000)
    assert not resolve_compile("auto", cpu, 10**6, pays_after=None)  # a task whose compiled step never pays on a CPU
    assert resolve_compile("auto", cuda, 1, pays_after=None)  # CUDA: always
    assert resolve_compile(True, cpu, 1, None) and not resolve_compile(False, cuda, 10**6, 1)  # forced either way
    assert resolve_compile("auto", cuda) and not resolve_compile("auto", cpu)  # a one-off command: on CUDA only
    assert DiTTask.compile_pays_after_steps_on_cpu and DeiTTask.compile_pays_after_steps_on_cpu is None


def test_train_compile_auto_counts_the_steps_this_invocation_runs(tmp_path, monkeypatch, capsys):
    """A run of 4 steps with the bar at 4, paused at step 3 (train.stop_at_step) and continued: neither invocation
    runs 4 steps, so neither compiles."""
    monkeypatch.setattr(DiTTask, "compile_pays_after_steps_on_cpu", 4)
    settings = ["model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "data.num_workers=0", "data.max_samples=32",
                "optim.batch_size=8", "optim.steps=4", "train.sample_every=0", "train.tensorboard=false",
                "train.compile=auto", f"train.output_dir={tmp_path}"]
    steps = []
    for stop in (3, None):
        cfg = load_config(dit_train.TrainConfig, ROOT / "configs/fmnist_dit_siamese.yaml",
                          [*settings, f"train.stop_at_step={stop or 'null'}"])
        trainer = Trainer(cfg, DiTTask(cfg))
        trainer.fit()
        assert not trainer.compiled and trainer.train_model is trainer.model
        steps.append(trainer.step)
    assert steps == [3, 4] and "compiling the training model" not in capsys.readouterr().out


def test_the_counter_sees_a_sync_in_project_code():
    from common.logging import _plain

    with HostSyncCounter() as counter:
        _plain(torch.tensor(1.5))  # .item() of a float tensor, in project code
        torch.tensor(2.5).item()  # the same read from outside the project is not counted
    assert len(counter.reads) == 1 and "common/logging.py" in counter.reads[0]


def test_a_skipped_step_leaves_the_ema_unchanged():
    from common.ema import ModelEma

    model = torch.nn.Linear(4, 4)
    ema = ModelEma(model, decay=0.9)
    with torch.no_grad():
        model.weight.add_(1.0)
    before = ema.module.weight.clone()
    ema.update(model, skip=torch.tensor(1.0))
    assert torch.equal(ema.module.weight, before)
    ema.update(model, skip=torch.tensor(0.0))
    torch.testing.assert_close(ema.module.weight, 0.9 * before + 0.1 * model.weight.detach(), rtol=0, atol=1e-6)


def test_ema_update_equals_a_per_tensor_lerp_bit_for_bit():
    """The EMA's update (lists taken once, one weight tensor) against a plain per-tensor restatement, over
    parameters, float buffers and integer buffers, with skip 0, skip 1 and no skip, several steps in a row."""
    from common.ema import ModelEma

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    model.register_buffer("scale", torch.ones(5))
    ema = ModelEma(model, decay=0.9)
    want = {k: v.clone() for k, v in ema.state_dict().items()}
    for step, skip in enumerate([0.0, 1.0, 0.0, None, 1.0, 0.0]):
        model.train()(torch.randn(16, 4))  # moves BatchNorm's running statistics and step count
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model.scale.mul_(1.5)
        ema.update(model, step, skip=None if skip is None else torch.tensor(skip))
        weight = torch.tensor(1.0 - 0.9) if skip is None else (1.0 - torch.tensor(skip)) * (1.0 - 0.9)
        for k, v in model.state_dict().items():
            want[k] = torch.lerp(want[k], v, weight) if v.is_floating_point() else v.clone()
        got = ema.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (step, k)
    assert int(want["1.num_batches_tracked"]) == 6
    assert not any(m is model for m in ema.modules())  # the cached model is not registered as a child


def _grads(model):
    return {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_models_equal_eager():
    """One tiny model per family under inductor: outputs and gradients equal eager, and so do the losses of the
    AdamW steps that follow (a training's loss curve, eager and compiled, as train.compile switches it)."""
    import copy

    import timm

    from diffusion.models import DiT

    torch.manual_seed(0)
    deit = timm.create_model("deit_tiny_siamese_patch16_224", img_size=16, patch_size=8, embed_dim=32, depth=2,
                             num_heads=2, num_classes=5)
    # no label dropout: eager and inductor draw their randomness differently, so a dropped label would differ
    dit_model = DiT(input_size=8, patch_size=4, in_channels=1, hidden_size=32, depth=2, num_heads=2, num_classes=5,
                    topology="siamese", class_dropout_prob=0.0)
    for p in dit_model.parameters():  # move adaLN-Zero's zero init off zero, so every path carries gradient
        p.data.add_(0.02 * torch.randn_like(p))
    deit_inputs = (torch.randn(3, 3, 16, 16),)
    dit_inputs = (torch.randn(3, 1, 8, 8), torch.tensor([1, 500, 999]), torch.tensor([0, 3, 4]))
    for model, inputs in ((deit, deit_inputs), (dit_model, dit_inputs)):
        compiled_model = torch.compile(copy.deepcopy(model))
        eager_out, compiled_out = model(*inputs), compiled_model(*inputs)
        torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-5)
        eager_out.square().mean().backward()
        compiled_out.square().mean().backward()
        eager_grads, compiled_grads = _grads(model), _grads(compiled_model)
        assert eager_grads.keys() == compiled_grads.keys()
        for name in eager_grads:
            torch.testing.assert_close(compiled_grads[name], eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)
        curves = {}
        for name, trained in (("eager", model), ("compiled", compiled_model)):
            optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3, fused=True)  # the trainer's optimizer
            curves[name] = []
            for _ in range(4):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                loss = trained(*inputs).square().mean()
                loss.backward()
                curves[name].append(loss.item())
        assert curves["eager"][-1] < curves["eager"][0]  # the steps moved the weights
        torch.testing.assert_close(curves["compiled"], curves["eager"], rtol=1e-4, atol=1e-6)
