"""Train a class-conditional DiT (any residual topology) on VAE latents or, on CPUs, Fashion-MNIST pixels.

    python -m diffusion.train --config configs/dit_b2_siamese.yaml data.path=LATENTS_DIR data.autoencoder=VAE_DIR
    accelerate launch --multi_gpu --num_processes 8 -m diffusion.train --config configs/dit_b2_siamese.yaml data.path=...
    torchrun --nproc_per_node 2 -m diffusion.train --config configs/fmnist_dit_siamese.yaml     # CPU, gloo

Settings are ``section.key=value`` overrides on top of the YAML (``--help`` lists the keys). The global
batch (``optim.batch_size``) is split over processes and gradient-accumulation steps, so one recipe gives
the same training on 1 GPU or 64: every random choice of a training example (the latent drawn from the stored
VAE moments, the flip, t, the noise, the label drop) is made per sample under its own seed. Running the same
command again continues the run from its newest checkpoint; a finished run is left as it is. The run directory
gets ``config.yaml``, ``metrics.jsonl``, TensorBoard events (``tb/``), ``checkpoints/``, EMA sample grids
(``samples/``), ``ema.safetensors`` (refreshed at every checkpoint, what the sampler loads), ``model.safetensors``
and ``final_metrics.json``. The loop itself is :mod:`common.trainer`; DiT's pieces are :mod:`diffusion.task`.
"""
from __future__ import annotations

from common.trainer import Trainer, run_cli
from diffusion.config import TrainConfig
from diffusion.task import DiTTask

__all__ = ["TrainConfig", "train", "main"]


def train(cfg: TrainConfig) -> dict:
    """Run (or continue) the training a config describes; return the final metrics."""
    return Trainer(cfg, DiTTask(cfg)).fit()


def main(argv=None) -> dict:
    return run_cli(TrainConfig, train, argv, prog="python -m diffusion.train", description=__doc__.split("\n\n")[0],
                   examples=["python -m diffusion.train --config configs/fmnist_dit_siamese.yaml optim.steps=500",
                             "accelerate launch --multi_gpu --num_processes 8 -m diffusion.train --config "
                             "configs/dit_b2_siamese.yaml data.path=latents/imagenet256 data.autoencoder=/models/sd-vae-ft-ema"])


if __name__ == "__main__":
    main()
