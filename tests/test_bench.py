"""The benchmark scripts run end to end (no timing assertions: speed belongs in the printed ratios), and the
conditions every figure carries (load, CPU time, threads, workers, the bounding process) are recorded."""
import subprocess
import sys
from types import SimpleNamespace

import pytest

from benchmarks import harness
from benchmarks.step import main

TINY_DEIT = ["--models", "tiny", "--batch-size", "2", "--img-size", "16", "--patch-size", "8"]
TINY_DIT = ["--family", "dit", "--models", "DiT-S/8", "--latent-size", "16", "--num-classes", "10", "--batch-size", "2"]


def test_step_benchmark_deit_reports_every_variant_with_progress(capsys):
    variants = "pre,siamese+recompute_norms,siamese,post"
    results = main(["--rounds", "1", "--warmup", "0", "--topologies", variants, *TINY_DEIT])["tiny"]
    assert set(results) == {"pre", "siamese+recompute_norms", "siamese", "post"}
    assert results["siamese+recompute_norms"]["params"] - results["pre"]["params"] == 19_200
    assert results["siamese"]["params"] == results["siamese+recompute_norms"]["params"]
    # Siamese saves more for backward than Pre-Norm (two streams, six norms per block); storing its norm chain
    # instead of fusing it, more still.
    act = {name: r["activation_mb"] for name, r in results.items()}
    assert act["siamese"] > act["siamese+recompute_norms"] > act["pre"] > 0
    out, err = capsys.readouterr()
    assert "x pre" in out and "siamese" in out and "cpu ms" in out
    assert "siamese+recompute_norms/pre: step time" in out and "saved activations" in out
    assert "pre: ready" in err and "round 1/1" in err and "load " in err  # progress, on stderr, as it goes
    assert "conditions: " in out and len(results["pre"]["conditions"]["round_loads"]) == 1
    assert "warmup_s" in results["pre"]  # the seconds of the warm-up steps (with --compile: the compiling)


def test_step_benchmark_deit_memory_mode(capsys):
    results = main(["--memory", "--topologies", "pre,siamese", *TINY_DEIT])["tiny"]
    assert set(results["siamese"]) == {"float32 eager", "bfloat16 eager"}
    assert results["siamese"]["float32 eager"] > results["pre"]["float32 eager"] > 0
    # bf16 autocast keeps bf16 copies of the activations the matmuls read (the streams stay fp32)
    assert results["pre"]["bfloat16 eager"] < results["pre"]["float32 eager"]
    out, err = capsys.readouterr()
    assert "float32 eager MB" in out and "parameters excluded" in out
    assert "siamese/pre saved activations: float32 eager" in out
    assert "siamese bfloat16 eager" in err


def test_step_benchmark_dit_reports_every_variant(capsys):
    variants = "pre,siamese+recompute_norms,siamese"
    results = main([*TINY_DIT, "--rounds", "1", "--warmup", "0", "--topologies", variants])["DiT-S/8"]
    assert results["siamese"]["params"] - results["pre"]["params"] == 12 * 8 * 384 + 4 * 384
    act = {name: r["activation_mb"] for name, r in results.items()}
    assert act["siamese"] > act["siamese+recompute_norms"] > act["pre"] > 0
    out, err = capsys.readouterr()
    assert "DiT-S/8" in out and "DiT-S/8" in err


def test_step_benchmark_dit_memory_mode(capsys):
    results = main([*TINY_DIT, "--memory", "--topologies", "pre,siamese"])["DiT-S/8"]
    assert results["siamese"]["float32 eager"] > results["pre"]["float32 eager"] > 0
    assert "float32 eager MB" in capsys.readouterr().out


@pytest.mark.fashion_mnist
def test_fid_benchmark_scores_bf16_and_fp32_on_the_same_noise(tmp_path):
    import torch

    from common.checkpoint import save_weights
    from diffusion.evaluation.features import FashionMNISTClassifier
    from diffusion.spec import DiTSpec
    from benchmarks.fid import main as bench_fid

    torch.manual_seed(0)
    weights = save_weights(FashionMNISTClassifier(), tmp_path / "fmnist_cnn.safetensors")
    spec = DiTSpec.published("DiT-S/4", input_size=32, in_channels=1, num_classes=10, autoencoder="none",
                             kwargs={"hidden_size": 32, "depth": 1, "num_heads": 2})
    model = spec.build()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    ckpt = save_weights(model, tmp_path / "ema.safetensors", metadata=spec.metadata())
    with pytest.warns(UserWarning, match="covariance is singular"):
        result = bench_fid(["--bf16-checkpoint", str(ckpt), "--feature-weights", str(weights), "--samples", "12",
                             "--steps", "2", "--batch-size", "6", "--seeds", "0", "1"])
    rows = result["seeds"]
    assert [r["seed"] for r in rows] == [0, 1] and all(r["mean_abs_pixel"] > 0 for r in rows)
    assert rows[0]["difference"] == pytest.approx(rows[0]["fid_bf16"] - rows[0]["fid_fp32"])
    assert result["summary"]["fp32_seed_std"] > 0
def test_floor_pins_pin_every_dependency_to_its_floor():
    from pathlib import Path

    from scripts.floor_pins import ROOT, floor_pins, requirements

    text = (ROOT / "pyproject.toml").read_text()
    pins = floor_pins(text)
    assert len(pins) == len(requirements(text)) and "pytest==8.0" in pins
    assert "torch==2.6" in pins and "pillow==10.1" in pins and "torch-fidelity==0.4" in pins
    assert floor_pins('dependencies = [\n    "a>=1.2, <2",  # note\n    "b>=3; python_version < \'3.12\'",\n]\n') \
        == ["a==1.2", "b==3; python_version < '3.12'"]
    assert Path(ROOT / "Makefile").read_text().count("scripts/floor_pins.py") == 1


def test_fid_benchmark_against_torch_fidelity_runs_both_commands_on_the_same_inputs(tmp_path):
    """What --vs-torch-fidelity computes: the two commands read the same folders and weights, the FIDs are parsed
    from what each prints, and the ratio is of the medians (no timing is asserted)."""
    from benchmarks.fid import fid_commands, ratio_summary, torch_fidelity_fid

    commands = fid_commands(tmp_path / "a", tmp_path / "b", tmp_path / "w.pth", 50, tmp_path / "ours.json")
    ours, theirs = commands["diffusion.fid"], commands["torch-fidelity"]
    for path in ("a", "b", "w.pth"):
        assert str(tmp_path / path) in ours and str(tmp_path / path) in theirs
    assert ours[ours.index("--metrics") + 1] == "fid" and "--fid" in theirs and "--no-cache" in theirs
    assert torch_fidelity_fid("Warning: x\nfrechet_inception_distance: 12.345678\n") == 12.345678
    runs = {"diffusion.fid": [{"seconds": 10.0}, {"seconds": 30.0}, {"seconds": 12.0}],
            "torch-fidelity": [{"seconds": 18.0}, {"seconds": 24.0}, {"seconds": 20.0}]}
    summary = ratio_summary(runs)
    assert summary["median_s"] == {"diffusion.fid": 12.0, "torch-fidelity": 20.0}
    assert summary["torch_fidelity_over_ours"] == pytest.approx(20.0 / 12.0)


def test_every_round_carries_its_load_and_every_call_its_cpu_and_a_loaded_round_is_marked():
    burn = [sys.executable, "-c", "sum(range(2 * 10**6))"]
    runs = harness.alternate({"command": lambda: subprocess.run(burn, check=True), "nothing": lambda: None}, rounds=2)
    assert len(runs.loads) == 2 and all(len(load) == 2 and min(load) >= 0 for load in runs.loads)
    assert all(len(r.load) == 2 for rs in runs.values() for r in rs)
    assert all(r.children_cpu_seconds > 0 for r in runs["command"])  # the command's CPU, counted once it ended
    assert all(r.children_cpu_seconds == 0 for r in runs["nothing"])
    quiet, loaded = harness.conditions(runs, max_load=1e9, threads=1), harness.conditions(runs, max_load=-3, workers=2)
    assert quiet["loaded_rounds"] == [] and loaded["loaded_rounds"] == [1, 2]
    # the bar counts the benchmark's own data workers: a load of 2.5 is quiet for a side with one worker on 2 cores
    assert not harness.is_loaded((1.0, 2.5), 2, workers=1) and harness.is_loaded((1.0, 3.5), 2, workers=1)
    assert harness.is_loaded((1.0, 2.5), 2) and harness.load_note((1.0, 3.5), 2, 1).endswith("LOADED (above 3)")
    assert "above --max-load -3 + its 2 data worker(s)" in harness.describe_conditions(loaded)
    assert set(quiet["sides"]) == {"command", "nothing"} and quiet["sides"]["command"]["children_cpu_s"] > 0
    assert "LOADED" in harness.describe_conditions(loaded) and "2 data worker(s)" in harness.describe_conditions(loaded)
    assert "LOADED" not in harness.describe_conditions(quiet) and "none above --max-load" in \
        harness.describe_conditions(quiet)
    assert harness.load_note(runs.loads[0], -1).endswith("LOADED (above -1)")


def test_the_bound_is_the_busier_process():
    assert harness.bound(10, 9.5, 6, 1)["bound"] == "main process"
    assert harness.bound(10, 4, 9.8, 1)["bound"] == "data worker"
    assert harness.bound(10, 4, 16, 2)["bound"] == "data worker"  # each of two workers 80% busy, the main 40%
    assert harness.bound(10, 4, 0, 0)["bound"] == "main process"  # no workers: the main process loads the data
    assert "bound by the data worker (main process busy 40%" in harness.describe_bound(harness.bound(10, 4, 9, 1))


def fake_run(ends, cpu_per_s, seconds, cpu_total):
    """A trainer run (benchmarks.vs_timm.TrainerRun) whose main process spent ``cpu_per_s`` CPU seconds per second."""
    clock = SimpleNamespace(at=lambda t: (cpu_per_s * t, 0.0), totals=lambda: (cpu_total, 0.0))
    return SimpleNamespace(clock=clock, seconds=seconds)


def test_compile_payback_divides_the_extra_fixed_cost_by_the_saving_per_step():
    from benchmarks.compile_payback import break_even, steady_and_fixed

    # eager: 20 steps of 0.1 s after 3 s of start-up; compiled: 20 steps of 0.05 s after 30 s of start-up and compiling
    eager = steady_and_fixed([3 + 0.1 * i for i in range(1, 21)], fake_run(None, 0.5, 5.0, 2.5), warmup=2)
    compiled = steady_and_fixed([30 + 0.05 * i for i in range(1, 21)], fake_run(None, 0.5, 31.0, 15.5), warmup=2)
    assert eager["step_s"] == pytest.approx(0.1) and compiled["step_s"] == pytest.approx(0.05)
    assert eager["fixed_s"] == pytest.approx(3.0) and compiled["fixed_s"] == pytest.approx(30.0)
    assert break_even(eager, compiled, "") == pytest.approx(27.0 / 0.05)  # 540 steps
    assert break_even(eager, compiled, "cpu_") == pytest.approx((15.0 - 1.5) / 0.025)
    assert break_even(compiled, eager, "") == float("inf")  # slower steps never repay


def test_the_profile_names_the_torch_ops_and_the_python_functions_a_command_spends_its_cpu_in(tmp_path, capsys):
    from benchmarks.cpu_profile import main as profile

    script = tmp_path / "work.py"
    script.write_text("import sys, torch\n\ndef python_loop():\n    total = 0\n    for i in range(300000):\n"
                      "        total += i * i\n    return total\n\n"
                      "x = torch.randn(256, 256)\nfor _ in range(20):\n    x = torch.mm(x, x).tanh()\n"
                      "python_loop()\nassert sys.argv[1:] == ['--flag']\n")
    result = profile(["--script", str(script), "--top", "5", "--", "--flag"])
    assert "aten::mm" in [name for name, _, _ in result["ops"]] and result["cpu_s"] > 0
    assert any("python_loop" in name for name, _, _ in result["functions"])
    out = capsys.readouterr().out
    assert "torch op" in out and "Python function (own time)" in out and "load " in out
