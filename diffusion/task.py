"""What DiT brings to the training loop (:mod:`common.trainer`): examples, model, diffusion loss, grids, FID.

The objective is DiT's (:mod:`diffusion.gaussian_diffusion`): uniform t, epsilon MSE plus the VLB for the
learned variance; or, with ``transport.enabled``, SiT's stochastic interpolants (:mod:`diffusion.transport`).
AdamW at a constant learning rate, an EMA updated every step. After a step the task may save a
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
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Dict, List, Literal, Optional, Tuple

import numpy as np
import torch

from common import trainer
from common.config import ConfigError, Range, config_to_dict
from common.data import resolve_num_workers
from common.train_state import step_stem
from diffusion.data import DataConfig, DiffusionExamples, build_images
from diffusion.transport import transport_from_config

if TYPE_CHECKING:  # timm, diffusers, torch-fidelity: imported where they are used, so that the settings load without
    from diffusion.sampling.decoder import Decoder
    from diffusion.sampling.sampler import Sampler
    from diffusion.spec import DiTSpec


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
        from diffusion.spec import check_dit_arguments

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
class TransportConfig:
    """SiT's stochastic interpolants (flow matching) in place of DDPM (:mod:`diffusion.transport`); off by default."""

    enabled: bool = False  # true: train and sample the transport below; false: DDPM with the diffusion: section
    path: Optional[Literal["linear", "gvp", "vp"]] = None  # x_t = alpha_t data + sigma_t noise; null: SiT's linear
    prediction: Optional[Literal["velocity", "noise", "score"]] = None  # the network's target; null: SiT's velocity
    loss_weight: Literal["none", "velocity", "likelihood"] = "none"  # of a noise or score loss (SiT's weights)
    train_eps: Optional[Annotated[float, Range(ge=0, lt=0.5)]] = None  # gap kept from the path's singular ends; null: SiT's for path and prediction
    sample_eps: Optional[Annotated[float, Range(ge=0, lt=0.5)]] = None  # the same when sampling; null: SiT's
    time_distribution: Optional[Literal["uniform", "logit_normal"]] = None  # training t; null: SiT's uniform, or LightningDiT's logit_normal
    logit_normal_mean: Optional[Annotated[float, Range()]] = None  # t = sigmoid(mean + std * N(0, 1)); required for logit_normal
    logit_normal_std: Optional[Annotated[float, Range(gt=0)]] = None
    cosine_loss_weight: Annotated[float, Range(ge=0)] = 0.0  # LightningDiT's velocity-direction term w * (1 - cos(pred, u_t)) added to the MSE (its use_cosine_loss: 1); velocity prediction only

    def __post_init__(self):
        if not self.enabled:
            if self.cosine_loss_weight:
                raise ConfigError("transport.cosine_loss_weight is a term of the transport's velocity loss: set "
                                  "transport.enabled=true, or transport.cosine_loss_weight=0")
            return
        missing = [k for k in ("logit_normal_mean", "logit_normal_std") if getattr(self, k) is None]
        if self.time_distribution == "logit_normal" and missing:
            raise ConfigError(f"transport.time_distribution=logit_normal needs transport.{', transport.'.join(missing)} "
                              "(LightningDiT's: 0 and 1)")
        transport_from_config(config_to_dict(self))  # a value the transport refuses fails here, before training


@dataclass(kw_only=True)
class RepaConfig:
    """REPA: align the hidden state after block ``depth`` with a frozen encoder's patch features (diffusion.repa)."""

    weight: Annotated[float, Range(ge=0)] = 0.0  # the alignment loss's weight; 0: off (REPA: 0.5)
    depth: Optional[Annotated[int, Range(ge=1)]] = None  # the aligned block, 1-based (REPA: 8 of SiT-XL/2's 28)
    encoder: Optional[str] = None  # timm name of the frozen encoder (REPA's DINOv2 ViT-B/14: vit_base_patch14_dinov2)
    encoder_weights: Optional[str] = None  # its weights file; never downloaded
    encoder_image_size: Optional[Annotated[int, Range(ge=1)]] = None  # the encoder's input side (REPA: 224 for 256 px images)
    encoder_kwargs: Dict[str, Any] = field(default_factory=dict)  # further timm.create_model arguments (sizes)
    encoder_mean: Optional[List[Annotated[float, Range(ge=0, le=1)]]] = None  # input normalisation; null: the timm model's (ImageNet's for DINOv2)
    encoder_std: Optional[List[Annotated[float, Range(gt=0)]]] = None
    projector_dim: Optional[Annotated[int, Range(ge=1)]] = None  # the width of REPA's 3-layer MLP projector (2048)

    def __post_init__(self):
        missing = [k for k in ("depth", "encoder", "encoder_weights", "encoder_image_size", "projector_dim")
                   if self.weight and getattr(self, k) is None]
        if missing:
            raise ConfigError(f"repa.weight > 0 needs repa.{', repa.'.join(missing)} (configs/repa.yaml sets "
                             "REPA's; repa.encoder_weights is your file of the encoder's weights)")


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
    sample_steps: Annotated[int, Range(ge=1)]  # respaced DDPM steps (transport: SiT's num_steps, the time grid's points) for the grids
    sampler: Optional[str] = None  # grids and FID; null: ddpm (DDPM) or sde-euler (transport); else diffusion.sample's --sampler
    sample_cfg_scale: Annotated[float, Range(ge=0)] = 1.0  # classifier-free guidance for the grids (1 = none)
    sample_guidance_interval: Optional[Tuple[Annotated[float, Range(ge=0, le=1)], Annotated[float, Range(ge=0, le=1)]]] = None  # transport grids: guide only at LOW <= t <= HIGH (LightningDiT's [0.1, 1]); null: always
    sample_timestep_shift: Annotated[float, Range(ge=0)] = 0.0  # transport ODE samplers, grids and FID: LightningDiT's time grid warp s t / (1 + (s - 1) t) (its 0.3); 0: none
    fid_every: Annotated[int, Range(ge=0)] = 0  # Frechet distance of EMA samples every N steps (and at the end); 0 = never
    fid_samples: Annotated[int, Range(ge=2, why="a covariance needs two samples")]  # images generated per evaluation (class i % num_classes, as diffusion.sample)
    fid_steps: Annotated[int, Range(ge=1)]  # respaced DDPM steps (transport: the time grid's points), no guidance
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
    transport: TransportConfig = field(default_factory=TransportConfig)
    repa: RepaConfig = field(default_factory=RepaConfig)

    def __post_init__(self):
        from diffusion.sampling.options import SAMPLERS, TRANSPORT_SAMPLERS

        allowed = TRANSPORT_SAMPLERS if self.transport.enabled else SAMPLERS
        if self.train.sampler is not None and self.train.sampler not in allowed:
            kind = "transport" if self.transport.enabled else "DDPM"
            raise ConfigError(f"train.sampler={self.train.sampler!r} does not sample a {kind} model; choose one of "
                             f"{', '.join(allowed)} (null: {'sde-euler' if self.transport.enabled else 'ddpm'})")
        flow = {"train.sample_timestep_shift": self.train.sample_timestep_shift,
                "train.sample_guidance_interval": self.train.sample_guidance_interval}
        if not self.transport.enabled and any(flow.values()):
            raise ConfigError(f"{', '.join(k for k, v in flow.items() if v)}: a transport model's sampling settings "
                              "(LightningDiT's); this run trains DDPM: set transport.enabled=true, or leave them unset")
        if self.train.sample_timestep_shift and (self.train.sampler or "sde-euler").startswith("sde-"):
            raise ConfigError("train.sample_timestep_shift warps an ODE's time grid: set train.sampler=euler "
                              "(LightningDiT's), heun or dopri5, or train.sample_timestep_shift=0")
        low, high = self.train.sample_guidance_interval or (0.0, 1.0)
        if low > high:
            raise ConfigError(f"train.sample_guidance_interval=[{low}, {high}]: LOW must not exceed HIGH (t = 1 is data)")
        if self.data.dataset == "latents" and self.data.autoencoder == "none" and (
                self.train.sample_every or self.train.fid_every):
            raise ConfigError("sample grids and in-training FID of latents need data.autoencoder (the VAE that made "
                              "the latents); or set train.sample_every=0 and train.fid_every=0 to train without a VAE")
        for name in ("sample_steps", "fid_steps"):  # DDPM respaces the training schedule: at most all its steps
            if not self.transport.enabled and getattr(self.train, name) > self.diffusion.num_timesteps:
                raise ConfigError(f"train.{name}={getattr(self.train, name)} exceeds diffusion.num_timesteps="
                                  f"{self.diffusion.num_timesteps}: sampling respaces the training steps")


def latent_vae(images) -> dict:
    """The VAE the training latents were encoded with, as their metadata records it, and LightningDiT's per-channel
    normalisation when the run applies it (empty for pixels)."""
    meta = getattr(getattr(images, "moments", None), "metadata", None)
    if meta is None:
        return {}
    return {"vae": meta.get("vae"), "vae_sha256": meta.get("vae_sha256"), "vae_scaling_factor": meta.get("scaling_factor"),
            "latent_norm": images.normalization}


def model_spec(cfg: TrainConfig, images) -> DiTSpec:
    """The trained model's description, from the config and the data: what the weights' metadata records."""
    from diffusion.spec import DiTSpec

    names = getattr(images, "classes", None)
    found = DiTSpec.from_train_config(config_to_dict(cfg), tuple(images[0][0].shape), latent_vae(images),
                                      names if names is not None and len(names) == cfg.data.num_classes else None)
    return DiTSpec(**found)


# --------------------------------------------------------------------------------------- sampling
def build_decoder(cfg: TrainConfig, device, expect: dict) -> Decoder:
    """The VAE (or pixel) decoder that the grid and FID samplers share: loaded once, checked against the VAE of the
    latents, and drawing non-finite samples black (a grid or FID never stops a run). A run without grids and FID
    loads it too, on the CPU, only to check it: the weights record ``data.autoencoder`` as the VAE that decodes them."""
    from diffusion.latents import VAENotFoundError
    from diffusion.sampling.decoder import Decoder

    try:
        return Decoder(cfg.data.autoencoder, device, option="data.autoencoder", expect=expect, nonfinite="black",
                       made_with=f"the latents in {cfg.data.path} were encoded with", latent_norm=expect.get("latent_norm"))
    except VAENotFoundError as err:
        if cfg.train.sample_every or cfg.train.fid_every:
            fix = "Or set train.sample_every=0 and train.fid_every=0 to train without sample grids and in-training FID."
        else:
            fix = "Or set data.autoencoder=none to train without it (then sample with --vae)."
        raise VAENotFoundError(f"{err} {fix}") from err


def build_sampler(spec: DiTSpec, ema_model, device, decoder: Decoder, steps: int, seed: int,
                  cfg_scale: float = 1.0, precision: str = "fp32", sampler: Optional[str] = None,
                  **flow_options) -> Sampler:
    """The sampler of diffusion.sample on the EMA weights, with fixed per-image noise streams (seeded by
    ``(train.seed, index)``), so that grids and FIDs of one run are comparable from step to step. ``flow_options``:
    a transport's :class:`~diffusion.sampling.chains.FlowSampling` settings (timestep shift, guidance interval)."""
    from diffusion.sampling.sampler import Sampler, sampling_objective

    objective, sampling = sampling_objective(spec, steps, sampler, **flow_options)
    return Sampler(ema_model, spec, decoder, objective, sampling, cfg_scale=cfg_scale, seed=seed, device=str(device),
                   precision=precision)


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
    from diffusion.sampling.grids import write_grid

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
        from diffusion.sampling.sample_sets import balanced_labels

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
    resumable_changes = ("optim.lr", "optim.steps", "data.autoencoder", "train.sample_", "train.fid_", "train.sampler")
    compile_pays_after_steps_on_cpu = 3000  # the micro-DiT's break-even, about 2,600 steps (docs/benchmarks.md)

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.lr = cfg.optim.lr
        if cfg.transport.enabled:  # no variational bound: a learned-sigma network's second half is unused
            self.loss_parts = ("mse", "cos") if cfg.transport.cosine_loss_weight else ("mse",)
        if cfg.repa.weight:
            self.loss_parts = (*self.loss_parts, "repa")
        self.last_fid: dict = {}
        if cfg.model.class_dropout_prob == 0 and cfg.train.sample_cfg_scale != 1.0 and cfg.train.sample_every:
            raise ConfigError("train.sample_cfg_scale needs a null class: set model.class_dropout_prob > 0")

    def setup(self, accelerator) -> None:
        cfg = self.cfg
        self.accelerator = accelerator
        images = build_images(cfg.data, with_image=bool(cfg.repa.weight))
        self.encoder = None
        if cfg.repa.weight:
            from diffusion.repa import FrozenEncoder

            self.encoder = FrozenEncoder(cfg.repa.encoder, cfg.repa.encoder_weights, cfg.repa.encoder_image_size,
                                         cfg.repa.encoder_kwargs, cfg.repa.encoder_mean, cfg.repa.encoder_std)
            self.encoder.to(accelerator.device)
        self.spec = model_spec(cfg, images)
        self.objective = self.spec.objective().to(accelerator.device)
        self.train_set = DiffusionExamples(images, cfg.diffusion.num_timesteps, cfg.model.class_dropout_prob,
                                           self.objective.time_draw)
        self.grid_sampler = self.fid_sampler = None
        self._samplers_built = False
        # Built now, before any training, so that a missing VAE, reference or weights file is an error up front.
        run, main = cfg.train, accelerator.is_main_process
        if run.fid_every or (run.sample_every and main):
            self.decoder = build_decoder(cfg, accelerator.device, latent_vae(images))
        else:
            self.decoder = None
            if cfg.data.autoencoder != "none":
                build_decoder(cfg, "cpu", latent_vae(images))  # checked against the latents' VAE, then dropped
        self.fid = (InTrainingFid(run, accelerator.device, resolve_num_workers(cfg.data.num_workers))
                    if run.fid_every else None)
        if self.fid is not None:
            self.fid.prepare(accelerator)

    def build_model(self) -> torch.nn.Module:
        repa = self.cfg.repa
        if repa.weight:
            from diffusion.repa import RepaDiT

            model = RepaDiT(align_depth=repa.depth, projector_dim=repa.projector_dim,
                            feature_dim=self.encoder.feature_dim, **self.spec.dit_kwargs())
            if model.x_embedder.num_patches != self.encoder.num_tokens:
                raise ConfigError(f"REPA aligns token by token: the DiT has {model.x_embedder.num_patches} tokens, "
                                 f"{repa.encoder} at {repa.encoder_image_size} px gives {self.encoder.num_tokens}; "
                                 "choose repa.encoder_image_size (or the patch sizes) so that they agree")
        else:
            model = self.spec.build()
        model.set_grad_checkpointing(self.cfg.model.grad_checkpointing)
        return model

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.cfg.optim.steps

    def loss(self, model, batch):
        x0, y, t, noise, drop, *image = batch  # image: REPA's encoder input
        kwargs = {"y": y, "force_drop_ids": drop.long() if self.cfg.model.class_dropout_prob > 0 else None}
        if self.encoder is not None:  # the one forward also returns the projected tokens after block repa.depth
            kwargs["align"] = True
        losses = self.objective.losses(model, x0, t, noise, kwargs)
        if self.encoder is not None:
            from diffusion.repa import alignment_loss

            losses["repa"] = alignment_loss(self.encoder(image[0]), losses.pop("extra"))
            losses["loss"] = losses["loss"] + self.cfg.repa.weight * losses["repa"]
        return losses["loss"].mean(), {k: losses[k].mean() for k in self.loss_parts}

    def _build_samplers(self, ctx: trainer.StepContext) -> None:
        """The samplers, once, when first needed: the grid sampler on the main process, the FID sampler on every
        process (in-training FID samples on all of them)."""
        from diffusion.sampling.grids import class_names

        cfg, run, device = self.cfg, self.cfg.train, self.accelerator.device
        self._samplers_built = True
        main = self.accelerator.is_main_process
        if not (run.fid_every or (run.sample_every and main)):
            return
        weights = ctx.ema_model if ctx.ema_model is not None else ctx.model
        decoder = self.decoder  # loaded in setup(), shared by both samplers
        shift = {"timestep_shift": run.sample_timestep_shift} if run.sample_timestep_shift else {}
        if run.sample_every and main:
            interval = {"guidance_interval": tuple(run.sample_guidance_interval)} if run.sample_guidance_interval else {}
            self.grid_sampler = build_sampler(self.spec, weights, device, decoder, run.sample_steps, run.seed,
                                              run.sample_cfg_scale, sampler=run.sampler, **shift, **interval)
            self.grid_names = class_names(cfg.data.num_classes, pixel=cfg.data.autoencoder == "none",
                                          names=self.spec.class_names)
        if run.fid_every:
            self.fid_sampler = build_sampler(self.spec, weights, device, decoder, run.fid_steps, run.seed,
                                             precision=run.fid_precision, sampler=run.sampler, **shift)

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

            path = ctx.run_dir / "samples" / f"{step_stem(step)}.png"
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
