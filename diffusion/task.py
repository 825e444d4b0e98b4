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
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from common import trainer
from common.config import ConfigError, config_to_dict
from common.data import resolve_num_workers
from common.train_state import step_stem
from diffusion.config import RunConfig, TrainConfig
from diffusion.data import DiffusionExamples, build_images

if TYPE_CHECKING:  # timm, diffusers, torch-fidelity: imported where they are used, so that the settings load without
    from diffusion.sampling.decoder import Decoder
    from diffusion.sampling.sampler import Sampler
    from diffusion.spec import DiTSpec


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
