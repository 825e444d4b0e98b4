"""The command-line conventions of common/cli.py: which errors get one line, and who says it.

Only the project's declared input errors (:class:`common.cli.InputError` and its subclasses) end in one ``error:``
line with status 2; a plain ValueError or FileNotFoundError is a bug and keeps its traceback. With several
processes rank 0 says the line; the other ranks exit 2 silently and leave their own message in the launcher's
error file, which torchrun's failure summary prints. Nothing here waits or times anything.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.cli import InputError, InputExit, InputNotFoundError, one_line_errors
from tests.rehearsal import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_the_project_input_errors_are_one_type():
    from common.checkpoint import CheckpointError
    from common.config import ConfigError
    from common.data import ImageFolderError
    from common.durable import DiskWriteError
    from common.logging import NonFiniteLossError
    from common.train_state import RunDirectoryError, RunLockedError
    from common.trainer import ResumeError
    from diffusion.extract_latents import ExtractionError
    from diffusion.latents import LatentsError, VAENotFoundError
    from diffusion.sampling.options import SamplingError

    for kind in (CheckpointError, ConfigError, ImageFolderError, DiskWriteError, NonFiniteLossError, RunDirectoryError,
                 RunLockedError, ResumeError, ExtractionError, LatentsError, VAENotFoundError, SamplingError):
        assert issubclass(kind, InputError), kind
    # what library callers catch still works: an input error is a ValueError, a missing input a FileNotFoundError
    assert issubclass(InputError, ValueError) and issubclass(InputNotFoundError, FileNotFoundError)
    assert issubclass(DiskWriteError, OSError) and issubclass(RunLockedError, RuntimeError)


def test_an_input_error_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        with one_line_errors():
            raise InputNotFoundError("data.path /x does not exist; pass the folder of images")
    assert exit_info.value.code == 2 and isinstance(exit_info.value, InputExit)
    assert capsys.readouterr().err == "error: data.path /x does not exist; pass the folder of images\n"


@pytest.mark.parametrize("bug", [ValueError("a bug"), FileNotFoundError("a bug"), KeyError("a bug")])
def test_anything_else_keeps_its_traceback(bug, capsys):
    with pytest.raises(type(bug)):
        with one_line_errors():
            raise bug
    assert capsys.readouterr().err == ""


def test_an_entry_points_own_error_type_must_be_an_input_error():
    class Mine(RuntimeError):
        pass

    with pytest.raises(TypeError, match="not an InputError subclass"):
        with one_line_errors(Mine):
            pass


def test_rank_0_says_the_line_the_others_leave_it_for_the_launcher(tmp_path, capsys, monkeypatch):
    for rank in ("0", "1"):
        error_file = tmp_path / f"error_{rank}.json"
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        with pytest.raises(SystemExit) as exit_info:
            with one_line_errors():
                raise InputError("optim.batch_size=127 does not split")
        assert exit_info.value.code == 2
        printed = capsys.readouterr().err
        assert printed == ("error: optim.batch_size=127 does not split\n" if rank == "0" else "")
        record = json.loads(error_file.read_text())["message"]
        assert record["message"] == "error: optim.batch_size=127 does not split"
        assert record["extraInfo"]["py_callstack"] == record["message"] + ("" if rank == "0" else " (rank 1)")


def torchrun(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_a_bad_command_line_under_two_processes_is_said_once(tmp_path):
    proc = torchrun("-m", "vision.train", "--config", "configs/fmnist_deit_siamese.yaml", "augment.hflip=2",
                    f"train.output_dir={tmp_path / 'run'}")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode != 0 and len(errors) == 1 and "augment.hflip=2 must lie in [0, 1]" in errors[0], proc.stderr
    usage = torchrun("-m", "diffusion.sample", "--checkpoint", "x.safetensors", "--steps", "many")
    said = [line for line in usage.stderr.splitlines() if line.startswith("python -m diffusion.sample: error")]
    assert usage.stderr.count("usage: python -m diffusion.sample") == 1, usage.stderr
    assert said == ["python -m diffusion.sample: error: argument --steps: invalid int value: 'many'"], usage.stderr


@pytest.mark.fashion_mnist
def test_an_error_only_rank_1_meets_reaches_the_launchers_summary(tmp_path):
    """Rank 1 exits 2 without printing; its message is in torchrun's failure summary, with its rank."""
    proc = torchrun("-m", "tests.faults", "rank1_input", "1", "--", "-m", "vision.train", "--config",
                    "configs/fmnist_deit_siamese.yaml", "data.max_train_samples=16", "data.max_val_samples=8",
                    "optim.batch_size=8", "data.num_workers=0", f"train.output_dir={tmp_path / 'run'}")
    assert proc.returncode != 0
    assert not [line for line in proc.stderr.splitlines() if line.startswith("error")], proc.stderr[-3000:]
    assert "error: only rank 1 meets this input error (tests/faults.py); fix it there (rank 1)" in proc.stderr, \
        proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr
