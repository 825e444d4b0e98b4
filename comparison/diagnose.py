"""The paper's diagnostics (common/diagnostics.py) of a finished run: a ``vision.train`` run (model and data from its
``config.yaml``, the held-out loss :func:`vision.evaluate.evaluate`) or a pixel-space ``diffusion.train`` run (its EMA
DiT, the diffusion loss at fixed ``t`` and noise on test images)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from common.checkpoint import load_weights
from common.cli import InputNotFoundError
from common.config import load_config
from common.diagnostics import PathLike, grad_norm_trace, hidden_state_norms, layer_removal, stream_contribution
from common.distributed import build_accelerator
from vision.data import build_dataset, build_eval_loader
from vision.augment import build_transform
from vision.deit import build_model
from vision.evaluate import evaluate
from vision.train import TrainConfig


def diagnose_deit_run(run_dir: PathLike, max_images: Optional[int] = 1000, batch_size: int = 250,
                      weights: str = "model.safetensors") -> Dict[str, dict]:
    """All diagnostics of a finished ``vision.train`` run, on the first ``max_images`` held-out images.

    The model and data come from the run's ``config.yaml``, the weights from ``run_dir/<weights>``;
    the held-out loss is :func:`vision.evaluate.evaluate` (cross-entropy, plus Top-1). Diagnostics that do not
    apply (stream contribution of a non-Siamese model) are left out.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / weights).is_file():
        raise InputNotFoundError(f"{run_dir} is not a finished vision.train run (needs config.yaml and {weights})")
    cfg = load_config(TrainConfig, run_dir / "config.yaml")
    if max_images is not None:
        cfg.data.max_val_samples = max_images
    cfg.data.num_workers = 0
    model = build_model(cfg.model, cfg.data)
    load_weights(model, run_dir / weights)
    dataset = build_dataset(cfg.data, "val", build_transform(cfg.data, training=False))
    loader = build_eval_loader(dataset, batch_size, 0)
    accelerator = build_accelerator("fp32", run_dir=None, tensorboard=False)
    images = next(iter(loader))[0]

    out = {"hidden_state_norms": hidden_state_norms(model, images),
           "layer_removal": layer_removal(model, lambda m: evaluate(m, loader, accelerator))}
    try:
        out["stream_contribution"] = stream_contribution(model)
    except ValueError:
        pass
    try:
        out["grad_norm"] = grad_norm_trace(run_dir)
    except ValueError:
        pass
    return out


def diagnose_dit_run(run_dir: PathLike, max_images: Optional[int] = 256) -> Dict[str, dict]:
    """Stream norms, layer removal (the training loss, DDPM's or the transport's, at fixed t and noise on test images) and stream contribution
    of a finished pixel-space ``diffusion.train`` run's EMA DiT, plus its logged gradient norms."""
    import torch

    from diffusion.data import PixelImages
    from diffusion.checkpoints import load_dit

    run_dir = Path(run_dir)
    if not (run_dir / "ema.safetensors").is_file():
        raise InputNotFoundError(f"{run_dir} is not a finished diffusion.train run (needs ema.safetensors)")
    model, spec, _ = load_dit(run_dir / "ema.safetensors")
    model.eval()
    test = PixelImages("test", spec.input_size, limit=max_images, hflip=False)
    x0 = torch.stack([test[i][0] for i in range(len(test))])
    labels = test.labels.clone()
    gen = torch.Generator().manual_seed(0)
    if spec.transport is not None:  # SiT's transport: its loss at fixed times and noise
        from diffusion.transport import Transport

        objective = Transport.from_description(spec.transport)
        draw = torch.randn if objective.time_distribution == "logit_normal" else torch.rand
        t = objective.training_times(draw(len(x0), generator=gen))
        noise = torch.randn(x0.shape, generator=gen)
        x_t, timesteps = objective.interpolate(t, noise, x0)[0], t
    else:
        objective = spec.diffusion()
        t = torch.randint(0, objective.num_train_timesteps, (len(x0),), generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        x_t, timesteps = objective.q_sample(x0, t, noise), objective.model_timesteps(t)

    def loss_fn(m):
        return float(objective.training_losses(m, x0, t, noise, model_kwargs={"y": labels})["loss"].mean())

    out = {"hidden_state_norms": hidden_state_norms(model, x_t, timesteps, labels),
           "layer_removal": layer_removal(model, loss_fn), "grad_norm": grad_norm_trace(run_dir)}
    try:
        out["stream_contribution"] = stream_contribution(model)
    except ValueError:
        pass
    return out


def is_dit_run(run_dir: PathLike) -> bool:
    """A ``diffusion.train`` run: its config has a ``diffusion:`` section."""
    import yaml

    config = Path(run_dir) / "config.yaml"
    return config.is_file() and "diffusion" in (yaml.safe_load(config.read_text()) or {})
