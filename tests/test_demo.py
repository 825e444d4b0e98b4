"""`make demo` (the README's first command) on a few images and steps: the same code, both families, its table,
plot and results file, and the one-seed caveat it prints."""
import json
import math
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.stats import t

from common.checkpoint import save_weights
from common.logging import read_metrics
from common.preemption import EXIT_PREEMPTED
from diffusion.evaluation.features import CACHE_ENV, FMNIST_WEIGHTS_FILE, FashionMNISTClassifier
from scripts.demo import RESULTS, main, one_seed_note

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.fashion_mnist
def test_the_demo_trains_both_families_and_says_what_one_seed_shows(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    torch.manual_seed(0)
    (tmp_path / "cache").mkdir()
    save_weights(FashionMNISTClassifier(), tmp_path / "cache" / FMNIST_WEIGHTS_FILE)  # a cached classifier
    with pytest.warns(UserWarning, match="covariance is singular"):  # 10 samples for 128-d features
        rows = main(["--train-images", "128", "--epochs", "1", "--dit-steps", "2", "--fid-samples", "10",
                     "--sample-steps", "2", "--out", str(tmp_path / "demo")])
    assert [(r["family"], r["topology"]) for r in rows] == [("DeiT", "pre"), ("DeiT", "siamese"), ("DiT", "pre"),
                                                             ("DiT", "siamese")]
    assert all(r["value"] == r["value"] and r["params"] > 0 for r in rows)  # finite Top-1 and distances
    out = capsys.readouterr().out
    note = one_seed_note()
    assert note in out and "docs/results/deit_6seeds" in note
    assert json.loads((tmp_path / "demo" / "results.json").read_text()) == json.loads(json.dumps(rows))
    assert (tmp_path / "demo" / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "demo" / "dit_siamese_grid.png").is_file()


def summary_figures(results) -> list:
    """The figures the demo's note should print, computed here from the summaries: SiameseNorm - Pre-Norm per seed."""
    def diffs(study, depth):
        rows = {r["topology"]: r["values"] for r in json.loads((results / study / "summary.json").read_text())
                if r["depth"] == depth}
        return [s - p for s, p in zip(rows["siamese"], rows["pre"])]

    def interval(d):
        return statistics.fmean(d), t.ppf(0.975, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))

    (deit, deit_half), (dit, dit_half) = interval(diffs("deit_6seeds", 6)), interval(diffs("dit_1500", 4))
    deep, long = diffs("deit_depth", 12) + diffs("deit_depth", 24), diffs("dit_long", 8)
    return [f"was {deit:+.2f} Top-1 (95% interval +-{deit_half:.2f}; docs/results/deit_6seeds)",
            f"it was {dit:+.0f} in Frechet distance (+-{dit_half:.0f}; docs/results/dit_1500)",
            f"({statistics.fmean(deep):+.1f} Top-1 on average; SiameseNorm ahead in {sum(d > 0 for d in deep)} of 12 pairs)",
            f"({statistics.fmean(long):+.0f} in distance; lower in {sum(d < 0 for d in long)} of 6 pairs)"]


def test_the_one_seed_note_prints_the_figures_of_the_reports_summaries(tmp_path):
    note = " ".join(one_seed_note().split())
    for figure in summary_figures(RESULTS):
        assert figure in note
    for study in ("deit_6seeds", "dit_1500", "deit_depth", "dit_long"):  # a changed summary changes the note
        (tmp_path / study).mkdir()
        rows = json.loads((RESULTS / study / "summary.json").read_text())
        for row in rows:
            row["values"] = [v + (1.5 if (study, row["topology"]) == ("deit_6seeds", "siamese") else 0.0)
                             for v in row["values"]]
        (tmp_path / study / "summary.json").write_text(json.dumps(rows))
    note = " ".join(one_seed_note(tmp_path).split())
    for figure in summary_figures(tmp_path):
        assert figure in note
    assert "was +1.46 Top-1" in note


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def lines_until(proc, start: str) -> list:
    """The demo's stdout, read as it prints it, up to the first line that starts with ``start``."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(start):
            return seen
    raise AssertionError(f"no line starting {start!r}: {''.join(seen)[-3000:]} {proc.stderr.read()[-3000:]}")


def stop_lines(out: str, err: str) -> list:
    return [line for line in (out + err).splitlines() if "received" in line]


@pytest.mark.fashion_mnist
def test_a_stopped_demo_says_how_to_continue_in_one_line_and_the_same_command_continues(tmp_path, capsys):
    """A real SIGTERM to the demo as its second part starts, then Ctrl-C (SIGINT to the whole process group, its data
    workers too) as its third starts: each ends with one line naming the part and exit 4 (the training, just set up,
    checkpoints its first step), and the same command keeps the finished part, continues the stopped ones from their
    checkpoints and finishes."""
    out = tmp_path / "demo"
    args = ["--families", "deit", "--topologies", "pre", "siamese", "post", "--train-images", "256", "--val-images",
            "100", "--epochs", "1", "--out", str(out)]
    demo = [sys.executable, "-m", "scripts.demo", *args]
    proc = subprocess.Popen(demo, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines_until(proc, "DeiT siamese (2 of 3): ")
    proc.send_signal(signal.SIGTERM)  # as a scheduler does
    said, err = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_PREEMPTED and "Traceback" not in err, err[-3000:]
    assert stop_lines(said, err) == ["DeiT siamese (2 of 3): SIGTERM received: stopped at step 1 with a checkpoint "
                                     "(exit 4); run the same command to continue"], said[-2000:]
    pre_weights = (out / "deit_pre" / "model.safetensors").stat().st_mtime_ns

    proc = subprocess.Popen(demo, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    before = lines_until(proc, "DeiT post (3 of 3): ")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
    said, err = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_PREEMPTED and "Traceback" not in err, err[-3000:]
    assert f"DeiT pre (1 of 3): finished before, kept ({out / 'deit_pre'})\n" in before
    assert stop_lines(said, err) == ["DeiT post (3 of 3): SIGINT received: stopped at step 1 with a checkpoint "
                                     "(exit 4); run the same command to continue"], said[-2000:]

    rows = main(args)  # the same command, to the end
    assert [r["topology"] for r in rows] == ["pre", "siamese", "post"] and all(r["value"] == r["value"] for r in rows)
    assert (out / "deit_pre" / "model.safetensors").stat().st_mtime_ns == pre_weights  # never trained again
    assert rows[0]["wall_s"] > 0 and rows[2]["wall_s"] is None  # a continued part has no wall time of its own
    for part in ("deit_siamese", "deit_post"):  # each continued from its step-1 checkpoint to its last step, 2
        records = read_metrics(out / part)
        assert [r["from"].rsplit("/", 1)[1] for r in records if r.get("event") == "resumed"] == ["step_000000001.pt"]
        assert [r["step"] for r in records if "train/loss" in r] == [2], part
    assert "--" in capsys.readouterr().out.split("wall s")[1].splitlines()[3]  # the table says so


def test_a_part_made_with_other_options_is_refused_naming_them(tmp_path, capsys):
    from tests.refusals import refusal

    (tmp_path / "deit_pre").mkdir()
    (tmp_path / "deit_pre" / "demo_settings.json").write_text(json.dumps(
        {"--train-images": 256, "--epochs": 1, "--val-images": None}))  # what a first `make demo` wrote
    line = refusal(main, ["--families", "deit", "--epochs", "2", "--train-images", "256", "--out", tmp_path], capsys)
    assert line == (f"error: {tmp_path / 'deit_pre'} was made with other settings (--epochs: 1 then, 2 now); rerun "
                    f"with those, or pass another --out (or delete {tmp_path / 'deit_pre'} to redo this part)"), line
