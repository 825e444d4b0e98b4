"""benchmarks.vs_peers without the peers: its --help, its argument errors, the row machinery (alternation,
per-round ratios, CPU and load, medians, the table) on two trivial commands, the peers' flags, and the shim that
runs DiT's and fast-DiT's scripts on a CPU. No timing is asserted."""
import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import vs_peers, vs_timm

ROOT = Path(__file__).resolve().parents[1]


def test_help_names_every_row_and_the_checkouts(capsys):
    with pytest.raises(SystemExit) as exit_:
        vs_peers.parse_args(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert all(name in out for name in (*vs_peers.ROWS, "--dit-repo", "--timm-repo", "--fast-dit-repo", "dit_shim.py",
                                        "--max-load", "--device", "--precision"))


@pytest.mark.parametrize("argv, fragment", [
    (["--rows", "sample,speed"], "--rows speed: choose from sample, evaluate, train, train_dit, fid"),
    (["--rows", "sample"], "row sample needs --dit-repo"),
    (["--rows", "evaluate,train"], "row evaluate, train needs --timm-repo"),
    (["--rows", "train_dit"], "row train_dit needs --fast-dit-repo"),
    (["--rows", "train_dit", "--fast-dit-repo", "/nonexistent"], "no extract_features.py there"),
    (["--rows", "fid", "--train-epochs", "0"], "--train-epochs 0: must be positive"),
    (["--rows", "sample", "--dit-repo", "/nonexistent"], "--dit-repo /nonexistent: no sample.py there"),
    (["--rows", "fid", "--rounds", "0"], "--rounds 0: must be positive"),
    (["--rows", "fid", "--train-warmup", "40"], "--train-warmup 40: must leave at least two"),
])
def test_argument_errors_name_the_problem_and_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        vs_peers.parse_args(argv)
    assert exit_.value.code == 2 and fragment in capsys.readouterr().err


def test_row_alternates_flips_and_reports_per_round_ratios_cpu_and_load(tmp_path, capsys):
    log = tmp_path / "order"
    side = lambda name: [sys.executable, "-c", f"open({str(log)!r}, 'a').write({name!r})"]  # noqa: E731
    env = vs_peers.environment(1, [])
    row = vs_peers.Row("trivial", "peer cmd", "runs/s", vs_peers.command_rate(1, side("o"), env, workers=1),
                       vs_peers.command_rate(1, side("p"), env, workers=1), "python -c ...", workers=1)
    result = vs_peers.measure_row(row, rounds=3, max_load=-2, threads=1)  # every round above the bar: LOADED
    assert log.read_text() == "oppoop"  # ours first, then the order flips every round
    assert len(result["ratios"]) == 3 and all(r > 0 for r in result["ratios"])
    assert result["ratio"] == sorted(result["ratios"])[1]  # the median of the per-round ratios
    assert result["conditions"]["loaded_rounds"] == [1, 2, 3] and result["conditions"]["workers"] == 1
    assert all(run["main_cpu_s"] + run["children_cpu_s"] > 0 for run in result["runs"]["ours"] + result["runs"]["peer"])
    assert result["cpu_s"]["ours"] > 0 and result["bound"]["ours"]["bound"] in ("main process", "data worker")
    assert len(result["cpu_ratios"]) == 3 and result["cpu_ratio"] == sorted(result["cpu_ratios"])[1]
    vs_peers.print_table([result])
    out = capsys.readouterr().out
    assert out.count("trivial round") == 3 and "median of 3 rounds" in out
    assert out.count("LOADED (above -1)") == 3 and "CPU " in out  # -2 + its one data worker
    assert "3 of 3 above --max-load -2 + its 1 data worker(s)" in out
    assert "| measure | peer | ratio (ours/peer) | CPU (peer/ours) | ours | peer | conditions | command |" in out
    assert "CPU seconds, peer cmd over ours: " in out
    assert "| trivial | peer cmd |" in out and "LOADED 3/3" in out


def test_a_quiet_round_is_not_marked():
    side = [sys.executable, "-c", "pass"]
    row = vs_peers.Row("trivial", "peer", "runs/s", vs_peers.command_rate(1, side, vs_peers.environment(1, [])),
                       vs_peers.command_rate(1, side, vs_peers.environment(1, [])), "python -c pass")
    result = vs_peers.measure_row(row, rounds=1, max_load=1e9, threads=1)
    assert result["conditions"]["loaded_rounds"] == [] and "LOADED" not in vs_peers.conditions_cell(result)
    assert result["bound"] == {"ours": None, "peer": None}  # no data workers: no bound to name


def test_bf16_where_both_sides_have_it():
    """On a GPU the trainers and evaluators run under bf16 autocast on both sides, each by its own switch."""
    a = argparse.Namespace(width=64, depth=2, heads=2, batch_size=8, workers=1, threads=1, ours_tree=str(ROOT),
                           epochs=2, device="cuda", precision="bf16")
    timm = vs_timm.timm_command(Path("train.py"), Path("images"), Path("out"), a)
    ours = vs_timm.ours_command(Path("images"), Path("out"), a)
    assert timm[timm.index("--device") + 1] == "cuda" and "--amp" in timm and "bfloat16" in timm
    assert "train.precision=bf16" in ours and "optim.epochs=2" in ours and timm[timm.index("--epochs") + 1] == "2"
    a.precision = "fp32"
    assert "--amp" not in vs_timm.timm_command(Path("train.py"), Path("images"), Path("out"), a)
    assert vs_peers.parse_args(["--rows", "fid", "--device", "cuda"]).precision == "bf16"
    assert vs_peers.parse_args(["--rows", "fid"]).precision == "fp32"


def test_fast_dit_features_are_one_npy_per_latent(tmp_path):
    root = vs_peers.write_fast_dit_features(tmp_path, 3)
    features = sorted((root / "imagenet256_features").iterdir())
    assert len(features) == 3 and np.load(features[0]).shape == (1, 4, 32, 32)
    assert np.load(root / "imagenet256_labels" / "0.npy").shape == (1,)


STUB_TRAIN = """
import torch
from diffusers.models import AutoencoderKL

def elsewhere():
    return torch.cuda.is_available()

def main():
    assert torch.cuda.is_available(), "Training currently requires at least one GPU."
    vae = AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-ema")
    torch.cuda.synchronize()
    print("train.py: asked elsewhere", elsewhere(), "vae", vae.config.latent_channels)

if __name__ == "__main__":
    main()
"""
STUB_SAMPLE = """
import torch

def main():
    print("sample.py: device", "cuda" if torch.cuda.is_available() else "cpu")

if __name__ == "__main__":
    main()
"""


def test_the_shim_runs_the_peers_scripts_on_a_cpu_without_downloads(tmp_path):
    """On a CPU the shim answers True only to train.py's own opening assert, makes torch.cuda.synchronize do
    nothing, and loads the SD VAE from the local folder; sample.py sees no GPU. Its own process: it patches torch."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text(STUB_TRAIN)
    (repo / "sample.py").write_text(STUB_SAMPLE)
    vae = vs_peers.write_sd_vae(tmp_path / "vae")
    outputs, env = {}, vs_peers.environment(1, [])
    for script in ("train.py", "sample.py"):
        done = subprocess.run([sys.executable, str(vs_peers.SHIM), str(repo), str(vae), script, "cpu", "--"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[script] = done.stdout
    assert "train.py: asked elsewhere False vae 4" in outputs["train.py"]
    assert "sample.py: device cpu" in outputs["sample.py"]


def test_row_command_reruns_the_row_with_the_options_given(tmp_path):
    (tmp_path / "sample.py").write_text("")
    a = vs_peers.parse_args(["--rows", "sample,fid", "--dit-repo", str(tmp_path), "--rounds", "3", "--steps", "20"])
    assert vs_peers.row_command(a, "sample") == \
        f"python -m benchmarks.vs_peers --rows sample --dit-repo {tmp_path} --rounds 3 --steps 20"
    assert vs_peers.row_command(a, "fid") == "python -m benchmarks.vs_peers --rows fid --rounds 3 --steps 20"


def test_a_failing_row_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    (tmp_path / "sample.py").write_text("")
    env = vs_peers.environment(1, [])
    ok = [sys.executable, "-c", "pass"]
    broken = [sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"]
    monkeypatch.setitem(vs_peers.BUILDERS, "sample", lambda a, work: vs_peers.Row(
        "broken", "peer", "runs/s", vs_peers.command_rate(1, broken, env), vs_peers.command_rate(1, ok, env), "-"))
    monkeypatch.setitem(vs_peers.BUILDERS, "fid", lambda a, work: vs_peers.Row(
        "fine", "peer", "runs/s", vs_peers.command_rate(1, ok, env), vs_peers.command_rate(1, ok, env), "-"))
    results = vs_peers.main(["--rows", "sample,fid", "--dit-repo", str(tmp_path), "--rounds", "1",
                             "--workdir", str(tmp_path / "work")])
    assert results[0]["row"] == "sample" and "broken" in results[0]["failed"] and results[1]["measure"] == "fine"
    assert "row sample failed: error:" in capsys.readouterr().out
    assert "failed" in (tmp_path / "work" / "vs_peers.json").read_text()


def test_failing_command_stops_with_its_output(tmp_path):
    failing = vs_peers.command_rate(1, [sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"],
                                    vs_peers.environment(1, []))
    with pytest.raises(SystemExit, match=r"failed \(exit 3\)") as exit_:
        failing()
    assert "broken" in str(exit_.value)
