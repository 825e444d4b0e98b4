"""The benchmark scripts run end to end (no timing assertions: speed belongs in the printed ratios)."""
import pytest

from scripts.bench_block import main

TINY_DEIT = ["--batch-size", "2", "--img-size", "16", "--patch-size", "8"]
TINY_DIT = ["--models", "DiT-S/8", "--latent-size", "16", "--num-classes", "10", "--batch-size", "2"]


def test_bench_block_reports_every_variant_with_progress(capsys):
    variants = "pre,siamese-recompute,siamese-stored,post"
    results = main(["--steps", "1", "--warmup", "0", "--topologies", variants, *TINY_DEIT])
    assert set(results) == {"pre", "siamese-recompute", "siamese-stored", "post"}
    assert results["siamese-recompute"]["params"] - results["pre"]["params"] == 19_200
    assert results["siamese-stored"]["params"] == results["siamese-recompute"]["params"]
    # Siamese saves more for backward than Pre-Norm (two streams, six norms per block); storing its norm chain
    # instead of recomputing it, more still.
    act = {name: r["activation_mb"] for name, r in results.items()}
    assert act["siamese-stored"] > act["siamese-recompute"] > act["pre"] > 0
    out, err = capsys.readouterr()
    assert "x pre" in out and "siamese-stored" in out and "cpu ms" in out
    assert "pre: ready" in err and "round 1/1" in err  # progress, on stderr, as it goes


def test_bench_block_memory_mode(capsys):
    results = main(["--memory", "--topologies", "pre,siamese", *TINY_DEIT])
    assert set(results["siamese"]) == {"float32 eager", "bfloat16 eager"}
    assert results["siamese"]["float32 eager"] > results["pre"]["float32 eager"] > 0
    # bf16 autocast keeps bf16 copies of the activations the matmuls read (the streams stay fp32)
    assert results["pre"]["bfloat16 eager"] < results["pre"]["float32 eager"]
    out, err = capsys.readouterr()
    assert "float32 eager MB" in out and "parameters excluded" in out
    assert "siamese bfloat16 eager" in err


def test_bench_dit_reports_every_variant(capsys):
    from scripts.bench_dit import main as bench_dit

    variants = "pre,siamese-recompute,siamese-stored"
    results = bench_dit([*TINY_DIT, "--steps", "1", "--warmup", "0", "--topologies", variants])["DiT-S/8"]
    assert results["siamese-stored"]["params"] - results["pre"]["params"] == 12 * 8 * 384 + 4 * 384
    act = {name: r["activation_mb"] for name, r in results.items()}
    assert act["siamese-stored"] > act["siamese-recompute"] > act["pre"] > 0
    out, err = capsys.readouterr()
    assert "DiT-S/8" in out and "DiT-S/8" in err


def test_bench_dit_memory_mode(capsys):
    from scripts.bench_dit import main as bench_dit

    results = bench_dit([*TINY_DIT, "--memory", "--topologies", "pre,siamese"])["DiT-S/8"]
    assert results["siamese"]["float32 eager"] > results["pre"]["float32 eager"] > 0
    assert "float32 eager MB" in capsys.readouterr().out


BEFORE_HOT_PATH = "08f319b"  # the revision before boxes-only erasing and the cached EMA lists


def test_bench_hot_path_compares_against_an_earlier_revision(capsys):
    import subprocess

    from scripts.bench_hot_path import ROOT, main as bench_hot_path

    if subprocess.run(["git", "cat-file", "-e", f"{BEFORE_HOT_PATH}^{{commit}}"], cwd=ROOT).returncode:
        pytest.skip(f"this checkout's history lacks {BEFORE_HOT_PATH}")
    # the outputs of both revisions are checked equal inside, before any timing
    results = bench_hot_path(["--before", BEFORE_HOT_PATH, "--rounds", "1", "--batch-size", "8", "--ema-width", "24"])
    assert results["erase"]["CUDA path before / now"] > 0 and results["ema"]["before / now"] > 0
    assert results["ema"]["lerped tensors"] == 232  # DiT-B/2 SiameseNorm's floating-point tensors
    assert "erase (batch 8" in capsys.readouterr().out


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
