"""Both trainers the way a CUDA user gets them by default (``train.precision=auto``: bf16 autocast;
``train.compile=auto``: the compiled model, which on a CPU it picks for a run of at least the task's
``compile_pays_after_steps_on_cpu``, here lowered to the test's 6 steps), run on the CPU, against eager fp32
(``auto`` with that bar one step above the run).

The tolerance: bf16 autocast rounds every matmul input to 8 significant bits (a relative error up to 2**-9 each),
so a tiny model's loss differs from fp32's by a fraction of a percent per step and the gap grows slowly over a
few steps; 5% of the loss bounds it with room, while a broken path (weights kept in bf16, a skipped update, a
graph that drops a term, NaN) moves the loss far more. Inductor is told to draw random numbers as eager does
(``fallback_random``), so drop path, label dropout and the diffusion noise are the same draws in both runs. The
DeiT run evaluates after each epoch, as a user's does: its eval-mode graph (a partial last batch) compiles in the
first epoch only.
"""
import json
from pathlib import Path

import pytest
import torch

from common.config import load_config
from common.trainer import Trainer
from diffusion import train as dit_train
from diffusion.task import DiTTask
from vision import train as deit_train
from vision.task import DeiTTask

pytestmark = pytest.mark.fashion_mnist
ROOT = Path(__file__).resolve().parents[1]

DEIT = ["model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
        "data.num_workers=0", "data.max_train_samples=32", "data.max_val_samples=20", "optim.batch_size=16",
        "train.eval_batch_size=16", "optim.epochs=3", "train.ema_decay=0.9", "model.drop_path=0.1",
        "augment.mixup=0.8", "augment.cutmix=1.0"]  # 3 epochs of 2 steps; evaluations of 16 + 4 images
DIT = ["model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "data.num_workers=0", "data.max_samples=48",
       "optim.batch_size=8", "optim.steps=6", "train.sample_every=0", "train.ema_decay=0.9"]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one precision per process: each run here starts from a clean state, and the tests after
    this file get one too (not the bf16 state of the last run)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def losses(schema, task_cls, recipe, overrides, out: Path, *, cuda_defaults: bool, monkeypatch, graphs=None):
    """The run's logged losses (6 steps, ``train.compile=auto``); ``graphs`` (a list) gets dynamo's count of compiled
    graphs after each epoch."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the eager fp32 run before it left its state
    monkeypatch.setattr(task_cls, "compile_pays_after_steps_on_cpu", 6 if cuda_defaults else 7)
    settings = ["train.compile=auto", "train.precision=bf16" if cuda_defaults else "train.precision=fp32"]
    cfg = load_config(schema, ROOT / "configs" / recipe, [*overrides, *settings, "train.log_every=1",
                                                          "train.tensorboard=false", "train.threads=1",
                                                          f"train.output_dir={out}"])
    task = task_cls(cfg)
    if graphs is not None:
        after_step = task.after_step

        def counted(ctx):
            out = after_step(ctx)
            if ctx.epoch_end:
                graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            return out

        task.after_step = counted
    trainer = Trainer(cfg, task)
    trainer.fit()
    assert (trainer.accelerator.mixed_precision == "bf16") == cuda_defaults
    assert isinstance(trainer.train_model, torch._dynamo.eval_frame.OptimizedModule) == cuda_defaults
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in records if "train/loss" in r]


@pytest.mark.parametrize("family", ["deit", "dit"])
def test_compiled_bf16_training_follows_eager_fp32(tmp_path, family, monkeypatch):
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()
    args = ((deit_train.TrainConfig, DeiTTask, "fmnist_deit_siamese.yaml", DEIT) if family == "deit" else
            (dit_train.TrainConfig, DiTTask, "fmnist_dit_siamese.yaml", DIT))
    eager = losses(*args, tmp_path / "eager", cuda_defaults=False, monkeypatch=monkeypatch)
    graphs = []
    with torch._inductor.config.patch(fallback_random=True):
        default = losses(*args, tmp_path / "default", cuda_defaults=True, monkeypatch=monkeypatch, graphs=graphs)
    if family == "deit":  # compiled in epoch 1 (training and evaluation), nothing new after
        assert len(graphs) == 3 and graphs[0] > 0 and graphs[1] == graphs[2] == graphs[0], graphs
    assert len(eager) == len(default) == 6
    for step, (a, b) in enumerate(zip(eager, default), 1):
        assert b == pytest.approx(a, rel=0.05), (step, eager, default)
    assert eager != default  # bf16 did round: the two runs are not the same computation
