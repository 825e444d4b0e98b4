"""Start-up: every public entry point answers ``--help`` and refuses a bad command line before it imports anything
heavy (timm, torchvision, diffusers, accelerate, torch-fidelity, scipy) or loads anything.

Structural, never timed: ``python -X importtime`` lists every module a command imported. The times themselves are
``python -m benchmarks.startup``'s (its own test is at the end: what it computes and prints).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import startup

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    """``python -X importtime ARGS`` as a user runs it (the project on the path, not installed)."""
    return subprocess.run([sys.executable, "-X", "importtime", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def imported(proc: subprocess.CompletedProcess) -> set:
    """The top-level packages a process imported, from its ``-X importtime`` lines."""
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)\s*$", proc.stderr, flags=re.M)
    return {name.split(".")[0] for name in names}


def messages(proc: subprocess.CompletedProcess) -> list:
    return [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("import time:")]


# settings each --help must list with their valid values (the declarative ranges of the config dataclasses)
LISTED = {
    "vision.train": ["data.input_size (int >= 1, 224)", "model.drop_path (float in [0, 1), 0.0)",
                     "augment.hflip (float in [0, 1], 0.5)", "augment.mixup (float >= 0, 0.0)",
                     "train.keep_last (int >= 2, 2)"],
    "diffusion.train": ["model.class_dropout_prob (float in [0, 1), required)", "optim.lr (float > 0, required)",
                        "train.fid_samples (int >= 2, required)", "data.num_workers (int >= 0 or auto, auto)"],
    "vision.evaluate": ["batch_size (int >= 1, 256)", "data.crop_pct (float in (0, 1], 0.875)"],
}


@pytest.mark.parametrize("entry_point", startup.ENTRY_POINTS)
def test_help_and_an_argument_error_import_nothing_heavy(entry_point):
    shown = run("-m", entry_point, "--help")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "common" in imported(shown)  # the project's code ran and importtime is read
    assert not imported(shown) & set(startup.HEAVY), sorted(imported(shown) & set(startup.HEAVY))
    for entry in LISTED.get(entry_point, ()):
        assert entry in shown.stdout, entry
    refused = run("-m", entry_point, *startup.ARGUMENT_ERRORS[entry_point])
    lines = messages(refused)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr and [line for line in lines if "error" in line], lines
    assert not imported(refused) & set(startup.HEAVY), sorted(imported(refused) & set(startup.HEAVY))


def test_help_texts_name_what_the_libraries_offer():
    """The sampler's and the scorer's --help name choices that live in heavy modules; they must match those."""
    from diffusion.evaluation.evaluator import METRICS
    from diffusion.evaluation.metrics import ADM_IS_SPLIT_SIZE
    from diffusion.evaluation.reference import ADM_REFERENCE_IMAGES
    from diffusion.models import DIT_TOPOLOGIES, DiT_models

    sample_help = run("-m", "diffusion.sample", "--help").stdout
    assert all(t in sample_help for t in DIT_TOPOLOGIES)
    sizes = {name.split("-")[1] for name in DiT_models}
    assert "DiT-{S,B,L,XL}/{2,4,8}" in sample_help and sizes == {"S/2", "S/4", "S/8", "B/2", "B/4", "B/8", "L/2", "L/4",
                                                                  "L/8", "XL/2", "XL/4", "XL/8"}
    fid_help = " ".join(run("-m", "diffusion.fid", "--help").stdout.split())
    assert f"from {','.join(METRICS)}" in fid_help
    assert f"ADM's {ADM_IS_SPLIT_SIZE}" in fid_help and f"ADM's {ADM_REFERENCE_IMAGES}" in fid_help


def test_bad_sample_labels_are_refused_before_the_weights_load(tmp_path):
    """The class count comes from the checkpoint's header: the labels are refused before the model (timm) or its
    weights are loaded; the weights here would not even fit a DiT."""
    checkpoint = tmp_path / "ema.safetensors"
    save_file({"w": torch.zeros(4)}, str(checkpoint), metadata={"model": "DiT-S/4", "num_classes": "10"})
    for labels, message in (("3,12", "--labels [12] are outside [0, 10)"), ("3,cat", "--labels '3,cat'")):
        proc = run("-m", "diffusion.sample", "--checkpoint", str(checkpoint), "--grid", str(tmp_path / "g.png"),
                   "--labels", labels)
        errors = [line for line in messages(proc) if line.startswith("error")]
        assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
        assert not imported(proc) & set(startup.HEAVY)


@pytest.mark.parametrize("trainer", sorted(startup.FIRST_LINE))
def test_a_trainer_says_what_starts_before_it_loads_the_libraries(trainer, tmp_path):
    """A run's first line comes once its command line is checked, before timm or accelerate are imported: in the
    one stream of its output (importtime's lines and the line, in the order they were written)."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", trainer, *startup.FIRST_LINE[trainer],
                             f"train.output_dir={tmp_path / 'run'}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    before = []
    try:
        for line in proc.stdout:
            if not line.startswith("import time:"):
                break
            before.append(line)
    finally:
        proc.kill()
        proc.communicate()
    assert line.startswith(f"{trainer}: {tmp_path / 'run'}: loading the libraries"), line
    loaded = imported(subprocess.CompletedProcess([], 0, "", "".join(before)))
    assert "torch" in loaded and not loaded & set(startup.HEAVY), sorted(loaded & set(startup.HEAVY))


def test_import_vision_still_registers_the_deits():
    """Python users: ``import vision`` (before or after timm) registers the DeiTs; its names load."""
    code = ("import vision, timm; a = timm.is_model('deit_small_post_patch16_224'); "
            "b = vision.SiameseNormVisionTransformer.__name__ == 'SiameseNormVisionTransformer'; print(a and b)")
    for program in (code, code.replace("import vision, timm", "import timm, vision")):
        proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.stdout.strip() == "True", proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------- the benchmark

def test_the_benchmark_takes_medians_and_ratios_to_the_bare_import():
    rows = startup.summarise({"bare": [2.0, 1.0, 4.0], "x --help": [3.0, 9.0, 1.0], "x error": [2.5]})
    assert [(r["what"], r["median_s"], r["ratio"], r["runs"]) for r in rows] == [
        ("bare", 2.0, 1.0, 3), ("x --help", 3.0, 1.5, 3), ("x error", 2.5, 1.25, 1)]
    text = startup.table(rows, {"x --help": {0}, "x error": {2}})
    assert "python -c 'import torch'" in text and "> 1.5x" not in text
    assert "> 1.5x" in startup.table(startup.summarise({"bare": [1.0], "y --help": [1.6]}), {})


def test_the_benchmark_runs_and_prints_a_row_per_command(capsys):
    rows = startup.main(["--repeats", "1", "--only", "scripts.demo", "--no-first-line"])
    assert [r["what"] for r in rows] == ["bare", "scripts.demo --help", "scripts.demo error"]
    assert all(r["runs"] == 1 and r["median_s"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "median of 1 alternating rounds" in out and "scripts.demo error" in out and out.count("\n") >= 5
    assert re.search(r"scripts\.demo error\s+[\d.]+\s+[\d.]+\s+2\b", out), out
