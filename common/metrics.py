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
Inception graph ADM's evaluator runs; see :class:`common.feature_extractors.InceptionV3WithSpatial`):

* ``fid``: Frechet distance of the 2048-d pool features (ADM ``pool_3``; layer ``"2048"``), float64 mean and
  covariance, ``scipy.linalg.sqrtm`` as ADM.
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

Reference statistics files have ADM's reference-batch layout, so ADM's files and ours are read by the same code
(and ours by ADM's evaluator): ``mu``, ``sigma`` (pool), ``mu_s``, ``sigma_s`` (spatial), ``arr_0`` (uint8
NHWC reference images for Precision/Recall); ours add ``count``, ``feature_extractor``, ``feature_layer``,
``arr_0_features`` (the pool features of ``arr_0``, so they are not recomputed) and ``info`` (a JSON string:
source, preprocessing, extractor weights SHA-256, skipped files). :func:`build_reference_statistics` writes them,
streaming over any number of images, resumable.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm.auto import tqdm

from common.data import IMAGE_EXTENSIONS, ImageFolderError, center_crop_arr, image_files
from common.durable import atomic_savez
from common.feature_extractors import INCEPTION, build_feature_extractor, default_layer, registered_class

PathLike = Union[str, os.PathLike]
ImageSource = Union[PathLike, torch.Tensor, np.ndarray]
FASHION_MNIST_PREFIX = "fashion-mnist:"
SAMPLING_PROTOCOL_KEY = "protocol"      # JSON string inside a samples .npz
SAMPLING_PROTOCOL_FILE = "protocol.json"  # ... or this file inside a samples folder
INFO_KEY = "info"                         # JSON string inside our statistics files

POOL, SPATIAL, LOGITS = "pool", "spatial", "logits"  # what each metric reads: Evaluator.features() keys
METRICS = ("fid", "sfid", "is", "pr", "kid")
DIT_METRICS = ("fid", "sfid", "is", "pr")  # the columns of the DiT tables (pr gives precision and recall)
ADM_IS_SPLIT_SIZE = 5000
ADM_PR_NEIGHBOURS = 3
ADM_REFERENCE_IMAGES = 10000  # images in ADM's reference batches (arr_0), used for Precision/Recall
CENTER_CROP_METHOD = ("ADM's center_crop_arr (common.data): halve with a box filter while the short side is "
                      ">= 2x the size, bicubic resize of the short side to the size, central square")


class MetricsError(ValueError):
    """Inputs that cannot give a meaningful metric: wrong range/shape/dtype, NaN, too few or mismatched counts."""


# ----------------------------------------------------------------------------- statistics and distance

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

    def save(self, path: PathLike) -> Path:
        """An ADM-compatible ``.npz`` of these statistics alone (:func:`save_reference_statistics`)."""
        return save_reference_statistics(path, self)

    def _metadata(self) -> dict:
        return {k: np.array(v) for k, v in (("count", self.count), ("feature_extractor", self.feature_extractor),
                                            ("feature_layer", self.feature_layer)) if v is not None}

    @classmethod
    def load(cls, path: PathLike) -> "FeatureStatistics":
        """The pool statistics (``mu``, ``sigma``) of a statistics file, ADM's or ours."""
        return load_reference_statistics(path).statistics

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


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray,
                     eps: float = 1e-6) -> float:
    """Frechet distance between N(mu1, sigma1) and N(mu2, sigma2), in float64:

    ``|mu1 - mu2|^2 + tr(sigma1) + tr(sigma2) - 2 tr((sigma1 sigma2)^(1/2))``.

    As in ADM's evaluator and pytorch-fid: ``scipy.linalg.sqrtm`` of the product; if that is not finite
    (near-singular covariances, e.g. fewer samples than feature dimensions) retry with ``eps`` added to both
    diagonals; drop the imaginary part that rounding leaves, but fail if it is not negligible.
    """
    from scipy import linalg

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
    covmean = linalg.sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean).all():
        offset = np.eye(d) * eps
        covmean = linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        imag = np.abs(np.diagonal(covmean).imag).max()
        if imag > 1e-3:
            raise MetricsError(f"sqrtm(sigma1 sigma2) has a non-negligible imaginary part ({imag:.3g}); "
                               "the covariances are not valid (too few samples or broken features?)")
        covmean = covmean.real
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * np.trace(covmean))


# ----------------------------------------------------------------------------- image sets

def images_to_uint8(images: torch.Tensor, value_range: Tuple[float, float] = (-1.0, 1.0)) -> torch.Tensor:
    """Float images in ``value_range`` -> uint8 ``[0, 255]``, rounding to nearest.

    For ``(-1, 1)`` this equals DiT's ``clamp(127.5 * x + 128, 0, 255).to(uint8)``. Raises on NaN/inf and on
    values outside the range (more than 0.1% of its width): clamp decoder outputs before calling this.
    """
    if not images.is_floating_point():
        raise MetricsError(f"images_to_uint8 expects floating-point images, got {images.dtype}")
    lo, hi = (float(v) for v in value_range)
    if not hi > lo:
        raise MetricsError(f"value_range {value_range} must be (low, high) with low < high")
    bad = ~torch.isfinite(images)
    if bad.any():
        per_image = bad.flatten(1).any(dim=1) if images.dim() > 1 else bad
        raise MetricsError(f"{int(per_image.sum())} of {len(images)} images contain NaN/inf values")
    tol = 1e-3 * (hi - lo)
    vmin, vmax = float(images.min()), float(images.max())
    if vmin < lo - tol or vmax > hi + tol:
        raise MetricsError(
            f"image values span [{vmin:.4g}, {vmax:.4g}] but value_range is ({lo:g}, {hi:g}). Pass the range the "
            f"images are really in (value_range=(0, 1) / (-1, 1) / (0, 255)), or clamp them first (x.clamp({lo:g}, {hi:g}))."
        )
    return ((images.double() - lo) * (255.0 / (hi - lo))).round().clamp(0, 255).to(torch.uint8)


def _check_layout(shape: Sequence[int], where: str, layout: str) -> None:
    channels = shape[1] if layout == "NCHW" else shape[-1]
    if len(shape) != 4 or channels not in (1, 3) or min(shape[1:]) < 1:
        raise MetricsError(f"{where}: expected images of shape {layout} with 1 or 3 channels, got {tuple(shape)}")



class ImageSet:
    """A finite set of images that yields uint8 ``[B, C, H, W]`` batches (C = 1 or 3), with their positions."""

    kind = "images"

    def __init__(self, source: str, count: int):
        self.source = source
        self.count = count
        self.skipped: Dict[str, str] = {}  # unreadable files that were left out (only folders read with a crop)

    def __len__(self) -> int:
        return self.count

    def indexed_batches(self, batch_size: int, num_workers: int = 0, start: int = 0,
                        stop: Optional[int] = None) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """``(positions, images)`` for the images at positions ``start .. stop - 1``, in order."""
        raise NotImplementedError

    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        for _, images in self.indexed_batches(batch_size, num_workers):
            yield images

    def fingerprint(self) -> str:
        """What identifies the content for a resumed pass (a folder: its file list)."""
        return f"{self.kind}:{self.source}:{self.count}"

    def describe(self) -> dict:
        return {"kind": self.kind, "source": self.source, "count": self.count}


class TensorImages(ImageSet):
    """Images already in memory, uint8 ``[N, C, H, W]``."""

    kind = "tensor"

    def __init__(self, images: torch.Tensor, source: str = "<tensor>"):
        _check_layout(images.shape, source, "NCHW")
        super().__init__(source, len(images))
        self.images = images

    def indexed_batches(self, batch_size, num_workers=0, start=0, stop=None):
        stop = self.count if stop is None else stop
        for i in range(start, stop, batch_size):
            j = min(i + batch_size, stop)
            yield torch.arange(i, j), self.images[i:j]


class _FolderDataset(Dataset):
    """Item ``i``: ``(uint8 [3, H, W] or None, i, error or None)``; errors travel to the main process as text."""

    def __init__(self, files: List[Path], size: Tuple[int, int], center_crop: Optional[int]):
        self.files, self.size, self.center_crop = files, size, center_crop

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        path = self.files[i]
        try:
            with Image.open(path) as img:
                if self.center_crop is None and img.size != self.size:
                    return None, i, (
                        f"{path} is {img.size[0]}x{img.size[1]} but the folder's first image is {self.size[0]}x"
                        f"{self.size[1]}; all images of a set must have one size (to build reference statistics "
                        "from a raw folder, pass --center-crop SIZE)")
                img = img.convert("RGB")  # decodes now: a truncated file fails here
            if self.center_crop is not None:
                img = center_crop_arr(img, self.center_crop)
            array = np.asarray(img)
        except Exception as err:  # noqa: BLE001 - PIL raises many types for broken files
            return None, i, f"cannot read {path}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return torch.from_numpy(array.copy()).permute(2, 0, 1), i, None


def _collate_folder(items):
    good = [item for item in items if item[0] is not None]
    images = torch.stack([item[0] for item in good]) if good else None
    return torch.tensor([item[1] for item in good], dtype=torch.long), images, [(i, e) for _, i, e in items if e]


class FolderImages(ImageSet):
    """PNG/JPEG files under a folder (recursively, sorted), read as RGB.

    Without ``center_crop`` all must have one size and an unreadable file is an error (a sample set must be
    complete). With ``center_crop=S`` (reference statistics of a raw folder such as ImageNet's) each image gets
    ADM's center crop to ``S x S``, and unreadable files are left out and listed in ``skipped``, as
    ``diffusion.extract_latents`` does with the same folder.
    """

    kind = "folder"

    def __init__(self, folder: PathLike, center_crop: Optional[int] = None):
        from PIL import Image

        folder = Path(folder)
        try:
            files = sorted(Path(p) for p in image_files(folder) if os.path.isfile(p))
        except ImageFolderError as err:
            raise MetricsError(str(err)) from None
        if not files:
            raise MetricsError(f"no {'/'.join(IMAGE_EXTENSIONS)} images found under {folder}")
        if center_crop is not None and center_crop < 1:
            raise MetricsError(f"--center-crop {center_crop} must be a positive size in pixels")
        size = None
        if center_crop is None:
            try:
                with Image.open(files[0]) as img:
                    size = img.size
            except Exception as err:  # noqa: BLE001 - PIL raises many types for broken files
                raise MetricsError(f"cannot read {files[0]}: {type(err).__name__}: {err}") from err
        super().__init__(str(folder), len(files))
        self.folder, self.center_crop = folder, center_crop
        self.dataset = _FolderDataset(files, size, center_crop)

    def indexed_batches(self, batch_size, num_workers=0, start=0, stop=None):
        stop = self.count if stop is None else stop
        loader = DataLoader(Subset(self.dataset, range(start, stop)), batch_size=batch_size, num_workers=num_workers,
                            shuffle=False, collate_fn=_collate_folder)
        for positions, images, errors in loader:
            for i, error in errors:
                if self.center_crop is None:
                    raise MetricsError(error)
                self.skipped[str(self.dataset.files[i].relative_to(self.folder))] = error
            if images is not None:
                yield positions, images

    def fingerprint(self) -> str:
        listing = "\n".join(str(p.relative_to(self.folder)) for p in self.dataset.files)
        return f"folder:{self.count}:{hashlib.sha256(listing.encode()).hexdigest()}"

    def describe(self) -> dict:
        out = super().describe()
        if self.center_crop is not None:
            out["center_crop"] = self.center_crop
        return out


class NpzImages(ImageSet):
    """``arr_0`` of an ADM-format ``.npz`` (uint8 ``[N, H, W, 3]`` or ``[N, H, W]``), streamed in batches.

    Written by hand because ``np.load`` reads the whole array: 50K 256px images are 9.8 GB.
    """

    kind = "npz"

    def __init__(self, path: PathLike, key: str = "arr_0"):
        self.path, self.member = Path(path), key + ".npy"
        with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as f:
            self.shape, self.dtype = _read_npy_header(f, f"{self.path}:{key}")
        if self.dtype != np.uint8:
            raise MetricsError(
                f"{self.path}:{key} has dtype {self.dtype}; ADM sample files hold uint8 [N, H, W, 3] in [0, 255]. "
                "Convert float images with images_to_uint8 (or np.clip(np.rint(x * 127.5 + 127.5), 0, 255).astype(np.uint8) "
                "for [-1, 1])."
            )
        if len(self.shape) == 3:
            self.shape = (*self.shape, 1)
        _check_layout(self.shape, f"{self.path}:{key}", "NHWC")
        super().__init__(str(self.path), self.shape[0])

    def indexed_batches(self, batch_size, num_workers=0, start=0, stop=None):
        stop = self.count if stop is None else stop
        image_bytes = math.prod(self.shape[1:])
        with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as f:
            _read_npy_header(f, str(self.path))
            if start:
                f.seek(start * image_bytes, os.SEEK_CUR)
            for i in range(start, stop, batch_size):
                n = min(batch_size, stop - i)
                data = f.read(n * image_bytes)
                if len(data) != n * image_bytes:
                    raise MetricsError(f"{self.path} is truncated: expected {self.count} images, data ends at {i}")
                array = np.frombuffer(data, np.uint8).reshape(n, *self.shape[1:])
                yield torch.arange(i, i + n), torch.from_numpy(array.copy()).permute(0, 3, 1, 2)

    def fingerprint(self) -> str:
        return f"npz:{self.shape}:{self.path.stat().st_size}"


def _read_npy_header(f, where: str):
    version = np.lib.format.read_magic(f)
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in readers:
        raise MetricsError(f"{where}: unsupported .npy format version {version}")
    shape, fortran_order, dtype = readers[version](f)
    if fortran_order:
        raise MetricsError(f"{where} is stored in Fortran order; re-save it with np.savez(path, np.ascontiguousarray(x))")
    return tuple(shape), dtype


def _npz_keys(path: Path) -> List[str]:
    try:
        with zipfile.ZipFile(path) as zf:
            return [n[:-4] for n in zf.namelist() if n.endswith(".npy")]
    except zipfile.BadZipFile as err:
        raise MetricsError(f"{path} is not a readable .npz file ({err})") from err


def _npz_path(path: PathLike) -> Path:
    path = Path(path)
    if path.suffix != ".npz":
        raise MetricsError(f"statistics files end in .npz (numpy appends it otherwise); got {path}")
    return path


def open_images(source: ImageSource, value_range: Optional[Tuple[float, float]] = None,
                center_crop: Optional[int] = None) -> ImageSet:
    """An :class:`ImageSet` from:

    * a folder of PNG/JPEG files (``center_crop=S``: ADM's center crop of every image to S x S, for raw folders);
      an ``.npz`` with ``arr_0`` uint8 NHWC (ADM's sample format);
    * ``fashion-mnist:train`` / ``fashion-mnist:test`` (the IDX files, see :mod:`common.data`);
    * a torch tensor ``[N, C, H, W]`` or a numpy array ``[N, H, W, C]`` (ADM layout): uint8, or float with
      ``value_range`` (converted by :func:`images_to_uint8`).
    """
    image_set = _open_images(source, value_range, center_crop)
    if center_crop is not None and not isinstance(image_set, FolderImages):
        raise MetricsError(f"--center-crop applies to image folders (raw images of any size); {image_set.source} is "
                           f"{image_set.kind} images")
    return image_set


def _open_images(source: ImageSource, value_range, center_crop) -> ImageSet:
    if isinstance(source, (torch.Tensor, np.ndarray)):
        is_numpy = isinstance(source, np.ndarray)
        x = torch.from_numpy(np.ascontiguousarray(source)) if is_numpy else source.detach().cpu()
        if is_numpy and x.dim() == 3:
            x = x[..., None]
        _check_layout(x.shape, "image array" if is_numpy else "image tensor", "NHWC" if is_numpy else "NCHW")
        if is_numpy:
            x = x.permute(0, 3, 1, 2)
        if x.is_floating_point():
            if value_range is None:
                raise MetricsError("float images need value_range=(low, high), e.g. (-1, 1) for diffusion samples "
                                   "or (0, 1); or pass uint8 images in [0, 255]")
            x = images_to_uint8(x, value_range)
        elif x.dtype != torch.uint8:
            raise MetricsError(f"images must be uint8 in [0, 255] or float with value_range, got {x.dtype}")
        return TensorImages(x.contiguous())
    source = str(source)
    if source.startswith(FASHION_MNIST_PREFIX):
        from common.data import load_fashion_mnist

        images, _ = load_fashion_mnist(source[len(FASHION_MNIST_PREFIX):])
        return TensorImages(torch.from_numpy(images.copy())[:, None], source=source)
    path = Path(source).expanduser()
    if path.is_dir():
        return FolderImages(path, center_crop)
    if not path.exists():
        raise MetricsError(f"{source!r} not found (expected an image folder, an .npz file or "
                           f"{FASHION_MNIST_PREFIX}train/test)")
    if path.suffix != ".npz":
        raise MetricsError(f"{path}: image files are read from a folder, or an .npz with arr_0 (uint8 NHWC)")
    keys = _npz_keys(path)
    if "arr_0" not in keys:
        if {"mu", "sigma"} <= set(keys):
            raise MetricsError(f"{path} holds feature statistics (mu, sigma), not images: use it as the reference")
        raise MetricsError(f"{path} has no 'arr_0' images (entries: {keys})")
    return NpzImages(path)


def read_sampling_protocol(source: ImageSource) -> Optional[dict]:
    """How a samples set was made, as written next to it by ``diffusion.sample`` (None if not recorded)."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = Path(source)
    if path.is_dir() and (path / SAMPLING_PROTOCOL_FILE).is_file():
        return json.loads((path / SAMPLING_PROTOCOL_FILE).read_text())
    if path.is_file() and path.suffix == ".npz" and SAMPLING_PROTOCOL_KEY in _npz_keys(path):
        with np.load(path, allow_pickle=False) as npz:
            return json.loads(str(npz[SAMPLING_PROTOCOL_KEY]))
    return None


# ----------------------------------------------------------------------------- features

@torch.no_grad()
def feature_batches(images: ImageSet, extractor, batch_size: int = 50, num_workers: int = 0, start: int = 0,
                    stop: Optional[int] = None) -> Iterator[Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]]:
    """``(positions, uint8 images, {layer: float32 features on the CPU})`` per batch of a torch-fidelity extractor.

    Grey images are repeated to RGB (torch-fidelity's extractors take RGB; ``fmnist-cnn`` averages them back).
    """
    device = next(extractor.parameters()).device
    for positions, batch in images.indexed_batches(batch_size, num_workers, start, stop):
        rgb = batch.expand(-1, 3, -1, -1) if batch.shape[1] == 1 else batch
        outputs = extractor(rgb.to(device))
        yield positions, batch, {name: f.float().cpu() for name, f in zip(extractor.features_list, outputs)}


def extract_features(images: ImageSet, extractor, batch_size: int = 50, num_workers: int = 0,
                     progress: bool = False) -> Dict[str, torch.Tensor]:
    """All images' features, ``{layer: float32 [N, D]}`` on the CPU, one pass of :func:`feature_batches`."""
    out: Dict[str, List[torch.Tensor]] = {name: [] for name in extractor.features_list}
    seen, skipped_before = 0, len(images.skipped)
    bar = tqdm(total=len(images), unit="img", desc=f"features {images.source}", disable=not progress, leave=False)
    for _, batch, features in feature_batches(images, extractor, batch_size, num_workers):
        for name, f in features.items():
            out[name].append(f)
        seen += len(batch)
        bar.update(len(batch))
    bar.close()
    if seen + len(images.skipped) - skipped_before != len(images):
        raise MetricsError(f"{images.source}: read {seen} images, expected {len(images)}")
    if seen == 0:
        raise MetricsError(f"{images.source}: no readable images")
    return {name: torch.cat(chunks) for name, chunks in out.items()}


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
                   device="cpu") -> torch.Tensor:
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
            d = d if nearest is None else torch.cat([nearest, d], dim=1)
            nearest = d.topk(min(k + 1, d.shape[1]), dim=1, largest=False).values  # sorted ascending
        radii.append(nearest[:, k])
    return torch.cat(radii).cpu()


def precision_recall(reference: torch.Tensor, samples: torch.Tensor, k: int = ADM_PR_NEIGHBOURS,
                     batch_size: int = 5000, float16: bool = True, device="cpu") -> Tuple[float, float]:
    """ADM's improved Precision and Recall (Kynkaanniemi et al. 2019) of ``samples`` against ``reference`` features:
    precision = share of samples within the k-NN radius of some reference vector, recall = share of reference
    vectors within the k-NN radius of some sample (distances ``<=`` radii, as ADM)."""
    reference, samples = reference.to(device), samples.to(device)  # once, not per block
    ref_radii = manifold_radii(reference, k, batch_size, float16, device).to(device)
    sample_radii = manifold_radii(samples, k, batch_size, float16, device).to(device)
    sample_inside = torch.zeros(len(samples), dtype=torch.bool, device=device)
    ref_inside = torch.zeros(len(reference), dtype=torch.bool, device=device)
    for i in range(0, len(reference), batch_size):
        rows, row_radii = reference[i: i + batch_size], ref_radii[i: i + batch_size]
        for j in range(0, len(samples), batch_size):
            d = pairwise_distances(rows, samples[j: j + batch_size], float16)
            sample_inside[j: j + batch_size] |= (d <= row_radii[:, None]).any(dim=0)
            ref_inside[i: i + batch_size] |= (d <= sample_radii[j: j + batch_size][None, :]).any(dim=1)
    return float(sample_inside.double().mean()), float(ref_inside.double().mean())


# ----------------------------------------------------------------------------- references

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
    keys = set(_npz_keys(path))
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
    path = _npz_path(path)
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
        if {"mu", "sigma"} <= set(_npz_keys(Path(source))):
            return load_reference_statistics(source)
    images = open_images(source, value_range)
    return Reference(images=images, source=images.source)


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


def _check_count(images: ImageSet, expected: Optional[int], what: str) -> None:
    if expected is not None and len(images) != expected:
        raise MetricsError(f"{what} {images.source} holds {len(images)} images but {expected} were expected "
                           "(an unfinished sampling run? rerun diffusion.sample with the same options to complete it)")
    if len(images) < 2:
        raise MetricsError(f"{what} {images.source} holds {len(images)} image(s); metrics need at least 2")


def _versions() -> dict:
    import scipy
    import torch_fidelity

    return {"torch": torch.__version__, "torch_fidelity": torch_fidelity.__version__, "scipy": scipy.__version__,
            "numpy": np.__version__}


def extractor_layers(feature_extractor: str, feature_layer: Optional[str], roles: Sequence[str]) -> Dict[str, str]:
    """``{role: layer}`` for the roles the extractor provides (``feature_layer`` overrides the pool layer)."""
    provided = registered_class(feature_extractor).get_provided_features_list()
    if feature_layer is not None and feature_layer not in provided:
        raise MetricsError(f"{feature_extractor} has no layer {feature_layer!r}; it provides {list(provided)}")
    defaults = {POOL: feature_layer or default_layer(feature_extractor, "fid"),
                SPATIAL: default_layer(feature_extractor, "sfid"), LOGITS: default_layer(feature_extractor, "isc")}
    return {role: defaults[role] for role in roles if defaults[role] in provided}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- the metric suite

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
                 num_workers: int = 0, value_range=None, progress: bool = False,
                 is_split_size: int = ADM_IS_SPLIT_SIZE, pr_neighbours: int = ADM_PR_NEIGHBOURS,
                 pr_batch_size: int = 5000, pr_float16: bool = True, kid_subsets: int = 100,
                 kid_subset_size: int = 1000, seed: int = 2020):
        self.name, self.device = feature_extractor, device or default_device()
        self.batch_size, self.num_workers = batch_size, num_workers
        self.value_range, self.progress = value_range, progress
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
        self.reference = open_reference(reference, value_range) if reference is not None else None
        if self.reference is not None and self.reference.statistics is None:
            _check_count(self.reference.images, None, "reference")

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

    def prepare_reference(self) -> None:
        """Reference statistics and pool features for the chosen metrics, from the file or one pass over its images."""
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
        features = self.features(ref.images)
        meta = dict(feature_extractor=self.name)
        if need_pool_features:
            self.ref_features = features[POOL]
        if "fid" in self.metrics and self.ref_pool is None:
            self.ref_pool = FeatureStatistics.from_features(features[POOL], feature_layer=pool, **meta)
        if "sfid" in self.metrics and self.ref_spatial is None:
            self.ref_spatial = FeatureStatistics.from_features(features[SPATIAL], feature_layer=self.layers[SPATIAL],
                                                               **meta)

    def _cache_matches(self, ref: Reference) -> bool:
        info = ref.info
        return info.get("feature_extractor") == self.name and info.get("arr_0_features_layer") == self.layers[POOL]

    def features(self, images) -> Dict[str, torch.Tensor]:
        """One pass over ``images`` (any :func:`open_images` source or an :class:`ImageSet`): ``{role: float32
        [N, D]}`` on the CPU for the roles the metrics read (``pool``, ``spatial``, ``logits``)."""
        image_set = images if isinstance(images, ImageSet) else open_images(images, self.value_range)
        by_layer = extract_features(image_set, self.extractor, self.batch_size, self.num_workers, self.progress)
        return {role: by_layer[layer] for role, layer in self.layers.items()}

    def score(self, features: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """The metrics from the features of the whole sample set (e.g. gathered from all processes)."""
        self.prepare_reference()
        out = {}
        if "fid" in self.metrics:
            out["fid"] = self._frechet(features[POOL], self.ref_pool, POOL)
        if "sfid" in self.metrics:
            out["sfid"] = self._frechet(features[SPATIAL], self.ref_spatial, SPATIAL)
        if "is" in self.metrics:
            out["is"] = inception_score(features[LOGITS], self.is_split_size)
        if "pr" in self.metrics:
            out["precision"], out["recall"] = precision_recall(self.ref_features, features[POOL], self.pr_neighbours,
                                                               self.pr_batch_size, self.pr_float16, self.device)
        if "kid" in self.metrics:
            from torch_fidelity.metric_kid import kid_features_to_metric

            smallest = min(len(features[POOL]), len(self.ref_features))
            if self.kid_subset_size > smallest:
                raise MetricsError(f"kid_subset_size={self.kid_subset_size} exceeds the smaller image set "
                                   f"({smallest}); pass --kid-subset-size {smallest} or fewer")
            kid = kid_features_to_metric(features[POOL], self.ref_features, kid_subsets=self.kid_subsets,
                                         kid_subset_size=self.kid_subset_size, rng_seed=self.seed, verbose=False)
            out.update(kid_mean=kid["kernel_inception_distance_mean"], kid_std=kid["kernel_inception_distance_std"])
        return out

    def _frechet(self, features: torch.Tensor, reference: FeatureStatistics, role: str) -> float:
        stats = FeatureStatistics.from_features(features)
        _check_statistics_match(reference, self.name, self.layers[role], self.reference.source, dim=len(stats.mu))
        if stats.count <= len(stats.mu):
            warnings.warn(f"{stats.count} samples for {len(stats.mu)}-d features: the covariance is singular and "
                          "the Frechet distance strongly biased; compare only numbers with equal sample counts "
                          "(published FIDs use 50,000)", stacklevel=3)
        return frechet_distance(stats.mu, stats.sigma, reference.mu, reference.sigma)

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
            out["frechet_distance"] = "float64 mean/covariance; ADM evaluator formula with scipy.linalg.sqrtm"
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
    _check_count(samples_set, expected_count, "samples")
    evaluator = Evaluator(reference, metrics=metrics, value_range=value_range, **evaluator_options)
    scores = evaluator.score(evaluator.features(samples_set))
    samples_info = samples_set.describe()
    sampling = read_sampling_protocol(samples)
    if sampling is not None:
        samples_info["sampling"] = sampling
    return {"metrics": scores, "protocol": {"samples": samples_info, **evaluator.protocol()}}


# ----------------------------------------------------------------------------- reference statistics of any size

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
    _check_count(image_set, None, "image set")
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
    path = None if path is None else _npz_path(path)
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
