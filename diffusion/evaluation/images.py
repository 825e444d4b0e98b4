"""Image sets for the metrics: folders of PNG/JPEG, ADM's sample ``.npz`` files (streamed), Fashion-MNIST, tensors;
all read as uint8 ``[B, C, H, W]`` batches, with the sampling protocol ``diffusion.sample`` wrote next to them.

    images = open_images("samples.npz")          # or a folder, "fashion-mnist:test", a tensor or an array
    for positions, batch in images.indexed_batches(50): ...
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from common.data import IMAGE_EXTENSIONS, ImageFolderError, center_crop_arr, image_files
from diffusion.evaluation.metrics import MetricsError

PathLike = Union[str, os.PathLike]
ImageSource = Union[PathLike, torch.Tensor, np.ndarray]
FASHION_MNIST_PREFIX = "fashion-mnist:"
SAMPLING_PROTOCOL_KEY = "protocol"      # JSON string inside a samples .npz
SAMPLING_PROTOCOL_FILE = "protocol.json"  # ... or this file inside a samples folder


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


def npz_keys(path: Path) -> List[str]:
    try:
        with zipfile.ZipFile(path) as zf:
            return [n[:-4] for n in zf.namelist() if n.endswith(".npy")]
    except zipfile.BadZipFile as err:
        raise MetricsError(f"{path} is not a readable .npz file ({err})") from err


def npz_path(path: PathLike) -> Path:
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
    keys = npz_keys(path)
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
    if path.is_file() and path.suffix == ".npz" and SAMPLING_PROTOCOL_KEY in npz_keys(path):
        with np.load(path, allow_pickle=False) as npz:
            return json.loads(str(npz[SAMPLING_PROTOCOL_KEY]))
    return None


def check_count(images: ImageSet, expected: Optional[int], what: str) -> None:
    if expected is not None and len(images) != expected:
        raise MetricsError(f"{what} {images.source} holds {len(images)} images but {expected} were expected "
                           "(an unfinished sampling run? rerun diffusion.sample with the same options to complete it)")
    if len(images) < 2:
        raise MetricsError(f"{what} {images.source} holds {len(images)} image(s); metrics need at least 2")
