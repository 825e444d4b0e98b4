"""Where users run: a scheduler's stop signal, per-rank randomness, a rank that dies, a file system the ranks do not
share, the umask of a shared one, engines the trainer does not support, exit codes a job script reads.

Tiny Fashion-MNIST runs in subprocesses, as a user launches them (``python -m``, ``torchrun``, or one process per
rank started by hand with the environment a scheduler gives, as ``srun`` does).
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.logging import read_metrics
from common.preemption import EXIT_PAUSED, EXIT_PREEMPTED
from tests.rehearsal import free_port

pytestmark = pytest.mark.fashion_mnist
ROOT = Path(__file__).resolve().parents[1]
DEIT = ["--config", str(ROOT / "configs/fmnist_deit_siamese.yaml"),
        "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
        "data.num_workers=1", "train.tensorboard=false", "train.threads=1", "data.max_train_samples=192",
        "data.max_val_samples=20", "optim.batch_size=16", "optim.epochs=2", "train.log_every=1", "train.ckpt_every=1000",
        "model.drop_path=0.1", "augment.mixup=0.8", "augment.cutmix=1.0", "train.ema_decay=0.5"]
DIT = ["--config", str(ROOT / "configs/fmnist_dit_siamese.yaml"), "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}",
       "data.num_workers=1", "train.tensorboard=false", "train.threads=1", "data.max_samples=96", "optim.batch_size=8",
       "optim.steps=24", "train.log_every=1", "train.ckpt_every=1000", "train.ema_decay=0.5", "train.sample_every=12",
       "train.sample_count=2", "train.sample_steps=2"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def launch(module, args, out, nproc=1, **popen):
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                                      str(free_port())]
    return subprocess.Popen([sys.executable, *launcher, "-m", module, *args, f"train.output_dir={out}"], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def wait_for_step(out: Path, step: int, proc, timeout=240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").is_file() and any(r.get("step", 0) >= step and "train/loss" in r
                                                     for r in read_metrics(out)):
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no step {step} logged in {timeout} s")


def finished(module, args, out, nproc=1, **popen):
    proc = launch(module, args, out, nproc, **popen)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


def same_weights(a: Path, b: Path) -> None:
    for name in ("model.safetensors", "ema.safetensors"):
        x, y = load_file(a / name), load_file(b / name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs: two processes under torchrun (DeiT, under a group-writable umask, as shared cluster projects
    use: not the default), and one in this process (DiT: the same function ``python -m diffusion.train`` calls,
    without another start-up)."""
    from diffusion.train import main as dit_main

    root = tmp_path_factory.mktemp("uninterrupted")
    dit_main([*DIT, f"train.output_dir={root / 'dit_1'}"])
    deit_2 = finished("vision.train", DEIT, root / "deit_2", nproc=2, preexec_fn=lambda: os.umask(0o002))
    return {"deit_2": deit_2, "dit_1": root / "dit_1"}


# One process (DiT) and two under torchrun (DeiT): the stop path is the trainer's, the same for both families.
@pytest.mark.parametrize("family, nproc, at", [("dit", 1, 7), ("deit", 2, 4)])
def test_sigterm_checkpoints_exits_4_and_the_rerun_is_bit_identical(references, tmp_path, family, nproc, at):
    module, args = ("vision.train", DEIT) if family == "deit" else ("diffusion.train", DIT)
    proc = launch(module, args, tmp_path, nproc)
    wait_for_step(tmp_path, at, proc)
    proc.send_signal(signal.SIGTERM)  # to torchrun with 2 processes: it passes it to every worker (and their group)
    out, err = proc.communicate(timeout=120)
    if nproc == 1:
        assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "SIGTERM received: stopped at step" in out + err and "Traceback" not in out.split("SIGTERM")[0]
    from common.train_state import CheckpointManager

    steps = CheckpointManager(tmp_path / "checkpoints").steps()
    assert steps and steps[-1] >= at, steps  # the step it stopped at, not one from before
    finished(module, args, tmp_path, nproc)  # the same command again
    same_weights(references[f"{family}_{nproc}"], tmp_path)
    logged = [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert logged == sorted(set(logged))


def test_ranks_draw_their_own_randomness(references):
    """Two ranks with drop path and mixup: different random streams (the checkpoint holds each rank's state), the
    same initial weights, and the run's data randomness still per sample."""
    from common.train_state import CheckpointManager, load_training_checkpoint

    manager = CheckpointManager(references["deit_2"] / "checkpoints")
    rng = load_training_checkpoint(manager.path_for(manager.steps()[-1]))["rng"]
    assert len(rng) == 2
    assert not torch.equal(rng[0]["torch"], rng[1]["torch"])
    assert not torch.equal(rng[0]["numpy"]["keys"], rng[1]["numpy"]["keys"])


def test_a_stop_signal_passes_between_a_comparison_and_the_run_it_trains():
    """``scripts.compare`` records stop signals between runs and each trainer records its own: a signal the run
    received reaches the comparison when the run ends, and one the comparison holds stops a run started after it at
    its first step."""
    from common.preemption import StopRequests

    before = signal.getsignal(signal.SIGUSR1)
    comparison = StopRequests(["SIGUSR1"]).install()
    run = StopRequests(["SIGUSR1"]).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal during the run (e.g. after its last step)
        assert run.received == signal.SIGUSR1 and comparison.received is None
        run.restore()
        assert comparison.received == signal.SIGUSR1  # passed on: the comparison starts no further run
        late = StopRequests(["SIGUSR1"]).install()
        assert late.received == signal.SIGUSR1  # a run started anyway stops at its first step
        late.restore()
    finally:
        run.restore()
        comparison.restore()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_time_based_checkpoints(tmp_path):
    from common.train_state import CheckpointManager
    from vision import train as deit_train

    from common.config import load_config

    cfg = load_config(deit_train.TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml",
                      [*DEIT[2:], "data.num_workers=0", "train.ckpt_every_minutes=0.00001", "train.keep_last=100",
                       f"train.output_dir={tmp_path}"])
    deit_train.train(cfg)
    assert CheckpointManager(tmp_path / "checkpoints").steps() == list(range(1, 25))  # every step: minutes elapsed


def test_a_dead_rank_ends_the_others_in_bounded_time(tmp_path):
    """Ranks started by hand (as srun starts them, no torchrun to end the rest): kill -9 one; the other must not wait
    in a collective for ever."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, "-m", "vision.train", *DEIT, "optim.epochs=20",
                                       "train.dist_timeout_minutes=1", f"train.output_dir={tmp_path}"], cwd=ROOT,
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    wait_for_step(tmp_path, 3, procs[0])
    procs[1].kill()
    start = time.monotonic()
    _, err = procs[0].communicate(timeout=180)
    assert procs[0].returncode not in (0, None) and time.monotonic() - start < 120, err[-2000:]


def test_ranks_that_see_different_checkpoints_stop_with_one_line(tmp_path):
    """Node-local disks: each rank's relative run directory is another folder, one with a checkpoint, one empty."""
    for d in ("node0", "node1"):
        (tmp_path / d).mkdir()
    first = subprocess.run([sys.executable, "-m", "vision.train", *DEIT, "train.stop_at_step=2", "train.output_dir=run"],
                           cwd=tmp_path / "node0", env=ENV, capture_output=True, text=True, timeout=300)
    # a run paused at train.stop_at_step exits 3, not 0 (a finished run exits 0: `finished` asserts it)
    assert first.returncode == EXIT_PAUSED and "paused at step 2" in first.stdout + first.stderr, first.stderr[-2000:]
    port, procs = str(free_port()), []
    for rank in (0, 1):
        env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "TORCHELASTIC_ERROR_FILE": str(tmp_path / f"errors/rank{rank}.json")}  # as srun_task.sh sets it
        procs.append(subprocess.Popen([sys.executable, "-m", "vision.train", *DEIT, "train.output_dir=run"],
                                      cwd=tmp_path / f"node{rank}", env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    errors = []
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-2000:]
        errors.append([line for line in err.splitlines() if line.startswith("error")])
        assert "Traceback" not in err
    assert len(errors[0]) == 1 and errors[1] == []  # said once, by rank 0; rank 1 leaves it in its error file
    assert "the processes see different checkpoints" in errors[0][0]
    assert "rank 0: step_000000002.pt, rank 1: none" in errors[0][0]
    recorded = json.loads((tmp_path / "errors/rank1.json").read_text())["message"]
    assert recorded["message"] == errors[0][0] and recorded["extraInfo"]["py_callstack"] == f"{errors[0][0]} (rank 1)"


def test_outputs_follow_the_umask(references):
    """Every file of the two-process reference run, written under umask 002, is group-writable (0o664)."""
    out = references["deit_2"]
    for path in [out / "model.safetensors", out / "ema.safetensors", out / "config.yaml", out / "metrics.jsonl",
                 out / "final_metrics.json", *sorted((out / "checkpoints").iterdir())]:
        assert path.stat().st_mode & 0o777 == 0o664, (path, oct(path.stat().st_mode & 0o777))


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"])
def test_engines_the_trainer_does_not_support_are_refused_by_name(kind):
    """FSDP and DeepSpeed need GPUs to be configured at all; the refusal is checked on what accelerate reports."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from common.cli import InputError
    from common.distributed import check_engine

    configured = SimpleNamespace(distributed_type=DistributedType[kind], state=SimpleNamespace(dynamo_plugin=None))
    with pytest.raises(InputError, match=rf"configured for {kind}, which this trainer does not support.*multi-GPU"):
        check_engine(configured, compile_model=False)


def test_accelerates_dynamo_backend_and_train_compile_are_refused_together(tmp_path, monkeypatch, capsys):
    """In this process (the refusal needs no process boundary): accelerate reads ACCELERATE_DYNAMO_BACKEND when the
    trainer makes its Accelerator, and the state it keeps is reset after, so later tests in this process compile
    nothing."""
    from accelerate.state import AcceleratorState

    from tests.refusals import refusal
    from vision.train import main

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        error = refusal(main, [*DEIT, "train.compile=true", f"train.output_dir={tmp_path}"], capsys)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert "would both compile" in error
    assert not (tmp_path / "checkpoints").exists()


SRUN = r"""#!/usr/bin/env bash
# srun as far as a CPU machine allows: SLURM_NTASKS tasks of the command on this host, each with its SLURM ids;
# a signal to srun goes to every task (as --signal does); --kill-on-bad-exit=1 ends the other tasks once one fails;
# the status is the highest of the tasks'.
kill_on_bad_exit=0
while [[ "$1" == --* ]]; do [[ "$1" == --kill-on-bad-exit=1 ]] && kill_on_bad_exit=1; shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i "$@" > "$LOGS/task$i.log" 2>&1 &
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
running=("${pids[@]}")
while (( ${#running[@]} )); do
  ended=""
  wait -n -p ended "${running[@]}"; rc=$?
  [[ -z "$ended" ]] && continue  # the trap interrupted the wait
  running=($(printf '%s\n' "${running[@]}" | grep -vx "$ended"))
  (( rc > status )) && status=$rc
  (( rc != 0 && kill_on_bad_exit )) && kill -TERM "${running[@]}" 2>/dev/null
done
exit $status
"""
SCONTROL = """#!/usr/bin/env bash
case "$1" in
  show) echo 127.0.0.1 ;;
  requeue) echo "$2" >> "$LOGS/requeued" ;;
esac
"""


def test_the_slurm_script_checkpoints_on_sigterm_and_requeues_until_done(references, tmp_path):
    """scripts/cluster/train.sbatch run as SLURM would run it (srun and scontrol stand-ins, 2 tasks on this CPU): a
    SIGTERM before the time limit leaves a checkpoint and a requeue; the requeued job finishes; the weights equal an
    uninterrupted 2-process run's."""
    bin_dir, logs = slurm_stand_ins(tmp_path)
    out = tmp_path / "run"
    env = {**ENV, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "LOGS": str(logs),
           "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_SUBMIT_DIR": str(ROOT), "MODULE": "vision.train", "MASTER_PORT": str(free_port())}
    job = [str(ROOT / "scripts/cluster/train.sbatch"), *DEIT, f"train.output_dir={out}"]
    first = subprocess.Popen(["bash", *job], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    wait_for_step(out, 4, first)
    srun = subprocess.run(["pgrep", "-f", "-s", str(first.pid), f"{bin_dir}/srun"], capture_output=True, text=True)
    os.kill(int(srun.stdout.split()[0]), signal.SIGTERM)  # what --signal=TERM@180 does before the time limit
    text, _ = first.communicate(timeout=180)
    assert first.returncode == 0 and "stopped with a checkpoint (exit 4): requeued" in text, text[-3000:]
    assert (logs / "requeued").read_text().split() == ["4242"]
    assert not (out / "final_metrics.json").exists()
    env["MASTER_PORT"] = str(free_port())
    second = subprocess.run(["bash", *job], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "finished" in second.stdout, second.stdout[-3000:]
    same_weights(references["deit_2"], out)


def slurm_stand_ins(tmp_path):
    """``(bin folder with srun and scontrol stand-ins, logs folder)``."""
    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir(), logs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir, logs


def test_the_slurm_script_prints_an_input_error_only_another_rank_met(tmp_path):
    """Rank 1 alone meets bad input (tests/faults.py's rank1_input) and exits 2 without printing: the job script
    prints its message from the rank's error file; rank 0 prints no error line."""
    bin_dir, logs = slurm_stand_ins(tmp_path)
    env = {**ENV, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "LOGS": str(logs),
           "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "4343", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_SUBMIT_DIR": str(ROOT), "MODULE": "tests.faults", "MASTER_PORT": str(free_port()),
           "RANK_ERRORS": str(tmp_path / "errors")}
    job = [str(ROOT / "scripts/cluster/train.sbatch"), "rank1_input", "1", "--", "-m", "vision.train", *DEIT,
           f"train.output_dir={tmp_path / 'run'}"]
    proc = subprocess.run(["bash", *job], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "failed (exit" in proc.stdout, proc.stdout[-3000:]
    assert ("rank 1: error: only rank 1 meets this input error (tests/faults.py); fix it there" in proc.stdout), \
        proc.stdout[-3000:]
    assert not [line for line in (logs / "task0.log").read_text().splitlines() if line.startswith("error")]
    assert not [line for line in (logs / "task1.log").read_text().splitlines() if line.startswith("error")]


PROBE = """
import json, sys
from common.config import load_config
from common.distributed import build_accelerator
from vision.task import DeiTTask, TrainConfig
cfg = load_config(TrainConfig, sys.argv[1], sys.argv[2:])
accelerator = build_accelerator("fp32", None, tensorboard=False)
task = DeiTTask(cfg)
task.setup(accelerator)
print(json.dumps({"rank": accelerator.process_index, "images": sum(len(t) for _, t in task.val_loader)}))
"""


def test_evaluation_shards_read_every_image_once_without_padding(tmp_path):
    """16 val images, eval batch 256, 2 processes: 8 images read per process (accelerate's even batches filled each
    process's batch up to 256, which made a small evaluation 30x slower)."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(probe), str(ROOT / "configs/fmnist_deit_siamese.yaml"),
                           "data.max_val_samples=16", "data.max_train_samples=32", "train.eval_batch_size=256",
                           "data.num_workers=0"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = sorted(json.loads(line)["images"] for line in proc.stdout.splitlines() if line.startswith("{"))
    assert counts == [8, 8]
