"""`make demo` (the README's first command) on a few images and steps: the same code, both families, its table,
plot and results file, and the one-seed caveat it prints."""
import json
import math
import statistics

import pytest
import torch
from scipy.stats import t

from common.checkpoint import save_weights
from diffusion.evaluation.features import CACHE_ENV, FMNIST_WEIGHTS_FILE, FashionMNISTClassifier
from scripts.demo import RESULTS, main, one_seed_note


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
