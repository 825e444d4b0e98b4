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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from common import trainer
from common.data import resolve_num_workers
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
            raise ValueError(f"model.kwargs has unknown DiT arguments {unknown}; valid: {', '.join(allowed)}")


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
        from diffusion.evaluation.features import FEATURE_EXTRACTORS_REGISTRY

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


def weights_metadata(cfg: TrainConfig, sample_shape, step: int, latent_vae: dict) -> dict:
    """What a sampler needs to rebuild the model around exported weights (and to check the VAE it decodes with)."""
    vae = {k: str(v) for k, v in latent_vae.items() if k in ("vae_sha256", "vae_scaling_factor") and v is not None}
    return {"model": cfg.model.name, "topology": cfg.model.topology, "learn_sigma": cfg.model.learn_sigma,
            "class_dropout_prob": cfg.model.class_dropout_prob, "in_channels": sample_shape[0],
            "input_size": sample_shape[1], "num_classes": cfg.data.num_classes, "model_kwargs": json.dumps(cfg.model.kwargs),
            "autoencoder": cfg.data.autoencoder, **vae, "step": step}


def latent_vae(images) -> dict:
    """The VAE the training latents were encoded with, as their metadata records it (empty for pixels)."""
    meta = getattr(getattr(images, "moments", None), "metadata", None)
    if meta is None:
        return {}
    return {"vae": meta.get("vae"), "vae_sha256": meta.get("vae_sha256"), "vae_scaling_factor": meta.get("scaling_factor")}


# --------------------------------------------------------------------------------------- sampling
def build_decoder(cfg: TrainConfig, device, expect: dict):
    """The VAE (or pixel) decoder that the grid and FID samplers share: loaded once, checked against the VAE of the
    latents, and drawing non-finite samples black (a grid or FID never stops a run)."""
    from diffusion.sample import Decoder

    try:
        return Decoder(cfg.data.autoencoder, device, option="data.autoencoder", expect=expect, nonfinite="black",
                       made_with=f"the latents in {cfg.data.path} were encoded with")
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
def save_grid(sampler, cfg: TrainConfig, path: Path, names) -> None:
    """Sample ``i`` of class ``i % num_classes``, fixed noise: the same grid at every step, upscaled and labelled."""
    from diffusion.sample import write_grid

    indices = torch.arange(cfg.train.sample_count)
    labels = indices % cfg.data.num_classes
    before = sampler.decoder.nonfinite_images
    with eval_mode(sampler.model):
        images = sampler(indices, labels)  # uint8 (B, C, H, W)
    write_grid(images, labels.tolist(), path, names)
    bad = sampler.decoder.nonfinite_images - before
    if bad:
        print(f"{path}: {bad} of {len(indices)} samples are not finite (drawn black); the EMA weights hold NaN/inf")


class InTrainingFid:
    """Frechet distance of the EMA model's samples to a reference, as diffusion.sample + diffusion.fid compute it.

    The extractor is built and the reference checked once (:class:`diffusion.evaluation.Evaluator`). Each call samples
    on every process -- chunk ``k`` of ``train.fid_batch_size`` samples on process ``k % world``, as diffusion.sample
    splits them -- extracts the features there, and scores the gathered features on the main process: no process
    waits in a barrier while another samples (for DiT-XL/2 that wait would pass NCCL's timeout).
    """

    def __init__(self, cfg: RunConfig, device, num_workers: int = 0):
        from diffusion.evaluation import Evaluator
        from diffusion.evaluation.features import resolve_weights

        self.cfg = cfg
        resolve_weights(cfg.fid_feature_extractor, cfg.fid_extractor_weights, option="train.fid_extractor_weights=PATH")
        self.evaluator = Evaluator(cfg.fid_reference, metrics=["fid"], feature_extractor=cfg.fid_feature_extractor,
                                   weights=cfg.fid_extractor_weights, device=str(device), num_workers=num_workers)

    @torch.no_grad()
    def __call__(self, sampler, accelerator) -> Optional[dict]:
        """``fid/...`` metrics on the main process, None on the others."""
        from common.distributed import gather_objects
        from diffusion.sample import balanced_labels

        start = time.perf_counter()
        chunks = list(torch.arange(self.cfg.fid_samples).split(self.cfg.fid_batch_size))
        mine = chunks[accelerator.process_index::accelerator.num_processes]
        features = None
        before = sampler.decoder.nonfinite_images
        if mine:
            with eval_mode(sampler.model):
                images = torch.cat([sampler(idx, balanced_labels(idx, sampler.spec.num_classes)) for idx in mine])
            features = self.evaluator.features(images)
        bad = sampler.decoder.nonfinite_images - before
        gathered = gather_objects(accelerator, (torch.cat(mine) if mine else None, features, bad))
        if not accelerator.is_main_process:
            return None
        bad = sum(b for _, _, b in gathered)
        if bad:  # a distance to NaN samples means nothing; the run goes on to its non-finite stop or recovers
            accelerator.print(f"in-training FID: {bad} of {self.cfg.fid_samples} samples are not finite; fid/fd is NaN")
            return {"fid/fd": math.nan, "fid/samples": self.cfg.fid_samples, "fid/steps": self.cfg.fid_steps,
                    "fid/seconds": time.perf_counter() - start}
        parts = [(idx, f) for idx, f, _ in gathered if idx is not None]
        order = torch.cat([idx for idx, _ in parts]).argsort()
        features = {role: torch.cat([f[role] for _, f in parts])[order] for role in parts[0][1]}
        return {"fid/fd": self.evaluator.score(features)["fid"], "fid/samples": self.cfg.fid_samples,
                "fid/steps": self.cfg.fid_steps, "fid/seconds": time.perf_counter() - start}


class DiTTask(trainer.Task):
    """DiT's pieces for :class:`common.trainer.Trainer`."""

    loss_parts = ("mse", "vb")
    # Besides the trainer's own list: the learning rate and length (constant schedule: a longer run just goes on),
    # the VAE used for grids, and the grid / in-training FID settings.
    resumable_changes = ("optim.lr", "optim.steps", "data.autoencoder", "train.sample_", "train.fid_")

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
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
        self.grid_sampler = self.fid_sampler = None
        self._samplers_built = False
        # Built now, before any training, so that a missing VAE, reference or weights file is an error up front.
        run, main = cfg.train, accelerator.is_main_process
        self.latent_vae = latent_vae(images)
        self.decoder = (build_decoder(cfg, accelerator.device, self.latent_vae)
                        if run.fid_every or (run.sample_every and main) else None)
        self.fid = (InTrainingFid(run, accelerator.device, resolve_num_workers(cfg.data.num_workers))
                    if run.fid_every else None)

    def build_model(self) -> torch.nn.Module:
        return build_model(self.cfg, self.sample_shape)

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.cfg.optim.steps

    def loss(self, model, batch):
        x0, y, t, noise, drop = batch
        kwargs = {"y": y, "force_drop_ids": drop.long() if self.cfg.model.class_dropout_prob > 0 else None}
        losses = self.diffusion.training_losses(model, x0, t, noise, kwargs)
        return losses["loss"].mean(), {k: losses[k].mean() for k in self.loss_parts}

    def _build_samplers(self, ctx: trainer.StepContext) -> None:
        """The samplers, once, when first needed: the grid sampler on the main process, the FID sampler on every
        process (in-training FID samples on all of them)."""
        cfg, run, device = self.cfg, self.cfg.train, self.accelerator.device
        self._samplers_built = True
        main = self.accelerator.is_main_process
        if not (run.fid_every or (run.sample_every and main)):
            return
        weights = ctx.ema_model if ctx.ema_model is not None else ctx.model
        decoder = self.decoder  # loaded in setup(), shared by both samplers
        if run.sample_every and main:
            self.grid_sampler = build_sampler(cfg, weights, self.sample_shape, device, decoder, run.sample_steps,
                                              run.sample_cfg_scale)
            from diffusion.sample import class_names

            listed = getattr(getattr(self.train_set.images, "moments", None), "metadata", {}).get("classes")
            self.grid_names = class_names(cfg.data.num_classes, pixel=cfg.data.autoencoder == "none", names=listed)
        if run.fid_every:
            self.fid_sampler = build_sampler(cfg, weights, self.sample_shape, device, decoder, run.fid_steps)

    def after_step(self, ctx: trainer.StepContext) -> Optional[dict]:
        run, step = self.cfg.train, ctx.step
        grid = run.sample_every and (step % run.sample_every == 0 or ctx.last)
        fid = run.fid_every and (step % run.fid_every == 0 or ctx.last)
        if not (grid or fid):
            return None
        if not self._samplers_built:
            self._build_samplers(ctx)
        metrics = None
        if grid and self.accelerator.is_main_process:
            save_grid(self.grid_sampler, self.cfg, ctx.run_dir / "samples" / f"step_{step:07d}.png", self.grid_names)
        if fid:
            metrics = self.fid(self.fid_sampler, self.accelerator)
            if metrics is not None:
                self.last_fid = metrics
                ctx.set_postfix(fd=f"{metrics['fid/fd']:.3f}")
        self.accelerator.wait_for_everyone()
        return metrics

    def final_metrics(self, ctx: trainer.StepContext) -> dict:
        if not self.last_fid:
            return {}
        return {"fid": self.last_fid["fid/fd"], "fid_samples": self.last_fid["fid/samples"], "fid_step": ctx.step}

    def weights_metadata(self, step: int) -> dict:
        return weights_metadata(self.cfg, self.sample_shape, step, self.latent_vae)
