"""What a first try of a documented command meets when something is missing or misspelt: one line naming the problem
and the fix (the option to set, the file to pass), never a number from no weights, a traceback or a silent export.
Each command runs as its entry point's ``main(argv)`` in this process (``tests/refusals.py``)."""
from pathlib import Path

import pytest

from common.config import load_config, save_config
from tests.refusals import refusal

ROOT = Path(__file__).resolve().parents[1]


def deit_run_folder(run: Path, *files: str) -> Path:
    """A vision.train run folder as the evaluator reads it: its config.yaml, and ``files`` (empty: never read)."""
    from vision.train import TrainConfig

    run.mkdir(parents=True, exist_ok=True)
    save_config(load_config(TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml", [f"train.output_dir={run}"]),
                run / "config.yaml")
    for name in files:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).touch()
    return run


def test_an_evaluation_without_weights_is_refused_naming_the_runs_weights_files(tmp_path, capsys):
    from vision.evaluate import main

    run = deit_run_folder(tmp_path / "run")
    line = refusal(main, ["--config", run / "config.yaml"], capsys)
    assert line.startswith("error: no weights to evaluate: without checkpoint= (and model.pretrained=false) the model "
                           "would be scored at its random initialisation; pass checkpoint=FILE"), line
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step_000000004.pt").touch()  # an unfinished run: its newest checkpoint
    line = refusal(main, ["--config", run / "config.yaml"], capsys)
    assert line.endswith(f"pass checkpoint={run / 'checkpoints' / 'step_000000004.pt'} (the unfinished run's newest "
                         "checkpoint)"), line
    for name in ("model.safetensors", "ema.safetensors"):
        (run / name).touch()
    line = refusal(main, ["--config", run / "config.yaml"], capsys)
    assert line.endswith(f"pass checkpoint={run / 'model.safetensors'} or checkpoint={run / 'ema.safetensors'} (the "
                         "run's final weights, raw or EMA)"), line
    # a config copied elsewhere: the run is found by its train.output_dir
    (tmp_path / "copy.yaml").write_text((run / "config.yaml").read_text())
    assert f"checkpoint={run / 'model.safetensors'}" in refusal(main, ["--config", tmp_path / "copy.yaml"], capsys)
