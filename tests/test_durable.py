"""common.durable: a write either completes (flushed, renamed, directory flushed) or leaves the old file alone."""
import os

import pytest

import common.durable as durable
from common.checkpoint import save_weights
from common.config import save_config
from common.train_state import atomic_torch_save


def test_atomic_write_replaces_only_complete_content(tmp_path):
    target = tmp_path / "sub" / "file.txt"
    durable.atomic_write_text(target, "old")
    assert target.read_text() == "old"
    with pytest.raises(RuntimeError, match="killed"):
        with durable.atomic_write(target) as tmp:
            tmp.write_text("half of the new")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.txt"]  # the temporary file is gone
    with durable.atomic_write(target) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"


def test_every_durable_writer_fsyncs_file_and_directory(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(durable.os, "fsync", lambda fd: (calls.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    import dataclasses

    import torch

    @dataclasses.dataclass
    class Cfg:
        lr: float = 0.1

    for write, name in ((lambda p: durable.atomic_write_text(p, "x"), "a.txt"),
                        (lambda p: save_config(Cfg(), p), "config.yaml"),
                        (lambda p: save_weights(torch.nn.Linear(2, 2), p), "w.safetensors"),
                        (lambda p: atomic_torch_save({"step": 1}, p), "step_000000001.pt")):
        calls.clear()
        write(tmp_path / "d" / name)
        assert calls == [str(tmp_path / "d" / (name + ".tmp")), str(tmp_path / "d")], name
        assert (tmp_path / "d" / name).is_file() and not (tmp_path / "d" / (name + ".tmp")).exists()
