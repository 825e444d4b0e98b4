"""make gpu-check: a clear error without a GPU, and the same code run on tiny models on the CPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import gpu_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_stops_with_a_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--out", str(tmp_path / "x.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "make gpu-check measures a CUDA GPU, and this machine has none" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.json").exists()


def test_tiny_run_on_the_cpu_writes_every_figure(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "gpu_check.json"
    results = gpu_check.main(["--allow-cpu", "--tiny", "--skip-compile", "--out", str(out)])
    assert json.loads(out.read_text()).keys() == results.keys() >= {"step_time", "host_syncs", "data_feed", "sampling"}
    for label, r in results["step_time"].items():
        assert r["siamese/pre time"] > 0 and r["siamese/pre activations"] > 1.0, label
    assert {r["project host reads per step"] for r in results["host_syncs"].values()} == {0}
    assert results["data_feed"]["images_per_s"] > 0 and results["sampling"]["fid50k_minutes_one_gpu"] > 0
