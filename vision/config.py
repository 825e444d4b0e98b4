"""DeiT's settings, every section of a ``vision.train`` recipe and of ``vision.evaluate``, with their valid values.

The sections are plain dataclasses (:mod:`common.config` loads and checks them); this module imports neither
timm nor torchvision, so that a command line is parsed, refused or described by ``--help`` before either is
loaded. The numbers are the recipes' (``configs/deit_recipe.yaml``, ``configs/fmnist_deit.yaml``); the defaults
here are "off" or the libraries' own. The code that uses each section: :mod:`vision.data` (``data``),
:mod:`vision.augment` (``augment``), :mod:`vision.evaluate` (``model``, evaluation), :mod:`vision.task`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Dict, Literal, Optional, Tuple, Union

from common import trainer
from common.config import ConfigError, Range

# ImageNet's channel statistics (timm's IMAGENET_DEFAULT_MEAN / _STD, written out so that the settings load without
# timm; tests/test_vision_data.py checks them against timm's).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Probability = Annotated[float, Range(ge=0, le=1)]
Channel = Annotated[float, Range(ge=0, le=1)]  # a normalisation mean, on images in [0, 1]
Spread = Annotated[float, Range(gt=0)]  # a normalisation std
CropArea = Annotated[float, Range(gt=0, le=1)]  # a fraction of the image area


@dataclass
class ModelConfig:
    """``timm.create_model(name, num_classes=data.num_classes, img_size=data.input_size, **kwargs)``."""

    name: str  # a timm model name, e.g. deit_tiny_siamese_patch16_224
    kwargs: Dict[str, Any] = field(default_factory=dict)  # e.g. topology, embed_dim, depth, num_heads, patch_size
    drop_path: Annotated[float, Range(ge=0, lt=1)] = 0.0  # stochastic-depth rate of the last block (timm's drop_path_rate)
    drop_path_schedule: Literal["linear", "uniform"] = "linear"  # linear: 0 at the first block rising to drop_path (timm, DeiT); uniform: drop_path at every block (DeiT III)
    pretrained: bool = False  # timm's pretrained weights (needs them cached; no download here)

    def __post_init__(self):
        unset = [k for k, v in self.kwargs.items() if v is None]  # timm would drop them silently
        if unset:
            raise ConfigError(f"model.kwargs {unset} have no value; give each a value or leave it out")

    def check_registered(self) -> None:
        """The name and keyword arguments against timm's registry (imports timm and registers our DeiTs)."""
        from vision.deit import check_model_name

        check_model_name(self.name, self.kwargs)


@dataclass
class DataConfig:
    """Where the images are and how evaluation sees them."""

    dataset: Literal["imagefolder", "fashion_mnist"] = "imagefolder"  # ImageNet layout, or Fashion-MNIST (CPU)
    path: Optional[str] = None  # imagefolder: root holding <train_split>/ and <val_split>/ (hf: or a Hub dataset); fashion_mnist: optional
    format: Literal["imagefolder", "wds", "hf"] = "imagefolder"  # how data.path stores the images: class folders, WebDataset tars or a Hugging Face dataset (python -m vision.shard converts)
    train_split: str = "train"  # sub-folder of data.path (hf: or a split of the dataset there)
    val_split: str = "val"  # sub-folder of data.path (hf: or a split of the dataset there)
    num_classes: Annotated[int, Range(ge=1)] = 1000  # checked against the class folders
    input_size: Annotated[int, Range(ge=1)] = 224  # training crop and evaluation size, pixels
    crop_pct: Annotated[float, Range(gt=0, le=1)] = 0.875  # eval: resize to input_size / crop_pct, then center crop input_size
    interpolation: str = "bicubic"  # resampling of resize and crop
    mean: Tuple[Channel, Channel, Channel] = IMAGENET_MEAN  # normalisation, per RGB channel
    std: Tuple[Spread, Spread, Spread] = IMAGENET_STD  # normalisation, per RGB channel
    num_workers: Union[Annotated[int, Range(ge=0)], Literal["auto"]] = "auto"  # DataLoader workers per process; auto: from the CPU count
    backend: Literal["torch", "dali"] = "torch"  # dali: GPU decode and augmentation (vision.dali, pip extra [dali])
    max_train_samples: Optional[Annotated[int, Range(ge=1)]] = None  # keep the first N training images (quick runs, tests)
    max_val_samples: Optional[Annotated[int, Range(ge=1)]] = None  # evaluate on the first N val images

    def __post_init__(self):
        moved = [f"data.{k}={getattr(self, k)}" for k in ("train_split", "val_split")
                 if getattr(self, k) != self.__dataclass_fields__[k].default]
        if self.dataset == "fashion_mnist" and moved:
            raise ConfigError(f"{', '.join(moved)}: data.dataset=fashion_mnist has fixed splits (training on its 60,000 "
                              "train images, evaluation on its 10,000 test images); the split names are folders of an "
                              "imagefolder data.path: leave them out")
        if self.format != "imagefolder" and self.dataset != "imagefolder":
            raise ConfigError(f"data.format={self.format} reads ImageNet-like data from data.path; "
                              f"data.dataset={self.dataset} has its own files: leave data.format=imagefolder")
        if self.format != "imagefolder" and self.backend == "dali":
            raise ConfigError(f"data.backend=dali reads image files: it needs data.format=imagefolder (data.format="
                              f"{self.format} runs on data.backend=torch)")

    def check_ready(self) -> None:
        """The images' place, needed to run (not to print a config)."""
        if self.dataset == "imagefolder" and not self.path:
            raise ConfigError("data.path is required for dataset=imagefolder: the directory that holds "
                              f"{self.train_split}/<class>/*.JPEG and {self.val_split}/<class>/*.JPEG (or their "
                              "shards, with data.format)")


@dataclass
class AugmentConfig:
    """Training-time augmentation and target mixing (neutral defaults: nothing on)."""

    auto_augment: Optional[str] = None  # timm policy string, DeiT: rand-m9-mstd0.5-inc1
    color_jitter: Annotated[float, Range(ge=0)] = 0.0  # brightness, contrast, saturation (3-Augment, and timm's pipeline without auto_augment)
    scale: Tuple[CropArea, CropArea] = (0.08, 1.0)  # random-resized-crop area range
    hflip: Probability = 0.5  # horizontal flip probability
    re_prob: Probability = 0.0  # random erasing probability
    re_mode: str = "pixel"  # erased box filled with per-pixel noise (timm: const, rand, pixel)
    re_count: Annotated[int, Range(ge=1)] = 1  # boxes per erased image
    repeated_aug: Annotated[int, Range(ge=1)] = 1  # repeats of each image per epoch (DeiT: 3); 1 = off
    mixup: Annotated[float, Range(ge=0)] = 0.0  # mixup alpha; 0 = off
    cutmix: Annotated[float, Range(ge=0)] = 0.0  # cutmix alpha; 0 = off
    mixup_prob: Probability = 1.0  # probability a batch is mixed
    mixup_switch_prob: Probability = 0.5  # probability of cutmix instead of mixup when both are on
    mixup_mode: Literal["batch", "pair", "elem"] = "batch"  # one lambda per batch, pair of images, or image
    label_smoothing: Annotated[float, Range(ge=0, lt=1)] = 0.0  # target smoothing (inside mixup's soft targets when mixing)
    three_augment: bool = False  # DeiT III's 3-Augment in place of timm's pipeline: crop, flip, one of grayscale / solarization / blur, color_jitter
    simple_random_crop: bool = False  # 3-Augment's crop: resize, then a random crop with 4 px reflect padding (DeiT III's --src; scale unused)
    bce_loss: bool = False  # binary cross-entropy on the (mixed) targets binarised at > 0 (DeiT III's --bce-loss)

    def __post_init__(self):
        if self.scale[0] > self.scale[1]:
            raise ConfigError(f"augment.scale={list(self.scale)}: the smallest crop area comes first")
        if self.three_augment and self.auto_augment:
            raise ConfigError(f"augment.three_augment=true replaces timm's pipeline, and with it augment.auto_augment="
                              f"{self.auto_augment!r}: set augment.auto_augment=null (DeiT III trains without it)")
        if self.simple_random_crop and not self.three_augment:
            raise ConfigError("augment.simple_random_crop=true is 3-Augment's crop (DeiT III's --src): set "
                              "augment.three_augment=true as well, or leave simple_random_crop false")
        if self.bce_loss and self.label_smoothing > 0:
            raise ConfigError(f"augment.bce_loss=true makes every target above 0 a positive (DeiT III's rule), and "
                              f"augment.label_smoothing={self.label_smoothing:g} puts every class above 0: set "
                              "augment.label_smoothing=0 (DeiT III trains its BCE without smoothing)")


@dataclass
class DistillConfig:
    """DeiT's knowledge distillation (its ``--distillation-type``, ``--teacher-model``, ``--teacher-path``,
    ``--distillation-alpha``, ``--distillation-tau``); off unless ``type`` is soft or hard (:mod:`vision.distill`)."""

    type: Literal["none", "soft", "hard"] = "none"  # hard: CE with the teacher's argmax; soft: KL at temperature tau
    teacher: Optional[str] = None  # a timm model name (DeiT: regnety_160, RegNetY-16GF)
    teacher_weights: Optional[str] = None  # the teacher's weights file (.pth/.pt/.safetensors); never downloaded
    teacher_kwargs: Dict[str, Any] = field(default_factory=dict)  # more timm.create_model arguments of the teacher
    alpha: Optional[Probability] = None  # loss = (1 - alpha) * base loss + alpha * distillation loss
    tau: Optional[Annotated[float, Range(gt=0)]] = None  # soft: the softmax temperature

    def __post_init__(self):
        if self.type == "none":
            return
        needed = ["teacher", "teacher_weights", "alpha"] + (["tau"] if self.type == "soft" else [])
        unset = [f"distill.{k}" for k in needed if getattr(self, k) is None]
        if unset:
            raise ConfigError(f"distill.type={self.type} needs {', '.join(unset)} (the recipe "
                              "configs/deit_distill.yaml gives all but distill.teacher_weights)")

    @property
    def on(self) -> bool:
        return self.type != "none"

    def check_registered(self) -> None:
        """The teacher's name against timm's registry and its weights file on disk, before any work."""
        if not self.on:
            return
        import timm

        from common.cli import InputNotFoundError

        if not timm.is_model(self.teacher):
            raise ConfigError(f"distill.teacher={self.teacher!r} is not a timm model (DeiT's teacher: regnety_160)")
        if not os.path.isfile(self.teacher_weights):
            raise InputNotFoundError(f"distill.teacher_weights={self.teacher_weights}: no such file; give the "
                                     f"{self.teacher} weights file (teachers are never downloaded)")


@dataclass(kw_only=True)
class OptimConfig(trainer.OptimConfig):
    """AdamW (or LAMB) with a per-step cosine schedule and linear warmup; the numbers are the recipe's
    (configs/deit_recipe.yaml, configs/deit3_recipe.yaml, configs/fmnist_deit.yaml)."""

    base_lr: Annotated[float, Range(gt=0)]  # peak lr at batch lr_base_batch
    lr_base_batch: Optional[Annotated[int, Range(ge=1)]]  # lr = base_lr * batch_size / lr_base_batch (DeiT's linear scaling rule); null: lr = base_lr at any batch (DeiT III's --unscale-lr)
    optimizer: Literal["adamw", "lamb"] = "adamw"  # lamb: timm's Lamb (DeiT III's, as apex's FusedLAMB: trust ratio, global grad-norm clip 1.0)
    epochs: Annotated[int, Range(ge=1)]  # passes over the training set
    warmup_epochs: Annotated[float, Range(ge=0)] = 0.0  # off
    warmup_lr: Optional[Annotated[float, Range(ge=0)]] = None  # lr at step 0 of the warmup (needed with warmup_epochs > 0)
    min_lr: Annotated[float, Range(ge=0)] = 0.0  # lr at the end of the cosine
    layer_decay: Optional[Annotated[float, Range(gt=0, le=1)]] = None  # layer-wise lr decay (timm's param_groups_layer_decay): block i of L gets lr * layer_decay^(L - i); null = off

    def __post_init__(self):
        if self.warmup_epochs > 0 and self.warmup_lr is None:
            raise ConfigError(f"optim.warmup_epochs={self.warmup_epochs} needs optim.warmup_lr (the lr it starts at)")

    @property
    def lr(self) -> float:
        return self.base_lr if self.lr_base_batch is None else self.base_lr * self.batch_size / self.lr_base_batch


@dataclass
class RunConfig(trainer.RunConfig):
    output_dir: str = "runs/deit"
    log_every: Annotated[int, Range(ge=1)] = 50
    eval_every: Annotated[int, Range(ge=0)] = 1  # evaluate every N epochs (and always after the last); 0 = only at the end
    eval_batch_size: Annotated[int, Range(ge=1)] = 256  # per process
    finetune: Optional[str] = None  # start from these weights (DeiT's --finetune): position embeddings resampled to data.input_size, heads of another class count reset

    def check_registered(self) -> None:
        if self.finetune is not None and not os.path.isfile(self.finetune):
            from common.cli import InputNotFoundError

            raise InputNotFoundError(f"train.finetune={self.finetune}: no such file; give the weights to fine-tune from "
                                     "(model.safetensors of a run, or a timm/DeiT state dict)")


@dataclass
class TrainConfig:
    """A DeiT training run (``python -m vision.train``)."""

    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    augment: AugmentConfig = field(default_factory=AugmentConfig)  # off
    distill: DistillConfig = field(default_factory=DistillConfig)  # off
    train: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        if self.augment.mixup > 0 or self.augment.cutmix > 0:
            if self.optim.batch_size % 2:
                raise ConfigError("mixup/cutmix mix pairs of images: optim.batch_size must be even")
        if self.augment.three_augment and self.data.backend == "dali":
            raise ConfigError("augment.three_augment=true runs in the DataLoader workers, which data.backend=dali "
                              "replaces: set data.backend=torch")

    def check_registered(self) -> None:
        if self.distill.on and "distilled" not in self.model.name:
            raise ConfigError(f"distill.type={self.distill.type} trains a distillation head: model.name must be a "
                              f"distilled model, e.g. {self.model.name.replace('_patch', '_distilled_patch')}"
                              if self.model.name.startswith("deit_") else
                              f"distill.type={self.distill.type} needs a distilled model (deit_*_distilled_patch16_224)")


@dataclass
class EvalConfig:
    """An evaluation (``python -m vision.evaluate``): a model, its weights and a val set."""

    model: ModelConfig
    data: DataConfig
    checkpoint: Optional[str] = None  # .safetensors / .pt weights, or a training checkpoint step_*.pt
    weights: Literal["model", "ema"] = "model"  # which weights of a training checkpoint
    batch_size: Annotated[int, Range(ge=1)] = 256  # images per forward pass, per process
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: Union[bool, Literal["auto"]] = "auto"  # torch.compile the model once (fixed shapes); auto: on CUDA only
    output: Optional[str] = None  # JSON results file (default: <checkpoint>.eval.json, or print only)
