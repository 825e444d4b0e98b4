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


def test_non_finite_guard_stops_after_limit():
    guard = NonFiniteGuard(max_in_row=3)
    assert guard.check(False, 1) is False and guard.check(True, 2) is True
    guard.check(False, 3)
    guard.check(False, 4)
    with pytest.raises(NonFiniteLossError, match="3 steps in a row"):
        guard.check(False, 5)
    assert guard.total == 4


def test_metrics_logger_writes_jsonl(tmp_path):
    from accelerate import Accelerator

    from common.logging import MetricsLogger

    logger = MetricsLogger(Accelerator(cpu=True), tmp_path)
    logger.log({"loss": torch.tensor(1.5), "bad": float("nan")}, step=3)
    logger.close()
    (record,) = read_metrics(tmp_path)
    assert record["step"] == 3 and record["loss"] == 1.5 and record["bad"] == "nan"
    MetricsLogger(Accelerator(cpu=True), tmp_path, fresh=True).close()  # a run started over
    assert read_metrics(tmp_path) == []
