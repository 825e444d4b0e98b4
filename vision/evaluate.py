"""Top-1 / Top-5 / loss of a DeiT (ours or any timm model) on an ImageFolder val set or Fashion-MNIST test.

Examples::

    # a run of vision.train (reads model + data sections of its config.yaml, loads model.safetensors)
    python -m vision.evaluate --config runs/deit_tiny_siamese/config.yaml \\
        checkpoint=runs/deit_tiny_siamese/model.safetensors

    # the pipeline sanity check: timm's public DeiT-T weights give 72.2 Top-1 on ImageNet val
    python -m vision.evaluate model.name=deit_tiny_patch16_224 model.pretrained=true \\
        data.dataset=imagefolder data.num_classes=1000 data.path=/data/imagenet

    # several GPUs (the val set is sharded, results gathered exactly once per image)
    accelerate launch -m vision.evaluate --config ... checkpoint=...

Results are printed and written as JSON (``output=``, default next to the checkpoint).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from common.cli import ArgumentParser, InputError, one_line_errors
from common.config import (check_ready, check_registered, deep_merge, from_dict, parse_overrides, read_yaml,
                           settings_epilog)
from common.data import pad_batch
from common.durable import atomic_write_text
from vision.config import DataConfig, EvalConfig, ModelConfig, TrainConfig  # noqa: F401  (the settings, without timm)


class NormalizeBatch:
    """The batch half of :func:`eval_transforms`: ``(uint8 images (B, 3, H, W), targets) -> (float images,
    targets)``, normalised by :class:`vision.augment.NormalizeErase` (no erasing) where the batch is."""

    def __init__(self, data: DataConfig):
        from vision.augment import AugmentConfig, NormalizeErase

        self.normalize = NormalizeErase(data, AugmentConfig(re_prob=0.0))

    def __call__(self, batch):
        images, targets = batch
        return self.normalize.images(images, boxes=None), targets


def eval_transforms(data: DataConfig):
    """``(image transform, batch transform)`` of evaluation: timm's eval transform
    (:func:`vision.augment.build_transform`) cut before its ``ToTensor`` + ``Normalize``, so the loader's workers
    hand over uint8 images (a quarter of the bytes, no per-image float pass), and :class:`NormalizeBatch`, which does
    the same arithmetic (``x / 255``, ``- mean``, ``/ std``) on the batch: the batches are bit-identical to the
    whole transform's. A transform of another shape is kept whole (batch transform None)."""
    from torchvision.transforms import Compose, Normalize, ToTensor

    from vision.augment import build_transform
    from vision.data import rgb_view

    transform = build_transform(data, training=False)
    stages = getattr(transform, "transforms", [])
    if len(stages) < 2 or not (isinstance(stages[-2], ToTensor) and isinstance(stages[-1], Normalize)):
        return transform, None
    return Compose([*stages[:-2], rgb_view]), NormalizeBatch(data)


def compile_for_eval(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` compiled for :func:`evaluate` with ``compiled=True``: one graph of fixed shapes (``dynamic=False``),
    the weights shared with ``model``."""
    return torch.compile(model, dynamic=False)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, accelerator, compiled: bool = False, batch_transform=None) -> dict:
    """Top-1, Top-5 (percent), mean cross-entropy and the count of the images they were computed on.

    ``loader`` holds this process's shard of the evaluation set (:func:`vision.data.build_eval_loader` with the
    process's rank: every image on exactly one process, no padding); the sums are all-reduced once at the end.
    Batches reach the device one ahead of the forward (:class:`common.data.DevicePrefetcher`), where
    ``batch_transform`` (if given) finishes them (:func:`eval_transforms`).
    ``compiled``: ``model`` is compiled for one batch shape (:func:`compile_for_eval`), the first batch's, so a
    smaller last batch is padded to it and the padding's logits are cut off before anything is counted.
    Images the dataset could not read (target ``-1 - index``, see :class:`vision.data.ReadableImageFolder`) are left
    out of every metric and reported as ``unreadable`` with their files.
    """
    from common.data import DevicePrefetcher
    from common.distributed import gather_objects

    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # loss, top-1, top-5, images
    unreadable = []  # per batch, on the device: the file index of each unreadable image, -1 for the others
    compiled_batch = None
    for images, targets in DevicePrefetcher(loader, accelerator.device, transform=batch_transform):
        count = images.shape[0]
        if compiled:
            compiled_batch = compiled_batch or count
            images = pad_batch(images, compiled_batch)
        with accelerator.autocast():
            logits = model(images)[:count].float()
        readable = targets >= 0
        unreadable.append((-1 - targets).clamp(min=-1))  # read once at the end: no host sync per batch
        labels = targets.clamp(min=0)
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        per_image = torch.stack([
            F.cross_entropy(logits, labels, reduction="none"),
            (top[:, 0] == labels).float(),
            (top == labels[:, None]).any(dim=1).float(),
            torch.ones_like(labels, dtype=torch.float32),
        ], dim=1) * readable[:, None]
        totals += per_image.sum(0).double()
    model.train(was_training)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(totals)
    loss, top1, top5, n = totals.tolist()
    mine = torch.cat(unreadable).unique().tolist() if unreadable else []
    bad = sorted({i for rank in gather_objects(accelerator, mine) for i in rank if i >= 0})
    if n == 0:
        raise InputError("the evaluation set has no readable image")
    result = {"top1": 100.0 * top1 / n, "top5": 100.0 * top5 / n, "loss": loss / n, "images": int(n),
              "unreadable": len(bad)}
    if bad:
        dataset = getattr(loader, "dataset", None)
        samples = getattr(getattr(dataset, "dataset", dataset), "samples", None)  # through the shard's Subset
        result["unreadable_files"] = [samples[i][0] if samples else i for i in bad]
    return result


def load_eval_config(path: Optional[str], overrides) -> EvalConfig:
    """A config file (an :class:`EvalConfig`, or a ``vision.train`` run's config, of which the sections the two
    schemas share are used) + overrides. Without weights (``checkpoint=``, or timm's ``model.pretrained=true``) it is
    refused, naming the run's weights files: a random initialisation's score is no result."""
    values = read_yaml(path) if path else {}
    evaluation, training = ({f.name for f in dataclasses.fields(schema)} for schema in (EvalConfig, TrainConfig))
    run_dirs = [Path(path).parent] if path else []
    run_dirs += [Path(values["train"]["output_dir"])] if isinstance(values.get("train"), dict) and \
        values["train"].get("output_dir") else []
    if set(values) & (training - evaluation):
        values = {k: v for k, v in values.items() if k in evaluation & training}
    values = deep_merge(values, parse_overrides(overrides))
    cfg = from_dict(EvalConfig, values)
    check_ready(cfg)
    if cfg.checkpoint is None and not cfg.model.pretrained:
        raise InputError(f"no weights to evaluate: without checkpoint= (and model.pretrained=false) the model would be "
                         f"scored at its random initialisation; pass {suggest_weights(run_dirs)}")
    return cfg


def suggest_weights(run_dirs) -> str:
    """The fix for an evaluation without weights: the weights of the run the config came from (its folder or its
    ``train.output_dir``): the final files, else its newest checkpoint; else the forms ``checkpoint=`` takes."""
    from common.train_state import CheckpointManager

    for run_dir in run_dirs:
        found = [run_dir / name for name in ("model.safetensors", "ema.safetensors") if (run_dir / name).is_file()]
        if found:
            return " or ".join(f"checkpoint={f}" for f in found) + " (the run's final weights" + \
                (", raw or EMA)" if len(found) == 2 else ")")
        checkpoints = CheckpointManager(run_dir / "checkpoints")
        if checkpoints.steps():
            return f"checkpoint={checkpoints.path_for(checkpoints.steps()[-1])} (the unfinished run's newest checkpoint)"
    return ("checkpoint=FILE (a run's model.safetensors or ema.safetensors, a checkpoints/step_*.pt, a timm or "
            "DeiT state dict), or model.pretrained=true for timm's own weights of model.name")


def run(cfg: EvalConfig) -> dict:
    from common.checkpoint import load_weights
    from common.distributed import build_accelerator
    from vision.data import build_dataset, build_eval_loader
    from vision.deit import build_model

    check_registered(cfg)
    from common.trainer import resolve_compile

    accelerator = build_accelerator(cfg.precision, run_dir=None, tensorboard=False)
    model = build_model(cfg.model, cfg.data)
    if cfg.checkpoint:
        # weights=ema picks the "ema" entry of a training checkpoint (for a run's EMA file use ema.safetensors)
        load_weights(model, cfg.checkpoint, key="ema" if cfg.weights == "ema" else None)
    transform, batch_transform = eval_transforms(cfg.data)
    dataset = build_dataset(cfg.data, "val", transform=transform)
    loader = build_eval_loader(dataset, cfg.batch_size, cfg.data.num_workers, accelerator.process_index,
                               accelerator.num_processes)
    model = model.to(accelerator.device)
    compiled = resolve_compile(cfg.compile, accelerator.device)
    metrics = evaluate(compile_for_eval(model) if compiled else model, loader, accelerator, compiled, batch_transform)
    metrics.update(model=cfg.model.name, checkpoint=cfg.checkpoint, weights=cfg.weights)
    output = cfg.output or (str(Path(cfg.checkpoint).with_suffix(".eval.json")) if cfg.checkpoint else None)
    if accelerator.is_main_process:
        unreadable = f"; {metrics['unreadable']} unreadable, left out: {', '.join(map(str, metrics['unreadable_files']))}" \
            if metrics["unreadable"] else ""
        print(f"{cfg.model.name}: top1 {metrics['top1']:.2f}  top5 {metrics['top5']:.2f}  "
              f"loss {metrics['loss']:.4f}  ({metrics['images']} images{unreadable})")
        if output:
            atomic_write_text(output, json.dumps(metrics, indent=2))
            print(f"wrote {output}")
    return metrics


def main(argv=None) -> dict:
    parser = ArgumentParser(
        prog="python -m vision.evaluate",
        description="Evaluate a classifier (Top-1/Top-5/loss). Settings are key=value pairs (listed below), on top "
                    "of --config.",
        epilog=settings_epilog(EvalConfig) + "\n\n" + __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML with eval keys, or a training run's config.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value settings, e.g. checkpoint=runs/x/model.safetensors")
    args = parser.parse_args(argv)
    with one_line_errors():
        return run(load_eval_config(args.config, args.overrides))


if __name__ == "__main__":
    main(sys.argv[1:])
