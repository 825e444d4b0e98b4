"""FID (and IS/KID on request) for generated images: torch-fidelity's features, our statistics and distance.

    result = compute_metrics("samples.npz", "VIRTUAL_imagenet256_labeled.npz", weights="inception.pth")
    result["metrics"]["fid"], result["protocol"]

Pieces, usable alone (e.g. for a small FID during training)::

    images = open_images("samples/")                         # folder, ADM .npz (arr_0 uint8 NHWC), tensor, array
    extractor = build_feature_extractor("inception-v3-compat", ["2048"], weights=..., device="cuda")
    stats = FeatureStatistics.from_features(extract_features(images, extractor)["2048"])
    frechet_distance(stats.mu, stats.sigma, ref.mu, ref.sigma)

Why not only ``torch_fidelity.calculate_metrics``: it cannot use precomputed reference statistics such as ADM's
``VIRTUAL_imagenet256_labeled.npz`` (``mu``, ``sigma``), which every published DiT FID is measured against, nor
read ADM's ``.npz`` sample files. Features come from torch-fidelity's extractors (its ``inception-v3-compat``
reproduces the TensorFlow Inception of ADM's evaluator); statistics are float64 and the Frechet distance is the
ADM/pytorch-fid formula with ``scipy.linalg.sqrtm``. With the same features it equals torch-fidelity's FID.

Statistics files are ADM-compatible ``.npz`` (``mu``, ``sigma``) plus our metadata (``count``,
``feature_extractor``, ``feature_layer``), so ADM's files and ours are read by the same code.
"""
from __future__ import annotations

import json
import math
import os
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from common.feature_extractors import INCEPTION, build_feature_extractor, default_layer

PathLike = Union[str, os.PathLike]
ImageSource = Union[PathLike, torch.Tensor, np.ndarray]
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
FASHION_MNIST_PREFIX = "fashion-mnist:"
SAMPLING_PROTOCOL_KEY = "protocol"      # JSON string inside a samples .npz
SAMPLING_PROTOCOL_FILE = "protocol.json"  # ... or this file inside a samples folder


class MetricsError(ValueError):
    """Inputs that cannot give a meaningful metric: wrong range/shape/dtype, NaN, too few or mismatched counts."""


# ----------------------------------------------------------------------------- statistics and distance

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
        x = features.detach().cpu().numpy() if isinstance(features, torch.Tensor) else np.asarray(features)
        if x.ndim != 2:
            raise MetricsError(f"features must be [N, D], got shape {x.shape}")
        if len(x) < 2:
            raise MetricsError(f"a covariance needs at least 2 feature vectors, got {len(x)}")
        x = x.astype(np.float64)
        if not np.isfinite(x).all():
            raise MetricsError(f"{int((~np.isfinite(x)).any(axis=1).sum())} of {len(x)} feature vectors contain NaN/inf")
        return cls(x.mean(axis=0), np.cov(x, rowvar=False), count=len(x), **metadata)

    def save(self, path: PathLike) -> Path:
        """Write an ADM-compatible ``.npz`` (``mu``, ``sigma``) with our metadata, atomically."""
        path = Path(path)
        if path.suffix != ".npz":
            raise MetricsError(f"statistics files end in .npz (numpy appends it otherwise); got {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = {k: np.array(v) for k, v in (("count", self.count), ("feature_extractor", self.feature_extractor),
                                             ("feature_layer", self.feature_layer)) if v is not None}
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, mu=self.mu, sigma=self.sigma, **extra)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: PathLike) -> "FeatureStatistics":
        path = Path(path)
        with np.load(path, allow_pickle=False) as npz:
            if "mu" not in npz.files or "sigma" not in npz.files:
                raise MetricsError(f"{path} has no 'mu'/'sigma' entries (it has {npz.files}): not a statistics file")
            meta = {k: npz[k].item() for k in ("count", "feature_extractor", "feature_layer") if k in npz.files}
            mu, sigma = npz["mu"].astype(np.float64), npz["sigma"].astype(np.float64)
        if mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
            raise MetricsError(f"{path}: mu {mu.shape} and sigma {sigma.shape} are not a [D] mean and [D, D] covariance")
        if "count" in meta:
            meta["count"] = int(meta["count"])
        return cls(mu, sigma, **meta)

    def describe(self) -> dict:
        return {"count": self.count, "dim": int(len(self.mu)), "feature_extractor": self.feature_extractor,
                "feature_layer": self.feature_layer}


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
    """A finite set of images that yields uint8 ``[B, C, H, W]`` batches (C = 1 or 3)."""

    kind = "images"

    def __init__(self, source: str, count: int):
        self.source = source
        self.count = count

    def __len__(self) -> int:
        return self.count

    def batches(self, batch_size: int, num_workers: int = 0) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"kind": self.kind, "source": self.source, "count": self.count}


class TensorImages(ImageSet):
    """Images already in memory, uint8 ``[N, C, H, W]``."""

    kind = "tensor"

    def __init__(self, images: torch.Tensor, source: str = "<tensor>"):
        _check_layout(images.shape, source, "NCHW")
        super().__init__(source, len(images))
        self.images = images

    def batches(self, batch_size, num_workers=0):
        for i in range(0, self.count, batch_size):
            yield self.images[i: i + batch_size]


class _FolderDataset(Dataset):
    def __init__(self, files: List[Path], size: Tuple[int, int]):
        self.files, self.size = files, size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.files[i]) as img:
            if img.size != self.size:
                raise MetricsError(f"{self.files[i]} is {img.size[0]}x{img.size[1]} but the folder's first image is "
                                   f"{self.size[0]}x{self.size[1]}; all images of a set must have one size")
            array = np.asarray(img.convert("RGB"))
        return torch.from_numpy(array.copy()).permute(2, 0, 1)


class FolderImages(ImageSet):
    """PNG/JPEG files under a folder (recursively, sorted), read as RGB; all of one size."""

    kind = "folder"

    def __init__(self, folder: PathLike):
        from PIL import Image

        folder = Path(folder)
        files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not files:
            raise MetricsError(f"no {'/'.join(IMAGE_EXTENSIONS)} images found under {folder}")
        with Image.open(files[0]) as img:
            size = img.size
        super().__init__(str(folder), len(files))
        self.dataset = _FolderDataset(files, size)

    def batches(self, batch_size, num_workers=0):
        yield from DataLoader(self.dataset, batch_size=batch_size, num_workers=num_workers, shuffle=False)


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

    def batches(self, batch_size, num_workers=0):
        image_bytes = math.prod(self.shape[1:])
        with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as f:
            _read_npy_header(f, str(self.path))
            for start in range(0, self.count, batch_size):
                n = min(batch_size, self.count - start)
                data = f.read(n * image_bytes)
                if len(data) != n * image_bytes:
                    raise MetricsError(f"{self.path} is truncated: expected {self.count} images, data ends at {start}")
                array = np.frombuffer(data, np.uint8).reshape(n, *self.shape[1:])
                yield torch.from_numpy(array.copy()).permute(0, 3, 1, 2)


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


def open_images(source: ImageSource, value_range: Optional[Tuple[float, float]] = None) -> ImageSet:
    """An :class:`ImageSet` from:

    * a folder of PNG/JPEG files; an ``.npz`` with ``arr_0`` uint8 NHWC (ADM's sample format);
    * ``fashion-mnist:train`` / ``fashion-mnist:test`` (the IDX files, see :mod:`common.data`);
    * a torch tensor ``[N, C, H, W]`` or a numpy array ``[N, H, W, C]`` (ADM layout): uint8, or float with
      ``value_range`` (converted by :func:`images_to_uint8`).
    """
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
        return FolderImages(path)
    if not path.is_file():
        raise MetricsError(f"{source!r} is neither an image folder, an .npz file nor {FASHION_MNIST_PREFIX}train/test")
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
def extract_features(images: ImageSet, extractor, batch_size: int = 50, num_workers: int = 0,
                     progress: bool = False) -> Dict[str, torch.Tensor]:
    """Run a torch-fidelity feature extractor over all images: ``{layer: float32 [N, D]}`` on the CPU.

    Grey images are repeated to RGB (torch-fidelity's extractors take RGB; ``fmnist-cnn`` averages them back).
    """
    device = next(extractor.parameters()).device
    out: Dict[str, List[torch.Tensor]] = {name: [] for name in extractor.features_list}
    seen = 0
    bar = tqdm(total=len(images), unit="img", desc=f"features {images.source}", disable=not progress, leave=False)
    for batch in images.batches(batch_size, num_workers):
        if batch.shape[1] == 1:
            batch = batch.expand(-1, 3, -1, -1)
        for name, feats in zip(extractor.features_list, extractor(batch.to(device))):
            out[name].append(feats.float().cpu())
        seen += len(batch)
        bar.update(len(batch))
    bar.close()
    if seen != len(images):
        raise MetricsError(f"{images.source}: read {seen} images, expected {len(images)}")
    return {name: torch.cat(chunks) for name, chunks in out.items()}


# ----------------------------------------------------------------------------- references and metrics

@dataclass
class Reference:
    """What a reference provides: statistics (FID), images (FID, KID), or both (ADM's reference batches)."""

    statistics: Optional[FeatureStatistics] = None
    images: Optional[ImageSet] = None
    source: str = "<statistics>"

    def describe(self) -> dict:
        out = {"source": self.source}
        if self.statistics is not None:
            out["statistics"] = self.statistics.describe()
        if self.images is not None:
            out["images"] = self.images.describe()
        return out


def open_reference(source: Union[ImageSource, FeatureStatistics], value_range=None) -> Reference:
    """A statistics ``.npz`` (ADM's or ours; ADM reference batches also carry ``arr_0`` images), a
    :class:`FeatureStatistics`, or any image source :func:`open_images` reads."""
    if isinstance(source, FeatureStatistics):
        return Reference(statistics=source)
    if isinstance(source, (str, os.PathLike)) and str(source).endswith(".npz") and Path(source).is_file():
        keys = _npz_keys(Path(source))
        if {"mu", "sigma"} <= set(keys):
            images = NpzImages(source) if "arr_0" in keys else None
            return Reference(statistics=FeatureStatistics.load(source), images=images, source=str(source))
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


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_statistics(images: Union[ImageSource, ImageSet], feature_extractor: str = INCEPTION, weights=None,
                       feature_layer: Optional[str] = None, batch_size: int = 50, device: Optional[str] = None,
                       num_workers: int = 0, value_range=None, progress: bool = False) -> FeatureStatistics:
    """FID statistics of an image set (e.g. to cache a reference once with ``FeatureStatistics.save``)."""
    images = images if isinstance(images, ImageSet) else open_images(images, value_range)
    _check_count(images, None, "image set")
    layer = feature_layer or default_layer(feature_extractor, "fid")
    extractor = build_feature_extractor(feature_extractor, [layer], weights, device or default_device())
    features = extract_features(images, extractor, batch_size, num_workers, progress)[layer]
    return FeatureStatistics.from_features(features, feature_extractor=feature_extractor, feature_layer=layer)


def compute_metrics(samples: ImageSource, reference=None, *, feature_extractor: str = INCEPTION, weights=None,
                    feature_layer: Optional[str] = None, fid: bool = True, isc: bool = False, kid: bool = False,
                    expected_count: Optional[int] = None, isc_splits: int = 10, kid_subsets: int = 100,
                    kid_subset_size: int = 1000, seed: int = 2020, batch_size: int = 50, device: Optional[str] = None,
                    num_workers: int = 0, value_range=None, progress: bool = False) -> dict:
    """FID of ``samples`` against ``reference`` (and IS of the samples, KID against reference images, on request).

    Returns ``{"metrics": {"fid", "isc_mean", "isc_std", "kid_mean", "kid_std"}, "protocol": {...}}`` with the
    protocol recorded: counts, sources, extractor, layer, weights file, the samples' own sampling protocol
    (if ``diffusion.sample`` wrote one) and library versions.
    """
    if not (fid or isc or kid):
        raise MetricsError("nothing to compute: enable at least one of fid, isc, kid")
    samples_set = samples if isinstance(samples, ImageSet) else open_images(samples, value_range)
    _check_count(samples_set, expected_count, "samples")
    ref = None
    if fid or kid:
        if reference is None:
            raise MetricsError("FID and KID need a reference (image folder, .npz images, or statistics .npz)")
        ref = open_reference(reference, value_range)
        if ref.images is not None:
            _check_count(ref.images, None, "reference")
        if kid and ref.images is None:
            raise MetricsError(f"KID needs reference images; {ref.source} holds only statistics")
    layer = feature_layer or default_layer(feature_extractor, "fid")
    layers = [layer] + ([default_layer(feature_extractor, "isc")] if isc else [])
    if fid and ref.statistics is not None:
        _check_statistics_match(ref.statistics, feature_extractor, layer, ref.source)
    extractor = build_feature_extractor(feature_extractor, layers, weights, device or default_device())
    if kid:
        smallest = min(len(samples_set), len(ref.images))
        if kid_subset_size > smallest:
            raise MetricsError(f"kid_subset_size={kid_subset_size} exceeds the smaller image set ({smallest}); "
                               f"pass --kid-subset-size {smallest} or fewer")

    sample_features = extract_features(samples_set, extractor, batch_size, num_workers, progress)
    need_ref_features = kid or (fid and ref.statistics is None)
    ref_features = extract_features(ref.images, extractor, batch_size, num_workers, progress) if need_ref_features else None
    metrics = {}
    if fid:
        meta = dict(feature_extractor=feature_extractor, feature_layer=layer)
        stats = FeatureStatistics.from_features(sample_features[layer], **meta)
        if ref.statistics is not None:
            _check_statistics_match(ref.statistics, feature_extractor, layer, ref.source, dim=len(stats.mu))
            ref_stats = ref.statistics
        else:
            ref_stats = FeatureStatistics.from_features(ref_features[layer], **meta)
        if stats.count <= len(stats.mu):
            warnings.warn(f"{stats.count} samples for {len(stats.mu)}-d features: the covariance is singular and "
                          "the Frechet distance strongly biased; compare only numbers with equal sample counts "
                          "(published FIDs use 50,000)", stacklevel=2)
        metrics["fid"] = frechet_distance(stats.mu, stats.sigma, ref_stats.mu, ref_stats.sigma)
    if isc:
        from torch_fidelity.metric_isc import isc_features_to_metric

        out = isc_features_to_metric(sample_features[layers[-1]], isc_splits, True, seed)
        metrics.update(isc_mean=out["inception_score_mean"], isc_std=out["inception_score_std"])
    if kid:
        from torch_fidelity.metric_kid import kid_features_to_metric

        out = kid_features_to_metric(sample_features[layer], ref_features[layer], kid_subsets=kid_subsets,
                                     kid_subset_size=kid_subset_size, rng_seed=seed, verbose=False)
        metrics.update(kid_mean=out["kernel_inception_distance_mean"], kid_std=out["kernel_inception_distance_std"])

    samples_info = samples_set.describe()
    sampling = read_sampling_protocol(samples)
    if sampling is not None:
        samples_info["sampling"] = sampling
    protocol = {
        "samples": samples_info,
        "reference": ref.describe() if ref is not None else None,
        "feature_extractor": feature_extractor,
        "feature_layer": layer,
        "extractor_weights": getattr(extractor, "weights_path", None),
        "frechet_distance": "float64 mean/covariance; ADM evaluator formula with scipy.linalg.sqrtm",
        "versions": _versions(),
    }
    if isc:
        protocol["isc"] = {"layer": layers[-1], "splits": isc_splits, "seed": seed}
    if kid:
        protocol["kid"] = {"subsets": kid_subsets, "subset_size": kid_subset_size, "seed": seed}
    return {"metrics": metrics, "protocol": protocol}
