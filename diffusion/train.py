"""Train a class-conditional DiT (Pre-Norm or SiameseNorm) on VAE latents or, on CPUs, Fashion-MNIST pixels.

    python -m diffusion.train --config configs/dit_b2_siamese.yaml data.path=LATENTS_DIR
    accelerate launch --multi_gpu --num_processes 8 -m diffusion.train --config configs/dit_b2_siamese.yaml data.path=...
    torchrun --nproc_per_node 2 -m diffusion.train --config configs/fmnist_dit_siamese.yaml     # CPU, gloo

Settings are ``section.key=value`` overrides on top of the YAML (``--help`` lists the keys). The global
batch (``optim.batch_size``) is split over processes and gradient-accumulation steps, so one recipe gives
the same training on 1 GPU or 64.

The objective is DiT's (:mod:`diffusion.gaussian_diffusion`): uniform t, epsilon MSE plus the VLB for the
learned variance. Every random choice of a training example (the latent drawn from the stored VAE
moments, the flip, t, the noise, the label drop for classifier-free guidance) is made in the dataset under
a per-sample seed (:class:`common.data.SeededDataset`), so the run is the same for any number of
processes and after a resume. Per step: micro-batches -> optional clipping -> AdamW (constant LR) -> EMA.
A non-finite loss skips the update; ``train.max_nonfinite`` in a row stops the run. The run directory
gets ``config.yaml``, ``metrics.jsonl``, TensorBoard events (``tb/``), ``checkpoints/`` (``train.resume=auto``
continues the newest), EMA sample grids (``samples/``), ``ema.safetensors`` (refreshed at every checkpoint,
what the sampler loads), ``model.safetensors`` and ``final_metrics.json``.

With ``train.fid_every=N`` the EMA model is scored every N steps (and at the end): ``train.fid_samples`` images
from diffusion.sample's sampler (sample ``i``: class ``i % num_classes``, noise seeded by ``(train.seed, i)``,
no guidance) against ``train.fid_reference``, logged as ``fid/fd`` in ``metrics.jsonl``. It is the number
``diffusion.sample --seed SEED --steps FID_STEPS`` then ``diffusion.fid`` give for ``ema.safetensors`` of that step.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Literal, Optional, Tuple

import torch
from torch.utils.data import Dataset

from common.checkpoint import bare_model, save_weights
from common.config import config_from_cli, config_to_dict, flatten, save_config
from common.data import ResumableSampler, build_train_loader, load_fashion_mnist
from common.distributed import build_accelerator, check_divisible, gather_objects, reduce_mean, seed_everything
from common.ema import ModelEma
from common.logging import MetricsLogger, NonFiniteGuard, progress_bar
from common.train_state import CheckpointManager, capture_rng_state, resolve_resume, restore_process_rng
from diffusion.gaussian_diffusion import GaussianDiffusion
from diffusion.latents import DEFAULT_VAE, LatentDataset, sample_latents
from diffusion.models import DiT, DiT_models


# ----------------------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    name: str = "DiT-B/2"  # a key of diffusion.models.DiT_models
    topology: Literal["pre", "post", "siamese", "mixln"] = "pre"
    learn_sigma: bool = True  # 2C outputs and the MSE+VLB loss; false: C outputs, plain MSE
    class_dropout_prob: float = 0.1  # label dropout for classifier-free guidance
    grad_checkpointing: bool = False  # recompute blocks in the backward pass (less memory)
    kwargs: Dict[str, Any] = field(default_factory=dict)  # further DiT arguments (hidden_size, depth, ...)

    def __post_init__(self):
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
class DataConfig:
    dataset: Literal["latents", "fashion_mnist"] = "latents"
    path: Optional[str] = None  # latents: the --out of diffusion.extract_latents; fashion_mnist: optional root
    autoencoder: str = DEFAULT_VAE  # VAE that decodes sample grids (dir or HF id); "none" = pixel space
    image_size: int = 256  # pixels; latents: must match the extraction
    num_classes: int = 1000
    hflip: bool = True  # random horizontal flip (latents: the stored flipped view)
    max_samples: Optional[int] = None  # keep the first N training examples (quick runs, tests)
    num_workers: int = 4

    def __post_init__(self):
        if self.dataset == "latents" and not self.path:
            raise ValueError("data.path is required for dataset=latents: the output directory of "
                             "`python -m diffusion.extract_latents` (it holds metadata.json)")
        if self.dataset == "latents" and self.autoencoder == "none":
            raise ValueError("dataset=latents needs data.autoencoder (the VAE that made the latents, for sample "
                             "grids); data.autoencoder=none is for pixel-space data")
        if self.dataset == "fashion_mnist" and self.autoencoder != "none":
            raise ValueError("dataset=fashion_mnist trains in pixel space: set data.autoencoder=none")
        if self.dataset == "fashion_mnist" and (self.image_size < 28 or self.image_size % 2):
            raise ValueError(f"data.image_size={self.image_size}: Fashion-MNIST (28 px) is padded to an even size >= 28")


@dataclass
class DiffusionConfig:
    num_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02


@dataclass
class OptimConfig:
    batch_size: int = 256  # GLOBAL batch: all processes x grad_accum x per-process micro-batch
    lr: float = 1e-4  # constant
    weight_decay: float = 0.0
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: Optional[float] = None  # max global grad norm; null = no clipping
    grad_accum: int = 1
    steps: int = 400_000


@dataclass
class RunConfig:
    output_dir: str = "runs/dit"
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: bool = False  # torch.compile the model
    threads: Optional[int] = None  # CPU intra-op threads (null: torch's default; 1 is fastest on a busy machine)
    ema_decay: float = 0.9999
    log_every: int = 100  # steps
    ckpt_every: int = 50_000  # steps (also at the end, and at stop_at_step)
    keep_last: int = 2
    keep_every: Optional[int] = None  # also keep checkpoints of steps divisible by this
    resume: Optional[str] = "auto"  # auto | null | path to a step_*.pt
    max_nonfinite: int = 20  # non-finite losses in a row before the run stops
    stop_at_step: Optional[int] = None  # end this invocation at this step (time-limited job slot); resume later
    tensorboard: bool = True
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


# ------------------------------------------------------------------------------------------- data
class PixelImages(Dataset):
    """Fashion-MNIST in [-1, 1], padded to ``image_size`` with the black background, randomly mirrored
    when ``hflip``: ``(x0 (1, S, S), label)``."""

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
        self.hflip = hflip
        self.length = len(self.moments) if limit is None else min(limit, len(self.moments))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        mean, logvar, label = self.moments[i]
        flip = torch.rand(1) < 0.5 if self.hflip else torch.zeros(1, dtype=torch.bool)
        noise = torch.randn(mean.shape[1:])
        return sample_latents(mean[None], logvar[None], flip, noise[None], self.moments.scaling_factor)[0], label


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
        raise ValueError(f"the latents in {cfg.path} are of {meta['image_size']}px images, the config says "
                         f"data.image_size={cfg.image_size}; make them agree")
    if len(meta["classes"]) != cfg.num_classes:
        raise ValueError(f"the latents in {cfg.path} have {len(meta['classes'])} classes, the config says "
                         f"data.num_classes={cfg.num_classes}; make them agree")
    return images


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


# ------------------------------------------------------------------------------------------ train
def train(cfg: TrainConfig) -> dict:
    """Run (or continue) the training a config describes; return the final metrics (main process)."""
    run_dir = Path(cfg.train.output_dir)
    accelerator = build_accelerator(cfg.train.precision, run_dir, cfg.train.tensorboard)
    rank, world = accelerator.process_index, accelerator.num_processes
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.model.class_dropout_prob == 0 and cfg.train.sample_cfg_scale != 1.0 and cfg.train.sample_every:
        raise ValueError("train.sample_cfg_scale needs a null class: set model.class_dropout_prob > 0")
    images = build_images(cfg.data)
    if accelerator.is_main_process:
        save_config(cfg, run_dir / "config.yaml")
    sample_shape = tuple(images[0][0].shape)
    examples = DiffusionExamples(images, cfg.diffusion.num_timesteps, cfg.model.class_dropout_prob)
    per_process_batch = check_divisible(cfg.optim.batch_size, world, cfg.optim.grad_accum)
    sampler = ResumableSampler(len(examples), world, rank, seed=cfg.train.seed)
    samples_per_step = per_process_batch * cfg.optim.grad_accum  # per process
    steps_per_epoch = len(sampler) // samples_per_step
    if steps_per_epoch == 0:
        raise ValueError(f"{len(examples)} training examples are fewer than one global batch "
                         f"({cfg.optim.batch_size}); lower optim.batch_size or use more data")
    loader = build_train_loader(examples, sampler, per_process_batch, cfg.data.num_workers)

    seed_everything(cfg.train.seed)  # the same initial weights on every rank
    model = build_model(cfg, sample_shape).to(accelerator.device)
    diffusion = GaussianDiffusion(cfg.diffusion.num_timesteps, cfg.diffusion.beta_start, cfg.diffusion.beta_end,
                                  learn_sigma=cfg.model.learn_sigma)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                  betas=cfg.optim.betas, eps=cfg.optim.eps)
    ema = ModelEma(model, cfg.train.ema_decay)  # starts as a copy of the weights, as DiT's
    n_params = sum(p.numel() for p in model.parameters())
    model = accelerator.prepare(model)
    train_model = torch.compile(model) if cfg.train.compile else model
    seed_everything(cfg.train.seed, rank)
    guard = NonFiniteGuard(cfg.train.max_nonfinite)
    ckpts = CheckpointManager(run_dir / "checkpoints", cfg.train.keep_last, cfg.train.keep_every)

    grid_sampler = fid_sampler = fid = None
    if (cfg.train.sample_every or cfg.train.fid_every) and accelerator.is_main_process:
        decoder = build_decoder(cfg, accelerator.device)
        if cfg.train.sample_every:
            grid_sampler = build_sampler(cfg, ema.module, sample_shape, accelerator.device, decoder,
                                         cfg.train.sample_steps, cfg.train.sample_cfg_scale)
        if cfg.train.fid_every:
            fid_sampler = build_sampler(cfg, ema.module, sample_shape, accelerator.device, decoder, cfg.train.fid_steps)
            fid = InTrainingFid(cfg.train, accelerator.device, cfg.data.num_workers)

    step = 0
    resumed = resolve_resume(cfg.train.resume, ckpts)
    if resumed is not None:
        path, state = resumed
        step = _load_state(state, model, ema, optimizer, guard, sampler, rank, world, path)
        accelerator.print(f"resumed from {path} at step {step}/{cfg.optim.steps}")

    logger = MetricsLogger(accelerator, run_dir, config=flatten(config_to_dict(cfg)) if cfg.train.tensorboard else None)
    if step == 0:
        logger.log({"params": n_params, "examples": len(examples), "steps_per_epoch": steps_per_epoch,
                    "world_size": world}, step=0)
    bar = progress_bar(accelerator, cfg.optim.steps, initial=step)
    meta = lambda s: weights_metadata(cfg, sample_shape, s)  # noqa: E731

    def save_checkpoint():
        rng = gather_objects(accelerator, capture_rng_state())
        if accelerator.is_main_process:
            epoch, done = divmod(step, steps_per_epoch)
            ckpts.save({
                "model": bare_model(model).state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "epoch": epoch,
                "sampler": {**sampler.state_dict(), "epoch": epoch, "start": done * samples_per_step * world},
                "rng": rng, "nonfinite": guard.state_dict(), "world_size": world, "config": config_to_dict(cfg),
            }, step)
            save_weights(ema.module, run_dir / "ema.safetensors", metadata=meta(step))
        accelerator.wait_for_everyone()

    def save_samples():
        if accelerator.is_main_process:
            save_grid(grid_sampler, cfg, run_dir / "samples" / f"step_{step:07d}.png")
        accelerator.wait_for_everyone()

    last_fid: dict = {}

    def evaluate_fid():  # main process only; the others wait
        nonlocal last_fid
        if accelerator.is_main_process:
            last_fid = fid(fid_sampler)
            logger.log(last_fid, step)
            bar.set_postfix(fd=f"{last_fid['fid/fd']:.3f}")
        accelerator.wait_for_everyone()

    window = dict.fromkeys(("loss", "mse", "vb", "grad_norm", "steps", "all_steps", "time", "wait"), 0.0)
    last_record: dict = {}
    last_saved = step
    model.train()
    while step < cfg.optim.steps:
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch, start=done_in_epoch * samples_per_step * world)
        batches = iter(loader)
        for _ in range(done_in_epoch, steps_per_epoch):
            t_start = time.perf_counter()
            parts = torch.zeros(3, device=accelerator.device)  # loss, mse, vb summed over micro-batches
            for micro in range(cfg.optim.grad_accum):
                t_wait = time.perf_counter()
                x0, y, t, noise, drop = (b.to(accelerator.device, non_blocking=True) for b in next(batches))
                window["wait"] += time.perf_counter() - t_wait
                kwargs = {"y": y, "force_drop_ids": drop.long() if cfg.model.class_dropout_prob > 0 else None}
                sync = micro == cfg.optim.grad_accum - 1
                with (contextlib.nullcontext() if sync else accelerator.no_sync(model)), accelerator.autocast():
                    losses = diffusion.training_losses(train_model, x0, t, noise, kwargs)
                    loss = losses["loss"].mean()
                    accelerator.backward(loss / cfg.optim.grad_accum)
                parts += torch.stack([losses[k].detach().mean() for k in ("loss", "mse", "vb")])
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad or math.inf)
            parts = reduce_mean(accelerator, parts / cfg.optim.grad_accum)
            finite = bool(torch.isfinite(parts).all() & torch.isfinite(grad_norm))  # one host sync per step
            if guard.check(finite, step + 1):
                optimizer.step()
                ema.update(model)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)

            if finite:
                for k, v in zip(("loss", "mse", "vb"), parts.tolist()):
                    window[k] += v
                window["grad_norm"] += float(grad_norm)
                window["steps"] += 1
            window["all_steps"] += 1
            window["time"] += time.perf_counter() - t_start
            last_step = step == cfg.optim.steps
            if step % cfg.train.log_every == 0 or last_step:
                n = max(window["steps"], 1)
                steps_per_s = window["all_steps"] / max(window["time"], 1e-9)
                last_record = {
                    "train/loss": window["loss"] / n, "train/mse": window["mse"] / n, "train/vb": window["vb"] / n,
                    "train/grad_norm": window["grad_norm"] / n, "train/lr": optimizer.param_groups[0]["lr"],
                    "train/steps_per_s": steps_per_s,
                    "train/images_per_s_per_process": steps_per_s * cfg.optim.batch_size / world,
                    "train/data_wait": window["wait"] / max(window["time"], 1e-9),
                    "train/nonfinite_steps": guard.total, "train/epoch": step / steps_per_epoch,
                }
                logger.log(last_record, step)
                bar.set_postfix(loss=f"{last_record['train/loss']:.4f}", it_s=f"{steps_per_s:.2f}")
                window = dict.fromkeys(window, 0.0)

            stop_now = cfg.train.stop_at_step is not None and step >= cfg.train.stop_at_step and not last_step
            if step % cfg.train.ckpt_every == 0 or last_step or stop_now:
                save_checkpoint()
                last_saved = step
            if cfg.train.sample_every and (step % cfg.train.sample_every == 0 or last_step):
                save_samples()
            if cfg.train.fid_every and (step % cfg.train.fid_every == 0 or last_step):
                evaluate_fid()
            if stop_now:
                bar.close()
                logger.close()
                accelerator.print(f"stopped at step {step} (train.stop_at_step); continue with train.resume=auto")
                return {"stopped_at": step}
            if last_step:
                break
    bar.close()

    if last_saved != step:
        save_checkpoint()
    final = {"steps": step, "params": n_params, "nonfinite_steps": guard.total,
             **{k.split("/", 1)[1]: v for k, v in last_record.items()}}
    if last_fid:
        final.update(fid=last_fid["fid/fd"], fid_samples=last_fid["fid/samples"], fid_step=step)
    if accelerator.is_main_process:
        save_weights(model, run_dir / "model.safetensors", metadata=meta(step))
        save_weights(ema.module, run_dir / "ema.safetensors", metadata=meta(step))
        (run_dir / "final_metrics.json").write_text(json.dumps(final, indent=2))
    logger.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # last: it destroys the process group
    return final


def _load_state(state, model, ema, optimizer, guard, sampler, rank, world, path) -> int:
    """Restore a training checkpoint; returns the step to continue from."""
    bare_model(model).load_state_dict(state["model"])
    ema.load_state_dict(state["ema"])
    optimizer.load_state_dict(state["optimizer"])
    guard.load_state_dict(state.get("nonfinite", {}))
    if state["sampler"]["num_samples"] != sampler.num_samples:
        raise ValueError(f"{path} was trained on {state['sampler']['num_samples']} examples, this run has "
                         f"{sampler.num_samples}: the data changed (data.path / data.max_samples)")
    restore_process_rng(state["rng"], rank, world, path)
    return int(state["step"])


# -------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> dict:
    cfg = config_from_cli(
        TrainConfig, argv, prog="python -m diffusion.train", description=__doc__.split("\n\n")[0],
        examples=["python -m diffusion.train --config configs/fmnist_dit_siamese.yaml optim.steps=500",
                  "accelerate launch --multi_gpu --num_processes 8 -m diffusion.train --config configs/dit_b2_siamese.yaml "
                  "data.path=latents/imagenet256 data.autoencoder=/models/sd-vae-ft-ema"])
    return train(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
