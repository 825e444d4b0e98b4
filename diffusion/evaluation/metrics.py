"""The metric maths of the DiT tables, as ADM's evaluator computes them, on features (no images, no networks).

* :func:`frechet_distance` (FID, sFID): float64 mean and covariance (:class:`FeatureStatistics`, or
  :class:`RunningMoments` for sets that arrive in parts); ADM's formula, its trace from symmetric eigenvalues
  (:func:`trace_sqrt_product`), or ADM's ``scipy.linalg.sqrtm`` with ``method="sqrtm"``.
* :func:`inception_score`: consecutive splits of 5,000, the mean of ``exp(mean KL(p(y|x) || p(y)))``.
* :func:`precision_recall`: k-nearest-neighbour manifolds (k = 3), squared distances op by op in float16 as ADM's
  TensorFlow graph computes them (:func:`pairwise_distances`; float32 where that overflows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import numpy as np
import torch

from common.cli import InputError

ADM_IS_SPLIT_SIZE = 5000
ADM_PR_NEIGHBOURS = 3
FRECHET_METHODS = ("eigh", "sqrtm")  # the fast symmetric eigenvalues (default), ADM's scipy.linalg.sqrtm


class MetricsError(InputError):
    """Inputs that cannot give a meaningful metric: wrong range/shape/dtype, NaN, too few or mismatched counts."""


def _as_float64(features: Union[torch.Tensor, np.ndarray]) -> np.ndarray:
    x = features.detach().cpu().numpy() if isinstance(features, torch.Tensor) else np.asarray(features)
    if x.ndim != 2:
        raise MetricsError(f"features must be [N, D], got shape {x.shape}")
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise MetricsError(f"{int((~np.isfinite(x)).any(axis=1).sum())} of {len(x)} feature vectors contain NaN/inf")
    return x


@dataclass
class FeatureStatistics:
    """Mean and covariance of features, float64; the metadata says which features (None: unknown, e.g. ADM)."""

    mu: np.ndarray
    sigma: np.ndarray
    count: Optional[int] = None
    feature_extractor: Optional[str] = None
    feature_layer: Optional[str] = None

    @classmethod
    def from_features(cls, features: Union[torch.Tensor, np.ndarray], **metadata) -> "FeatureStatistics":
        x = _as_float64(features)
        if len(x) < 2:
            raise MetricsError(f"a covariance needs at least 2 feature vectors, got {len(x)}")
        return cls(x.mean(axis=0), np.cov(x, rowvar=False), count=len(x), **metadata)

    def _metadata(self) -> dict:
        return {k: np.array(v) for k, v in (("count", self.count), ("feature_extractor", self.feature_extractor),
                                            ("feature_layer", self.feature_layer)) if v is not None}

    @classmethod
    def _from_npz(cls, npz, path: Path, suffix: str, **meta) -> "FeatureStatistics":
        mu, sigma = npz["mu" + suffix].astype(np.float64), npz["sigma" + suffix].astype(np.float64)
        if mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
            raise MetricsError(f"{path}: mu{suffix} {mu.shape} and sigma{suffix} {sigma.shape} are not a [D] mean and "
                               "[D, D] covariance")
        if meta.get("count") is not None:
            meta["count"] = int(meta["count"])
        return cls(mu, sigma, **meta)

    def describe(self) -> dict:
        return {"count": self.count, "dim": int(len(self.mu)), "feature_extractor": self.feature_extractor,
                "feature_layer": self.feature_layer}


class RunningMoments:
    """Mean and covariance of features that arrive in parts (float64; Chan, Golub and LeVeque's pairwise merge of
    counts, means and centred sums of squares), for image sets too large to hold their features at once."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, None, None

    def add(self, features: Union[torch.Tensor, np.ndarray]) -> None:
        x = _as_float64(features)
        if len(x) == 0:
            return
        mean = x.mean(axis=0)
        centred = x - mean
        m2 = centred.T @ centred
        if self.count == 0:
            self.count, self.mean, self.m2 = len(x), mean, m2
            return
        total = self.count + len(x)
        delta = mean - self.mean
        self.mean = self.mean + delta * (len(x) / total)
        self.m2 = self.m2 + m2 + np.outer(delta, delta) * (self.count * len(x) / total)
        self.count = total

    def statistics(self, **metadata) -> FeatureStatistics:
        if self.count < 2:
            raise MetricsError(f"a covariance needs at least 2 feature vectors, got {self.count}")
        return FeatureStatistics(self.mean, self.m2 / (self.count - 1), count=self.count, **metadata)

    def state(self, prefix: str) -> Dict[str, np.ndarray]:
        if self.count == 0:
            return {f"{prefix}_count": np.array(0)}
        return {f"{prefix}_count": np.array(self.count), f"{prefix}_mean": self.mean, f"{prefix}_m2": self.m2}

    @classmethod
    def from_state(cls, npz, prefix: str) -> "RunningMoments":
        moments = cls()
        moments.count = int(npz[f"{prefix}_count"])
        if moments.count:
            moments.mean, moments.m2 = npz[f"{prefix}_mean"], npz[f"{prefix}_m2"]
        return moments


def trace_sqrt_product(sigma1: np.ndarray, sigma2: np.ndarray) -> float:
    """``tr((sigma1 sigma2)^(1/2))`` of two covariances, in float64: the sum of the square roots of the eigenvalues
    of the symmetric ``F^T sigma2 F`` (``sigma1 = F F^T``: Cholesky, or ``V sqrt(W)`` from ``eigh`` where sigma1 is
    singular), which are those of ``sigma1 sigma2``. Why symmetric: a symmetric eigensolver returns them real and
    backward stable, where ``sqrtm`` or ``eigvals`` of the non-symmetric product leave complex rounding."""
    try:
        factor = np.linalg.cholesky(sigma1)
    except np.linalg.LinAlgError:  # positive semi-definite only (fewer samples than dimensions)
        values, vectors = np.linalg.eigh(sigma1)
        factor = vectors * np.sqrt(np.clip(values, 0.0, None))
    inner = factor.T @ sigma2 @ factor
    eigenvalues = np.linalg.eigvalsh((inner + inner.T) / 2)
    return float(np.sqrt(np.clip(eigenvalues, 0.0, None)).sum())


def _trace_sqrtm(sigma1: np.ndarray, sigma2: np.ndarray, eps: float) -> float:
    """ADM's evaluator (and pytorch-fid): ``scipy.linalg.sqrtm`` of the product; if that is not finite
    (near-singular covariances) retry with ``eps`` added to both diagonals; the imaginary part that rounding leaves
    is dropped, but must be negligible."""
    from scipy import linalg

    covmean = linalg.sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean).all():
        offset = np.eye(len(sigma1)) * eps
        covmean = linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        imag = np.abs(np.diagonal(covmean).imag).max()
        if imag > 1e-3:
            raise MetricsError(f"sqrtm(sigma1 sigma2) has a non-negligible imaginary part ({imag:.3g}); "
                               "the covariances are not valid (too few samples or broken features?)")
        covmean = covmean.real
    return float(np.trace(covmean))


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray,
                     eps: float = 1e-6, method: str = "eigh") -> float:
    """Frechet distance between N(mu1, sigma1) and N(mu2, sigma2), in float64:

    ``|mu1 - mu2|^2 + tr(sigma1) + tr(sigma2) - 2 tr((sigma1 sigma2)^(1/2))``, at least 0 (a set against itself
    gives 0, not the rounding's -1e-7).

    ``method``: ``eigh`` (default) takes the trace from eigenvalues (:func:`trace_sqrt_product`), seconds at
    2048-d; ``sqrtm`` is ADM's evaluator's ``scipy.linalg.sqrtm`` of the product (a Schur decomposition of a
    non-symmetric matrix: slower; ``eps`` is its retry offset). The two agree to 1e-6 relative on Inception-sized
    statistics.
    """
    if method not in FRECHET_METHODS:
        raise MetricsError(f"Frechet distance method {method!r}: choose one of {', '.join(FRECHET_METHODS)}")
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    d = len(mu1)
    if mu1.shape != mu2.shape or sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise MetricsError(
            f"statistics do not match: mu {mu1.shape} vs {mu2.shape}, sigma {sigma1.shape} vs {sigma2.shape}. "
            "Both sides must come from the same feature extractor and layer."
        )
    for name, a in (("mu1", mu1), ("mu2", mu2), ("sigma1", sigma1), ("sigma2", sigma2)):
        if not np.isfinite(a).all():
            raise MetricsError(f"{name} contains NaN/inf")
    diff = mu1 - mu2
    root_trace = trace_sqrt_product(sigma1, sigma2) if method == "eigh" else _trace_sqrtm(sigma1, sigma2, eps)
    return max(float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * root_trace), 0.0)


# ----------------------------------------------------------------------------- Inception Score, Precision/Recall

def inception_score(logits: Union[torch.Tensor, np.ndarray], split_size: int = ADM_IS_SPLIT_SIZE) -> float:
    """ADM's Inception Score: over consecutive splits of ``split_size`` samples (the last one may be shorter),
    ``exp(mean_x KL(p(y|x) || p(y)))`` with ``p(y)`` the split's mean, averaged over splits. float64, from
    log-softmax (ADM takes the log of float32 softmax outputs: equal to rounding)."""
    log_p = torch.as_tensor(logits).double().log_softmax(dim=1)
    scores = []
    for part in log_p.split(split_size):
        p = part.exp()
        kl = (p * (part - p.mean(dim=0, keepdim=True).log())).sum(dim=1).mean()
        scores.append(kl.exp().item())
    return float(np.mean(scores))


def _squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a * a).sum(1)[:, None] - 2.0 * (a @ b.T) + (b * b).sum(1)[None, :]).clamp_min(0.0)


def pairwise_distances(a: torch.Tensor, b: torch.Tensor, float16: bool = True) -> torch.Tensor:
    """Squared Euclidean distances ``|a_i - b_j|^2`` (float32) as ADM's ``DistanceBlock`` computes them:
    ``max(|a|^2 - 2 a.b + |b|^2, 0)``, every TensorFlow op's output rounded to float16 (inputs cast to float16;
    products and sums accumulated in float32, as GPUs do), falling back to float32 throughout where a float16
    value overflows. ``float16=False``: float32 throughout."""
    a, b = a.float(), b.float()
    if float16:
        a16, b16 = a.half().float(), b.half().float()
        norm_a = (a16 * a16).half().float().sum(1).half().float()
        norm_b = (b16 * b16).half().float().sum(1).half().float()
        twice = (2.0 * (a16 @ b16.T).half().float()).half().float()
        d = ((norm_a[:, None] - twice).half().float() + norm_b[None, :]).half().float().clamp_min(0.0)
        if torch.isfinite(d).all():
            return d
    return _squared_distances(a, b)


def manifold_radii(features: torch.Tensor, k: int = ADM_PR_NEIGHBOURS, batch_size: int = 5000, float16: bool = True,
                   device="cpu", on_block=None) -> torch.Tensor:
    """Distance (squared, as ADM) from each feature vector to its k-th nearest neighbour in the set, the vector
    itself counting as the 0-th (ADM's ``ManifoldEstimator.manifold_radii``), in row x column blocks."""
    if len(features) <= k:
        raise MetricsError(f"precision/recall need more than k={k} feature vectors per set, got {len(features)}")
    features = features.to(device)  # once: 50k x 2048 float32 is 400 MB, moved blockwise it would be ~4 GB of copies
    radii = []
    for rows in features.split(batch_size):
        nearest = None
        for cols in features.split(batch_size):
            d = pairwise_distances(rows, cols, float16)
            if on_block is not None:
                on_block()
            d = d if nearest is None else torch.cat([nearest, d], dim=1)
            nearest = d.topk(min(k + 1, d.shape[1]), dim=1, largest=False).values  # sorted ascending
        radii.append(nearest[:, k])
    return torch.cat(radii).cpu()


def precision_recall(reference: torch.Tensor, samples: torch.Tensor, k: int = ADM_PR_NEIGHBOURS,
                     batch_size: int = 5000, float16: bool = True, device="cpu",
                     progress: bool = False) -> Tuple[float, float]:
    """ADM's improved Precision and Recall (Kynkaanniemi et al. 2019) of ``samples`` against ``reference`` features:
    precision = share of samples within the k-NN radius of some reference vector, recall = share of reference
    vectors within the k-NN radius of some sample (distances ``<=`` radii, as ADM). ``progress``: a bar over the
    distance blocks (50,000 samples take minutes on a CPU)."""
    from tqdm.auto import tqdm

    blocks = [math.ceil(len(x) / batch_size) for x in (reference, samples)]
    bar = tqdm(total=blocks[0] ** 2 + blocks[1] ** 2 + blocks[0] * blocks[1], unit="block",
               desc="precision/recall distances", disable=not progress, leave=False)
    reference, samples = reference.to(device), samples.to(device)  # once, not per block
    ref_radii = manifold_radii(reference, k, batch_size, float16, device, bar.update).to(device)
    sample_radii = manifold_radii(samples, k, batch_size, float16, device, bar.update).to(device)
    sample_inside = torch.zeros(len(samples), dtype=torch.bool, device=device)
    ref_inside = torch.zeros(len(reference), dtype=torch.bool, device=device)
    for i in range(0, len(reference), batch_size):
        rows, row_radii = reference[i: i + batch_size], ref_radii[i: i + batch_size]
        for j in range(0, len(samples), batch_size):
            d = pairwise_distances(rows, samples[j: j + batch_size], float16)
            sample_inside[j: j + batch_size] |= (d <= row_radii[:, None]).any(dim=0)
            ref_inside[i: i + batch_size] |= (d <= sample_radii[j: j + batch_size][None, :]).any(dim=1)
            bar.update()
    bar.close()
    return float(sample_inside.double().mean()), float(ref_inside.double().mean())
