"""Faults and bad input, through both trainers (the one loop, common/trainer.py): kill -9 at chosen moments (a
checkpoint write, a step, the final outputs), reruns of finished runs, changed settings on resume, NaN storms (in
test_vision_train / test_diffusion_train), damaged files, a second run in the same directory, bad settings.

Tiny models on a few Fashion-MNIST images, one thread; each case is a handful of optimizer steps. The many-random-
kill-points version is ``python -m scripts.fault_suite``.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.config import load_config
from common.logging import read_metrics
from common.train_state import CheckpointManager, RunLock
from diffusion import train as dit_train
from tests.refusals import refusal
from vision import train as deit_train

pytestmark = pytest.mark.fashion_mnist
ROOT = Path(__file__).resolve().parents[1]
DEIT = ["model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
        "data.num_workers=0", "train.tensorboard=false", "train.threads=1", "data.max_train_samples=48",
        "data.max_val_samples=20", "optim.batch_size=16", "optim.epochs=2", "train.log_every=1"]
DIT = ["model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}", "data.num_workers=0", "train.tensorboard=false",
       "train.threads=1", "data.max_samples=24", "optim.batch_size=8", "optim.steps=4", "train.log_every=1",
       "train.ema_decay=0.5", "train.sample_count=2", "train.sample_steps=2"]
torch.set_num_threads(1)


def deit(out, *overrides, recipe="fmnist_deit_siamese"):
    return load_config(deit_train.TrainConfig, ROOT / f"configs/{recipe}.yaml", [*DEIT, f"train.output_dir={out}", *overrides])


def dit(out, *overrides):
    return load_config(dit_train.TrainConfig, ROOT / "configs/fmnist_dit_siamese.yaml", [*DIT, f"train.output_dir={out}",
                                                                                      *overrides])


def cli_error(main, recipe, *overrides, capsys) -> str:
    """Run a trainer's CLI that must refuse its input: exit status 2 and a one-line message."""
    return refusal(main, ["--config", ROOT / "configs" / recipe, *overrides], capsys)


def snapshot(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_rerunning_a_finished_run_leaves_it_as_it_was(tmp_path, capsys):
    final = deit_train.train(deit(tmp_path))
    assert {"val/top1", "val/loss", "params", "steps", "skipped_images"} <= set(final)
    before = snapshot(tmp_path)
    assert deit_train.train(deit(tmp_path)) == final
    assert "already finished at step 6" in capsys.readouterr().out
    assert snapshot(tmp_path) == before


def test_a_run_killed_after_its_last_checkpoint_writes_its_final_outputs_on_rerun(tmp_path):
    final = dit_train.train(dit(tmp_path, "train.sample_every=4"))
    for name in ("final_metrics.json", "model.safetensors", "samples/step_000000004.png"):
        (tmp_path / name).unlink()  # as if killed right after the final checkpoint
    records = len(read_metrics(tmp_path))
    again = dit_train.train(dit(tmp_path, "train.sample_every=4"))
    assert (tmp_path / "samples" / "step_000000004.png").is_file() and (tmp_path / "model.safetensors").is_file()
    assert again["steps"] == final["steps"] == 4
    assert not [r for r in read_metrics(tmp_path)[records:] if "train/loss" in r]  # no step trained again


def test_resume_at_an_epoch_boundary_is_bit_identical_with_evaluation_on(tmp_path):
    # Drop path and mixup draw from the global RNG; the end-of-epoch evaluation must not move it.
    common = ["model.drop_path=0.2", "augment.mixup=0.8", "augment.cutmix=1.0", "train.eval_every=1",
              "train.ema_decay=0.5", "train.ckpt_every=100"]
    deit_train.train(deit(tmp_path / "full", *common))
    assert deit_train.train(deit(tmp_path / "resumed", *common, "train.stop_at_step=3")) == {"stopped_at": 3}
    deit_train.train(deit(tmp_path / "resumed", *common))  # 3 steps per epoch: the checkpoint is at the boundary
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = load_file(tmp_path / "full" / name), load_file(tmp_path / "resumed" / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_a_new_learning_rate_on_resume_is_applied(tmp_path):
    deit_train.train(deit(tmp_path / "run", "train.stop_at_step=2"))
    deit_train.train(deit(tmp_path / "run", "optim.base_lr=2e-3"))
    deit_train.train(deit(tmp_path / "fresh", "optim.base_lr=2e-3"))
    lr = lambda d: {r["step"]: r["train/lr"] for r in read_metrics(d) if "train/lr" in r}  # noqa: E731
    resumed, fresh = lr(tmp_path / "run"), lr(tmp_path / "fresh")
    assert [resumed[s] for s in range(3, 7)] == [fresh[s] for s in range(3, 7)]
    assert "base_lr: 0.002" in (tmp_path / "run" / "config.yaml").read_text()  # it says what the run does
    event = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "resumed"][0]
    assert event["step"] == 2 and event["changed"]["optim.base_lr"] == [1e-3, 2e-3]


@pytest.mark.parametrize("change, named", [("optim.batch_size=8", "optim.batch_size: 16 -> 8"),
                                           ("model.kwargs.embed_dim=48", "model.kwargs.embed_dim: 32 -> 48"),
                                           ("model.name=deit_tiny_post_patch16_224", "model.name")])
def test_a_setting_that_cannot_change_on_resume_is_refused_by_name(tmp_path, capsys, change, named):
    deit_train.train(deit(tmp_path, "train.stop_at_step=1"))
    config_before = (tmp_path / "config.yaml").read_bytes()
    err = cli_error(deit_train.main, "fmnist_deit_siamese.yaml", *DEIT, f"train.output_dir={tmp_path}", change,
                    capsys=capsys)
    assert named in err and "another train.output_dir" in err
    assert (tmp_path / "config.yaml").read_bytes() == config_before


def test_resume_null_does_not_start_over_on_top_of_a_run(tmp_path, capsys):
    deit_train.train(deit(tmp_path, "train.stop_at_step=1"))
    err = cli_error(deit_train.main, "fmnist_deit_siamese.yaml", *DEIT, f"train.output_dir={tmp_path}",
                    "train.resume=null", capsys=capsys)
    assert "holds checkpoints up to step 1" in err


@pytest.mark.parametrize("overrides, message", [
    (["model.kwargs={embed_dim:32}"], "write `{embed_dim: 32}` with a space"),
    (["model.kwargs.embed_dm=32"], "not arguments of deit_tiny_siamese_patch16_224"),
    (["train.ckpt_every=0"], "train.ckpt_every=0 must be >= 1"),
    (["train.log_every=0"], "train.log_every=0 must be >= 1"),
    (["optim.batch_size=0"], "optim.batch_size=0 must be >= 1"),
    (["optim.epochs=0"], "optim.epochs=0 must be >= 1"),
    (["train.keep_last=1"], "train.keep_last=1 must be >= 2"),
    (["optim.base_lr=.nan"], "optim.base_lr=nan must be a finite number"),
    (["data.num_workers=-1"], "data.num_workers=-1 must be >= 0"),
    (["data.input_size=0"], "data.input_size=0 must be >= 1"),
    (["model.drop_path=5"], "model.drop_path=5 must lie in [0, 1)"),  # at depth 2 (DEIT's model)
    (["model.drop_path=5", "model.kwargs.depth=1"], "model.drop_path=5 must lie in [0, 1)"),  # and at depth 1
    (["augment.hflip=2"], "augment.hflip=2 must lie in [0, 1]"),
    (["augment.mixup=-1"], "augment.mixup=-1 must be >= 0"),
    (["augment.scale=[0.9, 0.5]"], "augment.scale=[0.9, 0.5]: the smallest crop area comes first"),
])
def test_deit_input_errors_before_any_work(tmp_path, capsys, overrides, message):
    err = cli_error(deit_train.main, "fmnist_deit_siamese.yaml", *DEIT, f"train.output_dir={tmp_path}", *overrides,
                    capsys=capsys)
    assert message in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("overrides, message", [
    (["optim.steps=0"], "optim.steps=0 must be >= 1"),
    (["model.class_dropout_prob=1"], "model.class_dropout_prob=1 must lie in [0, 1)"),
    (["diffusion.beta_end=2"], "diffusion.beta_end=2 must lie in (0, 1)"),
    (["data.image_size=0"], "data.image_size=0 must be >= 8"),
    (["train.sample_steps=1001"], "train.sample_steps=1001 exceeds diffusion.num_timesteps=1000"),
    (["model.topology=sandwich"], "the sandwich topology is not offered for DiT"),
    (["data.path=/data/my #1 run"], "/data/my #1 run"),  # not cut at the ` #` as a YAML comment
    (["optim.lr=.inf"], "optim.lr=inf must be a finite number"),
    (["train.fid_every=2", "train.fid_extractor_weights=/no/such.safetensors"],
     "'/no/such.safetensors' (train.fid_extractor_weights=PATH) does not exist"),
])
def test_dit_input_errors_before_any_work(tmp_path, capsys, overrides, message):
    err = cli_error(dit_train.main, "fmnist_dit_siamese.yaml", *DIT, f"train.output_dir={tmp_path}", *overrides,
                    capsys=capsys)
    assert message in err


@pytest.mark.parametrize("topology", ["residual", "deepnorm", "mixln"])
def test_the_dit_trainer_accepts_every_dit_topology(tmp_path, topology):
    assert dit_train.train(dit(tmp_path, f"model.topology={topology}", "optim.steps=1"))["steps"] == 1


def test_a_second_run_in_the_same_directory_is_refused(tmp_path, capsys):
    lock = RunLock(tmp_path)
    lock.acquire()  # a live run holds the directory
    try:
        err = cli_error(deit_train.main, "fmnist_deit_siamese.yaml", *DEIT, f"train.output_dir={tmp_path}", capsys=capsys)
    finally:
        lock.release()
    assert "is in use by another run (pid" in err and "another train.output_dir" in err
    assert not (tmp_path / "config.yaml").exists()


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from common.train_state import RunLock; "
                               f"RunLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); time.sleep(60)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline().strip() == "locked"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert deit_train.train(deit(tmp_path, "optim.epochs=1"))["steps"] == 3
    assert f"pid {holder.pid}" in capsys.readouterr().out  # named as the run whose lock was taken over


def test_every_checkpoint_unreadable_stops_instead_of_restarting(tmp_path, capsys):
    deit_train.train(deit(tmp_path, "train.stop_at_step=2", "train.ckpt_every=1"))
    ckpts = CheckpointManager(tmp_path / "checkpoints")
    for step in ckpts.steps():
        path = ckpts.path_for(step)
        path.write_bytes(path.read_bytes()[:100])
    with pytest.warns(UserWarning, match="skipping unreadable checkpoint"):
        err = cli_error(deit_train.main, "fmnist_deit_siamese.yaml", *DEIT, f"train.output_dir={tmp_path}",
                        capsys=capsys)
    assert "no readable checkpoint" in err and "step_000000001.pt" in err and "step_000000002.pt" in err
    assert [len(ckpts.path_for(s).read_bytes()) for s in ckpts.steps()] == [100, 100]  # not overwritten


def test_a_damaged_weights_file_is_one_line_naming_it(tmp_path, capsys):
    from vision import evaluate

    deit_train.train(deit(tmp_path, "optim.epochs=1"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--config", str(tmp_path / "config.yaml"), f"checkpoint={weights}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"{weights} is damaged" in err and "Traceback" not in err


def test_metrics_after_a_kill_are_cut_back_to_the_checkpoint(tmp_path):
    """SIGKILL in step 5 (logged: steps 1-4, newest checkpoint: step 3): on resume the records of step 4 are dropped
    and logged again, so no step appears twice; the length may change on resume."""
    args = ["--config", str(ROOT / "configs/fmnist_dit_siamese.yaml"), *DIT, f"train.output_dir={tmp_path}",
            "train.ckpt_every=3", "train.compile=false", "optim.steps=100000"]  # so long a run would compile
    killed = subprocess.run([sys.executable, "-m", "tests.faults", "step", "5", "--", "-m", "diffusion.train", *args],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert max(r["step"] for r in read_metrics(tmp_path)) == 4
    assert CheckpointManager(tmp_path / "checkpoints").steps()[-1] == 3
    dit_train.main(args[:-1] + ["optim.steps=8"])
    steps = [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert steps == list(range(1, 9))
    assert json.loads((tmp_path / "final_metrics.json").read_text())["steps"] == 8


# ------------------------------------------------------------------------------------- kill -9 at chosen moments
# DataLoader workers as users run them: a killed run's orphaned worker must not keep the directory locked.
KILL_RUNS = {"deit": ("vision.train", "fmnist_deit_siamese.yaml", [*DEIT, "train.ckpt_every=2", "train.ema_decay=0.5",
                                                                   "data.num_workers=1"]),
             "dit": ("diffusion.train", "fmnist_dit_siamese.yaml", [*DIT, "train.ckpt_every=2", "optim.steps=6",
                                                                     "data.num_workers=1"])}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each family's run without faults, for bit-for-bit comparison."""
    out = {}
    for family, (module, recipe, overrides) in KILL_RUNS.items():
        out[family] = tmp_path_factory.mktemp(family)
        main = deit_train.main if family == "deit" else dit_train.main
        main(["--config", str(ROOT / "configs" / recipe), *overrides, f"train.output_dir={out[family]}"])
    return out


# Each seam once (the trainer's, shared by both families); `python -m scripts.fault_suite` kills at random moments
# and seams, many trials.
@pytest.mark.parametrize("family, point, nth", [("deit", "ckpt_write", 2), ("deit", "final", 1),
                                                ("dit", "ckpt_done", 1), ("dit", "weights", 2), ("dit", "step", 4)])
def test_killed_at_a_chosen_moment_resumes_bit_identically(uninterrupted, tmp_path, family, point, nth):
    module, recipe, overrides = KILL_RUNS[family]
    args = ["--config", str(ROOT / "configs" / recipe), *overrides, f"train.output_dir={tmp_path}"]
    killed = subprocess.run([sys.executable, "-m", "tests.faults", point, str(nth), "--", "-m", module, *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (deit_train.main if family == "deit" else dit_train.main)(args)  # the same command again
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = load_file(uninterrupted[family] / name), load_file(tmp_path / name)
        assert all(torch.equal(a[k], b[k]) for k in a), (name, point)
    steps = [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == json.loads((tmp_path / "final_metrics.json").read_text())["steps"]
    final, reference = (json.loads((d / "final_metrics.json").read_text()) for d in (tmp_path, uninterrupted[family]))
    timing = {"steps_per_s", "images_per_s", "data_wait"}  # wall-clock rates differ between any two runs
    assert set(final) == set(reference), (point, set(reference) ^ set(final))
    assert {k: v for k, v in final.items() if k not in timing} == {k: v for k, v in reference.items() if k not in timing}


def faulted(point: str, nth: int, module: str, *args) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` under the fault ``point`` of tests/faults.py (a run as a user starts it)."""
    return subprocess.run([sys.executable, "-m", "tests.faults", point, str(nth), "--", "-m", module, *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)


def test_a_sigterm_while_a_finished_run_shuts_down_leaves_exit_status_0(tmp_path):
    """A scheduler's SIGTERM that arrives while a finished run releases its directory, and after it handed its
    signals back: the run stays finished with status 0 (143 would read as a failed job in scripts/cluster), the
    rerun of a finished run too."""
    args = ["--config", str(ROOT / "configs/fmnist_deit_siamese.yaml"), *DEIT, "optim.epochs=1",
            f"train.output_dir={tmp_path}"]
    for attempt in ("train", "rerun of the finished run"):
        proc = faulted("sigterm_at_shutdown", 1, "vision.train", *args)
        assert proc.returncode == 0, (attempt, proc.returncode, proc.stderr[-2000:])
        assert json.loads((tmp_path / "final_metrics.json").read_text())["steps"] == 3
    assert "already finished at step 3" in proc.stdout


def test_a_bug_keeps_its_traceback(tmp_path):
    """A plain ValueError in project code is a bug: its traceback and status 1, not a one-line input error."""
    proc = faulted("bug", 1, "diffusion.train", "--config", str(ROOT / "configs/fmnist_dit_siamese.yaml"), *DIT,
                   f"train.output_dir={tmp_path}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback (most recent call last)" in proc.stderr and "ValueError: a bug in project code" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith("error")]


def test_a_checkpoint_from_before_a_setting_existed_still_resumes(tmp_path):
    deit_train.train(deit(tmp_path, "train.stop_at_step=2"))
    path = CheckpointManager(tmp_path / "checkpoints").path_for(2)
    state = torch.load(path, weights_only=True)
    del state["config"]["data"]["backend"]  # a setting this checkpoint's version did not have yet
    torch.save(state, path)
    assert deit_train.train(deit(tmp_path))["steps"] == 6  # the new setting at its default is no change
