"""scripts.paper_imagenet: the paper's ImageNet study end to end on the CPU (tiny models, a tiny ImageFolder and tiny
latents; the study and its jobs in the test's process but one, forked by the launcher, preempted by a real SIGTERM,
the rerun continuing it), and its SLURM submissions as a stand-in ``sbatch`` records them."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from comparison.paper_imagenet import fork_module
from tests.refusals import refusal
from tests.rehearsal import write_image_folder
from tests.test_bad_input import extract, tiny_vae, write_folder

ROOT = Path(__file__).resolve().parents[1]
DEIT = ["data.num_classes=2", "data.input_size=32", "data.num_workers=0", "optim.batch_size=4", "optim.epochs=1",
        "model.kwargs={embed_dim: 16, depth: 2, num_heads: 2, patch_size: 8}", "train.threads=1",
        "train.tensorboard=false", "train.log_every=1"]
DIT = ["data.num_classes=2", "model.kwargs={hidden_size: 16, depth: 2, num_heads: 2}", "data.image_size=32", "data.num_workers=0",
       "optim.batch_size=4", "optim.steps=4", "train.sample_every=0", "train.threads=1", "train.tensorboard=false",
       "train.log_every=1"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The study's five inputs, tiny: ImageNet (2 classes), latents of a tiny VAE, Inception (random weights) and a
    reference batch of 8 images in ADM's npz layout."""
    from diffusion.evaluation.features import INCEPTION_WEIGHTS_FILE, write_random_inception

    root = tmp_path_factory.mktemp("paper_inputs")
    for split, seed in (("train", 0), ("val", 1)):
        write_image_folder(root / "imagenet" / split, classes=2, per_class=4, seed=seed)
    vae = tiny_vae(root / "vae")
    extract(write_folder(root / "images", ["n01440764", "n01443537"], per_class=4, size=40), vae, root / "latents")
    reference = root / "VIRTUAL_imagenet256_labeled.npz"
    np.savez(reference, arr_0=np.random.default_rng(0).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8))
    return ["--imagenet", root / "imagenet", "--latents", root / "latents", "--vae", vae, "--inception",
            write_random_inception(root / INCEPTION_WEIGHTS_FILE), "--adm-reference", reference]


def study(out, inputs, *extra):
    """One model per family (the other two differ only in the recipe file they train: ``--dry-run`` below plans all
    four)."""
    return ["--launcher", "local", "--out", out, *inputs, "--models", "deit_tiny", "dit_l4", "--fid-samples", "4",
            "--sample-steps", "2", "--sample-batch-size", "4", "--set-deit", *DEIT, "--set-dit", *DIT, *extra]


PREEMPTED = "dit_l4_siamese.yaml"  # the recipe of the job a real SIGTERM preempts


def run_job(module: str, args) -> int:
    """The local launcher's ``fork_module`` in this test: a job's own ``main(argv)`` in this process, as a fresh
    process would run it (accelerate's state is one per process), except DiT-L/4 SiameseNorm's training, which the
    launcher forks as it forks every job: the process that gets the real SIGTERM, and the one that continues it."""
    import importlib

    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    if any(a.endswith(PREEMPTED) for a in args):
        return fork_module(module, args)
    try:
        importlib.import_module(module).main(list(args))
    except SystemExit as stop:
        return stop.code or 0
    return 0


@pytest.fixture
def jobs_in_this_process(monkeypatch):
    """The local launcher runs its jobs by ``run_job``; what they leave in this process (accelerate's state, torch's
    thread count) is undone after the test."""
    import torch
    from accelerate.state import AcceleratorState

    from comparison import paper_imagenet

    threads = torch.get_num_threads()
    monkeypatch.setattr(paper_imagenet, "fork_module", run_job)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(threads)


@pytest.mark.filterwarnings("ignore:skipping unreadable image:UserWarning",  # the ImageNet copy's truncated file
                            "ignore:.*covariance is singular:UserWarning")  # FID of 4 samples
def test_the_study_runs_end_to_end_and_a_preempted_job_continues(inputs, tmp_path, monkeypatch, capfd,
                                                                   jobs_in_this_process):
    from common import trainer
    from common.logging import read_metrics
    from common.train_state import CheckpointManager
    from scripts.paper_imagenet import main
    from tests import faults

    out = tmp_path / "paper"
    argv = [str(a) for a in study(out, inputs)]
    with monkeypatch.context() as fault:  # DiT-L/4 SiameseNorm's training gets a real SIGTERM after its step 2
        fault.setenv("FAULT_ARGV", PREEMPTED)
        fault.setattr(trainer.Trainer, "train_step", trainer.Trainer.train_step)
        faults.install("sigterm", 2)
        status = main(argv)  # it checkpoints and exits 4; the study stops
    first = capfd.readouterr()
    assert status == 4, first.err[-4000:]
    assert "Plan (local): 10 jobs, 0 finished and kept" in first.out and "GPU-h  after: train_dit_l4_pre" in first.out
    assert "SIGTERM received" in first.out + first.err
    assert "train_dit_l4_siamese stopped with a checkpoint (exit 4)" in first.out
    preempted = out / "runs" / "dit_l4_siamese"
    assert CheckpointManager(preempted / "checkpoints").steps() == [2] and not (preempted / "final_metrics.json").exists()
    finished = [out / "runs" / "deit_tiny_pre" / "top1.json", out / "runs" / "deit_tiny_siamese" / "top1.json",
                out / "runs" / "dit_l4_pre" / "final_metrics.json"]
    stamps = [f.stat().st_mtime_ns for f in finished]
    report = (out / "report.md").read_text()
    assert "| [dit_l4](dit_l4/report.md) | FID-50K (ADM reference) | -- | -- | -- | 45.21 | 41.34 | -3.87 |" in report

    status = main(argv)  # the same command: it continues
    second = capfd.readouterr()
    assert status == 0, second.err[-4000:]
    assert "Plan (local): 10 jobs, 5 finished and kept" in second.out
    assert [f.stat().st_mtime_ns for f in finished] == stamps  # finished jobs are not redone
    records = read_metrics(preempted)
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r.get("event") == "resumed"] == [2]  # continued from its step-2 checkpoint
    report = (out / "report.md").read_text()
    top1 = json.loads(finished[0].read_text())["top1"]
    fid = json.loads((preempted / "fid_samples" / "fid.json").read_text())["metrics"]["fid"]
    assert f"| [deit_tiny](deit_tiny/report.md) | Top-1 % (ImageNet val) | {top1:.2f} |" in report
    assert f"| {fid:.2f} |" in report and "| 72.2 | 73.6 | +1.40 |" in report and "10 of 10 jobs finished." in report
    assert "**Not the paper's protocol**: FID of 4 samples of 2 steps" in report
    model_report = (out / "dit_l4" / "report.md").read_text()
    assert model_report.startswith("# ImageNet DiT topology comparison") and "| 2 | 0.0001 | siamese |" in model_report


SBATCH = """#!/usr/bin/env bash
# sbatch as far as a CPU machine allows: record the arguments (one line, unit-separated), answer a job id.
printf '%s\\x1f' "$@" >> "$LOGS/sbatch"; echo >> "$LOGS/sbatch"
echo "$((1000 + $(wc -l < "$LOGS/sbatch")));cluster"
"""
SQUEUE = """#!/usr/bin/env bash
cat "$LOGS/queued" 2>/dev/null || true
"""


def test_slurm_submits_every_job_after_the_ones_it_needs_and_not_twice(inputs, tmp_path, monkeypatch, capsys):
    from scripts.paper_imagenet import main

    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir(), logs.mkdir()
    for name, text in (("sbatch", SBATCH), ("squeue", SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "paper"
    args = [str(a) for a in ("--launcher", "slurm", "--out", out, *inputs, "--set-deit", "data.num_classes=2",
                             "--set-dit", "data.num_classes=2", "data.image_size=32")]  # the tiny inputs' sizes

    system_path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path / "logs"))  # no sbatch: one line; --dry-run prints the commands
    with pytest.raises(SystemExit) as refused:
        main(args)
    assert refused.value.code == 2 and "error: sbatch is not on PATH" in capsys.readouterr().err
    main(args + ["--dry-run"])
    printed = capsys.readouterr().out
    assert ("sbatch --parsable --job-name=paper-eval_deit_tiny_pre " in printed
            and "--dependency=afterok:$train_deit_tiny_pre scripts/cluster/train.sbatch --config" in printed)

    monkeypatch.setenv("PATH", f"{bin_dir}:{system_path}")
    monkeypatch.setenv("LOGS", str(logs))
    main(args)
    calls = [line.split("\x1f")[:-1] for line in (logs / "sbatch").read_text().splitlines()]
    assert len(calls) == 20
    ids = {c[1].removeprefix("--job-name=paper-"): str(1001 + i) for i, c in enumerate(calls)}
    by_name = {c[1].removeprefix("--job-name=paper-"): c for c in calls}
    train = by_name["train_dit_b2_siamese"]
    assert train[:5] == ["--parsable", "--job-name=paper-train_dit_b2_siamese", f"--output={out}/logs/%x-%j.out",
                         "--export=ALL,MODULE=diffusion.train", "scripts/cluster/train.sbatch"]
    assert train[5:7] == ["--config", str(ROOT / "configs/dit_b2_siamese.yaml")]
    assert train[7:10] == [f"data.path={inputs[3]}", f"data.autoencoder={inputs[5]}", "data.num_classes=2"]
    assert by_name["sample_dit_b2_siamese"][4] == f"--dependency=afterok:{ids['train_dit_b2_siamese']}"
    fid = by_name["fid_dit_b2_siamese"]
    assert fid[3:7] == ["--export=ALL,MODULE=diffusion.fid", f"--dependency=afterok:{ids['sample_dit_b2_siamese']}",
                        "--ntasks-per-node=1", "--gpus-per-node=1"]
    assert by_name["eval_deit_small_pre"][3:5] == ["--export=ALL,MODULE=vision.evaluate",
                                                   f"--dependency=afterok:{ids['train_deit_small_pre']}"]
    assert (ROOT / train[4]).is_file()

    (logs / "queued").write_text("\n".join(ids.values()) + "\n")  # all still queued: nothing is submitted again
    main(args)
    assert len((logs / "sbatch").read_text().splitlines()) == 20
    assert "train_deit_tiny_pre: queued as SLURM job 1001 (submitted before)" in capsys.readouterr().out

    (logs / "queued").write_text("")  # gone from the queue; one training finished: the rest is submitted again
    (out / "runs" / "deit_tiny_pre").mkdir(parents=True)
    (out / "runs" / "deit_tiny_pre" / "final_metrics.json").write_text("{}")
    main(args)
    again = [line.split("\x1f")[:-1] for line in (logs / "sbatch").read_text().splitlines()[20:]]
    names = [c[1].removeprefix("--job-name=paper-") for c in again]
    assert len(again) == 19 and "train_deit_tiny_pre" not in names
    assert not any(a.startswith("--dependency") for a in again[names.index("eval_deit_tiny_pre")])


def test_missing_inputs_are_one_line_before_anything_runs(tmp_path, capsys):
    from scripts.paper_imagenet import main

    with pytest.raises(SystemExit) as refused:
        main(["--launcher", "local", "--out", str(tmp_path / "p"), "--models", "dit_b2", "--latents", str(tmp_path)])
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --vae is needed for dit_b2"
    assert not (tmp_path / "p").exists()


def test_a_submitted_training_runs_under_the_job_script_and_requeues_when_preempted(inputs, tmp_path, monkeypatch):
    """The sbatch call the SLURM launcher makes for DeiT-T Pre-Norm, run by scripts/cluster/train.sbatch as SLURM runs
    it (srun and scontrol stand-ins, one task on this CPU): a real SIGTERM at step 2 leaves a checkpoint and a requeue,
    the requeued job finishes where it stopped, and the study then submits what follows it but not it again."""
    from common.logging import read_metrics
    from scripts.paper_imagenet import main
    from tests.rehearsal import free_port
    from tests.test_cluster import slurm_stand_ins

    bin_dir, logs = slurm_stand_ins(tmp_path)
    for name, text in (("sbatch", SBATCH), ("squeue", SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "paper"
    args = [str(a) for a in ("--launcher", "slurm", "--out", out, *inputs, "--models", "deit_tiny",
                             "--set-deit", *DEIT, "optim.epochs=2")]  # 8 images, batch 4: 4 steps
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    monkeypatch.setenv("LOGS", str(logs))
    main(args)
    calls = [line.split("\x1f")[:-1] for line in (logs / "sbatch").read_text().splitlines()]
    train = next(c for c in calls if c[1] == "--job-name=paper-train_deit_tiny_pre")
    script = train.index("scripts/cluster/train.sbatch")
    module = next(a for a in train[:script] if a.startswith("--export=")).split("MODULE=")[1]

    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLURM_NTASKS": "1",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "1001", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_SUBMIT_DIR": str(ROOT), "MASTER_PORT": str(free_port())}
    job_script = str(ROOT / train[script])
    first = subprocess.run(["bash", job_script, "sigterm", "2", "--", "-m", module, *train[script + 1:]], cwd=ROOT,
                           env={**env, "MODULE": "tests.faults"}, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and "stopped with a checkpoint (exit 4): requeued" in first.stdout, first.stdout[-3000:]
    assert (logs / "requeued").read_text().split() == ["1001"]
    run_dir = out / "runs" / "deit_tiny_pre"
    assert not (run_dir / "final_metrics.json").exists()

    second = subprocess.run(["bash", job_script, *train[script + 1:]], cwd=ROOT, env={**env, "MODULE": module},
                            capture_output=True, text=True, timeout=600)  # the requeued job, as SLURM starts it again
    assert second.returncode == 0 and "finished" in second.stdout, second.stdout[-3000:]
    assert [r["step"] for r in read_metrics(run_dir) if "train/loss" in r] == [1, 2, 3, 4]

    main(args)  # nothing queued any more: the rest is submitted again, the finished training is not
    again = [line.split("\x1f")[1] for line in (logs / "sbatch").read_text().splitlines()[len(calls):]]
    assert "--job-name=paper-train_deit_tiny_pre" not in again and "--job-name=paper-eval_deit_tiny_pre" in again


def test_the_dry_run_checks_what_every_training_checks_first(inputs, tmp_path, capsys):
    """Inputs that pass a check of paths but that every job would refuse at its start, after its wait in the queue:
    ImageNet with 2 classes for the recipes' 1000, latents of 32 px images for DiT's 256, another VAE than the one
    that encoded the latents. Each is one line naming the job and the option, before anything is planned or queued."""
    from scripts.paper_imagenet import main

    out = tmp_path / "paper"
    base = [str(a) for a in ("--launcher", "slurm", "--out", out, "--dry-run", *inputs)]
    line = refusal(main, [*base, "--models", "deit_tiny"], capsys)
    assert line == ("error: train_deit_tiny_pre would stop at its start: the train set has 2 classes but "
                    "data.num_classes=1000; set data.num_classes=2 (or point data.path at the right folder) (data.path "
                    "is --imagenet; other settings: --set-deit KEY=VALUE)"), line
    line = refusal(main, [*base, "--models", "dit_b2"], capsys)
    assert line == (f"error: train_dit_b2_pre would stop at its start: the latents in {inputs[3]} are of 32px images, "
                    "the config says data.image_size=256; make them agree (data.path is --latents, data.autoencoder "
                    "--vae; other settings: --set-dit KEY=VALUE)"), line
    line = refusal(main, [*base, "--models", "dit_b2", "--set-dit", "data.image_size=32"], capsys)
    assert line.startswith(f"error: train_dit_b2_pre would stop at its start: the latents in {inputs[3]} have 2 "
                           "classes, the config says data.num_classes=1000"), line
    other_vae = str(tiny_vae(tmp_path / "other_vae", seed=1))
    args = [*base, "--models", "dit_b2", "--set-dit", "data.image_size=32", "data.num_classes=2"]
    line = refusal(main, [*args[:args.index("--vae") + 1], other_vae, *args[args.index("--vae") + 2:]], capsys)
    assert line.startswith("error: train_dit_b2_pre would stop at its start: ") and "data.autoencoder" in line, line
    assert not out.exists()
    capsys.readouterr()
    main([*args, "--set-deit", "data.num_classes=2", "--models", "deit_tiny", "dit_b2"])  # the same inputs, sized
    printed = capsys.readouterr().out
    assert printed.count("checked train_") == 2 and "checked train_dit_b2_pre's inputs as it will: " in printed
    assert "Plan (slurm): 10 jobs, 0 finished and kept" in printed
