"""Train DeiT (Pre-Norm, Post-Norm or SiameseNorm) on ImageNet or Fashion-MNIST; resumable, multi-process.

    python -m vision.train --config configs/deit_tiny_siamese.yaml data.path=/data/imagenet
    accelerate launch --multi_gpu --num_processes 8 -m vision.train --config configs/deit_tiny_siamese.yaml data.path=...
    torchrun --nproc_per_node 2 -m vision.train --config configs/fmnist_deit_siamese.yaml     # CPU, gloo

Settings are ``section.key=value`` overrides on top of the YAML (see ``--help`` for the keys). The global
batch (``optim.batch_size``) is fixed by the recipe and split over processes and gradient-accumulation
steps, so the same recipe gives the same training on 1 GPU or 64. Running the same command again continues
the run from its newest checkpoint (``train.resume=auto``); a finished run is left as it is. The run directory
gets ``config.yaml``, ``metrics.jsonl``, TensorBoard events (``tb/``), ``checkpoints/``, the final
``model.safetensors`` (+ ``ema.safetensors``) and ``final_metrics.json`` (the final epoch, not the best).
The loop itself is :mod:`common.trainer`; DeiT's pieces are :mod:`vision.task`.
"""
from __future__ import annotations


from common.trainer import Trainer, run_cli
from vision.config import TrainConfig

__all__ = ["TrainConfig", "train", "main"]


def train(cfg: TrainConfig) -> dict:
    """Run (or continue) the training a config describes; return the final metrics."""
    from vision.task import DeiTTask  # timm, torchvision: loaded once the command line is checked

    return Trainer(cfg, DeiTTask(cfg)).fit()


def main(argv=None) -> dict:
    return run_cli(TrainConfig, train, argv, prog="python -m vision.train", description=__doc__.split("\n\n")[0],
                   examples=["python -m vision.train --config configs/fmnist_deit_siamese.yaml optim.epochs=2",
                             "accelerate launch --multi_gpu --num_processes 8 -m vision.train "
                             "--config configs/deit_tiny_siamese.yaml data.path=/data/imagenet"])


if __name__ == "__main__":
    main()
