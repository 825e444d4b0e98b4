"""python -m diffusion.fid end to end, offline, with an Inception-v3 state dict built here.

The weights are random (the real ones cannot be downloaded here) but the architecture and key names are
torch-fidelity's ``inception-v3-compat`` (torchvision's Inception-v3 with 1008 classes has the same state dict),
and the file is loaded through the same option a user passes. FID on the 64-d first pooled layer keeps the
Inception forward and the matrix square roots cheap on CPU; the code path is the same as for layer 2048. sFID's
2023-d matrix root would add seconds per run: its statistics are checked against the re-statement and the
distance itself is the Frechet distance tested on hand-made features in test_metrics.py.
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch_fidelity
from PIL import Image
from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

import diffusion.evaluation.evaluator as metrics
from diffusion.evaluation.features import (INCEPTION_WEIGHTS_FILE, FeatureExtractorError, InceptionV3WithSpatial,
                                           build_feature_extractor, file_sha256, write_random_inception)
from diffusion.evaluation.images import read_sampling_protocol
from diffusion.evaluation.reference import load_reference_statistics
from diffusion import fid as fid_cli
from tests.test_metrics import adm_float16_distances, adm_inception_score, brute_force_precision_recall

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
    assert out["saved"] == str(tmp_path / "ref_stats.npz") and out["statistics"]["count"] == 6
    assert out["statistics"]["dim"] == 64 and out["info"]["source"] == str(reference)
    assert out["spatial_statistics"]["dim"] == 2023 and out["images"]["count"] == 6
    ours_stats = load_reference_statistics(tmp_path / "ref_stats.npz").statistics
    # an ADM-style reference file: nothing but mu and sigma
    np.savez(tmp_path / "adm_ref.npz", mu=ours_stats.mu, sigma=ours_stats.sigma)
    result = run_cli("--samples", samples, "--reference", tmp_path / "adm_ref.npz", "--out", tmp_path / "fid.json",
                     "--inception-weights", inception_weights, "--feature-layer", LAYER, "--num-samples", 6,
                     "--metrics", "fid")
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
                     "--feature-layer", LAYER, "--metrics", "fid")
    assert direct["metrics"]["fid"] == pytest.approx(theirs, rel=1e-5)


def test_every_long_wait_says_so_and_adms_sqrtm_is_a_switch(tmp_path, inception_weights, capsys):
    """Without --quiet: a line on stderr before reading the reference, loading the extractor and each Frechet
    distance, a bar over the precision/recall distances; stdout holds only the JSON. --frechet-method sqrtm runs
    ADM's square root, the same number, and the protocol says which ran."""
    samples = write_folder(tmp_path / "samples", seed=0, n=6, size=16)
    reference = write_folder(tmp_path / "reference", seed=1, n=6, size=16, smooth=True)
    args = ["--samples", str(samples), "--reference", str(reference), "--extractor-weights", str(inception_weights),
            "--feature-layer", LAYER, "--metrics", "fid,pr", "--device", "cpu", "--num-workers", "0"]
    capsys.readouterr()
    fast = fid_cli.main(args)
    out, err = capsys.readouterr()
    assert json.loads(out)["metrics"] == fast["metrics"]
    for line in (f"reading the reference {reference}", "loading the inception-v3-compat feature extractor",
                 "fid: Frechet distance of 64-d statistics (eigh) ...", "precision/recall distances"):
        assert line in err, (line, err)
    assert fast["protocol"]["frechet_method"] == "eigh"
    adm = fid_cli.main(args + ["--frechet-method", "sqrtm", "--quiet"])
    assert adm["protocol"]["frechet_method"] == "sqrtm" and "sqrtm" in adm["protocol"]["frechet_distance"]
    assert adm["metrics"]["fid"] == pytest.approx(fast["metrics"]["fid"], rel=1e-6)
    assert "Frechet" not in capsys.readouterr().err  # --quiet: no progress
    with pytest.raises(SystemExit) as exit_info:
        fid_cli.main(args + ["--frechet-method", "svd"])
    assert exit_info.value.code == 2 and "--frechet-method" in capsys.readouterr().err


def test_inception_weights_from_torch_fidelity_cache_or_clear_error(tmp_path, monkeypatch, inception_weights):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    cached = tmp_path / "torch_home" / "hub" / "checkpoints" / INCEPTION_WEIGHTS_FILE
    samples = write_folder(tmp_path / "samples", seed=0, n=4, size=16)
    args = ("--samples", samples, "--reference", samples, "--feature-layer", LAYER, "--metrics", "fid")
    with pytest.raises(SystemExit, match=f"Inception-v3 weights not found at {cached}.*--extractor-weights"):
        run_cli(*args)
    cached.parent.mkdir(parents=True)
    shutil.copy(inception_weights, cached)
    result = run_cli(*args)
    assert result["protocol"]["extractor_weights"] == str(cached)
    assert result["metrics"]["fid"] == pytest.approx(0.0, abs=1e-3)


def test_cli_reports_bad_inputs(tmp_path, inception_weights):
    samples = write_folder(tmp_path / "samples", seed=0, n=3, size=16)
    with pytest.raises(SystemExit, match="does not exist") as exit_info:
        run_cli("--samples", samples, "--reference", samples, "--extractor-weights", tmp_path / "nope.pth")
    assert exit_info.value.code == 2  # every entry point: bad input is status 2, as argparse's
    torch.save({"fc.weight": torch.zeros(10, 2048)}, tmp_path / "wrong.pth")
    with pytest.raises(SystemExit, match="not torch-fidelity's Inception-v3"):
        run_cli("--samples", samples, "--reference", samples, "--extractor-weights", tmp_path / "wrong.pth")
    common = ("--extractor-weights", inception_weights, "--feature-layer", LAYER, "--metrics", "fid")
    with pytest.raises(SystemExit, match="missing' not found"):
        run_cli("--samples", tmp_path / "missing", "--reference", samples, *common)
    with pytest.raises(SystemExit, match="missing.npz' not found"):
        run_cli("--samples", samples, "--reference", tmp_path / "missing.npz", *common)
    with pytest.raises(SystemExit, match="--center-crop prepares raw folders for --save-stats"):
        run_cli("--samples", samples, "--reference", samples, "--center-crop", 16, *common)
    with pytest.raises(SystemExit, match="holds 3 images but 50000 were expected"):
        run_cli("--samples", samples, "--reference", samples, "--num-samples", 50000, *common)
    np.savez(tmp_path / "stats2048.npz", mu=np.zeros(2048), sigma=np.eye(2048))  # ADM-like, wrong layer here
    with pytest.raises(SystemExit, match="2048-d statistics but inception-v3-compat layer 64 gives 64-d"):
        run_cli("--samples", samples, "--reference", tmp_path / "stats2048.npz", *common)
    np.savez(tmp_path / "nan.npz", arr_0=np.zeros((3, 16, 16, 3), np.float32) * np.nan)
    with pytest.raises(SystemExit, match="dtype float32"):
        run_cli("--samples", tmp_path / "nan.npz", "--reference", samples, *common)
    with pytest.raises(SystemExit, match="fid need a reference"):
        run_cli("--samples", samples, *common)
    with pytest.raises(SystemExit, match="sfid: reference .*adm_ref.npz holds no sFID statistics|holds no sFID"):
        np.savez(tmp_path / "adm_ref.npz", mu=np.zeros(64), sigma=np.eye(64))
        run_cli("--samples", samples, "--reference", tmp_path / "adm_ref.npz", *common[:-2], "--metrics", "fid,sfid")


def test_kid_and_sampling_protocol_from_npz(tmp_path, inception_weights):
    """(IS runs the whole Inception: tested with the small extractor in test_metrics.py.)"""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    sampling = {"sampler": "ddpm", "steps": 250, "cfg_scale": 1.0, "vae": "stabilityai/sd-vae-ft-ema"}
    np.savez(tmp_path / "samples.npz", arr_0=images, arr_1=np.arange(6), protocol=np.array(json.dumps(sampling)))
    assert read_sampling_protocol(tmp_path / "samples.npz") == sampling
    reference = write_folder(tmp_path / "ref", seed=2, n=6, size=16, smooth=True)
    result = run_cli("--samples", tmp_path / "samples.npz", "--reference", reference, "--metrics", "fid,kid",
                     "--kid-subset-size", 4, "--kid-subsets", 3,
                     "--extractor-weights", inception_weights, "--feature-layer", LAYER)
    m = result["metrics"]
    assert m["fid"] > 0 and m["kid_mean"] > 0 and "is" not in m
    assert result["protocol"]["samples"]["sampling"] == sampling
    assert result["protocol"]["kid"] == {"subsets": 3, "subset_size": 4, "seed": 2020}


def test_help_describes_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        fid_cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--samples", "--reference", "--extractor-weights", "--save-stats", "--num-samples", "--metrics",
                   "--center-crop", "fid,sfid,is,pr", "VIRTUAL_imagenet256_labeled.npz", "fmnist-cnn"):
        assert option in text


def their_features(weights, images_uint8_nchw):
    """The re-statement's features: torch-fidelity's own Inception class for pool (layer 64) and IS logits, and ADM's
    sFID tensor read from the output of the whole Mixed_6d block (its first 192 channels are the 1x1 branch,
    mixed_6/conv), first 7 channels, flattened in NHWC order."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    net = FeatureExtractorInceptionV3("inception-v3-compat", [LAYER, "logits_unbiased"],
                                      feature_extractor_weights_path=str(weights)).eval()
    block = {}
    hook = net.Mixed_6d.register_forward_hook(lambda module, args, out: block.setdefault("out", out))
    with torch.no_grad():
        pool, logits = net(images_uint8_nchw)
    hook.remove()
    spatial = block["out"][:, :7].permute(0, 2, 3, 1).reshape(len(images_uint8_nchw), -1)
    return pool.double().numpy(), spatial.double().numpy(), logits.double().numpy()


def direct_frechet(a, mu2, sigma2):
    import scipy.linalg

    mu1, sigma1 = a.mean(0), np.cov(a, rowvar=False)
    root = scipy.linalg.sqrtm((sigma1 + np.eye(len(mu1)) * 1e-6) @ (sigma2 + np.eye(len(mu1)) * 1e-6)).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(root))


def test_dit_metric_set_in_one_pass_against_a_raw_folder_reference(tmp_path, inception_weights, monkeypatch):
    """--save-stats --center-crop on a raw folder of mixed sizes, then the default metrics (FID, sFID, IS,
    Precision, Recall) of 6 samples in one pass, each against an independent re-statement."""
    from common.data import center_crop_arr

    rng = np.random.default_rng(3)
    raw = tmp_path / "raw" / "n01440764"
    raw.mkdir(parents=True)
    for i in range(6):
        h, w = int(rng.integers(16, 50)), int(rng.integers(16, 50))
        ramp = np.linspace(0, 1, w)[None, :, None] * np.linspace(0.2, 1, h)[:, None, None]
        Image.fromarray((ramp * rng.uniform(60, 255, 3) + rng.uniform(0, 40, (h, w, 3))).astype(np.uint8)).save(
            raw / f"im_{i}.JPEG")
    stats = run_cli("--samples", tmp_path / "raw", "--save-stats", tmp_path / "ref.npz", "--center-crop", 16,
                    "--reference-images", 4, "--extractor-weights", inception_weights, "--feature-layer", LAYER)
    assert stats["info"]["preprocessing"]["center_crop"] == 16 and stats["images"]["count"] == 4
    samples = rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    np.savez(tmp_path / "samples.npz", arr_0=samples)

    seen, sfid_args = [], []
    real_forward, real_frechet = InceptionV3WithSpatial.forward, metrics.frechet_distance
    monkeypatch.setattr(InceptionV3WithSpatial, "forward",
                        lambda self, x: (seen.append(len(x)), real_forward(self, x))[1])

    def frechet_or_record(mu1, sigma1, mu2, sigma2, **options):  # the 2023-d statistics are checked below
        if len(mu1) > 64:
            sfid_args.append((mu1, sigma1, mu2, sigma2))
            return -1.0
        return real_frechet(mu1, sigma1, mu2, sigma2, **options)

    monkeypatch.setattr(metrics, "frechet_distance", frechet_or_record)
    result = run_cli("--samples", tmp_path / "samples.npz", "--reference", tmp_path / "ref.npz",
                     "--extractor-weights", inception_weights, "--feature-layer", LAYER, "--out", tmp_path / "m.json")
    assert sum(seen) == 6  # one pass over the samples; the reference's features come from the file
    m = result["metrics"]
    assert sorted(m) == ["fid", "is", "precision", "recall", "sfid"]
    protocol = json.loads((tmp_path / "m.json").read_text())["protocol"]
    assert protocol["metrics"] == ["fid", "sfid", "is", "pr"]
    assert protocol["feature_layers"]["spatial"] == "mixed_6/conv"
    assert protocol["reference"]["info"]["preprocessing"]["center_crop"] == 16
    assert protocol["is"]["split_size"] == 5000 and protocol["pr"]["k"] == 3 and protocol["pr"]["reference_count"] == 4

    # the re-statement: ADM's crop of each raw file, torch-fidelity's network, numpy statistics
    crops = np.stack([np.asarray(center_crop_arr(Image.open(p).convert("RGB"), 16)) for p in sorted(raw.iterdir())])
    ref_pool, ref_spatial, _ = their_features(inception_weights, torch.from_numpy(crops).permute(0, 3, 1, 2))
    pool, spatial, logits = their_features(inception_weights, torch.from_numpy(samples).permute(0, 3, 1, 2))
    saved = np.load(tmp_path / "ref.npz")
    np.testing.assert_allclose(saved["mu"], ref_pool.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saved["mu_s"], ref_spatial.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saved["sigma_s"], np.cov(ref_spatial, rowvar=False), rtol=1e-4, atol=1e-6)
    assert m["fid"] == pytest.approx(direct_frechet(pool, saved["mu"], saved["sigma"]), rel=1e-4)
    (mu1, sigma1, mu2, sigma2), = sfid_args
    np.testing.assert_allclose(mu1, spatial.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sigma1, np.cov(spatial, rowvar=False), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(mu2, saved["mu_s"])
    assert (spatial >= 0).all() and spatial.shape == (6, 7 * 17 * 17)
    assert m["is"] == pytest.approx(adm_inception_score(logits, 5000), rel=1e-5)
    chosen = [int(np.flatnonzero((crops == img).all(axis=(1, 2, 3)))[0]) for img in saved["arr_0"]]
    expected = brute_force_precision_recall(ref_pool[chosen], pool, distances=adm_float16_distances)
    assert (m["precision"], m["recall"]) == pytest.approx(expected, abs=0)

    # ADM's own layout (no metadata, no cached features): the reference images are read once more, same numbers
    np.savez(tmp_path / "adm.npz", **{k: saved[k] for k in ("mu", "sigma", "mu_s", "sigma_s", "arr_0")})
    seen.clear()
    adm = run_cli("--samples", tmp_path / "samples.npz", "--reference", tmp_path / "adm.npz", "--metrics", "fid,pr",
                  "--extractor-weights", inception_weights, "--feature-layer", LAYER)["metrics"]
    assert sum(seen) == 6 + 4
    assert adm == pytest.approx({k: m[k] for k in ("fid", "precision", "recall")}, rel=1e-6)


def test_inception_file_is_unpickled_once_and_only_as_plain_tensors(inception_weights, monkeypatch, tmp_path):
    """The weights file goes through torch.load once, with weights_only=True; torch-fidelity's constructor (which
    unpickles with weights_only=False) gets those tensors re-saved in memory, never the file; a wrong file is one
    clear error before any network is built."""
    real_load, calls = torch.load, []

    def recording_load(f, *args, **kwargs):
        calls.append((str(f) if isinstance(f, (str, bytes, os.PathLike)) else type(f).__name__,
                      kwargs.get("weights_only")))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    extractor = build_feature_extractor("inception-v3-compat", ["2048"], weights=inception_weights)
    from_file = [weights_only for source, weights_only in calls if source == str(inception_weights)]
    assert from_file == [True], calls
    assert all(weights_only for source, weights_only in calls if source != "BytesIO"), calls
    assert extractor.weights_sha256 == file_sha256(inception_weights)
    theirs = FeatureExtractorInceptionV3("x", ["2048"], feature_extractor_weights_path=str(inception_weights))
    for (name, ours), (_, reference) in zip(extractor.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(ours, reference), name
    monkeypatch.setattr(torch, "load", real_load)
    torch.save({"fc.weight": torch.zeros(10, 2048)}, tmp_path / "wrong.pth")
    with pytest.raises(FeatureExtractorError, match="is not torch-fidelity's Inception-v3"):
        build_feature_extractor("inception-v3-compat", ["2048"], weights=tmp_path / "wrong.pth")


def test_spatial_extension_leaves_torch_fidelitys_layers_unchanged(inception_weights):
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    images = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (1, 3, 20, 24), dtype=np.uint8))
    ours = build_feature_extractor("inception-v3-compat", ["2048", "mixed_6/conv", "logits_unbiased", "logits"],
                                   weights=inception_weights)
    theirs = FeatureExtractorInceptionV3("x", ["2048", "logits_unbiased", "logits"],
                                         feature_extractor_weights_path=str(inception_weights)).eval()
    with torch.no_grad():
        a, b = ours(images), theirs(images)
    for got, want in zip((a[0], a[2], a[3]), b):
        assert torch.equal(got, want)
    assert a[1].shape == (1, 2023) and ours.features_list == ["2048", "mixed_6/conv", "logits_unbiased", "logits"]
    early = build_feature_extractor("inception-v3-compat", ["64", "mixed_6/conv"], weights=inception_weights)
    with torch.no_grad():
        assert torch.equal(early(images)[1], a[1])  # "64" alone would stop before Mixed_6d
