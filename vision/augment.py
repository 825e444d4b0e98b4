"""The augmentation of DeiT training, including the device-side engine that finishes each batch on the device.

* :class:`AugmentConfig` (:mod:`vision.config`): the ``augment:`` section of a recipe (neutral defaults; the DeiT
  numbers live in ``configs/deit_recipe.yaml``).
* :func:`build_transform`: timm's ``create_transform`` (RandAugment, random-resized crop, random erasing;
  eval: resize ``input_size / crop_pct`` + center crop), or DeiT III's 3-Augment (:func:`three_augment`) with
  ``augment.three_augment``. ``use_prefetcher=True`` splits the training transform
  in two: the worker half ends in uint8 images plus the random-erasing boxes it drew, and
  :class:`NormalizeErase` (the batch half) normalises and erases on the device, behind
  :class:`common.data.DevicePrefetcher`; its images are read by :func:`load_rgb_tensor`::

      train_set = build_dataset(data, "train", build_transform(data, augment, True, use_prefetcher=True),
                                loader=load_rgb_tensor)
      feed = DevicePrefetcher(build_train_loader(train_set, ...), device, NormalizeErase(data, augment))

* :func:`hashed_normal`: counter-based noise, a function of (sample seed, stream, position), so erased values do not
  depend on the device, the batch or the process count.
* :func:`build_mixup`: timm's mixup/cutmix with label smoothing (soft targets), pair by pair in place
  (:class:`PairwiseMixup`), or None.
"""
from __future__ import annotations

import random
from typing import Optional, Tuple

import numpy as np
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as TF
from PIL import Image, ImageFilter, ImageOps
from timm.data import Mixup, auto_augment, create_transform
from timm.data.mixup import cutmix_bbox_and_lam
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import MaybePILToTensor, RandomResizedCropAndInterpolation, str_to_interp_mode

from common.cli import InputError
from vision.config import AugmentConfig, DataConfig
from vision.data import rgb_view


# ----------------------------------------------------------------------------- transforms and mixing

def posterize_keeping_bits(image: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """timm's posterize op, with "keep 0 bits" doing what it says (every channel 0) instead of raising.

    timm's RandAugment maps magnitude 10 of ``PosterizeIncreasing`` (reached by ``rand-m9-mstd0.5-inc1``
    whenever the magnitude noise exceeds +1, clipped to 10) and magnitudes < 2.5 of ``Posterize`` to 0 bits.
    Pillow <= 12 masked every value with 0 then, a black image: the augmentation the DeiT recipe was tuned
    with. Pillow 13 raises ``ValueError`` instead, which killed training runs from a DataLoader worker.
    """
    if bits_to_keep <= 0:
        return image.point(lambda _: 0)
    return auto_augment.posterize(image, bits_to_keep)


def _keep_posterize_defined(transform) -> None:
    """Swap timm's posterize for :func:`posterize_keeping_bits` in every RandAugment/AutoAugment/AugMix op of
    ``transform``; op choice, magnitudes and every other op stay timm's own."""
    for stage in getattr(transform, "transforms", [transform]):
        ops = list(getattr(stage, "ops", [])) + [op for sub in getattr(stage, "policy", []) for op in sub]
        for op in ops:
            if isinstance(op, auto_augment.AugmentOp) and op.aug_fn is auto_augment.posterize:
                op.aug_fn = posterize_keeping_bits


def build_transform(data: DataConfig, augment: Optional[AugmentConfig] = None, training: bool = False,
                    use_prefetcher: bool = False):
    """timm transforms: the training pipeline of ``augment``, or resize + center crop for evaluation.

    ``use_prefetcher=True`` (training only) returns the worker half of the same pipeline: timm's crop draws
    resampled by torch's uint8 kernel (:class:`RandomResizedCropTensor`), flip and RandAugment as timm
    builds them, then ``(uint8 image (3, H, W), erasing boxes)`` (:class:`PILToUint8`,
    :class:`RandomErasingBoxes`); finish the batch with :class:`NormalizeErase` on the device.
    """
    common = dict(input_size=data.input_size, interpolation=data.interpolation, mean=data.mean, std=data.std)
    if not training:
        if use_prefetcher:
            raise ValueError("use_prefetcher=True splits the training transform; evaluation uses the plain one")
        return create_transform(is_training=False, crop_pct=data.crop_pct, **common)
    a = augment or AugmentConfig()
    if a.three_augment:
        return three_augment(data, a, use_prefetcher)
    transform = create_transform(
        is_training=True, scale=a.scale, hflip=a.hflip, color_jitter=a.color_jitter or None,
        auto_augment=a.auto_augment, re_prob=a.re_prob, re_mode=a.re_mode, re_count=a.re_count,
        use_prefetcher=use_prefetcher, **common,
    )
    _keep_posterize_defined(transform)
    if use_prefetcher:
        swaps = {RandomResizedCropAndInterpolation: RandomResizedCropTensor.like, MaybePILToTensor: PILToUint8.like}
        stages = [swaps[type(t)](t) if type(t) in swaps else t for t in transform.transforms]
        transform.transforms = stages + [RandomErasingBoxes(a.re_prob, a.re_mode, a.re_count)]
    return transform


# ----------------------------------------------------------------------------- DeiT III's 3-Augment

def grayscale(image: Image.Image) -> Image.Image:
    return image.convert("L").convert("RGB")  # torchvision's Grayscale(3) on a PIL image: the same pixels


def solarize(image: Image.Image) -> Image.Image:
    return ImageOps.solarize(image)  # values >= 128 inverted


def gaussian_blur(image: Image.Image) -> Image.Image:
    """Pillow's Gaussian blur of a radius drawn uniformly from [0.1, 2] (DeiT III's, after DINO's)."""
    return image.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))


class ThreeAugmentOp:
    """One of 3-Augment's three operations. DeiT III's draw ``random.random()`` against their probability (1) before
    acting; the draw is made here too, so that for a seed the blur radius and every later draw are DeiT III's."""

    def __init__(self, op):
        self.op = op

    def __call__(self, image: Image.Image) -> Image.Image:
        random.random()
        return self.op(image)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.op.__name__})"


class Uint8ToPIL:
    """A uint8 ``(3, H, W)`` tensor (:func:`vision.data.load_rgb_tensor`) as a PIL image; a PIL image passes through."""

    def __call__(self, image):
        return Image.fromarray(image.permute(1, 2, 0).numpy()) if isinstance(image, torch.Tensor) else image


def three_augment(data: DataConfig, augment: AugmentConfig, use_prefetcher: bool = False) -> T.Compose:
    """DeiT III's 3-Augment (facebookresearch/deit ``augment.py``, ``--ThreeAugment``): a random-resized crop of
    ``augment.scale`` (``augment.simple_random_crop``: DeiT III's ``--src``, a resize to ``input_size`` and a random
    crop with 4 px reflect padding) and a flip, then ONE of grayscale, solarization and Gaussian blur, chosen
    uniformly per image, then a colour jitter of brightness, contrast and saturation by ``augment.color_jitter``.

    ``use_prefetcher=True`` ends in ``(uint8 image, erasing boxes)`` as :func:`build_transform` does (random-resized
    crops resampled by :class:`RandomResizedCropTensor`); else in normalised float images (and timm's random erasing
    when ``augment.re_prob``, which DeiT III sets to 0).
    """
    size, interpolation = data.input_size, data.interpolation
    if augment.simple_random_crop:
        crop = [Uint8ToPIL(), T.Resize(size, interpolation=str_to_interp_mode(interpolation)),
                T.RandomCrop(size, padding=4, padding_mode="reflect")]
    else:
        crop = [RandomResizedCropAndInterpolation(size, scale=augment.scale, interpolation=interpolation)]
        if use_prefetcher:
            crop = [RandomResizedCropTensor.like(crop[0])]
    one_of = T.RandomChoice([ThreeAugmentOp(grayscale), ThreeAugmentOp(solarize), ThreeAugmentOp(gaussian_blur)])
    stages = crop + [T.RandomHorizontalFlip(augment.hflip), one_of]
    if augment.color_jitter:
        stages.append(T.ColorJitter(augment.color_jitter, augment.color_jitter, augment.color_jitter))
    if use_prefetcher:
        erasing = RandomErasingBoxes(augment.re_prob, augment.re_mode, augment.re_count)
        return T.Compose(stages + [PILToUint8(), erasing])
    stages += [T.ToTensor(), T.Normalize(data.mean, data.std)]
    if augment.re_prob > 0:
        stages.append(RandomErasing(augment.re_prob, mode=augment.re_mode, max_count=augment.re_count, device="cpu"))
    return T.Compose(stages)


# ----------------------------------------------------------------------------- the prefetcher split

class RandomResizedCropTensor(RandomResizedCropAndInterpolation):
    """timm's random-resized crop, resampled by torch's antialiased uint8 kernel instead of Pillow's (about 3x
    faster): timm's own crop draws (the same boxes for the same seed) and the same filter (Keys cubic,
    a = -0.5, widened by the downscale factor). The pixels equal Pillow's but for about 1% (a few % in some
    upsampling draws) that differ by one grey level and < 0.5% by more (the two round their intermediate pass
    differently).
    Takes a PIL image or a uint8 ``(3, H, W)`` tensor; returns a PIL RGB image for RandAugment."""

    @classmethod
    def like(cls, crop: RandomResizedCropAndInterpolation) -> "RandomResizedCropTensor":
        tensor_crop = cls(crop.size, scale=crop.scale, ratio=crop.ratio)
        tensor_crop.interpolation = crop.interpolation
        return tensor_crop

    def __call__(self, image) -> Image.Image:
        if isinstance(image, Image.Image):
            image = rgb_view(image if image.mode == "RGB" else image.convert("RGB"))
        top, left, height, width = self.get_params(image, self.scale, self.ratio)
        mode = random.choice(self.interpolation) if isinstance(self.interpolation, (tuple, list)) else self.interpolation
        if height == 0 or width == 0:  # timm's draw on an image of < 5 pixels can be empty; Pillow resizes it to black
            return Image.new("RGB", self.size[::-1])
        # channels-last in and out: torch's uint8 kernel works in that layout, and its output is PIL's HWC layout
        box = image[None, :, top: top + height, left: left + width].contiguous(memory_format=torch.channels_last)
        out = self._resize(box, mode)
        return Image.fromarray(out[0].permute(1, 2, 0).numpy())

    def _resize(self, box: torch.Tensor, mode) -> torch.Tensor:
        """``TF.resize(box, self.size, mode, antialias=True)``; for bicubic, the kernel call it makes for uint8 on any
        CPU, without its per-call overhead."""
        if mode == TF.InterpolationMode.BICUBIC and tuple(box.shape[-2:]) != tuple(self.size):
            return torch.nn.functional.interpolate(box, size=list(self.size), mode="bicubic", align_corners=False,
                                                   antialias=True)
        return TF.resize(box, list(self.size), interpolation=mode, antialias=True)


class PILToUint8(MaybePILToTensor):
    """timm's ``MaybePILToTensor`` (a PIL image as uint8 ``(3, H, W)`` in HWC memory; tensors pass through) with one
    copy of an RGB image's pixels instead of two (:func:`vision.data.rgb_view`). The tensor views read-only
    memory: the collate copies it into the batch."""

    @classmethod
    def like(cls, _: MaybePILToTensor) -> "PILToUint8":
        return cls()

    def __call__(self, image):
        if isinstance(image, Image.Image) and image.mode == "RGB":
            return rgb_view(image)
        return super().__call__(image)


class _BoxRecorder:
    """Stands in for an image tensor so that timm's RandomErasing reports the boxes it would erase."""

    dtype = torch.float32

    def __init__(self, height: int, width: int):
        self.shape = (3, height, width)
        self.boxes = []

    def size(self):
        return self.shape

    def __setitem__(self, index, value):
        rows, cols = index[1], index[2]
        self.boxes.append((rows.start, cols.start, rows.stop - rows.start, cols.stop - cols.start))


class RandomErasingBoxes:
    """Worker half of random erasing: ``image -> (image, boxes)`` with ``boxes`` int64 ``(count, 5)`` rows
    ``(top, left, height, width, noise_seed)``; height 0 means no box.

    The decisions (whether, how many, where) are timm's ``RandomErasing`` draws themselves, from Python's
    ``random`` as in the CPU pipeline, so they stay a function of the sample seed; the erased values are
    drawn on the device by :class:`NormalizeErase` from ``noise_seed`` (one more draw after timm's).
    """

    def __init__(self, probability: float, mode: str = "pixel", count: int = 1):
        self.count = count
        # 'const' draws no fill values: same decisions as any mode, no torch RNG use, no work
        self.erasing = RandomErasing(probability, mode="const", max_count=count, device="cpu") if probability > 0 else None

    def __call__(self, image: torch.Tensor):
        boxes = torch.zeros(self.count, 5, dtype=torch.int64)
        if self.erasing is not None:
            recorder = _BoxRecorder(*image.shape[-2:])
            self.erasing(recorder)
            if recorder.boxes:
                boxes[: len(recorder.boxes), :4] = torch.tensor(recorder.boxes)
                boxes[:, 4] = random.getrandbits(31)
        return image, boxes


class NormalizeErase:
    """Batch half of the ``use_prefetcher`` split, on the batch's device:
    ``((uint8 images (B, 3, H, W), boxes (B, count, 5)), targets) -> (float images, targets)``.

    Normalisation is the same arithmetic as the CPU pipeline's ``ToTensor`` + ``Normalize``
    (``x / 255``, ``- mean``, ``/ std``), so the unerased pixels are bit-identical. Inside each box the
    values follow timm's modes: ``pixel`` N(0, 1) per pixel, ``rand`` N(0, 1) per channel, ``const`` 0,
    drawn by :func:`hashed_normal` from the box's ``noise_seed``: a function of the sample seed, independent
    of batch composition and device. Only the boxes' values are computed: on the CPU box by box (hashed as
    uint32 on the host, :func:`_normal_at_host`), elsewhere in one vectorised pass per box slot whose length is
    the number of values the boxes fill, a host number read from the boxes while they are on the host
    (:meth:`before_copy`, which :class:`common.data.DevicePrefetcher` runs before the copy), so the device is
    never waited for.
    """

    def __init__(self, data: DataConfig, augment: Optional[AugmentConfig] = None):
        self.mean = torch.tensor(data.mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(data.std, dtype=torch.float32).view(1, -1, 1, 1)
        augment = augment or AugmentConfig()
        self.mode = augment.re_mode.lower()
        self.erase = augment.re_prob > 0  # else every box is empty: nothing to read or fill
        if self.mode not in ("pixel", "rand", "const"):
            raise InputError(f"augment.re_mode={self.mode!r}; choose pixel, rand or const")
        self._constants = {}

    def before_copy(self, batch):
        """The host half: ``((images, boxes), targets) -> ((images, boxes, fill sizes), targets)``."""
        (images, boxes), targets = batch
        return (images, boxes, self.fill_sizes(boxes, images.shape[1])), targets

    def __call__(self, batch):
        (images, boxes, *sizes), targets = batch
        return self.images(images, boxes, *sizes), targets

    def fill_sizes(self, boxes: torch.Tensor, channels: int) -> Tuple[int, ...]:
        """Values each box slot fills over the batch (``channels x height x width`` summed over samples)."""
        if not self.erase:
            return (0,) * boxes.shape[1]
        return tuple((boxes[:, :, 2] * boxes[:, :, 3]).sum(0).mul_(channels).tolist())

    def images(self, images: torch.Tensor, boxes: torch.Tensor, sizes: Optional[Tuple[int, ...]] = None):
        """Normalised, erased float images. ``sizes``: :meth:`fill_sizes`; computed here when the boxes are on the
        host (on the device that would be a sync: pass them from :meth:`before_copy`)."""
        device = images.device
        if device not in self._constants:  # moved once, not per batch (a pageable copy can stall the host)
            self._constants[device] = (self.mean.to(device), self.std.to(device))
        mean, std = self._constants[device]
        x = torch.empty_like(images, dtype=torch.float32)
        for part in self._chunks(len(x), x[0].numel(), device):
            x[part].copy_(images[part]).div_(255).sub_(mean).div_(std)
        if not self.erase:
            return x
        if sizes is None:
            sizes = self.fill_sizes(boxes.cpu(), x.shape[1])
        if any(sizes) and boxes.device != device:
            boxes = (boxes.pin_memory() if device.type == "cuda" else boxes).to(device, non_blocking=True)
        for k, total in enumerate(sizes):
            if total:
                self._fill(x, boxes[:, k], k, total)
        return x

    def _fill(self, x: torch.Tensor, boxes: torch.Tensor, slot: int, total: int) -> None:
        """Erase box slot ``slot`` of every sample. On the CPU, where the boxes are host numbers, box by box
        through slices; elsewhere :meth:`_fill_vectorised`, a fixed number of kernels whatever the boxes."""
        if x.device.type != "cpu":
            return self._fill_vectorised(x, boxes, slot, total)
        c, h, w = x.shape[1:]
        for image, (top, left, height, width, seed) in zip(x, boxes.tolist()):
            if not height:
                continue
            region = image[:, top: top + height, left: left + width]
            if self.mode == "const":
                region.zero_()
                continue
            # the box's element numbers (channel, row, column), split into a per-(channel, row) and a per-column part
            channel = np.arange(c, dtype=np.int64).reshape(c, 1, 1)
            if self.mode == "rand":
                start, step = channel, np.zeros((1, 1, 1), dtype=np.int64)
            else:
                rows = np.arange(top, top + height, dtype=np.int64).reshape(1, -1, 1)
                start, step = (channel * h + rows) * w, np.arange(left, left + width, dtype=np.int64).reshape(1, 1, -1)
            region.copy_(_normal_at_host(int(_seed_key(torch.tensor(seed), slot)), start, step).expand_as(region))

    def _fill_vectorised(self, x: torch.Tensor, boxes: torch.Tensor, slot: int, total: int) -> None:
        """The ``total`` values the slot's boxes cover, laid out box after box (channel, row, column within a
        box), computed in one pass and written through ``(sample, channel, row, column)`` index tensors."""
        b, c, h, w = x.shape
        top, left, height, width, seed = boxes.unbind(1)
        area = height * width
        counts = area * c
        sample = torch.repeat_interleave(torch.arange(b, device=x.device), counts, output_size=total)
        offset = torch.arange(total, device=x.device) - (counts.cumsum(0) - counts)[sample]
        area, width = area[sample], width[sample]
        channel = offset // area
        within = offset - channel * area
        row, col = top[sample] + within // width, left[sample] + within % width
        if self.mode == "const":
            values = torch.zeros((), device=x.device)
        else:
            index = channel if self.mode == "rand" else (channel * h + row) * w + col
            values = _normal_at(_seed_key(seed, slot)[sample], index)
        x.index_put_((sample, channel, row, col), values)

    cpu_chunk_elements = 1 << 17  # CPU: values normalised at a time (cache-sized, no page faults of fresh memory)

    def _chunks(self, count: int, size: int, device: torch.device):
        """Slices of ``count`` items of ``size`` values: one on an accelerator, cache-sized pieces on the CPU."""
        step = count if device.type != "cpu" else max(1, self.cpu_chunk_elements // size)
        return [slice(i, i + step) for i in range(0, count, step)]


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply, multiplier 0x45d9f3b) on int64 tensors holding uint32 values;
    products stay below 2**59, so it is exact on every device."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _seed_key(seeds: torch.Tensor, stream: int) -> torch.Tensor:
    return _mix32((seeds.long() + 0x9E3779B9 * (stream + 1)) & _MASK32)


def _normal_at(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Standard normal values at element numbers ``index`` of the streams ``key`` (broadcast together)."""
    counter = 2 * index.to(key.device)
    return _box_muller((_mix32((key + counter) & _MASK32) >> 8).float(),
                       (_mix32((key + counter + 1) & _MASK32) >> 8).float())


def _box_muller(bits1: torch.Tensor, bits2: torch.Tensor) -> torch.Tensor:
    """Standard normal values from two 24-bit uniform integers (as float32, exact) per value."""
    u1, u2 = (bits1 + 0.5) / 2**24, (bits2 + 0.5) / 2**24
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * torch.pi * u2)


_MIX32_MULTIPLIER = np.uint32(0x45D9F3B)


def _mix32_host(x: np.ndarray) -> np.ndarray:
    """:func:`_mix32` in place on a uint32 array, whose arithmetic wraps at 2**32 by itself: the same values with
    no masking passes, each pass over half the bytes of int64 tensors."""
    for _ in range(2):
        x ^= x >> 16
        x *= _MIX32_MULTIPLIER
    x ^= x >> 16
    return x


def _normal_at_host(key: int, start: np.ndarray, step: np.ndarray) -> torch.Tensor:
    """:func:`_normal_at` (bit for bit) of the stream ``key`` at element numbers ``start + step`` (int64 arrays,
    broadcast together), hashed as uint32 on the host; the float arithmetic is the same torch calls."""
    counter = _uint32(key + 2 * start) + _uint32(2 * step)  # key + 2 x index, mod 2**32: the full-size sum wraps
    following = counter + np.uint32(1)
    return _box_muller(*(torch.from_numpy((_mix32_host(c) >> 8).astype(np.float32)) for c in (counter, following)))


def _uint32(values: np.ndarray) -> np.ndarray:
    return (values % 2**32).astype(np.uint32)


def hashed_normal(seeds: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Standard normal values ``(len(seeds), *index.shape)``: value ``[i, ...]`` is a function of ``seeds[i]``,
    ``stream`` and the element number in ``index`` alone (Box-Muller on hashed counters), so any subset of a
    sample's elements can be computed alone. torch has no per-sample seeded batched RNG; this gives each
    sample its own stream in one vectorised pass, the same on every device up to float rounding."""
    return _normal_at(_seed_key(seeds, stream).view(-1, *([1] * index.dim())), index[None])


class PairwiseMixup(Mixup):
    """timm's ``Mixup``, its batch mode done a few pairs at a time in place: image ``i`` mixes with image
    ``B - 1 - i`` (timm's flip) with timm's draws and arithmetic, so the images are timm's bit for bit, without a
    flipped copy of the whole batch (on the CPU the pairs stay in cache, and a block of one pair, as at 224 px, is
    mixed in place with no copy at all; elsewhere one block is the whole batch)."""

    cpu_chunk_elements = 1 << 17

    def _mix_batch(self, x):
        lam, use_cutmix = self._params_per_batch()
        if lam == 1.:
            return 1.
        if use_cutmix:
            (yl, yh, xl, xh), lam = cutmix_bbox_and_lam(x.shape, lam, ratio_minmax=self.cutmix_minmax,
                                                        correct_lam=self.correct_lam)
        n, half = len(x), len(x) // 2
        step = half if x.device.type != "cpu" else max(1, self.cpu_chunk_elements // x[0].numel())
        for i in range(0, half, step):
            j = min(i + step, half)
            single = j == i + 1  # one pair: b is the partner row itself, mixed in place; else a flipped copy
            a, b = x[i:j], x[n - j:n - i] if single else x[n - j:n - i].flip(0)  # row k of b: a's row k's partner
            if use_cutmix:
                box = a[:, :, yl:yh, xl:xh].clone()
                a[:, :, yl:yh, xl:xh] = b[:, :, yl:yh, xl:xh]
                b[:, :, yl:yh, xl:xh] = box
            else:
                a_share = a * (1. - lam)
                a.mul_(lam).add_(b * (1. - lam))
                b.mul_(lam).add_(a_share)
            if not single:
                x[n - j:n - i] = b.flip(0)
        return lam


def build_mixup(augment: AugmentConfig, num_classes: int) -> Optional[Mixup]:
    """timm's ``Mixup`` (:class:`PairwiseMixup`) when mixup or cutmix is on (it also applies label smoothing to
    the soft targets)."""
    if augment.mixup <= 0 and augment.cutmix <= 0:
        return None
    return PairwiseMixup(mixup_alpha=augment.mixup, cutmix_alpha=augment.cutmix, prob=augment.mixup_prob,
                 switch_prob=augment.mixup_switch_prob, mode=augment.mixup_mode,
                 label_smoothing=augment.label_smoothing, num_classes=num_classes)
