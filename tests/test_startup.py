"""Start-up: every public entry point answers ``--help`` and refuses a bad command line before it imports anything
heavy (timm, torchvision, diffusers, accelerate, torch-fidelity, scipy, datasets, webdataset) or loads anything.

Structural, never timed: the modules a command loaded (``sys.modules`` after it ran as ``python -m`` runs it, and
``python -X importtime`` for a trainer's first line). The times themselves are ``python -m benchmarks.startup``'s
(its own test is at the end: what it computes and prints).
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
# what a --help or a refused command line must not import: the libraries a command loads only once it works
HEAVY = ("timm", "torchvision", "diffusers", "accelerate", "torch_fidelity", "scipy", "datasets", "pyarrow",
         "webdataset")


def imported(importtime_lines: str) -> set:
    """The top-level packages a process imported, from its ``-X importtime`` lines."""
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)\s*$", importtime_lines, flags=re.M)
    return {name.split(".")[0] for name in names}


# settings each --help must list with their valid values (the declarative ranges of the config dataclasses)
LISTED = {
    "vision.train": ["data.input_size (int >= 1, 224)", "model.drop_path (float in [0, 1), 0.0)",
                     "augment.hflip (float in [0, 1], 0.5)", "augment.mixup (float >= 0, 0.0)",
                     "train.keep_last (int >= 2, 2)"],
    "diffusion.train": ["model.class_dropout_prob (float in [0, 1), required)", "optim.lr (float > 0, required)",
                        "train.fid_samples (int >= 2, required)", "data.num_workers (int >= 0 or auto, auto)"],
    "vision.evaluate": ["batch_size (int >= 1, 256)", "data.crop_pct (float in (0, 1], 0.875)"],
}


# Every entry point's --help and refused command line (and the sampler's refused labels), one after another in one
# interpreter: each runs as ``python -m`` runs it (runpy, ``__main__``), and the heavy packages loaded so far are read
# after each. Loaded modules stay loaded, which hides nothing: a heavy package is reported by the first command that
# loads it. One interpreter start instead of two dozen; the trainers' first-line tests below start real
# ``python -X importtime`` processes.
PROBE = r"""
import contextlib, io, json, runpy, sys
import torch  # every command imports it; the heavy packages are the ones it must not load yet
heavy, results = set(json.loads(sys.argv[1])), {}
for name, (entry, args) in json.loads(sys.argv[2]).items():
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["-m", *args]  # as `python -m` sets it while it imports the module's packages
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(entry, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    loaded = {module.split(".")[0] for module in sys.modules}
    results[name] = {"code": code, "out": out.getvalue(), "err": err.getvalue(), "heavy": sorted(loaded & heavy),
                     "common": "common" in loaded}
print(json.dumps(results))
"""
LABELS = {"3,12": "--labels [12] are outside [0, 10)", "3,cat": "--labels '3,cat'"}


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """What each command printed, returned and loaded: ``"<entry point> help"``, ``"<entry point> error"``, and
    ``"labels <labels>"`` (diffusion.sample with a checkpoint header of 10 classes whose weights fit no DiT)."""
    import json

    checkpoint = tmp_path_factory.mktemp("startup") / "ema.safetensors"
    save_file({"w": torch.zeros(4)}, str(checkpoint), metadata={"model": "DiT-S/4", "num_classes": "10"})
    todo = {}
    for entry, error_args in startup.ARGUMENT_ERRORS.items():
        todo[f"{entry} help"], todo[f"{entry} error"] = (entry, ["--help"]), (entry, error_args)
    for labels in LABELS:
        todo[f"labels {labels}"] = ("diffusion.sample", ["--checkpoint", str(checkpoint), "--grid",
                                                         str(checkpoint.with_name("g.png")), "--labels", labels])
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(HEAVY), json.dumps(todo)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("entry_point", startup.ENTRY_POINTS)
def test_help_and_an_argument_error_import_nothing_heavy(commands, entry_point):
    shown = commands[f"{entry_point} help"]
    assert shown["code"] == 0 and shown["common"], shown["err"][-3000:]  # the project's code ran
    assert shown["heavy"] == [], shown["heavy"]
    for entry in LISTED.get(entry_point, ()):
        assert entry in shown["out"], entry
    refused = commands[f"{entry_point} error"]
    lines = [line for line in refused["err"].splitlines() if line.strip()]
    assert refused["code"] == 2, refused["err"][-3000:]
    assert "Traceback" not in refused["err"] and [line for line in lines if "error" in line], lines
    assert refused["heavy"] == [], refused["heavy"]


def test_help_texts_name_what_the_libraries_offer(commands):
    """The sampler's and the scorer's --help name choices that live in heavy modules; they must match those."""
    from diffusion.evaluation.evaluator import METRICS
    from diffusion.evaluation.metrics import ADM_IS_SPLIT_SIZE
    from diffusion.evaluation.reference import ADM_REFERENCE_IMAGES
    from diffusion.models import DIT_TOPOLOGIES, DiT_models

    sample_help = commands["diffusion.sample help"]["out"]
    assert all(t in sample_help for t in DIT_TOPOLOGIES)
    sizes = {name.split("-")[1] for name in DiT_models if name.startswith("DiT-")}
    assert "DiT-{S,B,L,XL}/{2,4,8}" in sample_help and sizes == {"S/2", "S/4", "S/8", "B/2", "B/4", "B/8", "L/2", "L/4",
                                                                  "L/8", "XL/2", "XL/4", "XL/8"}
    lightning = {name.split("-")[1] for name in DiT_models if name.startswith("LightningDiT-")}
    assert "LightningDiT-{B,L,XL,1p0B,1p6B}/{1,2}" in " ".join(sample_help.split())
    assert lightning == {f"{s}/{p}" for s in ("B", "L", "XL", "1p0B", "1p6B") for p in (1, 2)}
    fid_help = " ".join(commands["diffusion.fid help"]["out"].split())
    assert f"from {','.join(METRICS)}" in fid_help
    assert f"ADM's {ADM_IS_SPLIT_SIZE}" in fid_help and f"ADM's {ADM_REFERENCE_IMAGES}" in fid_help


@pytest.mark.parametrize("labels", sorted(LABELS))
def test_bad_sample_labels_are_refused_before_the_weights_load(commands, labels):
    """The class count comes from the checkpoint's header: the labels are refused before the model (timm) or its
    weights are loaded; the weights here would not even fit a DiT."""
    refused = commands[f"labels {labels}"]
    errors = [line for line in refused["err"].splitlines() if line.startswith("error")]
    assert refused["code"] == 2 and len(errors) == 1 and LABELS[labels] in errors[0], refused["err"][-2000:]
    assert refused["heavy"] == []


@pytest.mark.parametrize("trainer", sorted(startup.FIRST_LINE))
def test_a_trainer_says_what_starts_before_it_loads_the_libraries(trainer, tmp_path):
    """A run's first line comes once its command line is checked, before timm or accelerate are imported: in the
    one stream of its output (importtime's lines and the line, in the order they were written)."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", trainer, *startup.FIRST_LINE[trainer],
                             f"train.output_dir={tmp_path / 'run'}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
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
    loaded = imported("".join(before))
    assert "torch" in loaded and not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


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
