"""Image classification data for DeiT: ImageNet (a folder, WebDataset tars, a Hugging Face dataset) or
Fashion-MNIST, image files, loaders.

* :class:`DataConfig` (:mod:`vision.config`): the ``data:`` section of a recipe.
* :func:`build_dataset`: ``imagefolder`` reads ``<path>/<split>/<class>/*.jpg`` (ImageNet: ``train/n01440764/
  *.JPEG``) as ``data.format`` stores it (``wds``, ``hf``: :mod:`common.image_sets`, written by ``python -m
  vision.shard``); ``fashion_mnist`` reads the IDX files (``path`` optional: a torchvision root).
* :func:`build_splits`: both splits, refused unless they list the same classes (what a training checks first).
* :class:`ReadableImages` (:class:`ReadableImageFolder` for a folder): an unreadable image is replaced by the next
  readable one, with a warning naming it; :func:`unreadable_flags` marks the distinct images across DataLoader
  workers; in the val split an unreadable image is left out of the metrics and named instead.
* :func:`load_rgb` / :func:`load_rgb_tensor`: an image file as RGB (PIL, or uint8 tensor for the device-side
  augmentation of :mod:`vision.augment`).
* :func:`build_eval_loader` (the training loader is :func:`common.data.build_train_loader`).
"""
from __future__ import annotations

import multiprocessing
import warnings
from pathlib import Path
from typing import Callable, Optional, Tuple, Union

import numpy as np
import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from common.cli import InputError
from common.data import FashionMNIST, ImageFolderError, add_note, ignore_in_workers, resolve_num_workers
from common.image_sets import FolderImages, ImageSet, is_path, open_encoded, open_image_set
from common.preemption import STOP_SIGNALS
from vision.config import DataConfig


# ----------------------------------------------------------------------------- datasets

class ReadableImages(Dataset):
    """A labelled image set (:mod:`common.image_sets`: a folder, WebDataset tars, a Hugging Face dataset) that
    survives unreadable images, and says which they were.

    An image that cannot be decoded is flagged (a byte per image, shared across DataLoader workers) and named in a
    warning the first time. What the dataset returns instead depends on ``substitute``:

    * ``True`` (training): the next readable image of the set, so batch shapes, and hence DDP, stay intact;
    * ``False`` (evaluation): a placeholder image with target ``-1 - index``, which :func:`vision.evaluate.evaluate`
      leaves out of every metric and reports by name: Top-1 is computed on exactly the readable images.

    Only reading is guarded: an error of the transform is a bug, so it propagates (and names the image).
    ``loader``: a path or encoded bytes -> image, by default :func:`load_rgb` (RGB PIL image); :func:`load_rgb_tensor`
    (uint8 tensor) for the ``use_prefetcher`` transform. ``limit`` keeps the first ``limit`` images.
    """

    def __init__(self, images: ImageSet, transform=None, limit: Optional[int] = None, loader: Callable = None,
                 substitute: bool = True):
        self.images = images
        self.classes = list(images.classes)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples = images.samples  # (name, label) pairs
        self.length = len(images) if limit is None else min(limit, len(images))
        self.transform = transform
        self.loader = loader or load_rgb
        self.substitute = substitute
        self.unreadable = multiprocessing.Array("b", self.length, lock=False)  # shared with the workers

    def __len__(self) -> int:
        return self.length

    def _read(self, i: int):
        try:
            return self.loader(self.images.read(i))
        except Exception as err:  # PIL raises OSError, ValueError or SyntaxError for broken files
            if not self.unreadable[i]:
                self.unreadable[i] = 1
                warnings.warn(f"skipping unreadable image {self.images.name(i)} ({type(err).__name__}: {err})")
            return None

    def _transform(self, image, i: Optional[int]):
        if self.transform is None:
            return image
        try:
            return self.transform(image)
        except Exception as err:
            add_note(err, f"while transforming {'<placeholder>' if i is None else self.images.name(i)}")
            raise

    def __getitem__(self, index: int):
        if not self.substitute:
            image = self._read(index)
            if image is None:  # evaluated as "not an image": left out of the metrics and named
                return self._transform(Image.new("RGB", (8, 8)), None), -1 - index
            return self._transform(image, index), int(self.images.labels[index])
        for attempt in range(min(self.length, 100)):
            i = (index + attempt) % self.length
            image = self._read(i)
            if image is not None:
                return self._transform(image, i), int(self.images.labels[i])
        raise RuntimeError(f"no readable image among 100 starting at {self.images.name(index)}; check the dataset "
                           "files")


class ReadableImageFolder(ReadableImages):
    """:class:`ReadableImages` of an ImageFolder (``root/<class>/**/<image>``), in torchvision's class and file order
    (symlink loops and empty classes refused by name)."""

    def __init__(self, root, transform=None, limit: Optional[int] = None, loader: Callable = None,
                 substitute: bool = True):
        super().__init__(FolderImages(root), transform, limit, loader, substitute)
        self.samples = self.images.samples[: self.length]  # (path, label), as torchvision's ImageFolder lists them


def unreadable_flags(dataset: Dataset) -> Optional[torch.Tensor]:
    """One uint8 flag per image of a (possibly wrapped) :class:`ReadableImages`: 1 = found unreadable so far in any
    worker; None for datasets without files."""
    while not hasattr(dataset, "unreadable") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    flags = getattr(dataset, "unreadable", None)
    return None if flags is None else torch.frombuffer(flags, dtype=torch.uint8) if len(flags) else torch.zeros(0)


def _layout(root: Path, split: str) -> str:
    return f"{root}/{split}/<class name>/<image>.JPEG (e.g. ImageNet's {split}/n01440764/*.JPEG)"


def _check_image_folder(root: Path, split: str) -> Path:
    folder = root / split
    layout = _layout(root, split)
    if not root.is_dir():
        raise ImageFolderError(f"data.path {str(root)!r} does not exist; expected the layout {layout}")
    if not folder.is_dir():
        present = ", ".join(sorted(p.name for p in root.iterdir() if p.is_dir())[:10]) or "nothing"
        raise ImageFolderError(f"{folder} is missing (found: {present}); expected the layout {layout}. "
                                "ImageNet's val/ must be sorted into class folders too (e.g. with the "
                                "valprep.sh script from the PyTorch ImageNet example).")
    if not any(p.is_dir() for p in folder.iterdir()):
        raise ImageFolderError(f"{folder} has no class sub-folders; expected the layout {layout}")
    return folder


def check_same_classes(train: Dataset, val: Dataset) -> None:
    """Labels are class positions: train and val must list the same class names, in the same order."""
    a, b = list(train.classes), list(val.classes)
    if a == b:
        return
    only_train, only_val = [c for c in a if c not in b], [c for c in b if c not in a]
    detail = (f"only in train: {', '.join(only_train[:5]) or 'none'}; only in val: {', '.join(only_val[:5]) or 'none'}"
              if only_train or only_val else "the same names in another order")
    raise InputError(f"the train and val class folders differ ({detail}), so a label would mean one class in "
                     "training and another in evaluation; give both splits the same class folders")


def build_dataset(cfg: DataConfig, split: str, transform=None, loader: Optional[Callable] = None) -> Dataset:
    """The ``train`` or ``val`` split (named by ``cfg.train_split`` / ``cfg.val_split`` on disk), stored as
    ``cfg.format`` says.

    ``loader`` decodes an image (a path or its bytes); the default is :func:`load_rgb`.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split {split!r}; use 'train' or 'val'")
    limit = cfg.max_train_samples if split == "train" else cfg.max_val_samples
    on_disk = cfg.train_split if split == "train" else cfg.val_split
    if cfg.dataset == "fashion_mnist":
        dataset = FashionMNIST("train" if split == "train" else "test", root=cfg.path, transform=transform,
                               mode="RGB", limit=limit)
    elif cfg.format == "imagefolder":
        folder = _check_image_folder(Path(cfg.path), on_disk)
        try:
            dataset = ReadableImageFolder(folder, transform=transform, limit=limit, loader=loader,
                                          substitute=split == "train")
        except ImageFolderError as err:
            raise ImageFolderError(f"{err}; expected the layout {_layout(folder.parent, folder.name)}") from None
    else:
        dataset = ReadableImages(open_image_set(cfg.format, cfg.path, on_disk), transform=transform, limit=limit,
                                 loader=loader, substitute=split == "train")
    if len(dataset.classes) != cfg.num_classes:
        raise InputError(f"the {split} set has {len(dataset.classes)} classes but data.num_classes={cfg.num_classes}; "
                         f"set data.num_classes={len(dataset.classes)} (or point data.path at the right folder)")
    return dataset


def build_splits(cfg: DataConfig, train_transform=None, val_transform=None, train_loader: Optional[Callable] = None
                 ) -> Tuple[Dataset, Dataset]:
    """The ``train`` and ``val`` splits (:func:`build_dataset`), refused unless they list the same classes: what a
    training checks of its data before anything else."""
    train = build_dataset(cfg, "train", train_transform, loader=train_loader)
    val = build_dataset(cfg, "val", val_transform)
    check_same_classes(train, val)
    return train, val


# ----------------------------------------------------------------------------- image files

def load_rgb(path) -> Image.Image:
    """An image file (a path, or its bytes read from a shard) as a decoded RGB PIL image: torchvision's PIL loader
    without its extra copy of images that are RGB already (``convert("RGB")`` copies them); the same pixels."""
    with open_encoded(path) as f:
        image = Image.open(f)
        image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def load_rgb_tensor(path) -> torch.Tensor:
    """An image file (a path, or its bytes read from a shard) as uint8 RGB ``(3, H, W)`` (channels-last memory), for
    the ``use_prefetcher`` transform.

    Decoded by torchvision.io (libjpeg-turbo, libpng, libwebp straight into the tensor, without Pillow's
    RGBX -> RGB repacking; ``python -m benchmarks.data_feed --breakdown`` times both); the pixels equal Pillow's ``convert("RGB")`` for JPEG
    (YCbCr, grayscale, CMYK), PNG (8-bit, palette, alpha) and WebP. Files it does not decode as one
    8-bit image (BMP, TIFF, 16-bit PNG, animations), and every file once torchvision drops these decoders
    (deprecated in 0.29 in favour of TorchCodec), go through :func:`load_rgb`; broken files raise Pillow's
    error, so ReadableImages skips them.
    """
    decode = getattr(getattr(torchvision, "io", None), "decode_image", None)
    if decode is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.filterwarnings("ignore", message="The given buffer is not writable")  # decoding only reads
                data = (torchvision.io.read_file(str(path)) if is_path(path)
                        else torch.frombuffer(path, dtype=torch.uint8))
                image = decode(data, mode=torchvision.io.ImageReadMode.RGB)
            if image.dtype == torch.uint8 and image.ndim == 3:
                return image
        except RuntimeError:
            pass
    return rgb_view(load_rgb(path))


def rgb_view(image: Image.Image) -> torch.Tensor:
    """uint8 ``(3, H, W)`` tensor over the pixels of an RGB PIL image (channels-last memory, one copy)."""
    with warnings.catch_warnings():  # numpy's view of PIL's bytes is read-only; nothing here writes to it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(image)).permute(2, 0, 1)


# ----------------------------------------------------------------------------- loaders

def build_eval_loader(dataset: Dataset, batch_size: int, num_workers: Union[int, str], rank: int = 0,
                      world: int = 1, persistent_workers: bool = False, ignore_signals=STOP_SIGNALS) -> DataLoader:
    """Sequential evaluation loader over process ``rank``'s shard (images ``rank, rank + world, ...``): every image
    is evaluated once, with no padding (accelerate's even batches would fill a small set up to a batch per process).
    Workers decode ahead of the forward (two batches each), into pinned memory on CUDA; ``persistent_workers`` keeps
    them between passes (a training run's evaluations) instead of starting them again for each. They ignore
    ``ignore_signals`` (a training's stop signals: its main process acts on them)."""
    if world > 1:
        dataset = torch.utils.data.Subset(dataset, range(rank, len(dataset), world))
    workers = resolve_num_workers(num_workers)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers,
                      worker_init_fn=ignore_in_workers(ignore_signals),
                      persistent_workers=persistent_workers and workers > 0, pin_memory=torch.cuda.is_available())
