"""DiT's training data: VAE latents (or Fashion-MNIST pixels on CPUs) turned into complete training examples.

* :class:`LatentImages`: a fresh latent per access, drawn from the VAE moments ``diffusion.extract_latents`` stored
  (the image or its mirror), scaled by the VAE's factor or normalised per channel (LightningDiT's ``latent_norm``);
  :class:`PixelImages`: Fashion-MNIST in [-1, 1], padded, randomly mirrored.
* :class:`DiffusionExamples`: ``(x0, label, t, noise, drop_label)`` (``t``: DDPM's timestep, or the draw a
  transport maps to its time); every random choice of an example is made in
  the dataset, so under :class:`common.data.SeededDataset` it depends only on the sample's seed (the same for any
  number of processes and after a resume).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import Dataset

from common.cli import InputError
from common.data import FASHION_MNIST_CLASSES, load_fashion_mnist
from diffusion.config import DataConfig
from diffusion.latents import LatentDataset, LatentScaling, draw_latent


class PixelImages(Dataset):
    """Fashion-MNIST in [-1, 1], padded to ``image_size`` with the black background, randomly mirrored
    when ``hflip``: ``(x0 (1, S, S), label)``; ``with_image`` appends the same pixels in [0, 1] (REPA's encoder
    input)."""

    classes = FASHION_MNIST_CLASSES

    def __init__(self, split: str, image_size: int, root: Optional[str] = None, limit: Optional[int] = None,
                 hflip: bool = True, with_image: bool = False):
        images, labels = load_fashion_mnist(split, root)
        self.with_image = with_image
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
        x = torch.nn.functional.pad(x, (self.pad,) * 4, value=-1.0)
        return (x, int(self.labels[i]), (x + 1) / 2) if self.with_image else (x, int(self.labels[i]))


class LatentImages(Dataset):
    """A fresh VAE latent per access, drawn from the stored moments: ``(x0 (C, h, w), label)``.

    View 0 is the image, view 1 its mirror; ``hflip`` picks one at random. ``with_image`` appends the stored pixels
    of the same view (uint8; extracted with ``--images``). A draw is scaled by the VAE's scaling factor, or with
    ``latent_norm`` normalised per channel by the latents' statistics, times ``latent_multiplier``
    (:attr:`scaling`; :attr:`normalization` is what the model's description records).
    """

    def __init__(self, root: str, hflip: bool = True, limit: Optional[int] = None, with_image: bool = False,
                 latent_norm: bool = False, latent_multiplier: float = 1.0):
        self.moments = LatentDataset(root)
        self.normalization = self.moments.normalization(latent_multiplier) if latent_norm else None
        self.scaling = LatentScaling(self.moments.scaling_factor, self.normalization)
        self.classes = self.moments.classes  # the image folder's class names (ImageNet: WordNet ids)
        self.hflip = hflip
        self.with_image = with_image
        if with_image:
            self.moments.read_image(0, 0)  # latents without images fail here, before training
        self.length = len(self.moments) if limit is None else min(limit, len(self.moments))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return draw_latent(self.moments, i, self.hflip, self.with_image, self.scaling)  # reads only the drawn view


TIME_DRAWS = ("index", "uniform", "normal")


class DiffusionExamples(Dataset):
    """A complete training example ``(x0, label, t, noise, drop_label)``. Together with the image dataset's
    own draws (latent, flip), all its randomness is drawn here, so that under :class:`SeededDataset` it
    depends only on the sample's seed.

    ``time_draw``: ``index``, DDPM's uniform timestep in ``[0, num_timesteps)``; ``uniform`` (U[0, 1)) or ``normal``
    (N(0, 1)), the draws :meth:`diffusion.transport.Transport.training_times` maps to a transport's times.
    """

    def __init__(self, images: Dataset, num_timesteps: int, class_dropout_prob: float, time_draw: str = "index"):
        if time_draw not in TIME_DRAWS:
            raise ValueError(f"time_draw={time_draw!r}; choose one of {', '.join(TIME_DRAWS)}")
        self.images = images
        self.num_timesteps = num_timesteps
        self.class_dropout_prob = class_dropout_prob
        self.time_draw = time_draw

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        x0, label, *image = self.images[i]  # image: REPA's encoder input, when the images carry it
        if self.time_draw == "index":
            t = torch.randint(self.num_timesteps, ())
        else:
            t = torch.rand(()) if self.time_draw == "uniform" else torch.randn(())
        noise = torch.randn_like(x0)
        drop = torch.rand(()) < self.class_dropout_prob
        return (x0, label, t, noise, drop, *image)


def build_images(cfg: DataConfig, with_image: bool = False) -> Dataset:
    """The training images; ``with_image`` adds what REPA's encoder sees (the pixels of the same view)."""
    if cfg.dataset == "fashion_mnist":
        return PixelImages("train", cfg.image_size, cfg.path, cfg.max_samples, cfg.hflip, with_image)
    images = LatentImages(cfg.path, cfg.hflip, cfg.max_samples, with_image, cfg.latent_norm, cfg.latent_multiplier)
    meta = images.moments.metadata
    if meta["image_size"] != cfg.image_size:
        raise InputError(f"the latents in {cfg.path} are of {meta['image_size']}px images, the config says "
                         f"data.image_size={cfg.image_size}; make them agree")
    if len(meta["classes"]) != cfg.num_classes:
        raise InputError(f"the latents in {cfg.path} have {len(meta['classes'])} classes, the config says "
                         f"data.num_classes={cfg.num_classes}; make them agree")
    return images
