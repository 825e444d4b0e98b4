"""DiT sampling as a diffusers pipeline that keeps the learned variance.

diffusers' ``DiTPipeline`` splits the learned-variance channels off and steps a scheduler with its own fixed
variance; this pipeline steps with the variance the model learned, on ADM's respaced timesteps, exactly as
``python -m diffusion.sample`` does (:func:`diffusion.sampling.chains.sample_loop`), for diffusers' ``DiTTransformer2DModel``
(a Pre-Norm DiT, :func:`diffusion.hub.to_diffusers_transformer`) and for our :class:`~diffusion.hub.DiTModel` (any
topology).

A saved pipeline folder carries its own code (:func:`write_remote_code`), so it loads where this project is not
installed, as diffusers loads custom pipelines:

    pipe = DiffusionPipeline.from_pretrained("exported", trust_remote_code=True)  # diffusion.export --format diffusers
    images = pipe([207, 360], num_inference_steps=250, generator=torch.Generator().manual_seed(0)).images
"""
from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import torch
from diffusers import (AutoencoderKL, DDPMScheduler, DiffusionPipeline, DiTTransformer2DModel, ImagePipelineOutput,
                       ModelMixin)

from common.topologies import topology_modules
from diffusion.gaussian_diffusion import GaussianDiffusion
from diffusion.hub import DiTModel, backbone_switches, exact_timesteps, to_diffusers_transformer
from diffusion.latents import LatentScaling
from diffusion.models import DiT, guide
from diffusion.spec import DiTSpec
from diffusion.sampling.chains import sample_loop
from diffusion.sampling.guidance import guided_fn, model_fn_for, resolve_guided_channels
from diffusion.sampling.noise import sample_generators
from diffusion.sampling.options import SAMPLERS, SamplingError


def scheduler_for(spec: DiTSpec) -> DDPMScheduler:
    """The model's training schedule as a diffusers scheduler config (its variance type says what the model learned)."""
    return DDPMScheduler(num_train_timesteps=spec.num_timesteps, beta_start=spec.beta_start, beta_end=spec.beta_end,
                         beta_schedule="linear", variance_type="learned_range" if spec.learn_sigma else "fixed_large",
                         prediction_type="epsilon", clip_sample=False)


REMOTE_CODE_PREFIX = "siamesenorm_dit"  # the shipped module is siamesenorm_dit_<hash of its text>.py


def remote_code() -> Tuple[str, str]:
    """``(module name, source)`` of the file a pipeline folder ships: :class:`DiTSamplingPipeline`, :class:`DiTModel`
    and what they use, gathered from this project's modules (:func:`common.source_bundle.bundle_source`); run from
    a shipped file, that file itself. The name carries a hash of the text: diffusers copies every local folder's code
    into one cache directory by file name."""
    if __name__ != "diffusion.pipeline":  # the shipped copy: it ships itself
        return Path(__file__).stem, Path(__file__).read_text()
    # imported by name, so that the shipped copy of this function does not carry the bundler
    bundle_source = importlib.import_module("common.source_bundle").bundle_source
    registrations = [(module, None) for module in topology_modules("dit")]  # every topology a DiTModel may have
    source = bundle_source([("diffusion.pipeline", "DiTSamplingPipeline"), ("diffusion.hub", "DiTModel"),
                            *registrations],
                           title="A SiameseNorm DiT as a diffusers pipeline: DiTSamplingPipeline and DiTModel (any "
                                 "topology)")
    return f"{REMOTE_CODE_PREFIX}_{hashlib.sha256(source.encode()).hexdigest()[:12]}", source


def write_remote_code(folder: Path, custom_transformer: bool) -> str:
    """Ship the code in a saved pipeline folder, the way diffusers loads custom pipelines and components with
    ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)``: the module at the folder's root names the
    pipeline class (``model_index.json``'s ``_class_name``), a copy in ``transformer/`` the transformer's."""
    name, source = remote_code()
    (folder / f"{name}.py").write_text(source)
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_class_name"] = [name, "DiTSamplingPipeline"]
    if custom_transformer:
        (folder / "transformer" / f"{name}.py").write_text(source)
        index["transformer"] = [name, "DiTModel"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return name


class DiTSamplingPipeline(DiffusionPipeline):
    """A class-conditional DiT, its schedule (a ``DDPMScheduler`` config), its VAE (None: pixel space) and how its
    latents were scaled for the VAE (``latent_norm``, in ``model_index.json``)."""

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae"]

    def __init__(self, transformer: ModelMixin, scheduler: DDPMScheduler, vae: Optional[AutoencoderKL] = None,
                 latent_norm: Optional[dict] = None):
        """``transformer``: diffusers' ``DiTTransformer2DModel`` (a Pre-Norm DiT) or :class:`DiTModel` (any
        topology; typed as their common base, since a folder's shipped code defines its own DiTModel class).
        ``latent_norm``: LightningDiT's per-channel normalisation the model was trained with (``{"mean", "std",
        "multiplier"}``, undone before the VAE decodes); None: the VAE's scaling factor."""
        super().__init__()
        if isinstance(transformer, DiTTransformer2DModel):
            exact_timesteps(transformer)
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)
        self.register_to_config(latent_norm=latent_norm)

    @classmethod
    def from_dit(cls, model: DiT, spec: DiTSpec, vae: Optional[AutoencoderKL] = None) -> "DiTSamplingPipeline":
        """A Pre-Norm DiT as diffusers' own ``DiTTransformer2DModel``, any other topology as :class:`DiTModel`."""
        if spec.transport is not None:
            raise SamplingError("this model was trained with SiT's transport, and the pipeline samples DDPM: share it "
                                "with --format hub (its config records the transport) and sample it with "
                                "python -m diffusion.sample")
        native = spec.topology == "pre" and not backbone_switches(model)
        transformer = to_diffusers_transformer(model) if native else DiTModel.from_dit(model, spec)
        return cls(transformer, scheduler_for(spec), vae, spec.latent_norm)

    def save_config(self, save_directory, *args, **kwargs):
        """``model_index.json``, plus the code that loads and runs the folder where this project is not installed:
        one module file (:func:`write_remote_code`) named there as the pipeline class and, unless the transformer is
        diffusers' own, as the transformer's class. ``save_pretrained`` calls this last, before an upload
        (``push_to_hub``), so every saved or pushed folder carries its code."""
        super().save_config(save_directory, *args, **kwargs)
        write_remote_code(Path(save_directory), custom_transformer=not isinstance(self.transformer,
                                                                                   DiTTransformer2DModel))

    def diffusion(self, steps: int, spacing: str) -> GaussianDiffusion:
        config, transformer = self.scheduler.config, self.transformer.config
        learn_sigma = transformer.out_channels == 2 * transformer.in_channels if isinstance(
            self.transformer, DiTTransformer2DModel) else transformer.learn_sigma
        return GaussianDiffusion(config.num_train_timesteps, config.beta_start, config.beta_end, learn_sigma=learn_sigma,
                                 sampling_steps=steps, spacing=spacing).to(self._execution_device)

    def model_fn(self, labels: torch.Tensor, guidance_scale: float, guided_channels):
        """``(x_t, timesteps) -> output`` of the transformer for ``labels``, guided when ``guidance_scale != 1``."""
        guided_channels = resolve_guided_channels(guided_channels, self.transformer.config.in_channels)
        if isinstance(self.transformer, DiT):
            return model_fn_for(self.transformer, labels, guidance_scale, guided_channels)

        def forward(x, t, y):
            return self.transformer(x, timestep=t, class_labels=y).sample

        if guidance_scale == 1.0:
            return lambda x, t: forward(x, t, labels)
        channels = self.transformer.config.in_channels if guided_channels == "all" else int(guided_channels)
        return guided_fn(lambda x, t, y: guide(forward(x, t, y), guidance_scale, channels), labels,
                         self.transformer.config.num_embeds_ada_norm)

    @torch.no_grad()
    def __call__(self, class_labels: Sequence[int], num_inference_steps: int = 250, guidance_scale: float = 1.0,
                 guided_channels: Union[int, str, None] = None, generator: Union[torch.Generator, List[torch.Generator], None] = None,
                 sampler: str = "ddpm", eta: float = 0.0, output_type: str = "pil", return_dict: bool = True):
        """Sample one image per class label.

        ``generator``: one CPU generator per sample (``sample_generators(seed, indices)`` gives the samples
        ``python -m diffusion.sample --seed seed`` makes at those indices), or one generator (or None: torch's global
        one) that seeds them. ``guided_channels``: the epsilon channels guided, a number or ``"all"``; by default
        the official DiT's first 3 of 4, every channel of a model with fewer. ``sampler``: ``ddpm`` (ADM's evenly respaced steps, the learned variance) or ``ddim``
        (ADM's ddimN steps, noise ``eta``). ``output_type``: ``pil``, ``np`` or ``pt`` (images in [0, 1]), or
        ``latent`` (the denoised latents).
        """
        if sampler not in SAMPLERS:
            raise SamplingError(f"sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
        device = self._execution_device
        labels = torch.as_tensor(list(class_labels), dtype=torch.long)
        if isinstance(generator, list):
            if len(generator) != len(labels):
                raise SamplingError(f"{len(generator)} generators for {len(labels)} class labels: pass one per sample")
            generators = generator
        else:
            seed = int(torch.randint(2 ** 32, (1,), generator=generator))
            generators = sample_generators(seed, range(len(labels)))
        config = self.transformer.config
        channels, size = config.in_channels, getattr(config, "sample_size", None) or config.input_size
        diffusion = self.diffusion(num_inference_steps, "ddim" if sampler == "ddim" else "even")
        fn = self.model_fn(labels.to(device), guidance_scale, guided_channels)
        latents = sample_loop(fn, diffusion, generators, (channels, size, size), sampler, eta, device)
        if output_type == "latent":
            images = latents
        else:
            scaling = None if self.vae is None else LatentScaling(self.vae.config.scaling_factor, self.config.latent_norm)
            decoded = latents if scaling is None else self.vae.decode(scaling.undo(latents)).sample
            images = (decoded.float() / 2 + 0.5).clamp(0, 1)
            if output_type != "pt":
                images = images.cpu().permute(0, 2, 3, 1).numpy()
                if output_type == "pil":
                    images = self.numpy_to_pil(images)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)
