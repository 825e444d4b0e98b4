"""Share a trained DeiT the way timm models are shared: timm's Hub format, a folder or a Hugging Face repository.

    python -m vision.export --run runs/deit_tiny_siamese --out exports/deit_tiny_siamese    # the weights it reports
    python -m vision.export --run runs/deit_tiny_siamese --out exports/x --weights ema --push-to-hub me/deit-t-siamese

The run must be finished (``final_metrics.json`` written, no newer checkpoint): an unfinished run is refused, or
with ``--allow-unfinished`` its newest checkpoint is exported and the step said. By default the export holds the
weights the run's own evaluation reports: DeiT's recipe reports the raw model's Top-1 (``val/top1``;
``vision.task.REPORTED_WEIGHTS``), so ``model.safetensors``, not the EMA (``--weights ema``). The choice is printed
and recorded in ``config.json`` under ``siamesenorm_export`` (weights, step, finished, the reported metric).

The folder holds ``model.safetensors``, timm's ``config.json`` (the architecture, one of the registered
``deit_*_<topology>_patch16_224``; the arguments it was built with (sizes, topology, image size); a ``pretrained_cfg``
with the run's evaluation preprocessing (input size, interpolation, crop, mean, std) and class names) and a model card,
``README.md``, that says how to load it. ``--push-to-hub`` uploads that folder; offline or without a token it is one
line, the folder stays. Load it with timm's own machinery after ``import vision`` (which registers the topologies)::

    import timm, vision
    model = timm.create_model("local-dir:exports/deit_tiny_siamese", pretrained=True)   # or "hf-hub:me/deit-t-siamese"
    config = timm.data.resolve_data_config(model=model)                                  # the run's preprocessing
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional, Sequence

from common.checkpoint import CheckpointError, upload_to_hub
from common.cli import InputError, one_line_errors
from common.durable import atomic_write_text

WEIGHTS = ("reported", "model", "ema")
METRIC_PREFIX = {"model": "val/", "ema": "val_ema/"}  # the evaluation's name for each set of weights


def class_names(data) -> Optional[Sequence[str]]:
    """The class of each output, as training labelled them: Fashion-MNIST's names or the train class folders."""
    from common.data import FASHION_MNIST_CLASSES

    if data.dataset == "fashion_mnist":
        return list(FASHION_MNIST_CLASSES)
    folder = Path(data.path) / data.train_split
    if not folder.is_dir():
        return None  # the data is not on this machine: the export goes without names
    return sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())


def choose_weights(run_dir: Path, weights: str, allow_unfinished: bool) -> dict:
    """What to export and why: ``{"weights", "source", "entry", "step", "finished", ...}``, or one-line refusal."""
    import yaml

    from common.trainer import run_state, unfinished_run_error
    from vision.task import REPORTED_METRIC, REPORTED_WEIGHTS

    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir} is not a vision.train run (it has no config.yaml): pass the run's output_dir")
    chosen = REPORTED_WEIGHTS if weights == "reported" else weights
    if chosen == "ema" and (yaml.safe_load((run_dir / "config.yaml").read_text()).get("train") or {}).get(
            "ema_decay") is None:
        raise InputError(f"{run_dir} was trained without an EMA (train.ema_decay is null): export its raw weights with "
                         "--weights model")
    state = run_state(run_dir)
    record = {"weights": chosen, "chosen_by": ("the run's reported metric" if weights == "reported" else
                                               f"--weights {weights}"),
              "reported_metric": REPORTED_METRIC, "finished": state["finished"], "total_steps": state["total_steps"]}
    if state["finished"]:
        final = state["final"]
        source = run_dir / f"{chosen}.safetensors"
        if not source.is_file():
            raise InputError(f"{run_dir} is not a finished vision.train run with {source.name} (a run trained without "
                             "train.ema_decay has no EMA: use --weights model)")
        metric = METRIC_PREFIX[chosen] + "top1"
        return {**record, "source": str(source), "entry": None, "step": final["steps"],
                "top1": final.get(metric), "top1_metric": metric, "reported_top1": final.get(REPORTED_METRIC)}
    if state["newest"] is None:
        raise InputError(f"{run_dir} has no checkpoint and no final weights: nothing was trained yet")
    if not allow_unfinished:
        raise unfinished_run_error(run_dir, state, "vision.train", f"step {state['newest']}")
    from common.train_state import CheckpointManager

    return {**record, "source": str(CheckpointManager(run_dir / "checkpoints").path_for(state["newest"])),
            "entry": chosen, "step": state["newest"], "top1": None, "top1_metric": None, "reported_top1": None}


def export_run(run_dir, out, weights: str = "reported", push_to_hub: Optional[str] = None,
               allow_unfinished: bool = False) -> dict:
    """Write ``out/model.safetensors`` + ``out/config.json`` (timm's Hub format) for a ``vision.train`` run; push it
    to the Hugging Face repository ``push_to_hub`` as well when given (needs network and a token). Returns what was
    exported (:func:`choose_weights`), also recorded in ``config.json`` as ``siamesenorm_export``."""
    from common.checkpoint import load_weights
    from common.config import load_config

    run_dir = Path(run_dir)
    choice = choose_weights(run_dir, weights, allow_unfinished)
    import vision  # noqa: F401  (registers the topologies)
    from timm.models import save_for_hf

    from vision.deit import build_model
    from vision.train import TrainConfig

    cfg = load_config(TrainConfig, run_dir / "config.yaml")
    model = build_model(cfg.model, cfg.data)
    load_weights(model, choice["source"], key=choice["entry"])
    size = cfg.data.input_size
    data_config = {"input_size": (3, size, size), "interpolation": cfg.data.interpolation, "mean": tuple(cfg.data.mean),
                   "std": tuple(cfg.data.std), "crop_pct": cfg.data.crop_pct, "crop_mode": "center"}
    names = class_names(cfg.data)
    model_config = {"label_names": list(names)} if names and len(names) == model.num_classes else {}
    model_config["siamesenorm_export"] = choice
    save_for_hf(model.eval(), out, model_config=model_config, data_config=data_config, safe_serialization=True)
    atomic_write_text(Path(out) / "README.md", model_card(cfg, choice, push_to_hub or f"local-dir:{out}"))
    if push_to_hub:
        import timm
        from huggingface_hub import HfApi

        def push():
            api = HfApi(library_name="timm", library_version=timm.__version__)
            repo = api.create_repo(push_to_hub, exist_ok=True).repo_id
            api.upload_folder(repo_id=repo, folder_path=str(out), commit_message="Add model")

        upload_to_hub(push, push_to_hub, out)  # the folder as written, its model card included
    return choice


def model_card(cfg, choice: dict, source: str) -> str:
    """The folder's README.md: what the model is, that this project's ``import vision`` registers its architecture
    with timm (plain timm does not know it), how to load it from ``source``, which weights it holds."""
    name = cfg.model.name
    hub = source if source.startswith("local-dir:") else f"hf-hub:{source}"
    weights = describe(choice).removeprefix("exporting ")
    return f"""---
library_name: timm
tags: [image-classification, timm, siamesenorm]
---
# {name}

A DeiT trained by `vision.train` of the SiameseNorm project ([arXiv 2602.08064](https://arxiv.org/abs/2602.08064)):
{cfg.data.num_classes} classes, {cfg.data.input_size} px{f", residual topology `{cfg.model.kwargs['topology']}`"
                                                         if "topology" in cfg.model.kwargs else ""}.

timm alone does not know `{name}`: install the project this model was trained with (`pip install -e .` in its
clone) and `import vision`, which registers its architectures with timm, before creating the model:

```python
import timm, vision                     # vision registers the residual topologies with timm
model = timm.create_model("{hub}", pretrained=True).eval()
transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))   # the run's evaluation preprocessing
```

Weights: {weights}. `config.json` records the choice under `siamesenorm_export`.
"""


def describe(choice: dict) -> str:
    """One line: which weights, from which step, and why."""
    names = {"model": "the raw model's weights", "ema": "the EMA weights"}
    text = f"exporting {names[choice['weights']]} ({choice['chosen_by']}) from step {choice['step']}"
    if not choice["finished"]:
        total = f" of {choice['total_steps']}" if choice["total_steps"] else ""
        return text + f"{total}: an UNFINISHED run (--allow-unfinished), from {choice['source']}"
    text += f" of the finished run: {choice['top1_metric']} = {choice['top1']:.4g}" if choice["top1"] is not None else ""
    if choice["weights"] != "model" or choice["reported_metric"] != choice["top1_metric"]:
        text += f" (the run reports {choice['reported_metric']} = {choice['reported_top1']:.4g})" \
            if choice["reported_top1"] is not None else ""
    return text


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(prog="python -m vision.export", description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a finished vision.train run directory")
    p.add_argument("--out", required=True, help="folder to write model.safetensors and config.json into")
    p.add_argument("--weights", choices=WEIGHTS, default="reported",
                   help="reported (default): the weights the run's evaluation reports (DeiT: the raw model, "
                        "val/top1); model: the raw weights; ema: the EMA weights (val_ema/top1)")
    p.add_argument("--allow-unfinished", action="store_true",
                   help="export a run that has not finished, from its newest checkpoint (the step is printed and "
                        "recorded)")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="also upload to this Hugging Face model repository")
    args = p.parse_args(argv)
    with one_line_errors(CheckpointError):
        choice = export_run(args.run, args.out, args.weights, args.push_to_hub, args.allow_unfinished)
    out = Path(args.out)
    print(describe(choice))
    print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}; load with "
          f"timm.create_model('local-dir:{out}', pretrained=True) after `import vision`")
    return out


if __name__ == "__main__":
    main()
