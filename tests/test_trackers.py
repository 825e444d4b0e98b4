"""Experiment trackers through accelerate: TensorBoard (default) and Weights & Biases, the real package offline.

What reaches them: the training curves, sample grids as images, and the run's constants (parameter count, world
size, ...) as hyper-parameters, never as one-point curves. A resumed run continues the same W&B run.
"""
import glob
import struct
from pathlib import Path

import pytest

from tests.refusals import refusal

pytestmark = pytest.mark.fashion_mnist
ROOT = Path(__file__).resolve().parents[1]
DIT = ["--config", str(ROOT / "configs/fmnist_dit_siamese.yaml"), "model.kwargs={hidden_size: 32, depth: 2, num_heads: 2}",
       "data.num_workers=0", "train.threads=1", "data.max_samples=32", "optim.batch_size=8", "optim.steps=4",
       "train.log_every=2", "train.sample_every=2", "train.sample_count=2", "train.sample_steps=2",
       "train.ema_decay=0.5", "train.ckpt_every=2"]


def train(out: Path, *extra) -> int:
    """``python -m diffusion.train`` in this process: its exit status (3: paused at ``train.stop_at_step``). A fresh
    accelerate state for each invocation, as a process of its own has."""
    from accelerate.state import AcceleratorState

    from diffusion.train import main

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        main([*DIT, *extra, f"train.output_dir={out}"])
    except SystemExit as stop:
        return stop.code or 0
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return 0


@pytest.fixture
def wandb_offline(monkeypatch):
    """The real package, offline and silent; its service process, started by the first run in this process, is shut
    down after the test (it also clears WANDB_SERVICE, which later processes would otherwise inherit)."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    wandb.teardown()


def wandb_records(run_file: str) -> list:
    """The protobuf records of an offline ``.wandb`` file (its log format: a 7-byte header, then 32 KiB blocks of
    records with a 7-byte header each: checksum, length, kind; kinds 2-4 split a record over blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = Path(run_file).read_bytes(), 32768, 7
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history_and_config(run_dir: Path):
    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config = {}, set()
    for f in files:
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                keys = {item.key or "/".join(item.nested_key) for item in r.history.item}
                history.setdefault(r.history.step.num, set()).update(keys)
            elif kind == "config":
                config.update(item.key or "/".join(item.nested_key) for item in r.config.update)
    return files, history, config


def test_weights_and_biases_offline_gets_curves_grids_and_constants_and_a_resumed_run_continues_it(tmp_path,
                                                                                                    wandb_offline):
    """Paused at step 2 (exit 3), then resumed to step 4: one W&B run id over both invocations, the curves and sample
    grids of both, the constants as config (never as curves), TensorBoard beside it."""
    import wandb

    out = tmp_path / "run"
    assert train(out, "train.trackers=[wandb]", "train.stop_at_step=2") == 3
    assert wandb.run is None  # the paused invocation finished its W&B run
    first_id = (out / ".tracker_run_id").read_text()
    assert train(out, "train.trackers=[wandb]") == 0
    files, history, config = history_and_config(out)
    assert len(files) == 2 and all(first_id in f for f in files)  # two invocations, one W&B run id
    assert {"train/loss", "train/mse", "train/grad_norm"} <= history[2] and "train/loss" in history[4]
    assert any(k.startswith("samples") for k in history[2]) and any(k.startswith("samples") for k in history[4])
    assert {"run/params", "run/world_size", "optim.lr", "model.topology"} <= config
    assert not {"params", "world_size", "examples"} & set().union(*history.values())  # constants are not curves
    assert len(glob.glob(str(out / "wandb" / "offline-run-*" / "files" / "media" / "images" / "samples_*.png"))) == 2

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"images": 0})
    events.Reload()
    assert "train/loss" in events.Tags()["scalars"] and "params" not in events.Tags()["scalars"]
    assert "samples" in events.Tags()["images"] and len(events.Images("samples")) == 2


@pytest.mark.parametrize("trackers, message", [("[nowhere]", "'nowhere' is not one of accelerate's trackers"),
                                               ("[clearml]", "clearml is not installed: pip install clearml")])
def test_an_unknown_or_missing_tracker_is_one_line(tmp_path, capsys, trackers, message):
    from diffusion.train import main

    assert message in refusal(main, [*DIT, f"train.trackers={trackers}", f"train.output_dir={tmp_path}"], capsys)
    assert not (tmp_path / "checkpoints").exists()
