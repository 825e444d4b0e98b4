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
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Dict, Literal, Optional

import numpy as np
import torch

from common import trainer
from common.config import ConfigError, Range, config_to_dict
from common.data import resolve_num_workers
from diffusion.data import DataConfig, DiffusionExamples, build_images

if TYPE_CHECKING:  # timm, diffusers, torch-fidelity: imported where they are used, so that the settings load without
    from diffusion.models import DiTSpec
    from diffusion.sampling import Decoder, Sampler


@dataclass(kw_only=True)
class ModelConfig:
    name: str  # a key of diffusion.models.DiT_models
    topology: str  # one of diffusion.models.DIT_TOPOLOGIES
    learn_sigma: bool  # 2C outputs and the MSE+VLB loss; false: C outputs, plain MSE
    class_dropout_prob: Annotated[float, Range(ge=0, lt=1)]  # label dropout for classifier-free guidance
    grad_checkpointing: bool = False  # recompute blocks in the backward pass (less memory)
    kwargs: Dict[str, Any] = field(default_factory=dict)  # further DiT arguments (hidden_size, depth, ...)

    def check_registered(self) -> None:
        """The name, topology and arguments against diffusion.models (which imports timm)."""
        from diffusion.models import check_dit_arguments

        try:
            check_dit_arguments(self.name, self.topology, self.class_dropout_prob, self.kwargs)
        except ValueError as err:  # check_dit_arguments's contract: a ValueError names what the description gets wrong
            raise ConfigError(str(err)) from None


@dataclass(kw_only=True)
class DiffusionConfig:
    num_timesteps: Annotated[int, Range(ge=2)]  # linear betas from beta_start to beta_end
    beta_start: Annotated[float, Range(gt=0, lt=1)]
    beta_end: Annotated[float, Range(gt=0, lt=1)]

    def __post_init__(self):
        if self.beta_start > self.beta_end:
            raise ConfigError(f"diffusion.beta_start={self.beta_start} must not exceed diffusion.beta_end={self.beta_end}")


@dataclass(kw_only=True)
class OptimConfig(trainer.OptimConfig):
    """AdamW at a constant learning rate, as DiT."""

    lr: Annotated[float, Range(gt=0)]  # constant
    steps: Annotated[int, Range(ge=1)]


@dataclass(kw_only=True)
class RunConfig(trainer.RunConfig):
    output_dir: str = "runs/dit"
    sample_every: Annotated[int, Range(ge=0)] = 0  # EMA sample grid every N steps (and at the end); 0 = never (no VAE needed)
    sample_count: Annotated[int, Range(ge=1)]  # images in a grid
    sample_steps: Annotated[int, Range(ge=1)]  # respaced DDPM steps for the grids
    sample_cfg_scale: Annotated[float, Range(ge=0)] = 1.0  # classifier-free guidance for the grids (1 = none)
    fid_every: Annotated[int, Range(ge=0)] = 0  # Frechet distance of EMA samples every N steps (and at the end); 0 = never
    fid_samples: Annotated[int, Range(ge=2, why="a covariance needs two samples")]  # images generated per evaluation (class i % num_classes, as diffusion.sample)
    fid_steps: Annotated[int, Range(ge=1)]  # respaced DDPM steps, no guidance
    fid_batch_size: Annotated[int, Range(ge=1)] = 64  # samples per forward pass (diffusion.sample's --batch-size default)
    fid_reference: Optional[str] = None  # fashion-mnist:test, image folder, .npz images, or statistics .npz (ADM's)
    fid_feature_extractor: str  # inception-v3-compat (ADM's), or fmnist-cnn (the CPU recipe)
    fid_extractor_weights: Optional[str] = None  # weights file; null: the extractor's cache (see diffusion.fid)
    fid_precision: Literal["fp32", "bf16"] = "fp32"  # the model's forward when sampling for FID (diffusion.sample's --precision)

    def __post_init__(self):
        super().__post_init__()
        if self.fid_every and not self.fid_reference:
            raise ConfigError("train.fid_every > 0 needs train.fid_reference: fashion-mnist:test, an image folder, an "
                              ".npz of images, or a statistics .npz (e.g. ADM's VIRTUAL_imagenet256_labeled.npz); "
                              "or set train.fid_every=0")

    def check_registered(self) -> None:
        """The feature extractor against torch-fidelity's registry (with ours registered)."""
        from diffusion.evaluation.features import FEATURE_EXTRACTORS_REGISTRY

        if self.fid_feature_extractor not in FEATURE_EXTRACTORS_REGISTRY:
            raise ConfigError(f"train.fid_feature_extractor={self.fid_feature_extractor!r} is not registered; "
                              f"choose one of {', '.join(sorted(FEATURE_EXTRACTORS_REGISTRY))}")


@dataclass
class TrainConfig:
    """A DiT training run. The numbers are the recipe's (:attr:`RECIPE` and the files that base on it): the fields
    without a default have none in code."""

    RECIPE: ClassVar[str] = "configs/dit_recipe.yaml"

    model: ModelConfig
    data: DataConfig
    diffusion: DiffusionConfig
    optim: OptimConfig
    train: RunConfig

    def __post_init__(self):
        if self.data.dataset == "latents" and self.data.autoencoder == "none" and (
                self.train.sample_every or self.train.fid_every):
            raise ConfigError("sample grids and in-training FID of latents need data.autoencoder (the VAE that made "
                              "the latents); or set train.sample_every=0 and train.fid_every=0 to train without a VAE")
        for name in ("sample_steps", "fid_steps"):  # respaced from the training schedule: at most all its steps
            if getattr(self.train, name) > self.diffusion.num_timesteps:
                raise ConfigError(f"train.{name}={getattr(self.train, name)} exceeds diffusion.num_timesteps="
                                  f"{self.diffusion.num_timesteps}: sampling respaces the training steps")


def latent_vae(images) -> dict:
    """The VAE the training latents were encoded with, as their metadata records it (empty for pixels)."""
    meta = getattr(getattr(images, "moments", None), "metadata", None)
    if meta is None:
        return {}
    return {"vae": meta.get("vae"), "vae_sha256": meta.get("vae_sha256"), "vae_scaling_factor": meta.get("scaling_factor")}


def model_spec(cfg: TrainConfig, images) -> DiTSpec:
    """The trained model's description, from the config and the data: what the weights' metadata records."""
    from diffusion.models import DiTSpec

    names = getattr(images, "classes", None)
    found = DiTSpec.from_train_config(config_to_dict(cfg), tuple(images[0][0].shape), latent_vae(images),
                                      names if names is not None and len(names) == cfg.data.num_classes else None)
    return DiTSpec(**found)


# --------------------------------------------------------------------------------------- sampling
def build_decoder(cfg: TrainConfig, device, expect: dict) -> Decoder:
    """The VAE (or pixel) decoder that the grid and FID samplers share: loaded once, checked against the VAE of the
    latents, and drawing non-finite samples black (a grid or FID never stops a run)."""
    from diffusion.latents import VAENotFoundError
    from diffusion.sampling import Decoder

    try:
        return Decoder(cfg.data.autoencoder, device, option="data.autoencoder", expect=expect, nonfinite="black",
                       made_with=f"the latents in {cfg.data.path} were encoded with")
    except VAENotFoundError as err:
        raise VAENotFoundError(f"{err} Or set train.sample_every=0 and train.fid_every=0 to train without "
                               "sample grids and in-training FID.") from err


def build_sampler(spec: DiTSpec, ema_model, device, decoder: Decoder, steps: int, seed: int,
                  cfg_scale: float = 1.0, precision: str = "fp32") -> Sampler:
    """The sampler of diffusion.sample on the EMA weights, with fixed per-image noise streams (seeded by
    ``(train.seed, index)``), so that grids and FIDs of one run are comparable from step to step."""
    from diffusion.sampling import Sampler

    return Sampler(ema_model, spec, decoder, spec.diffusion(sampling_steps=steps), cfg_scale=cfg_scale, seed=seed,
                   device=str(device), precision=precision)


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
    from diffusion.sampling import write_grid

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

    The extractor is built and the reference checked once (:class:`diffusion.evaluation.Evaluator`) and its statistics
    prepared before training (:meth:`prepare`, one share of its images per process). Each call samples
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

    def prepare(self, accelerator) -> None:
        """The reference's statistics, before training: its images (if it holds images, not statistics) are read in
        one share per process, so no process waits in a collective while another reads them all."""
        from common.distributed import gather_objects

        self.evaluator.prepare_reference(accelerator.process_index, accelerator.num_processes,
                                         lambda share: gather_objects(accelerator, share))

    @torch.no_grad()
    def __call__(self, sampler, accelerator) -> Optional[dict]:
        """``fid/...`` metrics on the main process, None on the others."""
        from common.distributed import gather_objects
        from diffusion.sampling import balanced_labels

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
            raise ConfigError("train.sample_cfg_scale needs a null class: set model.class_dropout_prob > 0")

    def setup(self, accelerator) -> None:
        cfg = self.cfg
        self.accelerator = accelerator
        images = build_images(cfg.data)
        self.spec = model_spec(cfg, images)
        self.train_set = DiffusionExamples(images, cfg.diffusion.num_timesteps, cfg.model.class_dropout_prob)
        self.diffusion = self.spec.diffusion().to(accelerator.device)
        self.grid_sampler = self.fid_sampler = None
        self._samplers_built = False
        # Built now, before any training, so that a missing VAE, reference or weights file is an error up front.
        run, main = cfg.train, accelerator.is_main_process
        self.decoder = (build_decoder(cfg, accelerator.device, latent_vae(images))
                        if run.fid_every or (run.sample_every and main) else None)
        self.fid = (InTrainingFid(run, accelerator.device, resolve_num_workers(cfg.data.num_workers))
                    if run.fid_every else None)
        if self.fid is not None:
            self.fid.prepare(accelerator)

    def build_model(self) -> torch.nn.Module:
        model = self.spec.build()
        model.set_grad_checkpointing(self.cfg.model.grad_checkpointing)
        return model

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
        from diffusion.sampling import class_names

        cfg, run, device = self.cfg, self.cfg.train, self.accelerator.device
        self._samplers_built = True
        main = self.accelerator.is_main_process
        if not (run.fid_every or (run.sample_every and main)):
            return
        weights = ctx.ema_model if ctx.ema_model is not None else ctx.model
        decoder = self.decoder  # loaded in setup(), shared by both samplers
        if run.sample_every and main:
            self.grid_sampler = build_sampler(self.spec, weights, device, decoder, run.sample_steps, run.seed,
                                              run.sample_cfg_scale)
            self.grid_names = class_names(cfg.data.num_classes, pixel=cfg.data.autoencoder == "none",
                                          names=self.spec.class_names)
        if run.fid_every:
            self.fid_sampler = build_sampler(self.spec, weights, device, decoder, run.fid_steps, run.seed,
                                             precision=run.fid_precision)

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
            from PIL import Image

            path = ctx.run_dir / "samples" / f"step_{step:07d}.png"
            save_grid(self.grid_sampler, self.cfg, path, self.grid_names)
            with Image.open(path) as image:
                ctx.log_images({"samples": np.asarray(image.convert("RGB"))})
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
        return self.spec.metadata(step=step)
