"""One run of a topology comparison: its name (:class:`RunSpec`), training through the real trainer, evaluation,
diagnostics (:mod:`comparison.diagnose`), divergence, and ``result.json``; a finished run is never redone, an
unfinished one continues from its last checkpoint. ``python -m scripts.compare`` runs a grid of them and writes the
report (:mod:`comparison.report`)."""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import List, Optional, Sequence

from common.cli import InputError
from common.durable import atomic_write_text
from common.train_state import RunLock, RunLockedError
from comparison.report import DIAGNOSTICS_FILE

ROOT = Path(__file__).resolve().parents[1]
RESULT_FILE = "result.json"
SETTINGS_FILE = "compare_settings.json"
# Options that change what a run computes: a finished run made with other values must not be reused.
RUN_OPTIONS = ("task", "data", "image_size", "train_images", "val_images", "diag_images", "epochs", "steps",
               "fid_samples", "sample_steps", "ema_decay", "feature_weights", "log_every", "set", "diagnostics")
RUN_CONTROL_OVERRIDES = ("train.stop_at_step=", "train.resume=")  # how far a run goes now, not what it computes
CLAIMS_DIR = ".claims"  # OUT/runs/.claims/<run>/.lock: which process runs which run

DEFAULT_OBJECTIVE = "ddpm"  # the recipe's own objective; a study may define others (``objectives:``)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    topology: str
    depth: int
    lr: float
    seed: int
    objective: str = DEFAULT_OBJECTIVE

    @property
    def name(self) -> str:
        prefix = "" if self.objective == DEFAULT_OBJECTIVE else f"{self.objective}_"
        return f"{prefix}{self.topology}_d{self.depth}_lr{self.lr:g}_s{self.seed}"

    @property
    def setting(self) -> tuple:
        return self.depth, self.lr


# ----------------------------------------------------------------------------- divergence

def _num(v) -> float:
    return float(v)  # the logger writes non-finite numbers as "nan"/"inf" strings


def loss_curve(records: Sequence[dict]) -> List[tuple]:
    """``[(step, train loss)]`` of a metrics.jsonl, one point per logged step (the last record wins on a resume)."""
    points = {int(r["step"]): _num(r["train/loss"]) for r in records if "train/loss" in r}
    return sorted(points.items())


def detect_divergence(records: Sequence[dict], error: Optional[str] = None) -> dict:
    """Did a run diverge, and at which step?

    Diverged means: the trainer stopped on non-finite losses (``error``), or a step had a non-finite loss or
    gradient (``train/nonfinite_steps`` > 0 or a NaN/inf logged loss), or the last logged loss is above the
    first logged one. The step is the first logged step with a non-finite loss/skip, else the first step from
    which every logged loss stays above the first one.
    """
    curve = loss_curve(records)
    for r in records:
        bad_loss = "train/loss" in r and not math.isfinite(_num(r["train/loss"]))
        skipped = _num(r.get("train/nonfinite_steps", 0)) > 0
        if bad_loss or skipped:
            return {"diverged": True, "step": int(r["step"]), "reason": "non-finite loss" + (" (run stopped)" if error else "")}
    if error:
        return {"diverged": True, "step": curve[-1][0] if curve else 0, "reason": f"run stopped: {error.splitlines()[0]}"}
    if len(curve) >= 2 and curve[-1][1] > curve[0][1]:
        start = curve[0][1]
        step = curve[-1][0]
        for s, loss in reversed(curve[1:]):
            if loss <= start:
                break
            step = s
        return {"diverged": True, "step": step, "reason": f"loss ended above its start ({curve[-1][1]:.3g} > {start:.3g})"}
    return {"diverged": False, "step": None, "reason": ""}


# ----------------------------------------------------------------------------- one run per task

def _write_json(path: Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=1))


def _imagefolder_overrides(path: str, image_size: int) -> List[str]:
    root = Path(path)
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise InputError(f"--data {path}: expected an ImageFolder root with train/<class>/ and val/<class>/ "
                         "(or pass fashion_mnist)")
    classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
    return [f"data.path={path}", f"data.num_classes={len(classes)}", f"data.input_size={image_size}"]


class RunStopped(Exception):
    """A stop signal ended a run's training with a checkpoint: the comparison starts no further run."""

    def __init__(self, signal_name: str, run: str, step: int):
        super().__init__(f"{signal_name} received: {run} stopped at step {step} with a checkpoint")
        self.signal_name = signal_name


def run_trainer(train, cfg) -> tuple:
    """``(final_metrics, None)``, or ``(None, result)`` for a run that stopped on NaNs or at ``train.stop_at_step``
    (``{"stopped_at": step}``) or on a stop signal (``{"stopped_at": step, "signal": name}``)."""
    from common.logging import NonFiniteLossError

    try:
        final = train(cfg)
    except NonFiniteLossError as err:
        return None, {"error": str(err)}
    if "stopped_at" in final:
        return None, {k: final[k] for k in ("stopped_at", "signal") if k in final}
    return final, None


def deit_model_name(topology: str) -> str:
    """timm's own DeiT is the Pre-Norm baseline; the others are registered by ``vision``."""
    return "deit_tiny_patch16_224" if topology == "pre" else f"deit_tiny_{topology}_patch16_224"


def train_deit(spec: RunSpec, run_dir: Path, opts) -> dict:
    from common.config import load_config
    from vision.train import TrainConfig, train

    topology, variant_set = topology_settings(spec, opts)
    overrides = [f"model.name={deit_model_name(topology)}", f"model.kwargs.depth={spec.depth}",
                 f"optim.base_lr={spec.lr}", f"train.seed={spec.seed}", f"train.output_dir={run_dir}",
                 "train.tensorboard=false", f"train.threads={opts.threads}", f"optim.epochs={opts.epochs}",
                 f"train.log_every={opts.log_every}", "train.resume=auto", "train.eval_every=0"]
    overrides.append(f"data.max_train_samples={opts.train_images}" if opts.train_images else "data.max_train_samples=null")
    overrides.append(f"data.max_val_samples={opts.val_images}" if opts.val_images else "data.max_val_samples=null")
    if opts.data != "fashion_mnist":
        size = opts.image_size
        overrides += ["data.dataset=imagefolder", "data.mean=[0.485, 0.456, 0.406]", "data.std=[0.229, 0.224, 0.225]",
                      f"model.kwargs.patch_size={max(1, size // 4)}"] + _imagefolder_overrides(opts.data, size)
    recipe = ROOT / "configs" / (getattr(opts, "config", None) or "fmnist_deit.yaml")  # a study's own, e.g. DeiT III's
    cfg = load_config(TrainConfig, recipe, overrides + variant_set + list(opts.set))
    final, unfinished = run_trainer(train, cfg)
    if unfinished:
        return unfinished
    return {"top1": final["val/top1"], "val_loss": final["val/loss"], "params": final["params"],
            "steps": final["steps"], "peak_lr": cfg.optim.lr}


def diagnose_deit(run_dir: Path, opts) -> dict:
    from comparison.diagnose import diagnose_deit_run

    return diagnose_deit_run(run_dir, max_images=opts.diag_images, batch_size=min(250, opts.diag_images or 250))


def topology_settings(spec: RunSpec, opts) -> tuple:
    """``(topology, trainer overrides)`` of a run: a study's ``variants:`` entry names a topology with its options
    (``dar_dynamic: {topology: dar, set: [model.kwargs.dar_query=dynamic]}``); any other label is the topology."""
    variant = (getattr(opts, "variants", None) or {}).get(spec.topology)
    return (variant["topology"], list(variant.get("set", []))) if variant else (spec.topology, [])


def objective_settings(spec: RunSpec, opts) -> dict:
    """What a run's objective changes (a study's ``objectives:`` entry): its recipe, trainer overrides (``{encoder}``
    stands for ``--encoder-weights``), and its sampler and steps; the default objective changes nothing."""
    definition = dict((opts.objectives or {}).get(spec.objective) or {})
    definition["set"] = [o.replace("{encoder}", str(opts.encoder_weights)) for o in definition.get("set", [])]
    return definition


def train_dit(spec: RunSpec, run_dir: Path, opts) -> dict:
    from common.config import load_config
    from common.logging import read_metrics
    from diffusion.fid import sample_and_score
    from diffusion.train import TrainConfig, train

    if opts.data != "fashion_mnist":
        raise InputError("--task dit compares on Fashion-MNIST pixels only (its FID features are the "
                         "Fashion-MNIST classifier's); for latents use diffusion.train and diffusion.fid directly")
    objective = objective_settings(spec, opts)
    sampler, steps = objective.get("sampler"), objective.get("sample_steps", opts.sample_steps)
    topology, variant_set = topology_settings(spec, opts)
    overrides = [f"model.topology={topology}", f"model.kwargs.depth={spec.depth}", f"optim.lr={spec.lr}",
                 f"train.seed={spec.seed}", f"train.output_dir={run_dir}", "train.tensorboard=false",
                 f"train.threads={opts.threads}", f"optim.steps={opts.steps}", f"train.log_every={opts.log_every}",
                 "train.resume=auto", "train.sample_every=0", f"train.ema_decay={opts.ema_decay}"]
    if sampler:
        overrides.append(f"train.sampler={sampler}")
    if opts.fid_every:  # the distance at fixed steps, by the in-training FID with the run's own sampler
        overrides += [f"train.fid_every={opts.fid_every}", f"train.fid_samples={opts.fid_samples}",
                      f"train.fid_steps={steps}", "train.fid_reference=fashion-mnist:test",
                      "train.fid_feature_extractor=fmnist-cnn"]
        if opts.feature_weights:
            overrides.append(f"train.fid_extractor_weights={opts.feature_weights}")
    if opts.train_images:
        overrides.append(f"data.max_samples={opts.train_images}")
    recipe = ROOT / "configs" / objective.get("config", "fmnist_dit.yaml")
    cfg = load_config(TrainConfig, recipe, overrides + variant_set + objective["set"] + list(opts.set))
    final, unfinished = run_trainer(train, cfg)
    if unfinished:
        return unfinished
    scores = sample_and_score(run_dir / "ema.safetensors", run_dir / "fid_samples", num_samples=opts.fid_samples,
                              steps=steps, extractor_weights=opts.feature_weights,
                              extra_sample_args=["--sampler", sampler] if sampler else ())
    result = {"fid": scores["metrics"]["fid"], "params": final.get("params"),
              "steps": final.get("steps"), "peak_lr": spec.lr}
    if opts.fid_every:
        curve = {int(r["step"]): float(r["fid/fd"]) for r in read_metrics(run_dir) if "fid/fd" in r}
        result["fid_curve"] = sorted(curve.items())
    return result


def diagnose_dit(run_dir: Path, opts) -> dict:
    from comparison.diagnose import diagnose_dit_run

    return diagnose_dit_run(run_dir, max_images=opts.diag_images)


TASKS = {"deit": (train_deit, diagnose_deit), "dit": (train_dit, diagnose_dit)}


def check_run_settings(run_dir: Path, opts, spec: Optional[RunSpec] = None) -> dict:
    """The settings that define a run's result; an error if ``run_dir`` was made with others."""
    settings = {k: getattr(opts, k) for k in RUN_OPTIONS}
    settings["set"] = [o for o in opts.set if not o.startswith(RUN_CONTROL_OVERRIDES)]
    for key in ("fid_every", "config"):  # recorded only when used, so runs made before they existed still match
        if getattr(opts, key, None):
            settings[key] = getattr(opts, key)
    if spec is not None and spec.objective != DEFAULT_OBJECTIVE:
        settings["objective"] = {"name": spec.objective, **objective_settings(spec, opts)}
    if spec is not None and spec.topology in (getattr(opts, "variants", None) or {}):
        settings["variant"] = dict(opts.variants[spec.topology])
    refuse_other_settings(run_dir, settings, "use another --out, or delete that run directory to redo it")
    return settings


def refuse_other_settings(run_dir: Path, settings: dict, fix: str, name: str = SETTINGS_FILE) -> None:
    """An error naming each setting that differs, if ``run_dir/name`` records other ``settings`` than these (a
    finished or half-done run must not be continued or reused under others); ``fix`` says how to go on."""
    settings_file = run_dir / name
    if not settings_file.is_file():
        return
    before = json.loads(settings_file.read_text())
    changed = {k: (before.get(k), v) for k, v in json.loads(json.dumps(settings)).items() if before.get(k) != v}
    if changed:
        raise InputError(f"{run_dir} was made with other settings ("
                         + ", ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in changed.items()) + f"); {fix}")


def run_one(spec: RunSpec, runs_dir: Path, opts) -> Optional[dict]:
    """Train, evaluate and diagnose one run; ``None`` if it stopped early (``train.stop_at_step``) and must go on,
    or another process is running it. Raises :class:`RunStopped` when a stop signal ended its training."""
    run_dir = runs_dir / spec.name
    done = run_dir / RESULT_FILE
    settings = check_run_settings(run_dir, opts, spec)
    if done.is_file():
        return json.loads(done.read_text())
    # A claim held from training to result.json: several processes running one comparison share its runs.
    claim = RunLock(runs_dir / CLAIMS_DIR / spec.name)
    try:
        claim.acquire()
    except RunLockedError:
        print(f"{spec.name}: being run by another process; skipped here", flush=True)
        return None
    try:
        if done.is_file():  # finished by another process since the check above
            return json.loads(done.read_text())
        return _train_evaluate_diagnose(spec, run_dir, settings, opts)
    finally:
        claim.release()


def _train_evaluate_diagnose(spec: RunSpec, run_dir: Path, settings: dict, opts) -> Optional[dict]:
    from common.logging import read_metrics

    done = run_dir / RESULT_FILE
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json(run_dir / SETTINGS_FILE, settings)
    train_fn, diagnose_fn = TASKS[opts.task]
    print(f"\n=== {spec.name} ===", flush=True)
    start = time.perf_counter()
    outcome = train_fn(spec, run_dir, opts)
    if "signal" in outcome:
        raise RunStopped(outcome["signal"], spec.name, outcome["stopped_at"])
    if "stopped_at" in outcome:
        return None
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    result = {**dataclasses.asdict(spec), "name": spec.name, **outcome,
              "divergence": detect_divergence(records, outcome.get("error")),
              "loss_curve": loss_curve(records), "train_wall_s": round(time.perf_counter() - start, 1)}
    if "error" not in outcome and opts.diagnostics:
        diagnostics = diagnose_fn(run_dir, opts)
        _write_json(run_dir / DIAGNOSTICS_FILE, diagnostics)
    _write_json(done, result)  # last: its presence marks the run finished
    return result
