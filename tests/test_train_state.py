"""Training checkpoints: atomic files, newest-complete resume, retention, RNG round trip."""
import random

import numpy as np
import pytest
import torch

from common.checkpoint import load_weights
from common.ema import ModelEma
from common.logging import NonFiniteGuard, NonFiniteLossError, read_metrics
from common.train_state import CheckpointManager, capture_rng_state, resolve_resume, restore_rng_state


def draw():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_rng_round_trip_through_weights_only_file(tmp_path):
    state = capture_rng_state()
    expected = draw()
    mgr = CheckpointManager(tmp_path)
    mgr.save({"rng": [state], "step": 1}, step=1)
    _, loaded = mgr.latest()  # loads with weights_only=True
    draw()
    restore_rng_state(loaded["rng"][0])
    assert draw() == expected


def test_retention_keeps_last_and_every(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_every=4)
    for step in range(1, 10):
        mgr.save({"step": step}, step)
    assert mgr.steps() == [4, 8, 9]
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=0)


def test_auto_resume_skips_incomplete_and_corrupt_files(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    model = torch.nn.Linear(3, 2)
    mgr.save({"model": model.state_dict(), "step": 3}, 3)
    # A kill during a write leaves only a temporary file; a full disk may leave a truncated one.
    (tmp_path / "step_000000007.pt.tmp").write_bytes(b"partial")
    good = mgr.path_for(3).read_bytes()
    mgr.path_for(5).write_bytes(good[: len(good) // 2])
    with pytest.warns(UserWarning, match="step_000000005.pt"):
        path, state = resolve_resume("auto", mgr)
    assert path == mgr.path_for(3) and state["step"] == 3
    assert resolve_resume(None, mgr) is None
    assert resolve_resume("auto", CheckpointManager(tmp_path / "empty")) is None
    with pytest.raises(FileNotFoundError, match="resume=auto"):
        resolve_resume(str(tmp_path / "missing.pt"), mgr)
    # The weights inside a training checkpoint load with the shared loader.
    fresh = torch.nn.Linear(3, 2)
    load_weights(fresh, path)
    assert torch.equal(fresh.weight, model.weight)


def test_ema_averages_and_round_trips():
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    ema = ModelEma(model, decay=0.5)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model)
    assert torch.allclose(ema.module.weight, torch.full((1, 2), 0.5))
    other = ModelEma(model, decay=0.5)
    other.load_state_dict(ema.state_dict())
    assert torch.equal(other.module.weight, ema.module.weight)
    with pytest.raises(ValueError):
        ModelEma(model, decay=1.0)


def test_non_finite_guard_counts_on_the_device():
    guard = NonFiniteGuard(max_in_row=3)
    for bad in (1, 0, 1, 1, 1):
        guard.record(torch.tensor(float(bad)))
    assert guard.read() == (3, 4)  # three in a row at the end, four in total
    assert guard.state_dict() == {"in_row": 3, "total": 4}
    err = guard.error(3, 4, step=5, last_good=1)
    assert isinstance(err, NonFiniteLossError) and "last 3 steps in a row" in str(err) and "step 1" in str(err)
    other = NonFiniteGuard(max_in_row=3)
    other.load_state_dict(guard.state_dict())
    assert other.read() == (3, 4)


def test_metrics_logger_writes_jsonl_and_cuts_back_on_resume(tmp_path):
    from accelerate import Accelerator

    from common.logging import MetricsLogger

    logger = MetricsLogger(Accelerator(cpu=True), tmp_path)
    for step in (3, 4, 5):
        logger.log({"loss": torch.tensor(1.5), "bad": float("nan")}, step=step)
    logger.close()
    assert read_metrics(tmp_path)[0] == {**read_metrics(tmp_path)[0], "step": 3, "loss": 1.5, "bad": "nan"}
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a torn last line from a kill
    MetricsLogger(Accelerator(cpu=True), tmp_path, resume_step=4).close()  # resumed from a step-4 checkpoint
    assert [r["step"] for r in read_metrics(tmp_path)] == [3, 4]
    MetricsLogger(Accelerator(cpu=True), tmp_path).close()  # a fresh run
    assert read_metrics(tmp_path) == []


def test_a_forked_child_does_not_keep_a_run_locked(tmp_path):
    """DataLoader workers are forked from the run's process; a worker orphaned by a kill must not hold the lock."""
    import os
    import signal
    import time

    from common.train_state import RunLock, RunLockedError

    lock = RunLock(tmp_path)
    lock.acquire()
    ready, started = os.pipe()
    child = os.fork()
    if child == 0:  # a worker that outlives its parent for a while
        os.write(started, b"1")
        time.sleep(30)
        os._exit(0)
    os.read(ready, 1)  # the child is running (its fork hooks have run, as a real worker's have long before a kill)
    try:
        os.close(lock.fd)  # the run's process dies: its descriptor is gone, the lock must go with it
        lock.fd = None
        RunLock(tmp_path).acquire()
    except RunLockedError as err:
        raise AssertionError(f"the forked child kept the lock: {err}")
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_resumed_log_window_is_each_ranks_or_under_another_world_the_total_on_rank_0():
    from common.trainer import resumed_log_window

    saved = [[2.0, 4.5, 1.0, 0.5], [2.0, 3.5, 3.0, 0.25]]  # per rank: finite steps, loss, grad norm, a loss part
    assert resumed_log_window(saved, 1, 2, 4) == saved[1]
    assert resumed_log_window(saved, 0, 1, 4) == [4.0, 8.0, 4.0, 0.75]  # one process now: it holds both ranks' sums
    assert resumed_log_window(saved, 2, 3, 4) is None  # three now: rank 0 holds the total, the others start at zero
    assert resumed_log_window(None, 0, 1, 4) is None  # a checkpoint from before log windows were kept
    assert resumed_log_window(saved, 0, 2, 3) is None  # other loss parts


def test_the_checkpoint_sizes_the_docs_quote_are_the_models():
    """docs/training.md and docs/dit.md say what a DiT-XL/2 run folder needs per checkpoint and after one step;
    :func:`checkpoint_size` gives those figures (the trainer prints its own run's at the start)."""
    from pathlib import Path

    from common.train_state import checkpoint_size
    from diffusion.models import DiT_models

    docs = Path(__file__).resolve().parents[1] / "docs"
    quoted = {"DiT-XL/2": "10.8 GB", "DiT-L/4": "7.3 GB", "DiT-B/2": "2.1 GB"}
    for name, figure in quoted.items():
        with torch.device("meta"):
            model = DiT_models[name]()
        checkpoint, weights = checkpoint_size(model, ema=True)
        assert f"{checkpoint / 1e9:.1f} GB" == figure
        if name == "DiT-XL/2":
            after_one_step = f"{(checkpoint + 2 * weights) / 1e9:.1f} GB"
            assert (after_one_step, f"{weights / 1e9:.1f} GB") == ("16.2 GB", "2.7 GB")
            for page in ("training.md", "dit.md"):
                assert figure in (docs / page).read_text() and after_one_step in (docs / page).read_text()
