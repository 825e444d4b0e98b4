"""Image classification data for DeiT: ImageFolder (ImageNet layout) or Fashion-MNIST, timm transforms, mixup.

* :class:`DataConfig` / :class:`AugmentConfig`: the ``data:`` and ``augment:`` sections of a recipe. Their
  defaults are neutral (no augmentation); the DeiT numbers live in ``configs/deit_recipe.yaml``.
* :func:`build_dataset`: ``imagefolder`` reads ``<path>/<split>/<class>/*.jpg`` (ImageNet: ``train/n01440764/
  *.JPEG``); ``fashion_mnist`` reads the IDX files (``path`` optional: a torchvision root).
* :class:`ReadableImageFolder`: an unreadable image is replaced by the next readable one, with a warning
  naming the file; ``skipped_images(dataset)`` counts them across DataLoader workers.
* :func:`build_transform`: timm's ``create_transform`` (RandAugment, random-resized crop, random erasing;
  eval: resize ``input_size / crop_pct`` + center crop).
* :func:`build_mixup`: timm's ``Mixup`` (mixup/cutmix with label smoothing -> soft targets) or None.
* :func:`build_eval_loader` (the training loader is :func:`common.data.build_train_loader`).
"""
from __future__ import annotations

import multiprocessing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import ImageFolder
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, Mixup, create_transform

from common.data import FashionMNIST

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class DataConfig:
    """Where the images are and how evaluation sees them."""

    dataset: Literal["imagefolder", "fashion_mnist"] = "imagefolder"
    path: Optional[str] = None  # imagefolder: root holding <train_split>/ and <val_split>/; fashion_mnist: optional
    train_split: str = "train"
    val_split: str = "val"
    num_classes: int = 1000
    input_size: int = 224
    crop_pct: float = 0.875  # eval: resize to input_size / crop_pct, then center crop input_size
    interpolation: str = "bicubic"
    mean: Tuple[float, float, float] = tuple(IMAGENET_DEFAULT_MEAN)
    std: Tuple[float, float, float] = tuple(IMAGENET_DEFAULT_STD)
    num_workers: int = 8
    max_train_samples: Optional[int] = None  # keep the first N training images (quick runs, tests)
    max_val_samples: Optional[int] = None

    def __post_init__(self):
        if self.dataset == "imagefolder" and not self.path:
            raise ValueError("data.path is required for dataset=imagefolder: the directory that holds "
                             f"{self.train_split}/<class>/*.JPEG and {self.val_split}/<class>/*.JPEG")
        if not 0.0 < self.crop_pct <= 1.0:
            raise ValueError(f"data.crop_pct={self.crop_pct} must lie in (0, 1]")


@dataclass
class AugmentConfig:
    """Training-time augmentation and target mixing (neutral defaults: nothing on)."""

    auto_augment: Optional[str] = None  # timm policy string, DeiT: rand-m9-mstd0.5-inc1
    color_jitter: float = 0.0  # ignored by timm when auto_augment is set
    scale: Tuple[float, float] = (0.08, 1.0)  # random-resized-crop area range
    hflip: float = 0.5
    re_prob: float = 0.0  # random erasing probability
    re_mode: str = "pixel"
    re_count: int = 1
    repeated_aug: int = 1  # repeats of each image per epoch (DeiT: 3); 1 = off
    mixup: float = 0.0  # mixup alpha; 0 = off
    cutmix: float = 0.0  # cutmix alpha; 0 = off
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: Literal["batch", "pair", "elem"] = "batch"
    label_smoothing: float = 0.0


# ----------------------------------------------------------------------------- datasets

def _skip_counter():
    return multiprocessing.Value("l", 0)  # shared with DataLoader worker processes


class ReadableImageFolder(ImageFolder):
    """``torchvision.datasets.ImageFolder`` that survives unreadable files.

    A file PIL cannot decode is skipped: a warning names it, ``skipped`` (shared across workers) counts
    it, and the next readable image of the folder list is returned instead, so batch shapes, and hence
    DDP, stay intact.
    """

    def __init__(self, root, transform=None, limit: Optional[int] = None):
        super().__init__(root, transform=transform)
        if limit is not None:
            self.samples = self.samples[:limit]
            self.targets = self.targets[:limit]
            self.imgs = self.samples
        self.skipped = _skip_counter()

    def __getitem__(self, index: int):
        for attempt in range(min(len(self.samples), 100)):
            i = (index + attempt) % len(self.samples)
            path, target = self.samples[i]
            try:
                image = self.loader(path)
            except Exception as err:  # PIL raises OSError, ValueError or SyntaxError for broken files
                with self.skipped.get_lock():
                    self.skipped.value += 1
                warnings.warn(f"skipping unreadable image {path} ({type(err).__name__}: {err})")
                continue
            if self.transform is not None:
                image = self.transform(image)
            return image, target
        raise RuntimeError(f"no readable image among 100 files starting at {self.samples[index][0]}; "
                           "check the dataset files")


def skipped_images(dataset: Dataset) -> int:
    """How many unreadable images a dataset (possibly wrapped) has skipped so far, over all workers."""
    while not hasattr(dataset, "skipped") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    counter = getattr(dataset, "skipped", None)
    return int(counter.value) if counter is not None else 0


def _check_image_folder(root: Path, split: str) -> Path:
    folder = root / split
    layout = f"{root}/{split}/<class name>/<image>.JPEG (e.g. ImageNet's {split}/n01440764/*.JPEG)"
    if not root.is_dir():
        raise FileNotFoundError(f"data.path {str(root)!r} does not exist; expected the layout {layout}")
    if not folder.is_dir():
        present = ", ".join(sorted(p.name for p in root.iterdir() if p.is_dir())[:10]) or "nothing"
        raise FileNotFoundError(f"{folder} is missing (found: {present}); expected the layout {layout}. "
                                "ImageNet's val/ must be sorted into class folders too (e.g. with the "
                                "valprep.sh script from the PyTorch ImageNet example).")
    classes = [p for p in folder.iterdir() if p.is_dir()]
    if not classes:
        raise FileNotFoundError(f"{folder} has no class sub-folders; expected the layout {layout}")
    if not any(f.suffix.lower() in IMAGE_EXTENSIONS for c in classes for f in c.iterdir()):
        raise FileNotFoundError(f"the class folders of {folder} hold no images ({', '.join(IMAGE_EXTENSIONS)}); "
                                f"expected the layout {layout}")
    return folder


def build_dataset(cfg: DataConfig, split: str, transform=None) -> Dataset:
    """The ``train`` or ``val`` split (named by ``cfg.train_split`` / ``cfg.val_split`` on disk)."""
    if split not in ("train", "val"):
        raise ValueError(f"split {split!r}; use 'train' or 'val'")
    limit = cfg.max_train_samples if split == "train" else cfg.max_val_samples
    if cfg.dataset == "fashion_mnist":
        dataset = FashionMNIST("train" if split == "train" else "test", root=cfg.path, transform=transform,
                               mode="RGB", limit=limit)
        n_classes = len(FashionMNIST.classes)
    else:
        folder = _check_image_folder(Path(cfg.path), cfg.train_split if split == "train" else cfg.val_split)
        dataset = ReadableImageFolder(folder, transform=transform, limit=limit)
        n_classes = len(dataset.classes)
    if n_classes != cfg.num_classes:
        raise ValueError(f"the {split} set has {n_classes} classes but data.num_classes={cfg.num_classes}; "
                         f"set data.num_classes={n_classes} (or point data.path at the right folder)")
    return dataset


# ----------------------------------------------------------------------------- transforms and mixing

def build_transform(data: DataConfig, augment: Optional[AugmentConfig] = None, training: bool = False):
    """timm transforms: the training pipeline of ``augment``, or resize + center crop for evaluation."""
    common = dict(input_size=data.input_size, interpolation=data.interpolation, mean=data.mean, std=data.std)
    if not training:
        return create_transform(is_training=False, crop_pct=data.crop_pct, **common)
    a = augment or AugmentConfig()
    return create_transform(
        is_training=True, scale=a.scale, hflip=a.hflip, color_jitter=a.color_jitter or None,
        auto_augment=a.auto_augment, re_prob=a.re_prob, re_mode=a.re_mode, re_count=a.re_count, **common,
    )


def build_mixup(augment: AugmentConfig, num_classes: int) -> Optional[Mixup]:
    """timm ``Mixup`` when mixup or cutmix is on (it also applies label smoothing to the soft targets)."""
    if augment.mixup <= 0 and augment.cutmix <= 0:
        return None
    return Mixup(mixup_alpha=augment.mixup, cutmix_alpha=augment.cutmix, prob=augment.mixup_prob,
                 switch_prob=augment.mixup_switch_prob, mode=augment.mixup_mode,
                 label_smoothing=augment.label_smoothing, num_classes=num_classes)


# ----------------------------------------------------------------------------- loaders

def build_eval_loader(dataset: Dataset, batch_size: int, num_workers: int) -> DataLoader:
    """Sequential evaluation loader (shard it with ``accelerator.prepare``)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                      pin_memory=torch.cuda.is_available())
