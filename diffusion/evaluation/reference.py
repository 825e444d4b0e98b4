"""Reference statistics in ADM's reference-batch layout: read (ADM's files and ours), written, and built from image sets
of any size, streamed and resumable.

Reference statistics files have ADM's reference-batch layout, so ADM's files and ours are read by the same code
(and ours by ADM's evaluator): ``mu``, ``sigma`` (pool), ``mu_s``, ``sigma_s`` (spatial), ``arr_0`` (uint8
NHWC reference images for Precision/Recall); ours add ``count``, ``feature_extractor``, ``feature_layer``,
``arr_0_features`` (the pool features of ``arr_0``, so they are not recomputed) and ``info`` (a JSON string:
source, preprocessing, extractor weights SHA-256, skipped files). :func:`build_reference_statistics` writes them,
streaming over any number of images, resumable.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from common.durable import atomic_savez
from diffusion.evaluation.features import (INCEPTION, POOL, SPATIAL, build_feature_extractor, default_device,
                                           extractor_layers, feature_batches)
from diffusion.evaluation.images import (ImageSet, ImageSource, NpzImages, PathLike, TensorImages, check_count,
                                         npz_keys, npz_path, open_images)
from diffusion.evaluation.metrics import FeatureStatistics, MetricsError, RunningMoments

INFO_KEY = "info"  # JSON string inside our statistics files
ADM_REFERENCE_IMAGES = 10000  # images in ADM's reference batches (arr_0), used for Precision/Recall
CENTER_CROP_METHOD = ("ADM's center_crop_arr (common.data): halve with a box filter while the short side is "
                      ">= 2x the size, bicubic resize of the short side to the size, central square")


@dataclass
class Reference:
    """What a reference provides: pool statistics (FID), spatial statistics (sFID), images and their pool features
    (Precision/Recall, KID). ADM's reference batches hold all but the features; an image set only images."""

    statistics: Optional[FeatureStatistics] = None
    spatial_statistics: Optional[FeatureStatistics] = None
    images: Optional[ImageSet] = None
    image_features: Optional[np.ndarray] = None  # pool features of ``images``, cached in our statistics files
    info: dict = field(default_factory=dict)  # a statistics file's own record: source, preprocessing, weights, ...
    source: str = "<statistics>"

    def describe(self) -> dict:
        out = {"source": self.source}
        if self.statistics is not None:
            out["statistics"] = self.statistics.describe()
        if self.spatial_statistics is not None:
            out["spatial_statistics"] = self.spatial_statistics.describe()
        if self.images is not None:
            out["images"] = self.images.describe()
        if self.info:  # what the statistics file says of itself, without its long lists
            out["info"] = {k: v for k, v in self.info.items() if k not in ("skipped", "settings")}
            out["info"]["skipped"] = len(self.info.get("skipped", {}))
        return out


def load_reference_statistics(path: PathLike) -> Reference:
    """A statistics ``.npz``: ADM's reference batch (``mu``, ``sigma``, ``mu_s``, ``sigma_s``, ``arr_0``) or ours
    (the same plus metadata and ``arr_0_features``); only ``mu`` and ``sigma`` are required."""
    path = Path(path)
    keys = set(npz_keys(path))
    if not {"mu", "sigma"} <= keys:
        raise MetricsError(f"{path} has no 'mu'/'sigma' entries (it has {sorted(keys)}): not a statistics file")
    with np.load(path, allow_pickle=False) as npz:
        info = json.loads(str(npz[INFO_KEY])) if INFO_KEY in keys else {}
        meta = {k: npz[k].item() for k in ("count", "feature_extractor", "feature_layer") if k in keys}
        pool = FeatureStatistics._from_npz(npz, path, "", **meta)
        spatial = None
        if {"mu_s", "sigma_s"} <= keys:
            spatial = FeatureStatistics._from_npz(npz, path, "_s", count=meta.get("count"),
                                                  feature_extractor=meta.get("feature_extractor"),
                                                  feature_layer=info.get("spatial_layer"))
        features = npz["arr_0_features"].astype(np.float32) if "arr_0_features" in keys else None
    images = NpzImages(path) if "arr_0" in keys else None
    if features is not None and (images is None or len(features) != len(images)):
        raise MetricsError(f"{path}: arr_0_features does not match arr_0; rebuild the file with --save-stats")
    return Reference(pool, spatial, images, features, info, str(path))


def save_reference_statistics(path: PathLike, pool: FeatureStatistics, spatial: Optional[FeatureStatistics] = None,
                              images: Optional[np.ndarray] = None, image_features: Optional[np.ndarray] = None,
                              info: Optional[dict] = None) -> Path:
    """Write ADM's reference-batch layout plus our metadata, atomically and fsynced (``images``: uint8 NHWC)."""
    path = npz_path(path)
    arrays = {"mu": pool.mu, "sigma": pool.sigma, **pool._metadata(), INFO_KEY: np.array(json.dumps(info or {}))}
    if spatial is not None:
        arrays.update(mu_s=spatial.mu, sigma_s=spatial.sigma)
    if images is not None:
        arrays["arr_0"] = np.ascontiguousarray(images)
        if image_features is not None:
            arrays["arr_0_features"] = np.asarray(image_features, np.float32)
    atomic_savez(path, **arrays)
    return path


def open_reference(source: Union[ImageSource, FeatureStatistics, Reference], value_range=None) -> Reference:
    """A statistics ``.npz`` (:func:`load_reference_statistics`), a :class:`FeatureStatistics`, a :class:`Reference`,
    or any image source :func:`open_images` reads."""
    if isinstance(source, Reference):
        return source
    if isinstance(source, FeatureStatistics):
        return Reference(statistics=source)
    if isinstance(source, (str, os.PathLike)) and str(source).endswith(".npz") and Path(source).is_file():
        if {"mu", "sigma"} <= set(npz_keys(Path(source))):
            return load_reference_statistics(source)
    images = open_images(source, value_range)
    return Reference(images=images, source=images.source)


def build_reference_statistics(source: Union[ImageSource, ImageSet], path: Optional[PathLike] = None, *,
                               feature_extractor: str = INCEPTION, weights=None, feature_layer: Optional[str] = None,
                               center_crop: Optional[int] = None, reference_images: int = ADM_REFERENCE_IMAGES,
                               shard_size: int = 10000, seed: int = 0, batch_size: int = 50,
                               device: Optional[str] = None, num_workers: int = 0, value_range=None,
                               progress: bool = False) -> Reference:
    """Reference statistics of an image set in ADM's reference-batch layout, streamed: the pool (and, for Inception,
    spatial) mean and covariance over all images, plus ``reference_images`` images drawn at random (seeded) with
    their pool features, for Precision/Recall (ADM's reference batches hold 10,000).

    ``center_crop=S`` reads a raw folder (images of any size, e.g. ImageNet's train folder) with ADM's center crop
    to S x S (an opened image set brings its own crop); unreadable files are left out and listed. With ``path`` the result is written there (atomically), and
    the pass is resumable: after every ``shard_size`` images the running moments and the shard's share of reference
    images go to ``<path>.partial/`` (atomically); a rerun with the same options continues after the last finished
    shard, and a finished file with the same options is returned as it is.
    """
    if isinstance(source, ImageSet):  # the crop recorded is the one the set applies
        image_set, center_crop = source, getattr(source, "center_crop", None)
    else:
        image_set = open_images(source, value_range, center_crop)
    check_count(image_set, None, "image set")
    if shard_size < 1 or reference_images < 0:
        raise MetricsError(f"shard_size={shard_size} must be positive and reference_images={reference_images} >= 0")
    layers = extractor_layers(feature_extractor, feature_layer, (POOL, SPATIAL))
    if POOL not in layers:
        raise MetricsError(f"{feature_extractor} provides no pool features for statistics")
    extractor = build_feature_extractor(feature_extractor, list(layers.values()), weights, device or default_device())
    n = len(image_set)
    chosen = np.sort(np.random.default_rng(seed).choice(n, min(reference_images, n), replace=False))
    preprocessing = ({"center_crop": center_crop, "method": CENTER_CROP_METHOD} if center_crop is not None
                     else {"center_crop": None, "method": "none: images as stored (all of one size)"})
    settings = {"source": str(image_set.source), "files": n, "listing": image_set.fingerprint(),
                "preprocessing": preprocessing, "feature_extractor": feature_extractor, "feature_layer": layers[POOL],
                "spatial_layer": layers.get(SPATIAL), "extractor_weights_sha256": extractor.weights_sha256,
                "reference_images": len(chosen), "seed": seed, "shard_size": shard_size}
    path = None if path is None else npz_path(path)
    if path is not None and path.is_file():
        try:
            done = load_reference_statistics(path)
        except (MetricsError, OSError, ValueError):
            done = None  # not a statistics file: it is overwritten
        if done is not None and done.info.get("settings") == settings:
            return done
    work = None if path is None else path.with_name(path.name + ".partial")
    moments = {role: RunningMoments() for role in layers}
    parts: List[dict] = []
    first = _resume_partial(work, settings, moments) if work is not None else 0
    num_shards = math.ceil(n / shard_size)
    wanted = torch.from_numpy(chosen)
    bar = tqdm(total=n, initial=min(first * shard_size, n), unit="img", desc=f"reference statistics {image_set.source}",
               disable=not progress)
    for shard in range(first, num_shards):
        start, stop = shard * shard_size, min(n, (shard + 1) * shard_size)
        skipped_before = set(image_set.skipped)
        collected = {role: [] for role in layers}
        part = {"images": [], "features": []}
        for positions, images, features in feature_batches(image_set, extractor, batch_size, num_workers, start, stop):
            for role, layer in layers.items():
                collected[role].append(features[layer])
            keep = torch.isin(positions, wanted)
            if keep.any():
                part["images"].append(images[keep].permute(0, 2, 3, 1).numpy())
                part["features"].append(features[layers[POOL]][keep].numpy())
            bar.update(len(positions))
        for role in layers:
            if collected[role]:
                moments[role].add(torch.cat(collected[role]))
        part = {k: np.concatenate(v) if v else None for k, v in part.items()}
        part["skipped"] = {k: v for k, v in image_set.skipped.items() if k not in skipped_before}
        bar.update(len(part["skipped"]))
        if work is None:
            parts.append(part)
        else:
            _write_partial(work, shard, part, moments, settings)
    bar.close()
    if work is not None:
        parts = [_read_part(work, shard) for shard in range(num_shards)]
    skipped = {k: v for part in parts for k, v in part["skipped"].items()}
    meta = dict(feature_extractor=feature_extractor)
    pool = moments[POOL].statistics(feature_layer=layers[POOL], **meta)
    spatial = moments[SPATIAL].statistics(feature_layer=layers[SPATIAL], **meta) if SPATIAL in layers else None
    with_images = [p for p in parts if p["images"] is not None]
    images = np.concatenate([p["images"] for p in with_images]) if with_images else None
    image_features = np.concatenate([p["features"] for p in with_images]) if with_images else None
    info = {"source": str(image_set.source), "count": pool.count, "preprocessing": preprocessing,
            "feature_extractor": feature_extractor, "spatial_layer": layers.get(SPATIAL),
            "extractor_weights": extractor.weights_path, "extractor_weights_sha256": extractor.weights_sha256,
            "arr_0_features_layer": layers[POOL] if images is not None else None,
            "reference_images": {"count": 0 if images is None else len(images), "seed": seed,
                                 "positions": "drawn uniformly without replacement among all files"},
            "skipped": skipped, "settings": settings}
    if skipped:
        warnings.warn(f"{len(skipped)} unreadable file(s) left out of the statistics (listed in the file's info), "
                      f"e.g. {next(iter(skipped.values()))}", stacklevel=2)
    if path is None:
        nchw = None if images is None else TensorImages(torch.from_numpy(images).permute(0, 3, 1, 2))
        return Reference(pool, spatial, nchw, image_features, info, str(image_set.source))
    save_reference_statistics(path, pool, spatial, images, image_features, info)
    shutil.rmtree(work, ignore_errors=True)
    return load_reference_statistics(path)


def _resume_partial(work: Path, settings: dict, moments: Dict[str, RunningMoments]) -> int:
    """The first shard still to do in ``work`` (0 for a new pass); refuses a partial pass made with other settings."""
    state_file = work / "moments.npz"
    if not state_file.is_file():
        return 0
    with np.load(state_file, allow_pickle=False) as npz:
        old = json.loads(str(npz["settings"]))
        if old != settings:
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            raise MetricsError(f"{work} holds a partial pass made with other settings ({', '.join(diff)} differ); "
                               "rerun with the same options to continue it, or delete it to start over")
        for role in moments:
            moments[role] = RunningMoments.from_state(npz, role)
        return int(npz["shards_done"])


def _write_partial(work: Path, shard: int, part: dict, moments: Dict[str, RunningMoments], settings: dict) -> None:
    """The shard's reference images first, then the moments that count the shard as done: a kill in between
    only repeats the shard."""
    arrays = {k: v for k, v in part.items() if k != "skipped" and v is not None}
    atomic_savez(work / f"part_{shard:06d}.npz", skipped=np.array(json.dumps(part["skipped"])), **arrays)
    state = {k: v for role, m in moments.items() for k, v in m.state(role).items()}
    atomic_savez(work / "moments.npz", shards_done=np.array(shard + 1), settings=np.array(json.dumps(settings)), **state)


def _read_part(work: Path, shard: int) -> dict:
    with np.load(work / f"part_{shard:06d}.npz", allow_pickle=False) as npz:
        part = {k: (npz[k] if k in npz.files else None) for k in ("images", "features")}
        part["skipped"] = json.loads(str(npz["skipped"]))
    return part
