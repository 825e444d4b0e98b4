"""`make demo` (the README's first command) on a few images and steps: the same code, both families, its table,
plot and results file, and the one-seed caveat it prints."""
import json

import pytest
import torch

from common.checkpoint import save_weights
from diffusion.evaluation.features import CACHE_ENV, FMNIST_WEIGHTS_FILE, FashionMNISTClassifier
from scripts.demo import ONE_SEED, main


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
    assert ONE_SEED in out and "docs/results/deit_6seeds" in ONE_SEED
    assert json.loads((tmp_path / "demo" / "results.json").read_text()) == json.loads(json.dumps(rows))
    assert (tmp_path / "demo" / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "demo" / "dit_siamese_grid.png").is_file()
