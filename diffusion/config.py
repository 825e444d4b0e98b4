"""DiT's settings, as a recipe and its overrides give them (``python -m diffusion.train --help`` lists them): one
dataclass per section, each number with its valid range, checked when the config loads (:mod:`common.config`),
before any heavy import; the model's name and arguments against the registry (``check_registered``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Optional, Tuple, Union

from common import trainer
from common.config import ConfigError, Range, config_to_dict
from diffusion.transport import transport_from_config


@dataclass(kw_only=True)
class DataConfig:
    dataset: Literal["latents", "fashion_mnist"]
    path: Optional[str] = None  # latents: the --out of diffusion.extract_latents; fashion_mnist: optional root
    autoencoder: str  # VAE that decodes sample grids (dir or HF id); "none" = pixel space
    image_size: Annotated[int, Range(ge=8)]  # pixels; latents: must match the extraction
    num_classes: Annotated[int, Range(ge=1)]
    hflip: bool  # random horizontal flip (latents: the stored flipped view)
    latent_norm: bool = False  # LightningDiT's per-channel normalisation (z - mean_c) / std_c * latent_multiplier with the latents' own statistics, in place of the VAE's scaling factor
    latent_multiplier: Annotated[float, Range(gt=0)] = 1.0  # with latent_norm: the factor after normalising (LightningDiT's VA-VAE recipes: 1.0)
    max_samples: Optional[Annotated[int, Range(ge=1)]] = None  # keep the first N training examples (quick runs, tests)
    num_workers: Union[Annotated[int, Range(ge=0)], Literal["auto"]] = "auto"  # DataLoader workers per process; auto: from the CPU count

    def __post_init__(self):
        if self.dataset == "fashion_mnist" and self.autoencoder != "none":
            raise ConfigError("dataset=fashion_mnist trains in pixel space: set data.autoencoder=none")
        if self.dataset == "fashion_mnist" and (self.image_size < 28 or self.image_size % 2):
            raise ConfigError(f"data.image_size={self.image_size}: Fashion-MNIST (28 px) is padded to an even size >= 28")
        if self.dataset == "fashion_mnist" and self.latent_norm:
            raise ConfigError("data.latent_norm normalises VAE latents, and dataset=fashion_mnist trains on pixels: set "
                              "data.latent_norm=false")
        if not self.latent_norm and self.latent_multiplier != 1.0:
            raise ConfigError(f"data.latent_multiplier={self.latent_multiplier} scales the normalised latents of "
                              "data.latent_norm=true; without it the VAE's scaling factor applies: set "
                              "data.latent_norm=true, or data.latent_multiplier=1")

    def check_ready(self) -> None:
        """The latents' place, needed to run (not to print a config)."""
        if self.dataset == "latents" and not self.path:
            raise ConfigError("data.path is required for dataset=latents: the output directory of "
                              "`python -m diffusion.extract_latents` (it holds metadata.json)")


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
