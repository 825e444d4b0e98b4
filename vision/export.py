"""Share a trained DeiT the way timm models are shared: timm's Hub format, a folder or a Hugging Face repository.

    python -m vision.export --run runs/deit_tiny_siamese --out exports/deit_tiny_siamese           # EMA weights
    python -m vision.export --run runs/deit_tiny_siamese --out exports/x --weights model --push-to-hub me/deit-t-siamese

The folder holds ``model.safetensors`` and timm's ``config.json``: the architecture (one of the registered
``deit_*_<topology>_patch16_224``), the arguments it was built with (sizes, topology, image size), and a
``pretrained_cfg`` with the run's evaluation preprocessing (input size, interpolation, crop, mean, std) and class
names. Load it with timm's own machinery after ``import vision`` (which registers the topologies)::

    import timm, vision
    model = timm.create_model("local-dir:exports/deit_tiny_siamese", pretrained=True)   # or "hf-hub:me/deit-t-siamese"
    config = timm.data.resolve_data_config(model=model)                                  # the run's preprocessing
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional, Sequence

from common.checkpoint import load_weights
from common.cli import InputError, one_line_errors
from common.config import load_config


def class_names(data) -> Optional[Sequence[str]]:
    """The class of each output, as training labelled them: Fashion-MNIST's names or the train class folders."""
    from common.data import FASHION_MNIST_CLASSES

    if data.dataset == "fashion_mnist":
        return list(FASHION_MNIST_CLASSES)
    folder = Path(data.path) / data.train_split
    if not folder.is_dir():
        return None  # the data is not on this machine: the export goes without names
    return sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())


def export_run(run_dir, out, weights: str = "ema", push_to_hub: Optional[str] = None) -> Path:
    """Write ``out/model.safetensors`` + ``out/config.json`` (timm's Hub format) for a finished ``vision.train`` run;
    push it to the Hugging Face repository ``push_to_hub`` as well when given (needs network and a token)."""
    import vision  # noqa: F401  (registers the topologies)
    from timm.models import push_to_hf_hub, save_for_hf

    from vision.deit import build_model
    from vision.train import TrainConfig

    run_dir = Path(run_dir)
    weights_file = run_dir / f"{weights}.safetensors"
    if not (run_dir / "config.yaml").is_file() or not weights_file.is_file():
        raise InputError(f"{run_dir} is not a finished vision.train run with {weights_file.name} (a run trained "
                         "without train.ema_decay has no EMA: use --weights model)")
    cfg = load_config(TrainConfig, run_dir / "config.yaml")
    model = build_model(cfg.model, cfg.data)
    load_weights(model, weights_file)
    size = cfg.data.input_size
    data_config = {"input_size": (3, size, size), "interpolation": cfg.data.interpolation, "mean": tuple(cfg.data.mean),
                   "std": tuple(cfg.data.std), "crop_pct": cfg.data.crop_pct, "crop_mode": "center"}
    names = class_names(cfg.data)
    model_config = {"label_names": list(names)} if names and len(names) == model.num_classes else {}
    save_for_hf(model.eval(), out, model_config=model_config, data_config=data_config, safe_serialization=True)
    if push_to_hub:
        push_to_hf_hub(model, push_to_hub, model_config=model_config, data_config=data_config,
                       safe_serialization=True)
    return Path(out)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(prog="python -m vision.export", description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a finished vision.train run directory")
    p.add_argument("--out", required=True, help="folder to write model.safetensors and config.json into")
    p.add_argument("--weights", choices=("ema", "model"), default="ema",
                   help="the run's EMA weights (ema.safetensors, default) or its raw weights (model.safetensors)")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="also upload to this Hugging Face model repository")
    args = p.parse_args(argv)
    with one_line_errors():
        out = export_run(args.run, args.out, args.weights, args.push_to_hub)
    print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}; load with "
          f"timm.create_model('local-dir:{out}', pretrained=True) after `import vision`")
    return out


if __name__ == "__main__":
    main()
