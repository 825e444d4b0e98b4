"""The metric set of the DiT tables, as ADM's evaluator computes it: FID, sFID, Inception Score, Precision and
Recall, from one feature pass over the samples, with the protocol recorded next to the numbers.

    result = compute_metrics("samples.npz", "VIRTUAL_imagenet256_labeled.npz", weights="inception.pth")
    result["metrics"]   # {"fid", "sfid", "is", "precision", "recall"}
    result["protocol"]  # counts, sources, layers, weights, the samples' sampling protocol, versions

One reference, many sample sets (e.g. during training, feature extraction sharded over processes)::

    evaluator = Evaluator("ref_stats.npz", metrics=["fid"], weights="inception.pth", device="cuda")
    features = evaluator.features(images_uint8)     # on any process: {"pool": [n, 2048], ...}, CPU tensors
    evaluator.score(gathered_features)              # on one process: {"fid": ...}

What is computed, and ADM's counterpart (torch-fidelity's ``inception-v3-compat`` reproduces the TensorFlow
Inception graph ADM's evaluator runs; see :class:`diffusion.evaluation.features.InceptionV3WithSpatial`):

* ``fid``: Frechet distance of the 2048-d pool features (ADM ``pool_3``; layer ``"2048"``), float64 mean and
  covariance, ADM's formula with the trace of the matrix root from symmetric eigenvalues (``frechet_method="eigh"``,
  seconds) or, as ADM computes it, from ``scipy.linalg.sqrtm`` (``"sqrtm"``, a slower Schur decomposition); equal
  to 1e-6.
* ``sfid``: the same on ADM's spatial features (``mixed_6/conv``, first 7 channels, NHWC order: 2023-d).
* ``is``: ``softmax(pool @ W)`` without the bias (ADM's graph; torch-fidelity's ``"logits_unbiased"``), over
  consecutive splits of 5,000 samples, the mean of ``exp(mean KL(p(y|x) || p(y)))``.
* ``pr`` -> ``precision``, ``recall``: k-nearest-neighbour manifolds (k = 3) on the pool features, precision
  = share of samples inside some reference ball, recall = share of reference images inside some sample ball;
  squared distances computed op by op in float16 as ADM's TensorFlow graph does (float32 where that overflows).
  The reference side is the reference batch's images (``arr_0``, 10,000 in ADM's files).
* ``kid`` (not in the DiT tables; torch-fidelity's formula) on request.

Why not only ``torch_fidelity.calculate_metrics``: it cannot use precomputed reference statistics such as ADM's
``VIRTUAL_imagenet256_labeled.npz``, which every published DiT number is measured against, nor read ADM's ``.npz``
sample files, and it has no sFID nor ADM's IS splits and Precision/Recall.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from diffusion.evaluation.features import (INCEPTION, LOGITS, POOL, SPATIAL, build_feature_extractor, default_device,
                                           extract_features, extractor_layers)
from diffusion.evaluation.images import ImageSet, ImageSource, check_count, open_images, read_sampling_protocol
from diffusion.evaluation.metrics import (ADM_IS_SPLIT_SIZE, ADM_PR_NEIGHBOURS, FRECHET_METHODS, FeatureStatistics,
                                          MetricsError, frechet_distance, inception_score, precision_recall)
from diffusion.evaluation.reference import Reference, open_reference

METRICS = ("fid", "sfid", "is", "pr", "kid")
DIT_METRICS = ("fid", "sfid", "is", "pr")  # the columns of the DiT tables (pr gives precision and recall)


def _check_statistics_match(ref: FeatureStatistics, extractor: str, layer: str, source: str,
                            dim: Optional[int] = None) -> None:
    if ref.feature_extractor is not None and ref.feature_extractor != extractor:
        raise MetricsError(f"reference {source} holds {ref.feature_extractor} statistics; samples use {extractor}. "
                           "Use the same --feature-extractor, or recompute the reference statistics.")
    if ref.feature_layer is not None and ref.feature_layer != layer:
        raise MetricsError(f"reference {source} holds layer {ref.feature_layer} statistics; samples use layer {layer}")
    if dim is not None and len(ref.mu) != dim:
        raise MetricsError(
            f"reference {source} has {len(ref.mu)}-d statistics but {extractor} layer {layer} gives {dim}-d features "
            "(statistics without metadata, like ADM's, are Inception pool3: inception-v3-compat layer 2048)."
        )


def say(progress: bool, message: str) -> None:
    """A progress line on stderr (stdout carries the results), before a step that can take a while."""
    if progress:
        print(message, file=sys.stderr, flush=True)


def _versions() -> dict:
    import scipy
    import torch_fidelity

    return {"torch": torch.__version__, "torch_fidelity": torch_fidelity.__version__, "scipy": scipy.__version__,
            "numpy": np.__version__}


class Evaluator:
    """The metrics of sample sets against one reference: the extractor is built and the reference checked once;
    then :meth:`features` (one pass over a sample set, on any process) and :meth:`score` (on the features of the
    whole set, e.g. gathered from all processes with ``torch.cat``) as often as needed. What the reference must
    compute (the features of its images, if it holds images) is computed once, on the first :meth:`score` (or
    :meth:`prepare_reference`), so processes that only extract features never read the reference images.

    ``metrics``: any of ``fid``, ``sfid``, ``is``, ``pr`` (precision and recall), ``kid``. None: the DiT tables'
    set (``fid``, ``sfid``, ``is``, ``pr``) as far as the extractor and the reference allow; what they do not
    allow is skipped with a warning and listed in the protocol (a metric asked for by name is an error instead).
    """

    def __init__(self, reference=None, *, metrics: Optional[Sequence[str]] = None, feature_extractor: str = INCEPTION,
                 weights=None, feature_layer: Optional[str] = None, device: Optional[str] = None, batch_size: int = 50,
                 num_workers: int = 0, value_range=None, progress: bool = False, frechet_method: str = "eigh",
                 is_split_size: int = ADM_IS_SPLIT_SIZE, pr_neighbours: int = ADM_PR_NEIGHBOURS,
                 pr_batch_size: int = 5000, pr_float16: bool = True, kid_subsets: int = 100,
                 kid_subset_size: int = 1000, seed: int = 2020):
        self.name, self.device = feature_extractor, device or default_device()
        self.batch_size, self.num_workers = batch_size, num_workers
        self.value_range, self.progress = value_range, progress
        if frechet_method not in FRECHET_METHODS:
            raise MetricsError(f"frechet_method {frechet_method!r}: choose one of {', '.join(FRECHET_METHODS)}")
        self.frechet_method = frechet_method
        self.is_split_size, self.pr_neighbours, self.pr_batch_size, self.pr_float16 = (
            is_split_size, pr_neighbours, pr_batch_size, pr_float16)
        self.kid_subsets, self.kid_subset_size, self.seed = kid_subsets, kid_subset_size, seed
        available_layers = extractor_layers(feature_extractor, feature_layer, (POOL, SPATIAL, LOGITS))

        explicit = metrics is not None
        if explicit:
            wanted = list(dict.fromkeys(metrics))
        else:
            wanted = [m for m in DIT_METRICS if m != "sfid" or SPATIAL in available_layers]
        unknown = [m for m in wanted if m not in METRICS]
        if unknown or not wanted:
            raise MetricsError(f"metrics {unknown or wanted}: choose from {', '.join(METRICS)}")
        needs_reference = [m for m in wanted if m != "is"]
        if needs_reference and reference is None:
            raise MetricsError(f"{', '.join(needs_reference)} need a reference (image folder, .npz images, or "
                               "statistics .npz); pass --reference, or --metrics is")
        if isinstance(reference, (str, os.PathLike)):
            say(progress, f"reading the reference {reference}")
        self.reference = open_reference(reference, value_range) if reference is not None else None
        if self.reference is not None and self.reference.statistics is None:
            check_count(self.reference.images, None, "reference")

        self.metrics, self.skipped = [], {}
        for metric in wanted:
            reason = self._unavailable(metric, available_layers)
            if reason is None:
                self.metrics.append(metric)
            elif explicit:
                raise MetricsError(reason)
            else:
                self.skipped[metric] = reason
        if self.skipped:
            warnings.warn("skipped " + "; ".join(f"{m}: {r}" for m, r in self.skipped.items()), stacklevel=2)
        roles = {POOL} if {"fid", "pr", "kid"} & set(self.metrics) else set()
        roles |= {SPATIAL} if "sfid" in self.metrics else set()
        roles |= {LOGITS} if "is" in self.metrics else set()
        self.layers = {role: available_layers[role] for role in (POOL, SPATIAL, LOGITS) if role in roles}
        ref = self.reference
        if ref is not None and ref.statistics is not None and "fid" in self.metrics:
            _check_statistics_match(ref.statistics, feature_extractor, self.layers[POOL], ref.source)
        if ref is not None and ref.spatial_statistics is not None and "sfid" in self.metrics:
            _check_statistics_match(ref.spatial_statistics, feature_extractor, self.layers[SPATIAL], ref.source)
        say(progress, f"loading the {feature_extractor} feature extractor")
        self.extractor = build_feature_extractor(feature_extractor, list(self.layers.values()), weights, self.device)
        theirs, ours = (ref.info.get("extractor_weights_sha256") if ref else None), self.extractor.weights_sha256
        if theirs and ours and theirs != ours:
            raise MetricsError(f"reference {ref.source} was computed with other {feature_extractor} weights (SHA-256 "
                               f"{theirs[:12]}, this run {ours[:12]} from {self.extractor.weights_path}); use the "
                               "weights it was made with, or rebuild it with --save-stats")
        self._prepared = False

    def _unavailable(self, metric: str, layers: dict) -> Optional[str]:
        """Why ``metric`` cannot be computed with this extractor and reference (None: it can)."""
        ref = self.reference
        has_images = ref is not None and (ref.images is not None or ref.image_features is not None)
        if metric == "sfid":
            if SPATIAL not in layers:
                return f"sfid needs ADM's spatial Inception features; {self.name} has none"
            if ref.spatial_statistics is None and ref.statistics is not None:
                return (f"reference {ref.source} holds no sFID statistics (mu_s, sigma_s); rebuild it with "
                        "diffusion.fid --save-stats")
        if metric == "is" and LOGITS not in layers:
            return f"is needs class logits; {self.name} has none"
        if metric in ("pr", "kid") and not has_images:
            return (f"{metric} needs reference images; {ref.source} holds only statistics (ADM's reference batches "
                    "and --save-stats files carry them as arr_0)")
        return None

    def prepare_reference(self, rank: int = 0, world: int = 1,
                          gather: Optional[Callable[[Any], List[Any]]] = None) -> None:
        """Reference statistics and pool features for the chosen metrics, from the file or one pass over its images.

        With ``world`` > 1 every process calls this with its ``rank`` and ``gather`` (``obj -> [obj of each rank]``,
        e.g. an all-gather): each extracts the features of one contiguous share of the reference images, and the
        shares are joined in order, so no process waits while another reads the whole reference."""
        if self._prepared:
            return
        self._prepared = True
        ref, pool = self.reference, self.layers.get(POOL)
        self.ref_pool, self.ref_spatial, self.ref_features = None, None, None
        if ref is None:
            return
        self.ref_pool, self.ref_spatial = ref.statistics, ref.spatial_statistics
        need_pool_features = bool({"pr", "kid"} & set(self.metrics))
        if need_pool_features and ref.image_features is not None and self._cache_matches(ref):
            self.ref_features = torch.from_numpy(ref.image_features)
            need_pool_features = False
        need_pass = need_pool_features or ("fid" in self.metrics and self.ref_pool is None) or \
            ("sfid" in self.metrics and self.ref_spatial is None)
        if not need_pass:
            return
        if ref.images is None:
            raise MetricsError(f"reference {ref.source}: its cached features are from "
                               f"{ref.info.get('feature_extractor')} layer {ref.info.get('arr_0_features_layer')} and "
                               "it holds no images to recompute them")
        features = self._reference_features(rank, world, gather)
        meta = dict(feature_extractor=self.name)
        if need_pool_features:
            self.ref_features = features[POOL]
        if "fid" in self.metrics and self.ref_pool is None:
            self.ref_pool = FeatureStatistics.from_features(features[POOL], feature_layer=pool, **meta)
        if "sfid" in self.metrics and self.ref_spatial is None:
            self.ref_spatial = FeatureStatistics.from_features(features[SPATIAL], feature_layer=self.layers[SPATIAL],
                                                               **meta)

    def _reference_features(self, rank: int, world: int, gather) -> Dict[str, torch.Tensor]:
        image_set = self._image_set(self.reference.images)
        if world == 1:
            return self.features(image_set)
        n = len(image_set)
        shares = gather(self.features(image_set, n * rank // world, n * (rank + 1) // world))
        return {role: torch.cat([share[role] for share in shares]) for role in self.layers}

    def _cache_matches(self, ref: Reference) -> bool:
        info = ref.info
        return info.get("feature_extractor") == self.name and info.get("arr_0_features_layer") == self.layers[POOL]

    def _image_set(self, images) -> ImageSet:
        return images if isinstance(images, ImageSet) else open_images(images, self.value_range)

    def features(self, images, start: int = 0, stop: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """One pass over ``images`` (any :func:`open_images` source or an :class:`ImageSet`; positions ``start ..
        stop - 1``, all by default): ``{role: float32 [N, D]}`` on the CPU for the roles the metrics read
        (``pool``, ``spatial``, ``logits``)."""
        by_layer = extract_features(self._image_set(images), self.extractor, self.batch_size, self.num_workers,
                                    self.progress, start, stop)
        return {role: by_layer[layer] for role, layer in self.layers.items()}

    def score(self, features: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """The metrics from the features of the whole sample set (e.g. gathered from all processes)."""
        self.prepare_reference()
        out = {}
        if "fid" in self.metrics:
            out["fid"] = self._frechet(features[POOL], self.ref_pool, POOL, "fid")
        if "sfid" in self.metrics:
            out["sfid"] = self._frechet(features[SPATIAL], self.ref_spatial, SPATIAL, "sfid")
        if "is" in self.metrics:
            out["is"] = inception_score(features[LOGITS], self.is_split_size)
        if "pr" in self.metrics:
            out["precision"], out["recall"] = precision_recall(self.ref_features, features[POOL], self.pr_neighbours,
                                                               self.pr_batch_size, self.pr_float16, self.device,
                                                               progress=self.progress)
        if "kid" in self.metrics:
            from torch_fidelity.metric_kid import kid_features_to_metric

            smallest = min(len(features[POOL]), len(self.ref_features))
            if self.kid_subset_size > smallest:
                raise MetricsError(f"kid_subset_size={self.kid_subset_size} exceeds the smaller image set "
                                   f"({smallest}); pass --kid-subset-size {smallest} or fewer")
            kid = kid_features_to_metric(features[POOL], self.ref_features, kid_subsets=self.kid_subsets,
                                         kid_subset_size=self.kid_subset_size, rng_seed=self.seed,
                                         verbose=self.progress)
            out.update(kid_mean=kid["kernel_inception_distance_mean"], kid_std=kid["kernel_inception_distance_std"])
        return out

    def _frechet(self, features: torch.Tensor, reference: FeatureStatistics, role: str, metric: str) -> float:
        stats = FeatureStatistics.from_features(features)
        _check_statistics_match(reference, self.name, self.layers[role], self.reference.source, dim=len(stats.mu))
        if stats.count <= len(stats.mu):
            warnings.warn(f"{stats.count} samples for {len(stats.mu)}-d features: the covariance is singular and "
                          "the Frechet distance strongly biased; compare only numbers with equal sample counts "
                          "(published FIDs use 50,000)", stacklevel=3)
        say(self.progress, f"{metric}: Frechet distance of {len(stats.mu)}-d statistics ({self.frechet_method}"
                           f"{', the slower root' if self.frechet_method == 'sqrtm' else ''}) ...")
        return frechet_distance(stats.mu, stats.sigma, reference.mu, reference.sigma, method=self.frechet_method)

    def protocol(self) -> dict:
        """How the numbers are made: recorded next to them."""
        self.prepare_reference()
        out = {
            "metrics": self.metrics,
            "reference": self.reference.describe() if self.reference is not None else None,
            "feature_extractor": self.name,
            "feature_layer": self.layers.get(POOL),
            "feature_layers": dict(self.layers),
            "extractor_weights": self.extractor.weights_path,
            "extractor_weights_sha256": self.extractor.weights_sha256,
            "versions": _versions(),
        }
        if self.skipped:
            out["skipped"] = dict(self.skipped)
        if {"fid", "sfid"} & set(self.metrics):
            out["frechet_distance"] = {
                "eigh": "float64 mean/covariance; ADM's formula, tr((S1 S2)^(1/2)) from the eigenvalues of the "
                        "symmetric F^T S2 F, S1 = F F^T",
                "sqrtm": "float64 mean/covariance; ADM evaluator formula with scipy.linalg.sqrtm"}[self.frechet_method]
            out["frechet_method"] = self.frechet_method
        if "is" in self.metrics:
            out["is"] = {"layer": self.layers[LOGITS], "split_size": self.is_split_size,
                         "rule": "ADM: consecutive splits, mean of exp(mean KL)"}
        if "pr" in self.metrics:
            out["pr"] = {"k": self.pr_neighbours, "layer": self.layers[POOL], "reference_count": len(self.ref_features),
                         "distances": "float16 ops as ADM (float32 on overflow)" if self.pr_float16 else "float32"}
        if "kid" in self.metrics:
            out["kid"] = {"subsets": self.kid_subsets, "subset_size": self.kid_subset_size, "seed": self.seed}
        return out


def compute_metrics(samples: Union[ImageSource, ImageSet], reference=None, *, metrics: Optional[Sequence[str]] = None,
                    expected_count: Optional[int] = None, value_range=None, **evaluator_options) -> dict:
    """The metrics of ``samples`` against ``reference`` (see :class:`Evaluator` for ``metrics`` and the options).

    Returns ``{"metrics": {"fid", "sfid", "is", "precision", "recall", ...}, "protocol": {...}}`` with the protocol
    recorded: counts, sources, extractor, layers, weights file and its SHA-256, the samples' own sampling protocol
    (if ``diffusion.sample`` wrote one), skipped metrics and library versions.
    """
    samples_set = samples if isinstance(samples, ImageSet) else open_images(samples, value_range)
    check_count(samples_set, expected_count, "samples")
    evaluator = Evaluator(reference, metrics=metrics, value_range=value_range, **evaluator_options)
    scores = evaluator.score(evaluator.features(samples_set))
    samples_info = samples_set.describe()
    sampling = read_sampling_protocol(samples)
    if sampling is not None:
        samples_info["sampling"] = sampling
    return {"metrics": scores, "protocol": {"samples": samples_info, **evaluator.protocol()}}
