"""Share a trained DeiT the way timm models are shared: timm's Hub format, a folder or a Hugging Face repository.

    python -m vision.export --run runs/deit_tiny_siamese --out exports/deit_tiny_siamese    # the weights it reports
    python -m vision.export --run runs/deit_tiny_siamese --out exports/x --weights ema --push-to-hub me/deit-t-siamese

The run must be finished (``final_metrics.json`` written, no newer checkpoint): an unfinished run is refused, or
with ``--allow-unfinished`` its newest checkpoint is exported and the step said. By default the export holds the
weights the run's own evaluation reports: DeiT's recipe reports the raw model's Top-1 (``val/top1``;
``vision.task.REPORTED_WEIGHTS``), so ``model.safetensors``, not the EMA (``--weights ema``). The choice is printed
and recorded in ``config.json`` under ``siamesenorm_export`` (weights, step, finished, the reported metric).

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
import json
import os
from pathlib import Path
from typing import Optional, Sequence

from common.checkpoint import CheckpointError
from common.cli import InputError, one_line_errors

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


def run_state(run_dir: Path) -> dict:
    """Where a run stands: ``final`` (its final metrics, None before it finished), ``newest`` (its newest
    checkpoint's step, None without one), ``total_steps`` (from its start record, None if unknown), ``finished``."""
    from common.logging import read_metrics
    from common.train_state import CheckpointManager
    from common.trainer import FINAL_METRICS_FILE

    final_file = run_dir / FINAL_METRICS_FILE
    final = json.loads(final_file.read_text()) if final_file.is_file() else None
    steps = CheckpointManager(run_dir / "checkpoints").steps()
    newest = steps[-1] if steps else None
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    total = next((r["total_steps"] for r in reversed(records) if "total_steps" in r), None)
    finished = final is not None and (newest is None or newest <= final["steps"])  # not resumed for longer since
    return {"final": final, "newest": newest, "total_steps": total, "finished": finished}


def choose_weights(run_dir: Path, weights: str, allow_unfinished: bool) -> dict:
    """What to export and why: ``{"weights", "source", "entry", "step", "finished", ...}``, or one-line refusal."""
    from vision.task import REPORTED_METRIC, REPORTED_WEIGHTS

    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir} is not a vision.train run (it has no config.yaml): pass the run's output_dir")
    chosen = REPORTED_WEIGHTS if weights == "reported" else weights
    state = run_state(run_dir)
    of_total = f" of {state['total_steps']}" if state["total_steps"] else ""
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
    where = (f"it is at step {state['newest']}{of_total}" + (f", resumed past its end at step {state['final']['steps']}"
                                                            if state["final"] else ""))
    if not allow_unfinished:
        raise InputError(f"{run_dir} is not finished ({where}; no final_metrics.json for it): finish it by rerunning "
                         f"vision.train with the same config, or export step {state['newest']} with "
                         "--allow-unfinished")
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
    from timm.models import push_to_hf_hub, save_for_hf

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
    if push_to_hub:
        push_to_hf_hub(model, push_to_hub, model_config=model_config, data_config=data_config,
                       safe_serialization=True)
    return choice


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
