"""python -m diffusion.fid end to end, offline, with an Inception-v3 state dict built here.

The weights are random (the real ones cannot be downloaded here) but the architecture and key names are
torch-fidelity's ``inception-v3-compat`` (torchvision's Inception-v3 with 1008 classes has the same state dict),
and the file is loaded through the same option a user passes. FID on the 64-d first pooled layer keeps the
Inception forward and the matrix square roots cheap on CPU; the code path is the same as for layer 2048.
"""
import json
import shutil

import numpy as np
import pytest
import torch
import torch_fidelity
from PIL import Image

from common.feature_extractors import INCEPTION_WEIGHTS_FILE
from common.metrics import FeatureStatistics, read_sampling_protocol
from diffusion import fid as fid_cli
from tests.rehearsal import write_random_inception

LAYER = "64"
# A handful of images for 64-d features: singular covariances are expected here (and warned about).
pytestmark = [pytest.mark.filterwarnings("ignore:.*covariance is singular:UserWarning"),
              pytest.mark.filterwarnings("ignore::scipy.linalg.LinAlgWarning")]


@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory):
    """torch-fidelity's Inception-v3 layout with seeded random weights, as a .pth file."""
    return write_random_inception(tmp_path_factory.mktemp("inception") / INCEPTION_WEIGHTS_FILE)


def write_folder(path, seed, n=6, size=32, smooth=False):
    """``n`` PNGs: uniform noise, or smooth colour gradients (a clearly different distribution)."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        if smooth:
            ramp = np.linspace(0, 1, size)
            img = (np.outer(ramp, ramp)[..., None] * rng.uniform(80, 255, 3)).astype(np.uint8)
        else:
            img = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(img).save(path / f"{i:04d}.png")
    return path


def run_cli(*args):
    return fid_cli.main([*map(str, args), "--device", "cpu", "--num-workers", "0", "--quiet", "--batch-size", "8"])


def test_adm_statistics_path_equals_torch_fidelity(tmp_path, inception_weights):
    samples = write_folder(tmp_path / "samples", seed=0)
    reference = write_folder(tmp_path / "reference", seed=1, smooth=True)
    theirs = torch_fidelity.calculate_metrics(
        input1=str(samples), input2=str(reference), fid=True, feature_layer_fid=LAYER, cuda=False, cache=False,
        verbose=False, save_cpu_ram=True, batch_size=8, feature_extractor_weights_path=str(inception_weights),
    )["frechet_inception_distance"]

    out = run_cli("--samples", reference, "--save-stats", tmp_path / "ref_stats.npz",
                  "--extractor-weights", inception_weights, "--feature-layer", LAYER)
    assert out["count"] == 6 and out["dim"] == 64
    ours_stats = FeatureStatistics.load(tmp_path / "ref_stats.npz")
    # an ADM-style reference file: nothing but mu and sigma
    np.savez(tmp_path / "adm_ref.npz", mu=ours_stats.mu, sigma=ours_stats.sigma)
    result = run_cli("--samples", samples, "--reference", tmp_path / "adm_ref.npz", "--out", tmp_path / "fid.json",
                     "--inception-weights", inception_weights, "--feature-layer", LAYER, "--num-samples", 6)
    assert theirs > 1.0
    assert result["metrics"]["fid"] == pytest.approx(theirs, rel=1e-5)
    saved = json.loads((tmp_path / "fid.json").read_text())
    assert saved["metrics"] == result["metrics"]
    protocol = saved["protocol"]
    assert protocol["samples"]["count"] == 6 and protocol["feature_extractor"] == "inception-v3-compat"
    assert protocol["feature_layer"] == LAYER and protocol["extractor_weights"] == str(inception_weights)
    assert protocol["reference"]["statistics"]["dim"] == 64
    # folder vs folder (reference features computed here) gives the same number
    direct = run_cli("--samples", samples, "--reference", reference, "--extractor-weights", inception_weights,
                     "--feature-layer", LAYER)
    assert direct["metrics"]["fid"] == pytest.approx(theirs, rel=1e-5)


def test_inception_weights_from_torch_fidelity_cache_or_clear_error(tmp_path, monkeypatch, inception_weights):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    cached = tmp_path / "torch_home" / "hub" / "checkpoints" / INCEPTION_WEIGHTS_FILE
    samples = write_folder(tmp_path / "samples", seed=0, n=4, size=16)
    args = ("--samples", samples, "--reference", samples, "--feature-layer", LAYER)
    with pytest.raises(SystemExit, match=f"Inception-v3 weights not found at {cached}.*--extractor-weights"):
        run_cli(*args)
    cached.parent.mkdir(parents=True)
    shutil.copy(inception_weights, cached)
    result = run_cli(*args)
    assert result["protocol"]["extractor_weights"] == str(cached)
    assert result["metrics"]["fid"] == pytest.approx(0.0, abs=1e-3)


def test_cli_reports_bad_inputs(tmp_path, inception_weights):
    samples = write_folder(tmp_path / "samples", seed=0, n=3, size=16)
    with pytest.raises(SystemExit, match="does not exist"):
        run_cli("--samples", samples, "--reference", samples, "--extractor-weights", tmp_path / "nope.pth")
    torch.save({"fc.weight": torch.zeros(10, 2048)}, tmp_path / "wrong.pth")
    with pytest.raises(SystemExit, match="not torch-fidelity's Inception-v3"):
        run_cli("--samples", samples, "--reference", samples, "--extractor-weights", tmp_path / "wrong.pth")
    common = ("--extractor-weights", inception_weights, "--feature-layer", LAYER)
    with pytest.raises(SystemExit, match="holds 3 images but 50000 were expected"):
        run_cli("--samples", samples, "--reference", samples, "--num-samples", 50000, *common)
    np.savez(tmp_path / "stats2048.npz", mu=np.zeros(2048), sigma=np.eye(2048))  # ADM-like, wrong layer here
    with pytest.raises(SystemExit, match="2048-d statistics but inception-v3-compat layer 64 gives 64-d"):
        run_cli("--samples", samples, "--reference", tmp_path / "stats2048.npz", *common)
    np.savez(tmp_path / "nan.npz", arr_0=np.zeros((3, 16, 16, 3), np.float32) * np.nan)
    with pytest.raises(SystemExit, match="dtype float32"):
        run_cli("--samples", tmp_path / "nan.npz", "--reference", samples, *common)
    with pytest.raises(SystemExit, match="need a reference"):
        run_cli("--samples", samples, *common)


def test_kid_and_sampling_protocol_from_npz(tmp_path, inception_weights):
    """(IS runs the whole Inception: tested with the small extractor in test_metrics.py.)"""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    sampling = {"sampler": "ddpm", "steps": 250, "cfg_scale": 1.0, "vae": "stabilityai/sd-vae-ft-ema"}
    np.savez(tmp_path / "samples.npz", arr_0=images, arr_1=np.arange(6), protocol=np.array(json.dumps(sampling)))
    assert read_sampling_protocol(tmp_path / "samples.npz") == sampling
    reference = write_folder(tmp_path / "ref", seed=2, n=6, size=16, smooth=True)
    result = run_cli("--samples", tmp_path / "samples.npz", "--reference", reference, "--kid",
                     "--kid-subset-size", 4, "--kid-subsets", 3,
                     "--extractor-weights", inception_weights, "--feature-layer", LAYER)
    m = result["metrics"]
    assert m["fid"] > 0 and m["kid_mean"] > 0 and "isc_mean" not in m
    assert result["protocol"]["samples"]["sampling"] == sampling
    assert result["protocol"]["kid"] == {"subsets": 3, "subset_size": 4, "seed": 2020}


def test_help_describes_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        fid_cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--samples", "--reference", "--extractor-weights", "--save-stats", "--num-samples",
                   "VIRTUAL_imagenet256_labeled.npz", "fmnist-cnn"):
        assert option in text
