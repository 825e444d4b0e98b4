"""Frechet distance, statistics files, image sources and their input checks (common/metrics.py)."""
import numpy as np
import pytest
import scipy.linalg
import torch
from PIL import Image
from torch_fidelity.metric_fid import fid_statistics_to_metric

from common.feature_extractors import FashionMNISTClassifier, FeatureExtractorError, build_feature_extractor
from common.checkpoint import save_weights
from common.metrics import (
    FeatureStatistics,
    MetricsError,
    compute_metrics,
    extract_features,
    frechet_distance,
    images_to_uint8,
    open_images,
    open_reference,
)


def fixed_features(seed, n=300, d=12, shift=0.0):
    rng = np.random.default_rng(seed)
    mixing = rng.standard_normal((d, d)) / np.sqrt(d)
    return rng.standard_normal((n, d)) @ mixing + shift


def random_spd(d, seed):
    a = np.random.default_rng(seed).standard_normal((d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


# ----------------------------------------------------------------------------- Frechet distance

def test_frechet_distance_matches_direct_sqrtm_and_torch_fidelity():
    a, b = fixed_features(0), fixed_features(1, shift=0.3)
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    direct = float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(scipy.linalg.sqrtm(s1 @ s2).real))
    ours = frechet_distance(mu1, s1, mu2, s2)
    assert ours == pytest.approx(direct, rel=1e-4)
    # torch-fidelity's own formula (eigenvalues of the product) on the same statistics
    theirs = fid_statistics_to_metric({"mu": mu1, "sigma": s1}, {"mu": mu2, "sigma": s2}, False)
    assert ours == pytest.approx(theirs["frechet_inception_distance"], rel=1e-6)
    stats = FeatureStatistics.from_features(torch.from_numpy(a).float())
    np.testing.assert_allclose(stats.mu, mu1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.sigma, s1, rtol=1e-5, atol=1e-6)
    assert stats.mu.dtype == np.float64 and stats.count == 300


def test_frechet_distance_closed_forms():
    d = 8
    rng = np.random.default_rng(3)
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    var1, var2 = rng.uniform(0.5, 2, d), rng.uniform(0.5, 2, d)
    # diagonal covariances: |dmu|^2 + sum (sqrt(v1) - sqrt(v2))^2
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(var1) - np.sqrt(var2)) ** 2).sum()
    assert frechet_distance(mu1, np.diag(var1), mu2, np.diag(var2)) == pytest.approx(expected, rel=1e-10)
    # sigma2 = 4 sigma1 (non-diagonal): (sigma1 sigma2)^(1/2) = 2 sigma1, so FD = |dmu|^2 + tr(sigma1)
    s = random_spd(d, 4)
    assert frechet_distance(mu1, s, mu2, 4 * s) == pytest.approx(((mu1 - mu2) ** 2).sum() + np.trace(s), rel=1e-8)
    assert frechet_distance(mu1, s, mu1, s) == pytest.approx(0.0, abs=1e-9)


def test_frechet_distance_near_singular_covariances_are_finite():
    a = fixed_features(5, n=6, d=20)  # 6 samples in 20 dims: rank-5 covariance
    s = FeatureStatistics.from_features(a)
    assert frechet_distance(s.mu, s.sigma, s.mu, s.sigma) == pytest.approx(0.0, abs=1e-4)
    b = FeatureStatistics.from_features(fixed_features(6, n=6, d=20, shift=1.0))
    fd = frechet_distance(s.mu, s.sigma, b.mu, b.sigma)
    theirs = fid_statistics_to_metric({"mu": s.mu, "sigma": s.sigma}, {"mu": b.mu, "sigma": b.sigma}, False)
    assert np.isfinite(fd) and fd == pytest.approx(theirs["frechet_inception_distance"], rel=1e-4)


def test_frechet_distance_rejects_mismatched_or_nan_statistics():
    s = random_spd(4, 0)
    with pytest.raises(MetricsError, match="same feature extractor"):
        frechet_distance(np.zeros(4), s, np.zeros(5), random_spd(5, 1))
    with pytest.raises(MetricsError, match="NaN"):
        frechet_distance(np.full(4, np.nan), s, np.zeros(4), s)
    with pytest.raises(MetricsError, match="at least 2"):
        FeatureStatistics.from_features(np.zeros((1, 4)))


def test_statistics_file_roundtrip_and_adm_layout(tmp_path):
    stats = FeatureStatistics.from_features(fixed_features(0), feature_extractor="fmnist-cnn", feature_layer="128")
    loaded = FeatureStatistics.load(stats.save(tmp_path / "s.npz"))
    np.testing.assert_array_equal(loaded.mu, stats.mu)
    np.testing.assert_array_equal(loaded.sigma, stats.sigma)
    assert (loaded.count, loaded.feature_extractor, loaded.feature_layer) == (300, "fmnist-cnn", "128")
    # ADM's reference files: only mu/sigma (float64), plus arr_0 reference images in the reference batches
    images = np.random.default_rng(0).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "adm.npz", mu=stats.mu, sigma=stats.sigma, arr_0=images)
    ref = open_reference(tmp_path / "adm.npz")
    assert ref.statistics.feature_extractor is None and ref.statistics.count is None
    assert len(ref.images) == 4
    with pytest.raises(MetricsError, match="not images"):
        open_images(tmp_path / "s.npz")
    with pytest.raises(MetricsError, match="end in .npz"):
        stats.save(tmp_path / "s.stats")


# ----------------------------------------------------------------------------- images

def test_images_to_uint8_matches_dit_quantization_and_checks_input():
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    dit = torch.clamp(127.5 * x + 128.0, 0, 255).to(torch.uint8)
    assert torch.equal(images_to_uint8(x), dit)
    assert torch.equal(images_to_uint8((x + 1) / 2, value_range=(0, 1)), dit)
    with pytest.raises(MetricsError, match=r"value_range is \(-1, 1\).*clamp"):
        images_to_uint8(x * 255)
    bad = x.clone()
    bad[2, 0, 1, 1] = float("nan")
    with pytest.raises(MetricsError, match="1 of 4 images contain NaN"):
        images_to_uint8(bad)


def batches(image_set, batch_size=3):
    return torch.cat(list(image_set.batches(batch_size)))


def test_image_sources_agree(tmp_path):
    nhwc = np.random.default_rng(1).integers(0, 256, (7, 10, 12, 3), dtype=np.uint8)
    expected = torch.from_numpy(nhwc).permute(0, 3, 1, 2)
    np.savez(tmp_path / "samples.npz", arr_0=nhwc, arr_1=np.arange(7))
    folder = tmp_path / "folder" / "class_a"
    folder.mkdir(parents=True)
    for i, img in enumerate(nhwc):
        Image.fromarray(img).save(folder / f"{i:03d}.png")
    for source in (tmp_path / "samples.npz", tmp_path / "folder", nhwc, expected):
        image_set = open_images(source)
        assert len(image_set) == 7
        assert torch.equal(batches(image_set), expected), source if isinstance(source, str) else type(source)
    grey = open_images(nhwc[..., 0])  # [N, H, W] arrays are grey images
    assert torch.equal(batches(grey), expected[:, :1])


def test_image_sources_reject_bad_input(tmp_path):
    with pytest.raises(MetricsError, match="1 or 3 channels"):
        open_images(torch.zeros(2, 4, 8, 8, dtype=torch.uint8))
    with pytest.raises(MetricsError, match="value_range"):
        open_images(torch.zeros(2, 3, 8, 8))
    with pytest.raises(MetricsError, match="NaN"):
        open_images(torch.full((2, 3, 8, 8), float("nan")), value_range=(-1, 1))
    np.savez(tmp_path / "float.npz", arr_0=np.zeros((2, 8, 8, 3), np.float32))
    with pytest.raises(MetricsError, match="dtype float32.*uint8"):
        open_images(tmp_path / "float.npz")
    with pytest.raises(MetricsError, match="neither an image folder"):
        open_images(tmp_path / "missing")
    (tmp_path / "mixed").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "mixed" / "a.png")
    Image.new("RGB", (9, 8)).save(tmp_path / "mixed" / "b.png")
    with pytest.raises(MetricsError, match="one size"):
        batches(open_images(tmp_path / "mixed"))
    # an .npy member whose header promises more images than it holds
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (4, 8, 8, 3)})
    with zipfile.ZipFile(tmp_path / "cut.npz", "w") as zf:
        zf.writestr("arr_0.npy", header.getvalue() + bytes(2 * 8 * 8 * 3))
    with pytest.raises(MetricsError, match="truncated"):
        batches(open_images(tmp_path / "cut.npz"), batch_size=3)


# ----------------------------------------------------------------------------- the small Fashion-MNIST extractor

def test_fmnist_extractor_loads_given_weights_and_reports_missing_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("SIAMESENORM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FeatureExtractorError, match="python -m scripts.train_fmnist_classifier"):
        build_feature_extractor("fmnist-cnn", ["128"])
    torch.manual_seed(0)
    weights = save_weights(FashionMNISTClassifier(), tmp_path / "w.safetensors")
    extractor = build_feature_extractor("fmnist-cnn", ["128", "logits"], weights=weights)
    images = torch.randint(0, 256, (5, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    feats = extract_features(open_images(images), extractor, batch_size=2)
    assert feats["128"].shape == (5, 128) and feats["logits"].shape == (5, 10)
    # RGB copies of grey images are averaged back; 32 px images padded with background are cropped back to 28
    rgb = extractor(images.expand(-1, 3, -1, -1))[0]
    torch.testing.assert_close(rgb, feats["128"])
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    torch.testing.assert_close(extractor(padded)[0], feats["128"])
    assert extractor(torch.zeros(2, 1, 16, 16, dtype=torch.uint8))[0].shape == (2, 128)
    with pytest.raises(FeatureExtractorError, match="unknown feature extractor"):
        build_feature_extractor("fmnist", ["128"])
    with pytest.raises(FeatureExtractorError, match="provides"):
        build_feature_extractor("fmnist-cnn", ["2048"], weights=weights)


@pytest.mark.filterwarnings("ignore::scipy.linalg.LinAlgWarning")
def test_compute_metrics_counts_and_reference_checks(tmp_path):
    torch.manual_seed(0)
    weights = save_weights(FashionMNISTClassifier(), tmp_path / "w.safetensors")
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 256, (12, 1, 28, 28), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 128, (12, 1, 28, 28), dtype=torch.uint8, generator=g)
    kw = dict(feature_extractor="fmnist-cnn", weights=weights, device="cpu")
    with pytest.warns(UserWarning, match="12 samples for 128-d features: the covariance is singular"):
        result = compute_metrics(a, b, isc=True, kid=True, kid_subset_size=6, kid_subsets=5, **kw)
    m = result["metrics"]
    assert m["fid"] > 0 and m["isc_mean"] > 0 and np.isfinite(m["kid_mean"])
    assert result["protocol"]["samples"]["count"] == 12 and result["protocol"]["feature_layer"] == "128"
    with pytest.warns(UserWarning):
        assert compute_metrics(a, a, **kw)["metrics"]["fid"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(MetricsError, match="holds 12 images but 50000 were expected"):
        compute_metrics(a, b, expected_count=50000, **kw)
    with pytest.raises(MetricsError, match="kid-subset-size"):
        compute_metrics(a, b, kid=True, **kw)
    stats = FeatureStatistics.from_features(np.zeros((3, 64)) + np.arange(3)[:, None])
    with pytest.raises(MetricsError, match="64-d statistics but fmnist-cnn layer 128"):
        compute_metrics(a, stats, **kw)
    tagged = FeatureStatistics(np.zeros(128), np.eye(128), feature_extractor="inception-v3-compat", feature_layer="2048")
    with pytest.raises(MetricsError, match="holds inception-v3-compat statistics"):
        compute_metrics(a, tagged, **kw)
    with pytest.raises(MetricsError, match="KID needs reference images"):
        compute_metrics(a, tagged, kid=True, **kw)
