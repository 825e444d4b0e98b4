"""scripts/studies.sh, which carries the background studies between machines: a fresh --out is rebuilt from
carry/ without touching what is there, a finished run's small files are carried (never its checkpoints) to the study
that owns it, `stop` ends a study's processes once its run has said it checkpointed, and `drain` ends them once their
run in progress has finished."""
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "studies.sh"


def studies_env(tmp_path, **extra):
    return {**os.environ, "STUDIES": str(tmp_path / "studies"), "RESULTS": str(tmp_path / "results"), **extra}


def studies(command, tmp_path, **env):
    done = subprocess.run(["bash", str(SCRIPT), *command.split()], env=studies_env(tmp_path, **env),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return done.stdout


def write(path: Path, text="{}"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_restore_keeps_what_is_there_and_carry_takes_only_the_small_files_of_new_finished_runs(tmp_path):
    results, runs_root = tmp_path / "results", tmp_path / "studies"
    write(results / "dit_flow/carry/fmnist_cnn.safetensors", "classifier")
    write(results / "dit_flow/carry/encoder/model.safetensors", "encoder")
    write(results / "dit_flow/carry/finished/pre_d8_lr0.001_s0/result.json")
    write(results / "dit_hc_attnres/carry/finished/mhc_d8_lr0.001_s0/result.json")
    write(results / "deit_hc_attnres/carry/finished/hc_d12_lr0.001_s0/result.json")
    write(runs_root / "deit_hc_attnres/runs/hc_d12_lr0.001_s0/metrics.jsonl")  # a run here already: kept as it is
    snapshot_python = runs_root / "code_test/.venv/bin/python"  # the snapshot exists: restore builds nothing
    write(snapshot_python, "#!/bin/sh\n")
    snapshot_python.chmod(0o755)

    status = studies("restore", tmp_path, REV="test")
    flow_runs = runs_root / "dit_flow/runs"
    assert (runs_root / "dit_flow/fmnist_cnn.safetensors").read_text() == "classifier"
    assert (runs_root / "dit_flow/encoder/model.safetensors").read_text() == "encoder"
    assert (flow_runs / "pre_d8_lr0.001_s0/result.json").is_file()
    assert (flow_runs / "mhc_d8_lr0.001_s0/result.json").is_file()  # dit_hc_attnres shares dit_flow's --out
    assert not (runs_root / "deit_hc_attnres/runs/hc_d12_lr0.001_s0/result.json").exists()
    assert "deit_hc_attnres: 0 finished; hc_d12_lr0.001_s0(no checkpoint); stopped" in status
    assert "dit_flow: 1 finished; nothing in progress; stopped" in status
    assert "dit_hc_attnres: 1 finished; nothing in progress; stopped" in status
    assert "dit_routing: 0 finished; nothing in progress; stopped" in status  # nothing carried yet

    write(flow_runs / "mhc_d8_lr0.001_s1/result.json", json.dumps({"fd": 1.0}))
    write(flow_runs / "mhc_d8_lr0.001_s1/config.yaml", "model: {}")
    write(flow_runs / "mhc_d8_lr0.001_s1/metrics.jsonl", '{"step": 50, "train/steps_per_s": 2.5}')
    write(flow_runs / "mhc_d8_lr0.001_s1/checkpoints/step_000000500.pt", "large")
    write(flow_runs / "flow_pre_d8_lr0.001_s3/checkpoints/step_000001000.pt", "unfinished")
    assert studies("carry", tmp_path).split() == ["carried", "dit_hc_attnres/mhc_d8_lr0.001_s1"]
    carried = results / "dit_hc_attnres/carry/finished/mhc_d8_lr0.001_s1"
    assert sorted(p.name for p in carried.iterdir()) == ["config.yaml", "metrics.jsonl", "result.json"]
    assert not (results / "dit_flow/carry/finished/mhc_d8_lr0.001_s1").exists()
    assert not (results / "dit_flow/carry/finished/flow_pre_d8_lr0.001_s3").exists()
    assert studies("carry", tmp_path) == ""  # carried once


STAND_IN_SAYING_READY = """
import os, signal, sys
signal.signal(signal.SIGTERM, lambda *_: print("\\rtrain 5/9\\rSIGTERM received: stopped at step 5 with a checkpoint "
                                              "(exit 4)", flush=True))  # then, as the snapshot does, runs on
{say_ready}
while True:
    signal.pause()
"""
STAND_IN = STAND_IN_SAYING_READY.format(say_ready='print("ready", file=sys.stderr, flush=True)')


def test_stop_ends_a_study_once_its_run_says_it_checkpointed(tmp_path):
    log = tmp_path / "studies/deit_hc_attnres/study.log"
    log.parent.mkdir(parents=True)
    with open(log, "w") as out:  # the command line scripts.compare has, so that `stop` finds the process
        stand_in = subprocess.Popen([sys.executable, "-c", STAND_IN, "scripts.compare", "--study", "deit_hc_attnres",
                                     "--out", str(tmp_path / "studies/deit_hc_attnres"), "--report", "r"],
                                    stdout=out, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert stand_in.stderr.readline() == "ready\n"  # its handler is installed
        said = studies("stop", tmp_path)
        assert stand_in.wait(timeout=60) == -9
        assert "deit_hc_attnres: SIGTERM received: stopped at step 5 with a checkpoint (exit 4)" in said
        assert "deit_hc_attnres: 0 finished; nothing in progress; stopped" in said
    finally:
        if stand_in.poll() is None:
            stand_in.kill()


HOLDS_A_RUN = """
import fcntl, os, signal, sys
lock = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(lock, fcntl.LOCK_EX)  # as the trainer's RunLock holds its run folder
print("ready", file=sys.stderr, flush=True)
while True:
    signal.pause()
"""


def test_drain_ends_each_process_of_a_study_once_its_own_run_in_progress_has_finished_and_carries_it(tmp_path):
    out = tmp_path / "studies/deit_hc_attnres"
    runs = [out / "runs/hc_d12_lr0.001_s4", out / "runs/mhc_d12_lr0.001_s4"]
    for run in runs:
        write(run / "config.yaml", "model: {}")
    (tmp_path / "studies/deit_hc_attnres/study.log").write_text("")
    stand_ins = [subprocess.Popen([sys.executable, "-c", HOLDS_A_RUN, str(run / ".lock"), "scripts.compare",
                                   "--study", "deit_hc_attnres", "--out", str(out), "--report", "r"],
                                  stderr=subprocess.PIPE, text=True, start_new_session=True) for run in runs]
    try:
        assert [s.stderr.readline() for s in stand_ins] == ["ready\n"] * 2
        assert "deit_hc_attnres: 0 finished; hc_d12_lr0.001_s4(no checkpoint) mhc_d12_lr0.001_s4(no checkpoint); " \
               "running (2 processes)" in studies("status", tmp_path)
        drain = subprocess.Popen(["bash", str(SCRIPT), "drain", "5"], env=studies_env(tmp_path, DRAIN_POLL="1"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            drain.wait(timeout=3)
        assert [s.poll() for s in stand_ins] == [None, None]
        write(runs[0] / "result.json", json.dumps({"top1": 50.0}))  # the first process's run finishes
        assert stand_ins[0].wait(timeout=60) == -9
        assert stand_ins[1].poll() is None and drain.poll() is None  # the other trains on
        write(runs[1] / "result.json", json.dumps({"top1": 51.0}))
        said, err = drain.communicate(timeout=120)
        assert drain.returncode == 0, err
        assert stand_ins[1].wait(timeout=60) == -9
        for run in runs:
            assert f"deit_hc_attnres: {run.name} finished; ended before the next run" in said
            assert f"carried deit_hc_attnres/{run.name}" in said
        assert "deit_hc_attnres: 2 finished; nothing in progress; stopped" in said
    finally:
        for stand_in in stand_ins:
            if stand_in.poll() is None:
                stand_in.kill()


# Started by `start`, so not a child of the test: it says it is ready through the FIFO named by $READY.
STARTED_STAND_IN = STAND_IN_SAYING_READY.format(say_ready='open(os.environ["READY"], "w").write("ready\\n")')


def test_start_runs_n_processes_per_study_each_with_its_log_and_stop_ends_every_one(tmp_path):
    """`start 2` twice starts two processes per unfinished study, not four, from a snapshot whose run lists `start`
    first made this checkout's (the amendments' added runs; nothing else in the file changes); `stop` reads each
    process's own log for its line."""
    snapshot_python = tmp_path / "studies/code_test/.venv/bin/python"  # the snapshot's python: the stand-in
    write(snapshot_python, f"#!/bin/sh\nexec {sys.executable} -c '{STARTED_STAND_IN}' \"$@\"\n")
    snapshot_python.chmod(0o755)
    checkout = (ROOT / "configs/compare.yaml").read_text()
    # the baselines deit_attnres's and dit_routing's amendments added to their lists
    added = ["      - {topologies: [pre, siamese, attnres_block], depths: [12, 24], seeds: [0, 1, 2, 3, 4, 5]}\n",
             "      - {topologies: [pre, siamese, attnres], depths: [8], seeds: [0, 1, 2, 3, 4, 5]}\n"]
    assert all(checkout.count(line) == 1 for line in added)
    snapshot_config = tmp_path / "studies/code_test/configs/compare.yaml"
    write(snapshot_config, "".join(line for line in checkout.splitlines(keepends=True) if line not in added))
    ready = tmp_path / "ready"
    os.mkfifo(ready)
    # Read-write: the FIFO never reaches end-of-file, so each stand-in's line waits here until it is read.
    ready_fd = os.open(ready, os.O_RDWR)
    try:
        said = "".join(studies(command, tmp_path, READY=str(ready), REV="test")
                       for command in ("start", "start 2", "start 2"))
        logs = {study: [tmp_path / f"studies/{study}/study.log", tmp_path / f"studies/{study}/study2.log"]
                for study in ("deit_attnres", "dit_routing")}
        finished = ("dit_flow", "deit3_depth", "dit_lightning")
        assert all(f"{study} started" not in said for study in finished)  # restored and reported, not started again
        assert snapshot_config.read_text() == checkout
        for study, (first, second) in logs.items():
            assert said.count(f"{study}: its snapshot's run list updated from configs/compare.yaml") == 1
            assert said.count(f"{study} started; log") == 2
            assert f"{study} started; log {first}" in said and f"{study} started; log {second}" in said
            assert said.count(f"{study} runs already (pids ") == 2
        said_ready = b""  # every handler installed before the SIGTERM
        while said_ready.count(b"\n") < 4:
            assert select.select([ready_fd], [], [], 120)[0], f"only {said_ready!r} from the four processes"
            said_ready += os.read(ready_fd, 4096)
        assert said_ready == b"ready\n" * 4
        status = studies("status", tmp_path)
        assert status.count("running (2 processes)") == 2, status
        said = studies("stop", tmp_path)
        assert said.count("SIGTERM received: stopped at step 5 with a checkpoint (exit 4)") == 4, said
        for study in logs:
            assert f"{study}: 0 finished; nothing in progress; stopped" in said
    finally:
        os.close(ready_fd)
        subprocess.run(["pkill", "-9", "-f", str(tmp_path / "studies")], check=False)


def test_drain_refuses_a_limit_that_is_not_whole_minutes_in_one_line(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "drain", "4.5"], env=studies_env(tmp_path), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "drain takes whole minutes, e.g. `drain 45` (got '4.5')\n"
