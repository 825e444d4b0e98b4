"""What DiT brings to the training loop (:mod:`common.trainer`): examples, model, diffusion loss, grids, FID.

The objective is DiT's (:mod:`diffusion.gaussian_diffusion`): uniform t, epsilon MSE plus the VLB for the
learned variance, AdamW at a constant learning rate, an EMA updated every step. After a step the task may save a
grid of EMA samples (``train.sample_every``) and score an in-training Frechet distance (``train.fid_every``):
``train.fid_samples`` images from diffusion.sample's sampler (sample ``i``: class ``i % num_classes``, noise seeded
by ``(train.seed, i)``, no guidance) against ``train.fid_reference``, logged as ``fid/fd``. It is the number
``diffusion.sample --seed SEED --steps FID_STEPS`` then ``diffusion.fid`` give for ``ema.safetensors`` of that step.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from common import trainer
from common.residual import check_topology
from diffusion.data import DataConfig, DiffusionExamples, build_images
from diffusion.gaussian_diffusion import GaussianDiffusion
from diffusion.models import DIT_TOPOLOGIES, DiT, DiT_models


@dataclass
class ModelConfig:
    name: str = "DiT-B/2"  # a key of diffusion.models.DiT_models
    topology: str = "pre"  # one of diffusion.models.DIT_TOPOLOGIES
    learn_sigma: bool = True  # 2C outputs and the MSE+VLB loss; false: C outputs, plain MSE
    class_dropout_prob: float = 0.1  # label dropout for classifier-free guidance
    grad_checkpointing: bool = False  # recompute blocks in the backward pass (less memory)
    kwargs: Dict[str, Any] = field(default_factory=dict)  # further DiT arguments (hidden_size, depth, ...)

    def __post_init__(self):
        check_topology(self.topology, DIT_TOPOLOGIES)
        if self.name not in DiT_models:
            raise ValueError(f"model.name={self.name!r} is not a DiT; choose one of {', '.join(DiT_models)}")
        if not 0.0 <= self.class_dropout_prob < 1.0:
            raise ValueError(f"model.class_dropout_prob={self.class_dropout_prob} must lie in [0, 1)")
        own = {"input_size", "in_channels", "num_classes", "learn_sigma", "class_dropout_prob", "topology"}
        allowed = [p for p in inspect.signature(DiT).parameters if p not in own]
        unknown = [k for k in self.kwargs if k not in allowed]
        if unknown:
            raise ValueError(f"model.kwargs has unknown DiT arguments {unknown} (in YAML write `{{hidden_size: 96}}` with "
                             f"a space after the colon); valid: {', '.join(allowed)}")


@dataclass
class DiffusionConfig:
    num_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02


@dataclass
class OptimConfig(trainer.OptimConfig):
    """AdamW at a constant learning rate, as DiT (its numbers are in configs/dit_recipe.yaml)."""

    lr: float = 1e-4  # constant
    steps: int = 400_000

    def __post_init__(self):
        super().__post_init__()
        if self.steps < 1 or self.lr <= 0:
            raise ValueError(f"optim.steps={self.steps} must be >= 1 and optim.lr={self.lr} positive")


@dataclass
class RunConfig(trainer.RunConfig):
    output_dir: str = "runs/dit"
    ema_decay: Optional[float] = 0.9999  # the EMA weights are the ones sampled (null: sample the raw weights)
    ckpt_every: int = 50_000  # steps (also at the end, and at stop_at_step)
    sample_every: int = 10_000  # EMA sample grid every N steps (and at the end); 0 = never (no VAE needed)
    sample_count: int = 16  # images in a grid
    sample_steps: int = 100  # respaced DDPM steps for the grids
    sample_cfg_scale: float = 1.0  # classifier-free guidance for the grids (1 = none)
    fid_every: int = 0  # Frechet distance of EMA samples every N steps (and at the end); 0 = never
    fid_samples: int = 5000  # images generated per evaluation (class i % num_classes, as diffusion.sample)
    fid_steps: int = 250  # respaced DDPM steps (diffusion.sample's default), no guidance
    fid_batch_size: int = 64  # samples per forward pass (diffusion.sample's --batch-size default)
    fid_reference: Optional[str] = None  # fashion-mnist:test, image folder, .npz images, or statistics .npz (ADM's)
    fid_feature_extractor: str = "inception-v3-compat"  # or fmnist-cnn (the CPU recipe)
    fid_extractor_weights: Optional[str] = None  # weights file; null: the extractor's cache (see diffusion.fid)

    def __post_init__(self):
        from common.feature_extractors import FEATURE_EXTRACTORS_REGISTRY

        super().__post_init__()
        if self.sample_every < 0 or self.sample_count < 1 or self.sample_steps < 1:
            raise ValueError(f"train.sample_every={self.sample_every} must be >= 0 (0: no grids), train.sample_count="
                             f"{self.sample_count} and train.sample_steps={self.sample_steps} >= 1")
        if self.fid_every < 0:
            raise ValueError(f"train.fid_every={self.fid_every}: a number of steps, or 0 for no in-training FID")
        if self.fid_every and not self.fid_reference:
            raise ValueError("train.fid_every > 0 needs train.fid_reference: fashion-mnist:test, an image folder, an "
                             ".npz of images, or a statistics .npz (e.g. ADM's VIRTUAL_imagenet256_labeled.npz); "
                             "or set train.fid_every=0")
        if self.fid_samples < 2 or self.fid_steps < 1 or self.fid_batch_size < 1:
            raise ValueError(f"train.fid_samples={self.fid_samples} must be >= 2, train.fid_steps={self.fid_steps} "
                             f"and train.fid_batch_size={self.fid_batch_size} >= 1")
        if self.fid_feature_extractor not in FEATURE_EXTRACTORS_REGISTRY:
            raise ValueError(f"train.fid_feature_extractor={self.fid_feature_extractor!r} is not registered; "
                             f"choose one of {', '.join(sorted(FEATURE_EXTRACTORS_REGISTRY))}")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(dataset="fashion_mnist", autoencoder="none", image_size=32))
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        if self.data.dataset == "latents" and self.data.autoencoder == "none" and (
                self.train.sample_every or self.train.fid_every):
            raise ValueError("sample grids and in-training FID of latents need data.autoencoder (the VAE that made "
                             "the latents); or set train.sample_every=0 and train.fid_every=0 to train without a VAE")




def build_model(cfg: TrainConfig, sample_shape) -> torch.nn.Module:
    channels, size, _ = sample_shape
    model = DiT_models[cfg.model.name](
        input_size=size, in_channels=channels, num_classes=cfg.data.num_classes, learn_sigma=cfg.model.learn_sigma,
        class_dropout_prob=cfg.model.class_dropout_prob, topology=cfg.model.topology, **cfg.model.kwargs,
    )
    model.set_grad_checkpointing(cfg.model.grad_checkpointing)
    return model


def weights_metadata(cfg: TrainConfig, sample_shape, step: int) -> dict:
    """What a sampler needs to rebuild the model around exported weights."""
    return {"model": cfg.model.name, "topology": cfg.model.topology, "learn_sigma": cfg.model.learn_sigma,
            "class_dropout_prob": cfg.model.class_dropout_prob, "in_channels": sample_shape[0],
            "input_size": sample_shape[1], "num_classes": cfg.data.num_classes, "model_kwargs": json.dumps(cfg.model.kwargs),
            "autoencoder": cfg.data.autoencoder, "step": step}


# --------------------------------------------------------------------------------------- sampling
def build_decoder(cfg: TrainConfig, device):
    """The VAE (or pixel) decoder that the grid and FID samplers share: loaded once."""
    from diffusion.sample import Decoder

    try:
        return Decoder(cfg.data.autoencoder, device)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err} Or set train.sample_every=0 and train.fid_every=0 to train without "
                                "sample grids and in-training FID.") from err


def build_sampler(cfg: TrainConfig, ema_model, sample_shape, device, decoder, steps: int, cfg_scale: float = 1.0):
    """diffusion.sample's sampler on the EMA weights, with fixed per-image noise streams (seeded by
    ``(train.seed, index)``), so that grids and FIDs of one run are comparable from step to step."""
    from diffusion.sample import ModelSpec, Sampler

    spec = ModelSpec(name=cfg.model.name, topology=cfg.model.topology, learn_sigma=cfg.model.learn_sigma,
                     class_dropout_prob=cfg.model.class_dropout_prob, in_channels=sample_shape[0],
                     input_size=sample_shape[1], num_classes=cfg.data.num_classes, kwargs=cfg.model.kwargs,
                     autoencoder=cfg.data.autoencoder)
    diffusion = GaussianDiffusion(cfg.diffusion.num_timesteps, cfg.diffusion.beta_start, cfg.diffusion.beta_end,
                                  learn_sigma=cfg.model.learn_sigma, sampling_steps=steps)
    return Sampler(ema_model, spec, decoder, diffusion, cfg_scale=cfg_scale, seed=cfg.train.seed, device=str(device))


@contextlib.contextmanager
def eval_mode(model):
    """Sample in eval mode (no label dropout), then restore the training flag."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@torch.no_grad()
def save_grid(sampler, cfg: TrainConfig, path: Path) -> None:
    from torchvision.utils import save_image

    indices = torch.arange(cfg.train.sample_count)
    with eval_mode(sampler.model):
        images = sampler(indices, indices % cfg.data.num_classes)  # uint8 (B, C, H, W)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(images.float() / 255.0, path, nrow=int(math.ceil(math.sqrt(len(images)))))


class InTrainingFid:
    """Frechet distance of the EMA model's samples to a reference, as diffusion.sample + diffusion.fid compute it.

    Built once per run: the feature extractor and the reference statistics; each call only samples, extracts
    features and measures. Written here rather than calling ``compute_metrics`` per evaluation because that
    rebuilds the extractor and re-reads the reference every time; the pieces are common.metrics' own.
    """

    def __init__(self, cfg: RunConfig, device, num_workers: int = 0):
        from common.feature_extractors import build_feature_extractor, default_layer
        from common.metrics import FeatureStatistics, _check_statistics_match, extract_features, open_reference

        self.cfg, self.name = cfg, cfg.fid_feature_extractor
        self.layer = default_layer(self.name, "fid")
        self.extractor = build_feature_extractor(self.name, [self.layer], cfg.fid_extractor_weights, device)
        reference = open_reference(cfg.fid_reference)
        meta = dict(feature_extractor=self.name, feature_layer=self.layer)
        if reference.statistics is not None:
            _check_statistics_match(reference.statistics, self.name, self.layer, reference.source)
            self.reference = reference.statistics
        else:
            features = extract_features(reference.images, self.extractor, num_workers=num_workers)[self.layer]
            self.reference = FeatureStatistics.from_features(features, **meta)
        self.source = reference.source
        if cfg.fid_samples <= len(self.reference.mu):
            warnings.warn(f"train.fid_samples={cfg.fid_samples} for {len(self.reference.mu)}-d features: the "
                          "covariance is singular and the Frechet distance strongly biased; compare only numbers "
                          "with equal sample counts", stacklevel=2)

    @torch.no_grad()
    def __call__(self, sampler) -> dict:
        from common.metrics import FeatureStatistics, _check_statistics_match, extract_features, frechet_distance
        from common.metrics import open_images
        from diffusion.sample import balanced_labels

        n, b = self.cfg.fid_samples, self.cfg.fid_batch_size
        start = time.perf_counter()
        with eval_mode(sampler.model):
            images = torch.cat([sampler(idx, balanced_labels(idx, sampler.spec.num_classes))
                                for idx in torch.arange(n).split(b)])
        features = extract_features(open_images(images), self.extractor)[self.layer]
        stats = FeatureStatistics.from_features(features)
        _check_statistics_match(self.reference, self.name, self.layer, self.source, dim=len(stats.mu))
        fd = frechet_distance(stats.mu, stats.sigma, self.reference.mu, self.reference.sigma)
        return {"fid/fd": fd, "fid/samples": n, "fid/steps": self.cfg.fid_steps,
                "fid/seconds": time.perf_counter() - start}


class DiTTask:
    """DiT's pieces for :class:`common.trainer.Trainer`."""

    loss_parts = ("mse", "vb")
    # Besides the trainer's own list: the learning rate and length (constant schedule: a longer run just goes on),
    # the VAE used for grids, and the grid / in-training FID settings.
    resumable_changes = ("optim.lr", "optim.steps", "data.autoencoder", "train.sample_", "train.fid_")

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.num_workers = cfg.data.num_workers
        self.lr = cfg.optim.lr
        self.last_fid: dict = {}
        if cfg.model.class_dropout_prob == 0 and cfg.train.sample_cfg_scale != 1.0 and cfg.train.sample_every:
            raise ValueError("train.sample_cfg_scale needs a null class: set model.class_dropout_prob > 0")

    def setup(self, accelerator) -> None:
        cfg = self.cfg
        self.accelerator = accelerator
        images = build_images(cfg.data)
        self.sample_shape = tuple(images[0][0].shape)
        self.train_set = DiffusionExamples(images, cfg.diffusion.num_timesteps, cfg.model.class_dropout_prob)
        self.diffusion = GaussianDiffusion(cfg.diffusion.num_timesteps, cfg.diffusion.beta_start,
                                           cfg.diffusion.beta_end, learn_sigma=cfg.model.learn_sigma).to(accelerator.device)
        self.grid_sampler = self.fid_sampler = self.fid = None
        self._samplers_built = False

    def build_feed(self, sampler, batch_size: int, device):
        return trainer.default_feed(self.train_set, sampler, batch_size, self.num_workers, device)

    def build_model(self) -> torch.nn.Module:
        return build_model(self.cfg, self.sample_shape)

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.cfg.optim.steps

    def lr_scheduler(self, optimizer, steps_per_epoch: int, total_steps: int):
        return None  # constant

    def loss(self, model, batch):
        x0, y, t, noise, drop = batch
        kwargs = {"y": y, "force_drop_ids": drop.long() if self.cfg.model.class_dropout_prob > 0 else None}
        losses = self.diffusion.training_losses(model, x0, t, noise, kwargs)
        return losses["loss"].mean(), {k: losses[k].mean() for k in self.loss_parts}

    def run_summary(self) -> dict:
        return {}

    def log_extras(self, trainer) -> dict:
        return {}

    def _build_samplers(self, trainer) -> None:
        """The decoder (VAE), grid sampler and FID scorer, once, on the main process, when first needed."""
        cfg, run = self.cfg, self.cfg.train
        self._samplers_built = True
        if not self.accelerator.is_main_process:
            return
        weights = trainer.ema.module if trainer.ema is not None else trainer.model
        decoder = build_decoder(cfg, self.accelerator.device)
        if run.sample_every:
            self.grid_sampler = build_sampler(cfg, weights, self.sample_shape, self.accelerator.device, decoder,
                                              run.sample_steps, run.sample_cfg_scale)
        if run.fid_every:
            self.fid_sampler = build_sampler(cfg, weights, self.sample_shape, self.accelerator.device, decoder,
                                             run.fid_steps)
            self.fid = InTrainingFid(run, self.accelerator.device, cfg.data.num_workers)

    def after_step(self, trainer, last: bool, epoch_end: bool) -> Optional[dict]:
        run, step = self.cfg.train, trainer.step
        grid = run.sample_every and (step % run.sample_every == 0 or last)
        fid = run.fid_every and (step % run.fid_every == 0 or last)
        if not (grid or fid):
            return None
        if not self._samplers_built:
            self._build_samplers(trainer)
        metrics = None
        if self.accelerator.is_main_process:
            if grid:
                save_grid(self.grid_sampler, self.cfg, trainer.run_dir / "samples" / f"step_{step:07d}.png")
            if fid:
                metrics = self.last_fid = self.fid(self.fid_sampler)
                trainer.bar.set_postfix(fd=f"{metrics['fid/fd']:.3f}")
        self.accelerator.wait_for_everyone()
        return metrics

    def final_metrics(self, trainer) -> dict:
        if not self.last_fid:
            return {}
        return {"fid": self.last_fid["fid/fd"], "fid_samples": self.last_fid["fid/samples"], "fid_step": trainer.step}

    def weights_metadata(self, step: int) -> dict:
        return weights_metadata(self.cfg, self.sample_shape, step)
