"""Frechet distance, statistics files, image sources and their input checks (diffusion/evaluation/)."""
import numpy as np
import pytest
import scipy.linalg
import scipy.spatial
import torch
from PIL import Image
from torch_fidelity.metric_fid import fid_statistics_to_metric
from torch_fidelity.metric_isc import isc_features_to_metric

from common.checkpoint import save_weights
from diffusion.evaluation.evaluator import Evaluator, compute_metrics
from diffusion.evaluation.features import (FashionMNISTClassifier, FeatureExtractorError, build_feature_extractor,
                                           extract_features)
from diffusion.evaluation.images import images_to_uint8, open_images
from diffusion.evaluation.metrics import (FeatureStatistics, MetricsError, RunningMoments, frechet_distance,
                                          inception_score, pairwise_distances, precision_recall)
from diffusion.evaluation.reference import (build_reference_statistics, load_reference_statistics, open_reference,
                                           save_reference_statistics)


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


def test_a_set_against_itself_is_never_negative():
    """The rounding of ``tr + tr - 2 tr sqrt`` is negative about half the time (-2.5e-7 printed as a FID): clamped."""
    for seed in range(20):
        s = FeatureStatistics.from_features(fixed_features(seed, n=200, d=64))
        for method in ("eigh", "sqrtm"):
            assert 0.0 <= frechet_distance(s.mu, s.sigma, s.mu, s.sigma, method=method) < 1e-9, (seed, method)


def test_frechet_distance_rejects_mismatched_or_nan_statistics():
    s = random_spd(4, 0)
    with pytest.raises(MetricsError, match="same feature extractor"):
        frechet_distance(np.zeros(4), s, np.zeros(5), random_spd(5, 1))
    with pytest.raises(MetricsError, match="NaN"):
        frechet_distance(np.full(4, np.nan), s, np.zeros(4), s)
    with pytest.raises(MetricsError, match="at least 2"):
        FeatureStatistics.from_features(np.zeros((1, 4)))


def inception_sized_features(seed, n=3000, d=2048, shift=0.0):
    """``n`` feature vectors shaped like Inception's pool features: non-negative-ish means, a covariance spectrum
    decaying as 1/k in a random basis (the shared ``basis``), a second set rescaled and shifted."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, d), dtype=np.float32) * (1.0 / np.sqrt(np.arange(1, d + 1, dtype=np.float32)))
    return z @ INCEPTION_SIZED_BASIS.T * np.float32(1.0 + shift) + np.float32(0.4 + shift)


INCEPTION_SIZED_BASIS = np.linalg.qr(np.random.default_rng(99).standard_normal((256, 256)))[0].astype(np.float32)
INCEPTION_SIZED_BASIS = np.kron(np.eye(8, dtype=np.float32), INCEPTION_SIZED_BASIS)  # 2048-d, 8 rotated blocks


@pytest.fixture(scope="module")
def inception_sized_statistics():
    a, b = inception_sized_features(0), inception_sized_features(1, shift=0.05)
    return FeatureStatistics.from_features(a), FeatureStatistics.from_features(b)


def test_frechet_distance_fast_trace_equals_adms_sqrtm_on_inception_sized_statistics(inception_sized_statistics):
    """The default trace (symmetric eigenvalues, float64) against ADM's scipy.linalg.sqrtm formula and torch-fidelity's
    eigenvalues of the product, on 2048-d statistics of 3,000 vectors each; a set against itself is not negative."""
    s, t = inception_sized_statistics
    fast = frechet_distance(s.mu, s.sigma, t.mu, t.sigma)
    adm = frechet_distance(s.mu, s.sigma, t.mu, t.sigma, method="sqrtm")
    assert adm > 1.0 and fast == pytest.approx(adm, rel=1e-6)
    theirs = fid_statistics_to_metric({"mu": s.mu, "sigma": s.sigma}, {"mu": t.mu, "sigma": t.sigma}, False)
    assert fast == pytest.approx(theirs["frechet_inception_distance"], rel=1e-6)
    # fewer vectors than dimensions (singular covariances: no Cholesky factor, the eigh one), the same distance
    few = FeatureStatistics.from_features(inception_sized_features(2, n=100)[:, :256])
    other = FeatureStatistics.from_features(inception_sized_features(3, n=120, shift=0.1)[:, :256])
    # a set against itself: rounding, never below 0 (sqrtm on the 256-d set: it costs seconds at 2048-d)
    for method, stats in (("eigh", s), ("eigh", few), ("sqrtm", few)):
        assert 0.0 <= frechet_distance(stats.mu, stats.sigma, stats.mu, stats.sigma, method=method) < 1e-9
    with pytest.raises(np.linalg.LinAlgError):
        np.linalg.cholesky(few.sigma)
    assert frechet_distance(few.mu, few.sigma, other.mu, other.sigma) == pytest.approx(
        frechet_distance(few.mu, few.sigma, other.mu, other.sigma, method="sqrtm"), rel=1e-6)
    with pytest.raises(MetricsError, match="choose one of eigh, sqrtm"):
        frechet_distance(s.mu, s.sigma, t.mu, t.sigma, method="svd")


def test_statistics_file_roundtrip_and_adm_layout(tmp_path):
    stats = FeatureStatistics.from_features(fixed_features(0), feature_extractor="fmnist-cnn", feature_layer="128")
    loaded = load_reference_statistics(save_reference_statistics(tmp_path / "s.npz", stats)).statistics
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
        save_reference_statistics(tmp_path / "s.stats", stats)


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
    with pytest.raises(MetricsError, match="missing' not found"):
        open_images(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(MetricsError, match="image files are read from a folder"):
        open_images(tmp_path / "notes.txt")
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


@pytest.mark.fashion_mnist
def test_the_classifier_script_trains_weights_the_extractor_loads(tmp_path, monkeypatch, capsys):
    from safetensors import safe_open

    from scripts.train_fmnist_classifier import main as train_classifier

    monkeypatch.setenv("SIAMESENORM_CACHE", str(tmp_path / "cache"))
    result = train_classifier(["--limit", "512", "--epochs", "2", "--batch-size", "64", "--lr", "3e-3"])
    losses = [float(line.split("loss ")[1].split()[0]) for line in capsys.readouterr().out.splitlines()
              if line.startswith("epoch")]
    assert len(losses) == 2 and losses[1] < losses[0] < 2.31  # learns from chance level (ln 10 = 2.30)
    assert result["path"] == tmp_path / "cache" / "fmnist_cnn.safetensors" and result["test_accuracy"] > 0.3
    with safe_open(str(result["path"]), "pt") as f:
        assert f.metadata()["train_images"] == "512"
    extractor = build_feature_extractor("fmnist-cnn", ["logits"])  # found in the cache without --weights
    assert extractor(torch.zeros(2, 1, 28, 28, dtype=torch.uint8))[0].shape == (2, 10)

    with pytest.raises(SystemExit, match="larger than the 32 training images") as exit_info:
        train_classifier(["--limit", "32", "--batch-size", "64", "--out", str(tmp_path / "x.safetensors")])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        train_classifier(["--epochs", "0"])
    assert exit_info.value.code == 2 and "--epochs must be at least 1" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::scipy.linalg.LinAlgWarning")
@pytest.mark.filterwarnings("ignore:.*covariance is singular:UserWarning")
def test_compute_metrics_counts_and_reference_checks(tmp_path):
    torch.manual_seed(0)
    weights = save_weights(FashionMNISTClassifier(), tmp_path / "w.safetensors")
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 256, (12, 1, 28, 28), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 128, (12, 1, 28, 28), dtype=torch.uint8, generator=g)
    kw = dict(feature_extractor="fmnist-cnn", weights=weights, device="cpu")
    with pytest.warns(UserWarning, match="12 samples for 128-d features: the covariance is singular"):
        result = compute_metrics(a, b, metrics=["fid", "is", "pr", "kid"], kid_subset_size=6, kid_subsets=5, **kw)
    m = result["metrics"]
    assert m["fid"] > 0 and m["is"] > 0 and np.isfinite(m["kid_mean"]) and 0 <= m["precision"] <= 1
    assert result["protocol"]["samples"]["count"] == 12 and result["protocol"]["feature_layer"] == "128"
    assert result["protocol"]["feature_layers"] == {"pool": "128", "logits": "logits"}
    assert len(result["protocol"]["extractor_weights_sha256"]) == 64
    # by default: the DiT tables' metrics the extractor has (no spatial layer: no sFID), nothing skipped
    with pytest.warns(UserWarning):
        same = compute_metrics(a, a, **kw)
    assert sorted(same["metrics"]) == ["fid", "is", "precision", "recall"] and "skipped" not in same["protocol"]
    assert same["metrics"]["fid"] == pytest.approx(0.0, abs=1e-6)
    assert same["metrics"]["precision"] == same["metrics"]["recall"] == 1.0
    with pytest.raises(MetricsError, match="holds 12 images but 50000 were expected"):
        compute_metrics(a, b, expected_count=50000, **kw)
    with pytest.raises(MetricsError, match="kid-subset-size"):
        compute_metrics(a, b, metrics=["kid"], **kw)
    with pytest.raises(MetricsError, match="sfid needs ADM's spatial Inception features; fmnist-cnn has none"):
        compute_metrics(a, b, metrics=["fid", "sfid"], **kw)
    with pytest.raises(MetricsError, match="choose from fid, sfid, is, pr, kid"):
        compute_metrics(a, b, metrics=["fid", "isc"], **kw)
    stats = FeatureStatistics.from_features(np.zeros((3, 64)) + np.arange(3)[:, None])
    with pytest.raises(MetricsError, match="64-d statistics but fmnist-cnn layer 128"):
        compute_metrics(a, stats, metrics=["fid"], **kw)
    tagged = FeatureStatistics(np.zeros(128), np.eye(128), feature_extractor="inception-v3-compat", feature_layer="2048")
    with pytest.raises(MetricsError, match="holds inception-v3-compat statistics"):
        compute_metrics(a, tagged, metrics=["fid"], **kw)
    with pytest.raises(MetricsError, match="kid needs reference images"):
        compute_metrics(a, tagged, metrics=["kid"], **kw)
    # statistics-only references: what they cannot give is skipped with a warning and recorded
    own = FeatureStatistics.from_features(torch.randn(200, 128, generator=g), feature_extractor="fmnist-cnn",
                                          feature_layer="128")
    with pytest.warns(UserWarning, match="skipped pr: pr needs reference images"):
        partial = compute_metrics(a, own, **kw)
    assert sorted(partial["metrics"]) == ["fid", "is"] and "pr" in partial["protocol"]["skipped"]
    with pytest.raises(MetricsError, match="need a reference.*--metrics is"):
        compute_metrics(a, None, **kw)
    assert sorted(compute_metrics(a, None, metrics=["is"], **kw)["metrics"]) == ["is"]


# ----------------------------------------------------------------------------- the metrics, against re-statements

def test_running_moments_equal_numpy_mean_and_covariance():
    x = fixed_features(7, n=1000, d=16, shift=3.0)
    moments = RunningMoments()
    for part in np.split(x, [1, 2, 50, 51, 400, 999]):  # uneven parts, single rows included
        moments.add(part)
    stats = moments.statistics(feature_layer="16")
    np.testing.assert_allclose(stats.mu, x.mean(0), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(stats.sigma, np.cov(x, rowvar=False), rtol=1e-12, atol=1e-13)
    assert stats.count == 1000 and stats.feature_layer == "16"


def adm_inception_score(logits, split_size):
    """ADM evaluator's compute_inception_score, re-stated on numpy softmax outputs."""
    z = logits - logits.max(1, keepdims=True)
    preds = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    scores = []
    for i in range(0, len(preds), split_size):
        part = preds[i: i + split_size]
        kl = part * (np.log(part) - np.log(np.expand_dims(np.mean(part, 0), 0)))
        scores.append(np.exp(np.mean(np.sum(kl, 1))))
    return float(np.mean(scores))


def test_inception_score_is_adms_consecutive_splits():
    logits = np.random.default_rng(0).standard_normal((23, 10)) * 3
    for split in (5, 23, 100):  # 5 leaves a short last split of 3, as ADM's does
        assert inception_score(torch.from_numpy(logits), split) == pytest.approx(adm_inception_score(logits, split),
                                                                                 rel=1e-12)
    # with equal splits and no shuffling it is torch-fidelity's formula too
    theirs = isc_features_to_metric(torch.from_numpy(logits[:20]), splits=4, shuffle=False)["inception_score_mean"]
    assert inception_score(logits[:20], 5) == pytest.approx(theirs, rel=1e-12)
    assert inception_score(np.zeros((8, 10)), 4) == pytest.approx(1.0)  # constant predictions: IS = 1


def brute_force_precision_recall(ref, samples, k=3, distances=None):
    """Improved precision/recall (Kynkaanniemi et al.) with full distance matrices: radius = distance to the k-th
    nearest neighbour counting the point itself (the (k+1)-th smallest entry of its row)."""
    distances = distances or (lambda a, b: scipy.spatial.distance.cdist(a, b, "sqeuclidean"))
    ref_radii = np.sort(distances(ref, ref), axis=1)[:, k]
    sample_radii = np.sort(distances(samples, samples), axis=1)[:, k]
    d = distances(ref, samples)
    precision = np.mean((d <= ref_radii[:, None]).any(axis=0))
    recall = np.mean((d <= sample_radii[None, :]).any(axis=1))
    return precision, recall


def adm_float16_distances(u, v):
    """ADM's DistanceBlock on float16 inputs, each TensorFlow op's output rounded to float16 (sums and products
    accumulated in float32), re-stated in numpy; None where a float16 value overflows (ADM then uses float32)."""
    u16, v16 = u.astype(np.float16), v.astype(np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        norm_u = np.square(u16).astype(np.float32).sum(1).astype(np.float16)
        norm_v = np.square(v16).astype(np.float32).sum(1).astype(np.float16)
        matmul = (u16.astype(np.float32) @ v16.astype(np.float32).T).astype(np.float16)
        d = np.maximum(norm_u[:, None] - np.float16(2) * matmul + norm_v[None, :], np.float16(0))
    return d.astype(np.float32) if np.isfinite(d).all() else None


def test_precision_recall_match_brute_force_knn():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((60, 5))
    samples = rng.standard_normal((45, 5)) * 1.3 + 0.4
    expected = brute_force_precision_recall(ref, samples)
    assert 0.2 < expected[0] < 0.95 and 0.2 < expected[1] < 0.95  # neither trivial
    r, s = torch.from_numpy(ref).float(), torch.from_numpy(samples).float()
    for batch in (7, 45, 1000):  # blocks change memory, never the result
        assert precision_recall(r, s, batch_size=batch, float16=False) == pytest.approx(expected, abs=0)
    # float16 as ADM's graph: equal to the numpy re-statement of its ops
    fp16 = brute_force_precision_recall(ref, samples, distances=adm_float16_distances)
    for batch in (7, 1000):
        assert precision_recall(r, s, batch_size=batch) == pytest.approx(fp16, abs=0)
    np.testing.assert_array_equal(pairwise_distances(r, s).numpy(), adm_float16_distances(ref, samples))
    # large features overflow float16: ADM falls back to float32, and so do we
    big = r * 1000
    assert adm_float16_distances(big.numpy(), big.numpy()) is None
    torch.testing.assert_close(pairwise_distances(big, big), pairwise_distances(big, big, float16=False))
    # duplicates and ties (small integer features are exact in float16): '<=' and the point itself count as in ADM
    ints_ref = rng.integers(0, 3, (40, 4)).astype(np.float64)
    ints_samples = rng.integers(0, 4, (30, 4)).astype(np.float64)
    expected = brute_force_precision_recall(ints_ref, ints_samples)
    for float16 in (True, False):
        got = precision_recall(torch.from_numpy(ints_ref), torch.from_numpy(ints_samples), batch_size=6,
                               float16=float16)
        assert got == pytest.approx(expected, abs=0)
    with pytest.raises(MetricsError, match="more than k=3"):
        precision_recall(r[:3], s)


def test_reference_statistics_of_a_raw_folder_streamed_and_resumed(tmp_path, monkeypatch):
    """--save-stats on a folder of JPEG/PNG of mixed sizes with ADM's center crop: statistics equal those of the
    cropped images computed directly; a kill between shards resumes to the same file; a broken file is skipped."""
    import diffusion.evaluation.reference as metrics
    from common.data import center_crop_arr

    torch.manual_seed(0)
    weights = save_weights(FashionMNISTClassifier(), tmp_path / "w.safetensors")
    rng = np.random.default_rng(0)
    raw = tmp_path / "raw"
    for i in range(11):
        size = (int(rng.integers(20, 90)), int(rng.integers(20, 90)))
        folder = raw / f"n{i % 3:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
        img.save(folder / f"img_{i:03d}.{'JPEG' if i % 2 else 'png'}")
    (raw / "n00000000" / "broken.JPEG").write_bytes(b"\xff\xd8 not a jpeg")
    kw = dict(feature_extractor="fmnist-cnn", weights=weights, device="cpu", center_crop=28, reference_images=5,
              shard_size=4, batch_size=3)

    # the re-statement: crop each readable file with ADM's crop, features through the extractor, numpy statistics
    files = sorted(p for p in raw.rglob("*") if p.is_file() and p.name != "broken.JPEG")
    crops = np.stack([np.asarray(center_crop_arr(Image.open(p).convert("RGB"), 28)) for p in files])
    extractor = build_feature_extractor("fmnist-cnn", ["128"], weights=weights)
    direct = extract_features(open_images(crops), extractor)["128"].double().numpy()

    calls = {"n": 0}
    real_write = metrics._write_partial

    def killed_after_two_shards(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        real_write(*args)

    monkeypatch.setattr(metrics, "_write_partial", killed_after_two_shards)
    with pytest.raises(KeyboardInterrupt):
        build_reference_statistics(raw, tmp_path / "ref.npz", **kw)
    assert sorted(p.name for p in (tmp_path / "ref.npz.partial").iterdir()) == \
        ["moments.npz", "part_000000.npz", "part_000001.npz"]
    with pytest.raises(MetricsError, match="partial pass made with other settings .*preprocessing"):
        build_reference_statistics(raw, tmp_path / "ref.npz", **{**kw, "center_crop": 30})
    monkeypatch.setattr(metrics, "_write_partial", real_write)
    seen = []
    real_batches = metrics.feature_batches
    monkeypatch.setattr(metrics, "feature_batches", lambda *a, **k: (seen.append(a[4:6]), real_batches(*a, **k))[1])
    with pytest.warns(UserWarning, match="1 unreadable file"):
        resumed = build_reference_statistics(raw, tmp_path / "ref.npz", **kw)
    assert seen == [(8, 12)]  # only the unfinished shard was read again
    assert not (tmp_path / "ref.npz.partial").exists()

    # (float32 features of batches cut differently by the shards: equal to float32 rounding)
    np.testing.assert_allclose(resumed.statistics.mu, direct.mean(0), rtol=0, atol=1e-7)
    np.testing.assert_allclose(resumed.statistics.sigma, np.cov(direct, rowvar=False), rtol=0, atol=1e-8)
    assert resumed.statistics.count == 11 and resumed.spatial_statistics is None  # no spatial layer in fmnist-cnn
    info = resumed.info
    assert info["preprocessing"]["center_crop"] == 28 and "center_crop_arr" in info["preprocessing"]["method"]
    assert list(info["skipped"]) == ["n00000000/broken.JPEG"] and info["reference_images"]["count"] == 5
    kept = np.load(tmp_path / "ref.npz")
    assert kept["arr_0"].shape == (5, 28, 28, 3) and kept["arr_0_features"].shape == (5, 128)
    # the reference images are 5 distinct crops, in file order, stored with their features
    matches = [int(np.flatnonzero((crops == img).all(axis=(1, 2, 3)))[0]) for img in kept["arr_0"]]
    np.testing.assert_allclose(kept["arr_0_features"], direct[matches], rtol=1e-5, atol=1e-6)
    assert sorted(matches) == matches and len(set(matches)) == 5

    # an uninterrupted pass gives the same numbers bit for bit; a finished file with the same options is kept
    with pytest.warns(UserWarning, match="1 unreadable file"):
        whole = build_reference_statistics(raw, tmp_path / "whole.npz", **kw)
    np.testing.assert_array_equal(whole.statistics.sigma, resumed.statistics.sigma)
    np.testing.assert_array_equal(np.load(tmp_path / "whole.npz")["arr_0_features"], kept["arr_0_features"])
    seen.clear()
    assert build_reference_statistics(raw, tmp_path / "ref.npz", **kw).info == resumed.info
    assert seen == []

    # the file serves as a reference: cached features of arr_0, the same numbers as recomputing them
    samples = torch.from_numpy(crops[:6]).permute(0, 3, 1, 2)
    ev = Evaluator(tmp_path / "ref.npz", metrics=["fid", "pr"], feature_extractor="fmnist-cnn", weights=weights,
                   device="cpu")
    ev.prepare_reference()
    assert ev.ref_features is not None and seen == []  # no pass over the reference images
    with pytest.warns(UserWarning, match="covariance is singular"):
        cached = ev.score(ev.features(samples))
    np.savez(tmp_path / "adm_like.npz", mu=kept["mu"], sigma=kept["sigma"], arr_0=kept["arr_0"])
    with pytest.warns(UserWarning, match="covariance is singular"):
        recomputed = compute_metrics(samples, tmp_path / "adm_like.npz", metrics=["fid", "pr"],
                                     feature_extractor="fmnist-cnn", weights=weights, device="cpu")["metrics"]
    assert recomputed == pytest.approx(cached, rel=1e-6)
    with pytest.raises(MetricsError, match="--center-crop applies to image folders"):
        open_images(tmp_path / "adm_like.npz", center_crop=28)
    with pytest.raises(MetricsError, match="cannot read .*broken.JPEG: UnidentifiedImageError"):
        open_images(raw)  # without the crop a set must be complete: a broken file is an error
    (raw / "n00000000" / "broken.JPEG").unlink()
    with pytest.raises(MetricsError, match="all images of a set must have one size.*--center-crop"):
        batches(open_images(raw))


@pytest.mark.filterwarnings("ignore:.*covariance is singular:UserWarning")
def test_evaluator_scores_features_gathered_from_shards(tmp_path):
    """The trainer's use: each process extracts features of its share, one process scores the concatenation; the
    numbers equal one call on the whole set, and extracting features never touches the reference."""
    torch.manual_seed(0)
    weights = save_weights(FashionMNISTClassifier(), tmp_path / "w.safetensors")
    g = torch.Generator().manual_seed(2)
    samples = torch.randint(0, 256, (20, 1, 28, 28), dtype=torch.uint8, generator=g)
    reference = torch.randint(0, 200, (30, 1, 28, 28), dtype=torch.uint8, generator=g)
    kw = dict(metrics=["fid", "is", "pr"], feature_extractor="fmnist-cnn", weights=weights, device="cpu")
    evaluator = Evaluator(reference, **kw)
    shards = [evaluator.features(part) for part in samples.split(7)]
    assert not evaluator._prepared  # no reference features computed by feature extraction
    gathered = {role: torch.cat([s[role] for s in shards]) for role in shards[0]}
    assert sorted(gathered) == ["logits", "pool"] and gathered["pool"].shape == (20, 128)
    whole = compute_metrics(samples, reference, **kw)["metrics"]
    assert evaluator.score(gathered) == pytest.approx(whole, rel=1e-6)
    assert evaluator.score(gathered) == pytest.approx(whole, rel=1e-6)  # scoring again reuses the reference


def test_reference_read_in_shares_per_process_equals_one_pass(tmp_path):
    """In-training FID prepares the reference before training with every process reading one contiguous share of its
    images (two ranks here, as threads joined by a real all-gather): each reads only its share, and the statistics
    and features equal one pass over all of them."""
    import threading

    torch.manual_seed(0)
    weights = save_weights(FashionMNISTClassifier(), tmp_path / "w.safetensors")
    reference = torch.randint(0, 200, (31, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    kw = dict(metrics=["fid", "pr"], feature_extractor="fmnist-cnn", weights=weights, device="cpu", batch_size=4)
    whole = Evaluator(reference, **kw)
    whole.prepare_reference()
    ranks = [Evaluator(reference, **kw) for _ in range(2)]
    read = [0, 0]
    for rank, evaluator in enumerate(ranks):
        evaluator.extractor.register_forward_hook(lambda m, args, out, r=rank: read.__setitem__(r, read[r] + len(args[0])))
    shares, barrier = [None, None], threading.Barrier(2)

    def gather_for(rank):
        def gather(obj):
            shares[rank] = obj
            barrier.wait()
            return list(shares)
        return gather

    threads = [threading.Thread(target=ev.prepare_reference, args=(r, 2, gather_for(r))) for r, ev in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert read == [15, 16]  # 31 images: 0..14 on rank 0, 15..30 on rank 1
    for ev in ranks:
        # equal up to float32 round-off: a share starts mid-batch, so the batches the convolutions see differ
        torch.testing.assert_close(ev.ref_features, whole.ref_features, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ev.ref_pool.mu, whole.ref_pool.mu, rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(ev.ref_pool.sigma, whole.ref_pool.sigma, rtol=1e-5, atol=1e-7)
