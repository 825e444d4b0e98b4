"""A DiT's description, :class:`DiTSpec`: everything that rebuilds a DiT around its weights and samples it as it was
trained (model name and sizes, topology, the latents' channels and size, classes, the VAE and how latents were scaled
for it, the diffusion schedule), built, written into checkpoint metadata and read back in one place. :mod:`diffusion.checkpoints` reads it out of each checkpoint format.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from common.cli import InputError
from common.config import did_you_mean
from common.topologies import check_topology, option_names, resolve_topology
from diffusion.models import DIT_CONFIGS, DiT, DiT_models


def published_default(argument: str, name: str = "DiT-XL/2"):
    """The published value of a ``DiT(...)`` argument for model ``name``: its config's (LightningDiT's latents and
    backbone), else the constructor's default (the published DiT's)."""
    return DIT_CONFIGS.get(name, {}).get(argument, inspect.signature(DiT).parameters[argument].default)


SPEC_OWN = ("input_size", "in_channels", "num_classes", "learn_sigma", "class_dropout_prob", "topology")


def check_dit_arguments(name: str, topology: str, class_dropout_prob: float, kwargs: Dict[str, Any],
                        where: str = "model.") -> None:
    """What a DiT description may hold (a config's ``model:`` section, a checkpoint's metadata)."""
    check_topology(topology, "dit")
    if name not in DiT_models:
        raise InputError(f"{where}name={name!r} is not a DiT{did_you_mean(name, DiT_models)}; choose one of "
                         f"{', '.join(DiT_models)}")
    if not 0.0 <= class_dropout_prob < 1.0:
        raise InputError(f"{where}class_dropout_prob={class_dropout_prob} must lie in [0, 1)")
    own = [p for p, v in inspect.signature(DiT).parameters.items() if p not in SPEC_OWN and v.kind != v.VAR_KEYWORD]
    allowed = own + list(option_names())
    unknown = [k for k in kwargs if k not in allowed]
    if unknown:
        raise InputError(f"{where}kwargs has unknown DiT arguments {unknown}; valid: {', '.join(allowed)}")
    depth = kwargs.get("depth", DIT_CONFIGS[name]["depth"])
    try:  # the topology's own options, for the depth the model gets
        resolve_topology(topology, depth, "dit", **{k: v for k, v in kwargs.items() if k in option_names()})
    except InputError as err:
        raise InputError(f"{where}kwargs: {err}") from None


@dataclass
class DiTSpec:
    """Everything that rebuilds a DiT around its weights and samples it as it was trained, in one place.

    The trainer writes it into ``model.safetensors`` / ``ema.safetensors`` (:meth:`metadata`); the sampler, FID,
    export and comparison read it back from any checkpoint (:func:`load_dit`), and a shared folder carries it as
    its ``config.json`` (:mod:`diffusion.hub`). What a file does not record falls back to the published DiT's
    values (:meth:`published`): the official checkpoints record nothing.
    """

    name: str  # a key of DiT_models
    topology: str
    learn_sigma: bool
    class_dropout_prob: float
    in_channels: int
    input_size: int  # latent side (pixels for pixel-space models)
    num_classes: int
    autoencoder: str  # the VAE that decodes samples (directory or Hugging Face id); "none": pixel space
    num_timesteps: int  # the diffusion schedule the model was trained with
    beta_start: float
    beta_end: float
    kwargs: Dict[str, Any] = field(default_factory=dict)  # further DiT arguments (hidden_size, depth, ...)
    vae_sha256: Optional[str] = None  # fingerprint of the VAE that encoded the training latents, if recorded
    vae_scaling_factor: Optional[float] = None
    class_names: Optional[List[str]] = None  # one per class (WordNet ids, folder names), if recorded
    transport: Optional[Dict[str, Any]] = None  # SiT's transport it was trained with (Transport.description()); None: DDPM
    latent_norm: Optional[Dict[str, Any]] = None  # LightningDiT's per-channel normalisation of its latents ({"mean", "std", "multiplier"}); None: the VAE's scaling factor

    def __post_init__(self):
        check_dit_arguments(self.name, self.topology, self.class_dropout_prob, self.kwargs, where="")
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise InputError(f"{len(self.class_names)} class names for {self.num_classes} classes")
        if self.latent_norm is not None and not (len(self.latent_norm["mean"]) == len(self.latent_norm["std"])
                                                 == self.in_channels):
            raise InputError(f"latent_norm holds {len(self.latent_norm['mean'])} channel means and "
                             f"{len(self.latent_norm['std'])} stds for a model of {self.in_channels} channels")

    @classmethod
    def published(cls, name: str, **values) -> "DiTSpec":
        """``name`` with the published DiT's values (constructor defaults, SD VAE, DiT's schedule) under ``values``."""
        from diffusion.gaussian_diffusion import DIT_SCHEDULE
        from diffusion.latents import DEFAULT_VAE

        defaults = {k: published_default(k, name) for k in SPEC_OWN}
        schedule = {"num_timesteps": DIT_SCHEDULE["num_train_timesteps"], "beta_start": DIT_SCHEDULE["beta_start"],
                    "beta_end": DIT_SCHEDULE["beta_end"]}
        return cls(name=name, **{**defaults, "autoencoder": DEFAULT_VAE, **schedule, **values})

    # ---------------------------------------------------------------------------------------------- build
    def dit_kwargs(self) -> Dict[str, Any]:
        """The ``DiT(...)`` arguments of this model."""
        own = {k: getattr(self, k) for k in SPEC_OWN}
        return {**DIT_CONFIGS[self.name], **own, **self.kwargs}

    def build(self) -> DiT:
        return DiT(**self.dit_kwargs())

    def diffusion(self, **options):
        """The model's diffusion; ``options`` (``sampling_steps``, ``spacing``) go to GaussianDiffusion."""
        from diffusion.gaussian_diffusion import GaussianDiffusion

        return GaussianDiffusion(self.num_timesteps, self.beta_start, self.beta_end, learn_sigma=self.learn_sigma,
                                 **options)

    def objective(self):
        """The objective it was trained with (:class:`diffusion.objective.Objective`): SiT's transport as recorded,
        or its DDPM schedule."""
        if self.transport is not None:
            from diffusion.transport import Transport

            return Transport.from_description(self.transport)
        return self.diffusion()

    @property
    def shape(self) -> Tuple[int, int, int]:
        """``(C, H, W)`` of one sample the model denoises."""
        return self.in_channels, self.input_size, self.input_size

    # ------------------------------------------------------------------------------------ write and read
    def metadata(self, **extra) -> Dict[str, str]:
        """safetensors metadata (all strings) that :meth:`from_metadata` reads back; ``extra`` (e.g. ``step``) rides along."""
        values = {"model": self.name, "model_kwargs": json.dumps(self.kwargs),
                  **{k: getattr(self, k) for k in (*SPEC_OWN, "autoencoder", "num_timesteps", "beta_start", "beta_end",
                                                   "vae_sha256", "vae_scaling_factor")}}
        if self.class_names is not None:
            values["class_names"] = json.dumps(self.class_names)
        if self.transport is not None:
            values["transport"] = json.dumps(self.transport)
        if self.latent_norm is not None:
            values["latent_norm"] = json.dumps(self.latent_norm)
        return {k: str(v) for k, v in {**values, **extra}.items() if v is not None}

    @staticmethod
    def from_metadata(meta: Dict[str, str]) -> Dict[str, Any]:
        """The fields a safetensors file of diffusion.train records (none for other files)."""
        if "model" not in meta:
            return {}
        as_bool = lambda s: s.lower() == "true"  # noqa: E731
        convert = {"model": ("name", str), "model_kwargs": ("kwargs", json.loads), "topology": ("topology", str),
                   "learn_sigma": ("learn_sigma", as_bool), "class_dropout_prob": ("class_dropout_prob", float),
                   "in_channels": ("in_channels", int), "input_size": ("input_size", int),
                   "num_classes": ("num_classes", int), "autoencoder": ("autoencoder", str),
                   "num_timesteps": ("num_timesteps", int), "beta_start": ("beta_start", float),
                   "beta_end": ("beta_end", float), "vae_sha256": ("vae_sha256", str),
                   "vae_scaling_factor": ("vae_scaling_factor", float), "class_names": ("class_names", json.loads),
                   "transport": ("transport", json.loads), "latent_norm": ("latent_norm", json.loads)}
        return {field: fn(meta[key]) for key, (field, fn) in convert.items() if key in meta}

    @staticmethod
    def from_train_config(config: Dict[str, Any], sample_shape: Optional[Sequence[int]] = None,
                          vae: Optional[Dict[str, Any]] = None, class_names: Optional[Sequence[str]] = None
                          ) -> Dict[str, Any]:
        """The fields of a diffusion.train config (as a dict), with the training data's ``sample_shape`` and ``vae``
        (:func:`diffusion.task.latent_vae`: the VAE and how its latents were scaled). Without ``sample_shape`` (the
        config of a training checkpoint that records nothing else) pixels have the config's ``image_size``, and
        latents no shape: their VAE's downsampling and channels are the data's, not the config's."""
        model, data, schedule = config.get("model", {}), config.get("data", {}), config.get("diffusion", {})
        if sample_shape is None and "image_size" in data and data.get("dataset") == "fashion_mnist":
            sample_shape = (1, data["image_size"])
        found = {"name": model.get("name"), "topology": model.get("topology"), "learn_sigma": model.get("learn_sigma"),
                 "class_dropout_prob": model.get("class_dropout_prob"), "kwargs": model.get("kwargs"),
                 "num_classes": data.get("num_classes"), "autoencoder": data.get("autoencoder"),
                 **{k: schedule.get(k) for k in ("num_timesteps", "beta_start", "beta_end")},
                 "class_names": None if class_names is None else list(class_names)}
        if (config.get("transport") or {}).get("enabled"):
            from diffusion.transport import transport_from_config

            found["transport"] = transport_from_config(config["transport"]).description()
        if sample_shape is not None:
            found.update(in_channels=int(sample_shape[0]), input_size=int(sample_shape[1]))
        found.update({k: (vae or {}).get(k) for k in ("vae_sha256", "vae_scaling_factor", "latent_norm")})
        return {k: v for k, v in found.items() if v is not None}

    @classmethod
    def resolve(cls, found: Dict[str, Any], overrides: Optional[Dict[str, Any]] = None) -> "DiTSpec":
        """Command-line values over what the checkpoint records over the published DiT's values."""
        values = {**found, **{k: v for k, v in (overrides or {}).items() if v is not None}}
        if "name" not in values:
            raise InputError("this checkpoint does not say which model it holds (a plain state dict such as the "
                             f"official DiT-XL-2-256x256.pt): pass --model (one of {', '.join(DiT_models)}) and "
                             "--image-size")
        if values["name"] not in DiT_models:
            raise InputError(f"--model {values['name']!r} is not a DiT{did_you_mean(values['name'], DiT_models)}; "
                             f"choose one of {', '.join(DiT_models)}")
        return cls.published(**values)
