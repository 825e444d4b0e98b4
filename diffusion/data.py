"""DiT's training data: VAE latents (or Fashion-MNIST pixels on CPUs) turned into complete training examples.

* :class:`DataConfig`: the ``data:`` section of a DiT recipe.
* :class:`LatentImages`: a fresh latent per access, drawn from the VAE moments ``diffusion.extract_latents`` stored
  (the image or its mirror); :class:`PixelImages`: Fashion-MNIST in [-1, 1], padded, randomly mirrored.
* :class:`DiffusionExamples`: ``(x0, label, t, noise, drop_label)``; every random choice of an example is made in
  the dataset, so under :class:`common.data.SeededDataset` it depends only on the sample's seed (the same for any
  number of processes and after a resume).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union

import torch
from torch.utils.data import Dataset

from common.cli import InputError
from common.config import ConfigError, Range
from common.data import FASHION_MNIST_CLASSES, load_fashion_mnist
from diffusion.latents import LatentDataset, draw_latent


@dataclass(kw_only=True)
class DataConfig:
    dataset: Literal["latents", "fashion_mnist"]
    path: Optional[str] = None  # latents: the --out of diffusion.extract_latents; fashion_mnist: optional root
    autoencoder: str  # VAE that decodes sample grids (dir or HF id); "none" = pixel space
    image_size: Annotated[int, Range(ge=8)]  # pixels; latents: must match the extraction
    num_classes: Annotated[int, Range(ge=1)]
    hflip: bool  # random horizontal flip (latents: the stored flipped view)
    max_samples: Optional[Annotated[int, Range(ge=1)]] = None  # keep the first N training examples (quick runs, tests)
    num_workers: Union[Annotated[int, Range(ge=0)], Literal["auto"]] = "auto"  # DataLoader workers per process; auto: from the CPU count

    def __post_init__(self):
        if self.dataset == "latents" and not self.path:
            raise ConfigError("data.path is required for dataset=latents: the output directory of "
                              "`python -m diffusion.extract_latents` (it holds metadata.json)")
        if self.dataset == "fashion_mnist" and self.autoencoder != "none":
            raise ConfigError("dataset=fashion_mnist trains in pixel space: set data.autoencoder=none")
        if self.dataset == "fashion_mnist" and (self.image_size < 28 or self.image_size % 2):
            raise ConfigError(f"data.image_size={self.image_size}: Fashion-MNIST (28 px) is padded to an even size >= 28")


class PixelImages(Dataset):
    """Fashion-MNIST in [-1, 1], padded to ``image_size`` with the black background, randomly mirrored
    when ``hflip``: ``(x0 (1, S, S), label)``."""

    classes = FASHION_MNIST_CLASSES

    def __init__(self, split: str, image_size: int, root: Optional[str] = None, limit: Optional[int] = None,
                 hflip: bool = True):
        images, labels = load_fashion_mnist(split, root)
        self.images = torch.from_numpy(images[:limit].copy())
        self.labels = torch.from_numpy(labels[:limit].copy())
        self.pad = (image_size - self.images.shape[-1]) // 2
        self.hflip = hflip

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i].float().div(127.5).sub(1.0)[None]
        if self.hflip and torch.rand(()) < 0.5:
            x = x.flip(-1)
        return torch.nn.functional.pad(x, (self.pad,) * 4, value=-1.0), int(self.labels[i])


class LatentImages(Dataset):
    """A fresh VAE latent per access, drawn from the stored moments: ``(x0 (C, h, w), label)``.

    View 0 is the image, view 1 its mirror; ``hflip`` picks one at random.
    """

    def __init__(self, root: str, hflip: bool = True, limit: Optional[int] = None):
        self.moments = LatentDataset(root)
        self.classes = self.moments.classes  # the image folder's class names (ImageNet: WordNet ids)
        self.hflip = hflip
        self.length = len(self.moments) if limit is None else min(limit, len(self.moments))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return draw_latent(self.moments, i, self.hflip)  # reads only the drawn view


class DiffusionExamples(Dataset):
    """A complete training example ``(x0, label, t, noise, drop_label)``. Together with the image dataset's
    own draws (latent, flip), all its randomness is drawn here, so that under :class:`SeededDataset` it
    depends only on the sample's seed."""

    def __init__(self, images: Dataset, num_timesteps: int, class_dropout_prob: float):
        self.images = images
        self.num_timesteps = num_timesteps
        self.class_dropout_prob = class_dropout_prob

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        x0, label = self.images[i]
        t = torch.randint(self.num_timesteps, ())
        noise = torch.randn_like(x0)
        drop = torch.rand(()) < self.class_dropout_prob
        return x0, label, t, noise, drop


def build_images(cfg: DataConfig) -> Dataset:
    if cfg.dataset == "fashion_mnist":
        return PixelImages("train", cfg.image_size, cfg.path, cfg.max_samples, cfg.hflip)
    images = LatentImages(cfg.path, cfg.hflip, cfg.max_samples)
    meta = images.moments.metadata
    if meta["image_size"] != cfg.image_size:
        raise InputError(f"the latents in {cfg.path} are of {meta['image_size']}px images, the config says "
                         f"data.image_size={cfg.image_size}; make them agree")
    if len(meta["classes"]) != cfg.num_classes:
        raise InputError(f"the latents in {cfg.path} have {len(meta['classes'])} classes, the config says "
                         f"data.num_classes={cfg.num_classes}; make them agree")
    return images
