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
import json
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from common.cli import ArgumentParser, InputError, InputNotFoundError, one_line_errors
from common.config import ConfigError, check_registered, deep_merge, from_dict, parse_overrides, read_yaml, settings_epilog
from common.durable import atomic_write_text
from vision.config import DataConfig, EvalConfig, ModelConfig  # noqa: F401  (the settings, without timm)


def check_model_name(name: str, kwargs: dict) -> None:
    """``model.name`` must be a timm model (ours registered) and ``model.kwargs`` its arguments: a config error
    before any work, not a silently ignored setting."""
    import timm

    import vision.deit  # noqa: F401  (registers our DeiT variants with timm)

    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:12]
        raise ConfigError(f"unknown model {name!r}; e.g. {', '.join(close) or 'see timm.list_models()'}. Ours: "
                          "deit_{tiny,small,base}_{siamese,post,mixln,...}_patch16_224 (Pre-Norm: timm's "
                          "deit_*_patch16_224)")
    check_model_kwargs(name, kwargs)


def build_model(model: ModelConfig, data: DataConfig) -> torch.nn.Module:
    """Create the timm model a config names (name and keyword arguments were checked with the config)."""
    import timm

    import vision.deit  # noqa: F401  (registers our DeiT variants with timm)

    kwargs = dict(model.kwargs)
    kwargs.setdefault("img_size", data.input_size)
    if model.pretrained:
        check_pretrained_reachable(model.name)
    try:
        return timm.create_model(model.name, pretrained=model.pretrained, num_classes=data.num_classes,
                                 drop_path_rate=model.drop_path, **kwargs)
    except TypeError as err:
        if "unexpected keyword argument" in str(err):
            raise ConfigError(f"model.kwargs do not fit {model.name}: {err}") from None
        raise


def check_pretrained_reachable(name: str, timeout: float = 3.0) -> None:
    """Fail in seconds, not after a minute of retries, when timm's weights are neither cached nor downloadable."""
    import socket

    import timm
    from huggingface_hub import try_to_load_from_cache

    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        raise InputError(f"{name} has no pretrained weights in timm; pass checkpoint=FILE instead of model.pretrained=true")
    if cfg.hf_hub_id and any(isinstance(try_to_load_from_cache(cfg.hf_hub_id, f), str)
                             for f in ("model.safetensors", "pytorch_model.bin", cfg.hf_hub_filename or "model.safetensors")):
        return
    if cfg.url and (Path(torch.hub.get_dir()) / "checkpoints" / Path(cfg.url).name).is_file():
        return
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
    except OSError:
        raise InputNotFoundError(f"the pretrained weights of {name} are not cached and huggingface.co cannot be "
                                 "reached: pass the weights file with checkpoint=FILE (and model.pretrained=false)") from None


def check_model_kwargs(name: str, kwargs: dict) -> None:
    """Unknown keyword arguments of a ViT/DeiT are an error before any work (not a silently ignored setting)."""
    import inspect

    from timm.models import model_entrypoint
    from timm.models.vision_transformer import VisionTransformer

    from vision.deit import SiameseNormVisionTransformer

    module = model_entrypoint(name).__module__
    if module not in ("timm.models.vision_transformer", "timm.models.deit", SiameseNormVisionTransformer.__module__):
        return  # another timm family: timm's own TypeError is reported by build_model
    valid = set(inspect.signature(VisionTransformer).parameters)
    if module == SiameseNormVisionTransformer.__module__:
        valid |= set(inspect.signature(SiameseNormVisionTransformer).parameters)
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise ConfigError(f"model.kwargs {unknown} are not arguments of {name}; valid ones include "
                          f"{', '.join(sorted(valid - {'kwargs'}))}")
    if "topology" in kwargs:
        from common.residual import MODEL_TOPOLOGIES

        if kwargs["topology"] not in MODEL_TOPOLOGIES:
            raise ConfigError(f"model.kwargs.topology={kwargs['topology']!r} is not a topology; choose one of "
                              f"{', '.join(MODEL_TOPOLOGIES)}")


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, accelerator) -> dict:
    """Top-1, Top-5 (percent), mean cross-entropy and the count of the images they were computed on.

    ``loader`` holds this process's shard of the evaluation set (:func:`vision.data.build_eval_loader` with the
    process's rank: every image on exactly one process, no padding); the sums are all-reduced once at the end.
    Images the dataset could not read (target ``-1 - index``, see :class:`vision.data.ReadableImageFolder`) are left
    out of every metric and reported as ``unreadable`` with their files.
    """
    from common.distributed import gather_objects

    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # loss, top-1, top-5, images
    unreadable = []  # per batch, on the device: the file index of each unreadable image, -1 for the others
    for images, targets in loader:
        images, targets = images.to(accelerator.device), targets.to(accelerator.device)
        with accelerator.autocast():
            logits = model(images).float()
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
    """A config file (eval keys, or a training config whose ``model``/``data`` sections are used) + overrides."""
    values = read_yaml(path) if path else {}
    if "optim" in values or "train" in values or "augment" in values:
        values = {k: values[k] for k in ("model", "data") if k in values}
    values = deep_merge(values, parse_overrides(overrides))
    return from_dict(EvalConfig, values)


def run(cfg: EvalConfig) -> dict:
    from common.checkpoint import load_weights
    from common.distributed import build_accelerator
    from vision.augment import build_transform
    from vision.data import build_dataset, build_eval_loader

    check_registered(cfg)
    accelerator = build_accelerator(cfg.precision, run_dir=None, tensorboard=False)
    model = build_model(cfg.model, cfg.data)
    if cfg.checkpoint:
        # weights=ema picks the "ema" entry of a training checkpoint (for a run's EMA file use ema.safetensors)
        load_weights(model, cfg.checkpoint, key="ema" if cfg.weights == "ema" else None)
    dataset = build_dataset(cfg.data, "val", transform=build_transform(cfg.data, training=False))
    loader = build_eval_loader(dataset, cfg.batch_size, cfg.data.num_workers, accelerator.process_index,
                               accelerator.num_processes)
    model = model.to(accelerator.device)
    metrics = evaluate(model, loader, accelerator)
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
