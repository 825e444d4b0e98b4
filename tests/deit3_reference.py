"""Re-statements of DeiT III's training pieces and of LayerScale inside SiameseNorm, for the tests.

From facebookresearch/deit: ``augment.py`` (3-Augment, ``new_data_aug_generator``: its three operations, each drawing
its probability from Python's ``random`` before acting, chosen by ``transforms.RandomChoice``), ``engine.py`` and
``main.py`` (``--bce-loss``: timm's ``Mixup`` targets binarised by ``gt(0.0)``, then ``BCEWithLogitsLoss``). The
model re-statement is docs/method.md section 1 with DeiT III's LayerScale ``gamma`` on each sublayer output and timm's
``no_embed_class`` embedding, in plain tensor ops over our state-dict names. Nothing here imports the project.
"""
import math
import random

import torch
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import ImageFilter, ImageOps
from timm.data.transforms import RandomResizedCropAndInterpolation

from tests.deit_reference import _attention, _linear, _ln, _mlp


class _Gray:
    def __init__(self, chosen: list):
        self.chosen = chosen

    def __call__(self, img):
        if random.random() < 1.0:
            self.chosen.append("grayscale")
            return T.Grayscale(3)(img)
        return img


class _Solarize:
    def __init__(self, chosen: list):
        self.chosen = chosen

    def __call__(self, img):
        if random.random() < 1.0:
            self.chosen.append("solarize")
            return ImageOps.solarize(img)
        return img


class _Blur:
    def __init__(self, chosen: list):
        self.chosen = chosen

    def __call__(self, img):
        if random.random() <= 1.0:
            self.chosen.append("blur")
            return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))
        return img


def three_augment(input_size: int, color_jitter: float, src: bool, mean, std, chosen: list) -> T.Compose:
    """DeiT III's training transform with ``--ThreeAugment`` (``src``: ``--src``); ``chosen`` receives the name of
    the operation each image gets. Its crop is bicubic, of scale (0.08, 1)."""
    if src:
        crop = [T.Resize(input_size, interpolation=T.InterpolationMode.BICUBIC),  # DeiT III writes interpolation=3
                T.RandomCrop(input_size, padding=4, padding_mode="reflect"), T.RandomHorizontalFlip()]
    else:
        crop = [RandomResizedCropAndInterpolation(input_size, scale=(0.08, 1.0), interpolation="bicubic"),
                T.RandomHorizontalFlip()]
    rest = [T.RandomChoice([_Gray(chosen), _Solarize(chosen), _Blur(chosen)])]
    if color_jitter:
        rest.append(T.ColorJitter(color_jitter, color_jitter, color_jitter))
    return T.Compose(crop + rest + [T.ToTensor(), T.Normalize(mean=torch.tensor(mean), std=torch.tensor(std))])


def binarised_targets(mixed: torch.Tensor) -> torch.Tensor:
    """engine.py with ``--bce-loss``: every class whose mixed target is above 0 becomes 1."""
    return mixed.gt(0.0).type(mixed.dtype)


def bce_loss(logits: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    return torch.nn.BCEWithLogitsLoss()(logits, binarised_targets(mixed))


def embed_without_class_position(sd, images, patch_size):
    """timm's ``no_embed_class``: the position embedding covers the patches alone; the class token joins after."""
    x = F.conv2d(images, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=patch_size)
    x = x.flatten(2).transpose(1, 2) + sd["pos_embed"]
    return torch.cat([sd["cls_token"].expand(x.shape[0], -1, -1), x], dim=1)


def siamese_layerscale_forward(sd, images, *, depth, num_heads, patch_size):
    """Logits of a SiameseNorm DeiT III model: ``Z = gamma * F(...)`` enters both streams."""
    x = y = embed_without_class_position(sd, images, patch_size)
    for l in range(depth):
        c = math.sqrt(2 * (l + 1))
        p = f"blocks.{l}"
        for i, sublayer in ((1, lambda h: _attention(sd, f"{p}.attn", h, num_heads)),
                            (2, lambda h: _mlp(sd, f"{p}.mlp", h))):
            x = _ln(sd, f"{p}.post_norm{i}", x)
            z = sd[f"{p}.ls{i}.gamma"] * sublayer(_ln(sd, f"{p}.input_norm{i}", x + _ln(sd, f"{p}.pre_norm{i}", y)))
            x = x + z / c
            y = y + z
    h = _ln(sd, "norm.norm_out", _ln(sd, "norm.norm_x", x) + _ln(sd, "norm.norm_y", y))
    return _linear(sd, "head", h[:, 0])
