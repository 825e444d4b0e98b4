"""``data.backend=dali``: the DeiT training feed decoded and augmented by NVIDIA DALI.

JPEG decode (nvJPEG on the GPU, fused with the random-resized crop so only the crop is decoded), bicubic
resize, flip and RandAugment run in a DALI pipeline; normalisation and random erasing are
:class:`vision.augment.NormalizeErase` on the same device; mixup/cutmix stay in torch. Install with
``pip install -e '.[dali]'`` (``nvidia-dali-cuda130``; use ``nvidia-dali-cuda120`` with a CUDA 12 torch).
On a CPU device the same pipeline runs DALI's CPU operators (libjpeg-turbo): how it is tested without a GPU.

    loader = DaliTrainLoader(train_set.samples, sampler, per_process_batch, cfg.data, cfg.augment, device,
                             seed=cfg.train.seed + rank)
    sampler.set_epoch(epoch, start)
    for images, targets in loader: ...                    # float (B, 3, S, S) normalised, int64 (B,), on device

What stays as in the torch backend: the sample order, repeats, sharding and mid-epoch resume position
(:class:`common.data.ResumableSampler`), and the erasing decisions (drawn from each sample's seed).
What does not (the limits):

* The crop, flip and RandAugment draws come from DALI's generators, seeded once per pipeline: a resumed
  run, or the same run on another number of processes, sees other augmentations (the torch backend's are a
  function of (seed, epoch, position)).
* DALI's RandAugment is the paper's, not timm's: ``n`` ops always applied (timm: each with probability 0.5),
  chosen among 14 (translate, shear, rotate, brightness, contrast, color, sharpness, posterize 8..4 bits,
  solarize, equalize, auto-contrast, identity; timm has invert and solarize-add and no identity), no
  magnitude noise (``mstd``), bilinear warps with a grey fill of 128 (timm: bicubic, the dataset mean).
  timm's magnitude ``m`` of 10 maps to bin ``round(m / 10 * 30)`` of 31. It is a different augmentation
  from the recipe's: use it for throughput, or tune the recipe for it.
* A file DALI cannot decode stops the run (the torch backend skips it with a warning).

DALI works one batch ahead, on its own threads: it decodes batch k + 1 while the model trains on batch k.
"""
from __future__ import annotations

import random
import re
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from common.cli import InputError
from common.data import ResumableSampler, resolve_num_workers
from vision.data import DataConfig
from vision.augment import AugmentConfig, NormalizeErase, RandomErasingBoxes

DALI_MAGNITUDE_BINS = 31


class DaliMissingError(InputError, ImportError):
    """data.backend=dali without NVIDIA DALI installed."""


def require_dali():
    """The ``nvidia.dali`` module, or a one-line error naming the install command."""
    try:
        import nvidia.dali
    except ImportError:
        raise DaliMissingError("data.backend=dali needs NVIDIA DALI, which is not installed: pip install -e '.[dali]' "
                         "(nvidia-dali-cuda130; nvidia-dali-cuda120 for a CUDA 12 torch), or set data.backend=torch") from None
    return nvidia.dali


def rand_augment_args(policy: str) -> dict:
    """DALI ``rand_augment`` arguments for a timm ``rand-...`` policy string (``n``, ``m`` -> bin, ``inc``)."""
    if not policy.startswith("rand"):
        raise InputError(f"augment.auto_augment={policy!r}: the DALI backend has RandAugment ('rand-m9-...') only")
    args = {"n": 2, "m": 10.0, "monotonic_mag": False}
    for part in policy.split("-")[1:]:
        key, value = re.match(r"([a-z]+)(.*)", part).groups()
        if key == "m":
            args["m"] = float(value)
        elif key == "n":
            args["n"] = int(value)
        elif key == "inc":
            args["monotonic_mag"] = bool(int(value))
    args["m"] = round(min(args["m"], 10) / 10 * (DALI_MAGNITUDE_BINS - 1))
    return args


def build_pipeline(data: DataConfig, augment: AugmentConfig, batch_size: int, device: torch.device,
                   seed: int, num_threads: int = 4):
    """The DALI pipeline: encoded bytes in (external source ``encoded``), uint8 HWC crops out."""
    require_dali()
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import rand_augment

    cuda = device.type == "cuda"
    size = data.input_size
    interp = {"bicubic": types.INTERP_CUBIC, "bilinear": types.INTERP_LINEAR}.get(data.interpolation)
    if interp is None:
        raise InputError(f"data.interpolation={data.interpolation!r}: the DALI backend supports bicubic or bilinear")

    @pipeline_def(enable_conditionals=True)
    def pipeline():
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
        images = fn.decoders.image_random_crop(
            encoded, device="mixed" if cuda else "cpu", output_type=types.RGB, random_area=list(augment.scale),
            random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
        images = fn.resize(images, resize_x=size, resize_y=size, interp_type=interp, antialias=True)
        if augment.hflip > 0:
            images = fn.flip(images, horizontal=fn.random.coin_flip(probability=augment.hflip))
        if augment.auto_augment:
            images = rand_augment.rand_augment(images, shape=[size, size], **rand_augment_args(augment.auto_augment))
        return images

    pipe = pipeline(batch_size=batch_size, num_threads=num_threads, device_id=device.index or 0 if cuda else None,
                    seed=seed, prefetch_queue_depth=1, exec_pipelined=True, exec_async=True)
    pipe.build()
    return pipe


class DaliTrainLoader:
    """Training batches ``(images, targets)`` on ``device`` from a DALI pipeline, in ``sampler``'s order.

    ``samples``: ``(path, class index)`` pairs (an ImageFolder's ``samples``). Call ``sampler.set_epoch``
    before each iteration, as with the torch loader; the last incomplete batch is dropped.
    """

    def __init__(self, samples: Sequence[Tuple[str, int]], sampler: ResumableSampler, batch_size: int,
                 data: DataConfig, augment: AugmentConfig, device, seed: int = 0, num_threads: int = 4):
        self.samples, self.sampler, self.batch_size = list(samples), sampler, batch_size
        self.device = torch.device(device)
        self.pipe = build_pipeline(data, augment, batch_size, self.device, seed, num_threads)
        self.erasing = RandomErasingBoxes(augment.re_prob, augment.re_mode, augment.re_count)
        self.normalize_erase = NormalizeErase(data, augment)
        self.blank = torch.empty(3, data.input_size, data.input_size, dtype=torch.uint8)  # erasing reads its shape only

    def __len__(self) -> int:
        """Batches in a full epoch."""
        return len(self.sampler) // self.batch_size

    def _boxes(self, seeds) -> torch.Tensor:
        """Erasing decisions from each sample's seed (Python's generator only; its state is restored)."""
        state = random.getstate()
        try:
            boxes = []
            for seed in seeds:
                random.seed(seed)
                boxes.append(self.erasing(self.blank)[1])
        finally:
            random.setstate(state)
        return torch.stack(boxes)

    def _schedule(self, batch) -> None:
        """Read the batch's files and start DALI on them (it runs asynchronously, on its own threads)."""
        self.pipe.feed_input("encoded", [np.fromfile(self.samples[i][0], dtype=np.uint8) for i, _ in batch])
        self.pipe.schedule_run()

    def __iter__(self):
        keys = list(self.sampler)  # from the epoch's start position on
        batches = [keys[first: first + self.batch_size]
                   for first in range(0, len(keys) - self.batch_size + 1, self.batch_size)]
        pending = 0  # batches started and not yet taken: DALI decodes batch k + 1 while the model trains on k
        try:
            for k, batch in enumerate(batches):
                if k == 0:
                    self._schedule(batch)
                    pending += 1
                if k + 1 < len(batches):
                    self._schedule(batches[k + 1])
                    pending += 1
                targets = torch.tensor([self.samples[i][1] for i, _ in batch])
                boxes = self._boxes([seed for _, seed in batch])
                (images,) = self.pipe.outputs()
                pending -= 1
                images = _to_torch(images, self.device).permute(0, 3, 1, 2)  # NHWC memory, NCHW view
                yield (self.normalize_erase.images(images, boxes),  # host boxes: sizes read there, no sync
                       targets.to(self.device, non_blocking=True))
        finally:  # stopped early (the run's last step, stop_at_step): drop what was started, or the next epoch
            for _ in range(pending):  # would receive it
                self.pipe.outputs()


def _to_torch(images, device: torch.device) -> torch.Tensor:
    """A DALI batch of equal-shaped uint8 HWC images as one torch tensor (B, H, W, C) on ``device``."""
    dense = images.as_tensor()
    if device.type == "cuda":
        from nvidia.dali.plugin.pytorch import feed_ndarray

        out = torch.empty(dense.shape(), dtype=torch.uint8, device=device)
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device))
        return out
    return torch.from_numpy(np.array(dense))


def build_dali_loader(dataset, sampler: ResumableSampler, batch_size: int, data: DataConfig,
                      augment: Optional[AugmentConfig], device, seed: int = 0) -> DaliTrainLoader:
    """:class:`DaliTrainLoader` over an ImageFolder-style dataset (its ``samples``) built by ``build_dataset``."""
    samples = getattr(dataset, "samples", None)
    if samples is None:
        raise InputError("data.backend=dali reads image files: use data.dataset=imagefolder (Fashion-MNIST is "
                         "in memory; use data.backend=torch)")
    return DaliTrainLoader(samples, sampler, batch_size, data, augment or AugmentConfig(), device, seed,
                           num_threads=max(1, resolve_num_workers(data.num_workers)))
