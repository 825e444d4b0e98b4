"""The paper's ImageNet table as one study (``python -m scripts.paper_imagenet``): the jobs of each model and topology
(a training, then its evaluation, or its 50,000 samples and their FID), what each waits for and costs, the checks
each training runs first, run here one after another or submitted to SLURM, and the report beside the paper's
numbers. ``scripts/paper_imagenet.py`` is the command line.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from common.cli import InputError
from common.durable import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
STUDY_FILE = ROOT / "configs" / "paper_imagenet.yaml"
SBATCH_SCRIPT = "scripts/cluster/train.sbatch"
TOPOLOGIES = ("pre", "siamese")
PAPER_FID = {"samples": 50000, "steps": 250}  # the FID-50K protocol of the paper's table
EXIT_CONTINUE = (3, 4)  # the trainers' paused / preempted: the same command continues the job


def read_study() -> dict:
    import yaml

    return yaml.safe_load(STUDY_FILE.read_text())


@dataclasses.dataclass
class Job:
    name: str
    module: str
    args: List[str]
    done: Path  # the file the job writes last: it is finished when this exists
    after: List[str] = dataclasses.field(default_factory=list)
    sbatch: List[str] = dataclasses.field(default_factory=list)  # resources other than train.sbatch's 8-GPU node
    gpu_hours: float = 0.0
    source: str = ""  # where the cost figure comes from
    config: object = None  # a training's loaded config (checked before anything is queued)

    @property
    def command(self) -> str:
        return shlex.join(["python", "-m", self.module, *self.args])


# ----------------------------------------------------------------------------- the jobs and their cost

def _recipe(model: str, topology: str, sets: Sequence[str]):
    """The training config a job runs: the shipped recipe with the user's overrides (for its length and batch)."""
    from common.config import load_config

    if model.startswith("deit"):
        from vision.train import TrainConfig
    else:
        from diffusion.train import TrainConfig
    return load_config(TrainConfig, ROOT / "configs" / f"{model}_{topology}.yaml", sets)


class Costs:
    """GPU-hours of a job from images/s per GPU: measured by ``benchmarks.gpu_check`` (``--gpu-check``) where it ran
    that model, else the FLOPs of configs/paper_imagenet.yaml at the assumed (or that run's measured) MFU."""

    def __init__(self, study: dict, gpu: str, gpu_check: Optional[Path]):
        from benchmarks.harness import PEAK_BF16

        if gpu not in PEAK_BF16:
            raise InputError(f"--gpu {gpu}: no peak known; choose one of {', '.join(PEAK_BF16)}")
        self.study, self.gpu, self.peak = study, gpu, PEAK_BF16[gpu]
        self.measured = json.loads(gpu_check.read_text()) if gpu_check else {}
        self.mfu, self.mfu_source = study["assumed_mfu"], f"assumed MFU {study['assumed_mfu']:g}"
        runs = [r for part in ("trainer", "trainer_pre") for r in (self.measured.get(part) or {}).values()
                if isinstance(r, dict) and r.get("mfu")]
        if runs:
            self.mfu = sum(r["mfu"] for r in runs) / len(runs)
            self.mfu_source = f"MFU {self.mfu:.2f} measured by gpu_check ({gpu_check})"

    def train(self, model: str, topology: str, images: float) -> tuple:
        label = self.study["gpu_check_runs"].get(model, "").format(topology=topology)
        part = self.measured.get("trainer" if topology == "siamese" else "trainer_pre") or {}
        rate = (part.get(label) or {}).get("images_per_s")
        if rate:
            return images / rate / 3600, f"{rate:.0f} img/s measured by gpu_check ({label})"
        return self._flops(images * self.study["models"][model]["train_gflop"], 1.0, "training FLOPs")

    def sample(self, model: str, images: int, steps: int) -> tuple:
        measured = self.measured.get("sampling") or {}
        if model == "dit_b2" and measured.get("images_per_s") and steps == measured.get("steps"):
            rate = measured["images_per_s"]
            return images / rate / 3600, f"{rate:.1f} img/s measured by gpu_check (sampling)"
        per_image = steps * self.study["models"][model]["forward_gflop"] + self.study["vae_decode_gflop"]
        return self._flops(images * per_image, 0.5, "sampling FLOPs, TF32")

    def forward(self, images: int, gflop: float, what: str) -> tuple:
        return self._flops(images * gflop, 0.5 if what == "Inception" else 1.0, f"{what} FLOPs")

    def _flops(self, gflop: float, peak_share: float, what: str) -> tuple:
        rate = self.mfu * self.peak * peak_share
        return gflop * 1e9 / rate / 3600, f"{what} at {self.mfu_source} of {self.gpu} ({rate / 1e12:.0f} TFLOP/s)"


def build_jobs(opts, study: dict, costs: Costs) -> List[Job]:
    """Per model: both trainings, then their evaluations (DeiT: vision.evaluate; DiT: diffusion.sample, diffusion.fid)."""
    jobs = []
    for model in opts.models:
        family = study["models"][model]["family"]
        trains = []
        for topology in TOPOLOGIES:
            run = opts.out / "runs" / f"{model}_{topology}"
            if family == "deit":
                sets = [f"data.path={opts.imagenet}", *opts.set_deit]
                cfg = _recipe(model, topology, [f"train.output_dir={run}", *sets])
                images = cfg.optim.epochs * study["imagenet_train_images"]
                module = "vision.train"
            else:
                sets = [f"data.path={opts.latents}", f"data.autoencoder={opts.vae}", *opts.set_dit]
                cfg = _recipe(model, topology, [f"train.output_dir={run}", *sets])
                images = cfg.optim.steps * cfg.optim.batch_size
                module = "diffusion.train"
            hours, source = costs.train(model, topology, images)
            trains.append(Job(f"train_{model}_{topology}", module,
                              ["--config", str(ROOT / "configs" / f"{model}_{topology}.yaml"), *sets,
                               f"train.output_dir={run}"], run / "final_metrics.json", gpu_hours=hours, source=source,
                              config=cfg))
        jobs += trains
        for topology, train in zip(TOPOLOGIES, trains):
            jobs += evaluation_jobs(model, topology, family, train, opts, study, costs)
    return jobs


def evaluation_jobs(model: str, topology: str, family: str, train: Job, opts, study: dict, costs: Costs) -> List[Job]:
    run = train.done.parent
    one_gpu = ["--ntasks-per-node=1", "--gpus-per-node=1"]
    if family == "deit":
        hours, source = costs.forward(study["imagenet_val_images"], study["models"][model]["forward_gflop"], "forward")
        return [Job(f"eval_{model}_{topology}", "vision.evaluate",
                    ["--config", str(run / "config.yaml"), f"checkpoint={run / 'model.safetensors'}",
                     f"output={run / 'top1.json'}"], run / "top1.json", [train.name], gpu_hours=hours, source=source)]
    samples = run / "fid_samples"
    hours, source = costs.sample(model, opts.fid_samples, opts.sample_steps)
    sample = Job(f"sample_{model}_{topology}", "diffusion.sample",
                 ["--checkpoint", str(run / "ema.safetensors"), "--num-samples", str(opts.fid_samples),
                  "--steps", str(opts.sample_steps), "--vae", str(opts.vae), "--out-dir", str(samples), "--quiet",
                  *(["--batch-size", str(opts.sample_batch_size)] if opts.sample_batch_size else [])],
                 samples / "samples.npz", [train.name], gpu_hours=hours, source=source)
    hours, source = costs.forward(opts.fid_samples, study["inception_gflop"], "Inception")
    fid = Job(f"fid_{model}_{topology}", "diffusion.fid",
              ["--samples", str(samples / "samples.npz"), "--reference", str(opts.adm_reference), "--num-samples",
               str(opts.fid_samples), "--extractor-weights", str(opts.inception), "--metrics", "fid", "--quiet",
               "--out", str(samples / "fid.json")], samples / "fid.json", [sample.name], one_gpu, hours, source)
    return [sample, fid]


# ----------------------------------------------------------------------------- what the jobs check first

INPUT_OPTIONS = {"vision.train": "data.path is --imagenet; other settings: --set-deit KEY=VALUE",
                 "diffusion.train": "data.path is --latents, data.autoencoder --vae; other settings: --set-dit KEY=VALUE"}


def check_first(module: str, cfg) -> str:
    """What a training job checks before its first step, by the trainers' own functions: the registries' names, and
    DeiT's image folders (class count, train and val alike), DiT's latents (image size, class count) and their VAE.
    Returns what was checked."""
    from common.config import check_ready, check_registered

    check_registered(cfg)
    check_ready(cfg)
    if module == "vision.train":
        from vision.data import build_splits

        train, _ = build_splits(cfg.data)
        return f"{cfg.data.path}: {len(train.classes)} classes in train and val"
    from diffusion.data import build_images
    from diffusion.task import build_decoder, latent_vae

    images = build_images(cfg.data)
    if cfg.data.autoencoder != "none":
        build_decoder(cfg, "cpu", latent_vae(images))
    return (f"{cfg.data.path}: {len(images)} latents of {cfg.data.image_size} px images, {cfg.data.num_classes} classes, "
            f"encoded by {cfg.data.autoencoder}")


def check_inputs(jobs: Sequence[Job]) -> None:
    """Each unfinished training's first checks, once per data setting, before anything is queued: input that every
    job of the study would meet only at its start (after hours in a queue) is refused here, naming the job."""
    checked = set()
    for job in jobs:
        if job.config is None or job.done.is_file():
            continue
        key = (job.module, repr(job.config.data))
        if key in checked:
            continue
        checked.add(key)
        try:
            print(f"checked {job.name}'s inputs as it will: {check_first(job.module, job.config)}", flush=True)
        except InputError as err:
            raise InputError(f"{job.name} would stop at its start: {err} ({INPUT_OPTIONS[job.module]})") from None


# ----------------------------------------------------------------------------- the plan and the study's state

def print_plan(jobs: Sequence[Job], launcher: str) -> None:
    total = sum(j.gpu_hours for j in jobs if not j.done.is_file())
    print(f"Plan ({launcher}): {len(jobs)} jobs, {sum(j.done.is_file() for j in jobs)} finished and kept; "
          f"{total:,.0f} GPU-hours left (GPU-hours = GPUs x hours; 8 GPUs take 1/8 of the wall time)\n")
    for job in jobs:
        state = "done" if job.done.is_file() else f"{job.gpu_hours:,.1f} GPU-h"
        print(f"  {job.name:<22} {state:>14}  after: {', '.join(job.after) or '-'}")
        print(f"      {job.command}")
    print("\nCost figures:")
    for source in dict.fromkeys(j.source for j in jobs):
        print(f"  - {source}")
    print(flush=True)


def check_state(jobs: Sequence[Job], out: Path) -> None:
    """A job started under other settings is not continued with these: its recorded command must be its command."""
    state = out / "plan.json"
    before = json.loads(state.read_text()) if state.is_file() else {}
    started = [j.name for j in jobs if j.name in before and before[j.name] != j.command and j.done.parent.exists()]
    if started:
        raise InputError(f"{out}: {', '.join(started)} started with another command (see {state}); use another --out, "
                         "or delete those jobs' folders to redo them")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(state, json.dumps({**before, **{j.name: j.command for j in jobs}}, indent=1))


# ----------------------------------------------------------------------------- launchers

def run_local(jobs: Sequence[Job]) -> int:
    """Each unfinished job in order, in a process of its own; 0 when all are finished, else the exit status that
    stopped the study (3 or 4: rerun to continue)."""
    import importlib

    for module in dict.fromkeys(j.module for j in jobs if not j.done.is_file()):
        importlib.import_module(module)  # once here: each job's process starts with it imported
    for job in jobs:
        if job.done.is_file():
            continue
        print(f"\n=== {job.name}: {job.command}", flush=True)
        status = fork_module(job.module, job.args)
        if status == 0 and not job.done.is_file():
            raise InputError(f"{job.name} exited 0 but did not write {job.done}")
        if status != 0:
            what = "stopped with a checkpoint" if status in EXIT_CONTINUE else "failed"
            print(f"\n{job.name} {what} (exit {status}); rerun the same command to continue", flush=True)
            return status
    return 0


def fork_module(module: str, args: Sequence[str]) -> int:
    """``python -m MODULE ARGS`` in a child process forked from this one; a SIGTERM or SIGINT to this process is
    passed on to the child (which checkpoints and exits 4), as a scheduler signals every process of a job."""
    import runpy

    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the job's own process
        code = 1
        try:
            for number in (signal.SIGTERM, signal.SIGINT):
                signal.signal(number, signal.SIG_DFL)
            sys.argv = [module, *args]
            sys.modules.pop(module, None)  # imported by the parent: run afresh as __main__, its imports kept
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)

    def forward(number, frame):
        os.kill(pid, number)

    previous = {n: signal.signal(n, forward) for n in (signal.SIGTERM, signal.SIGINT)}
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def sbatch_argv(job: Job, ids: Dict[str, str], out: Path) -> List[str]:
    needs = [ids[name] for name in job.after if name in ids]
    return ["sbatch", "--parsable", f"--job-name=paper-{job.name}", f"--output={out / 'logs'}/%x-%j.out",
            f"--export=ALL,MODULE={job.module}", *([f"--dependency=afterok:{':'.join(needs)}"] if needs else []),
            *job.sbatch, SBATCH_SCRIPT, *job.args]


def queued_jobs() -> set:
    """The ids of this user's jobs SLURM still holds (pending, running, requeued)."""
    proc = subprocess.run(["squeue", "--noheader", "--me", "--format=%i"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise InputError(f"squeue failed: {proc.stderr.strip() or proc.returncode}")
    return set(proc.stdout.split())


def run_slurm(jobs: Sequence[Job], out: Path, dry_run: bool) -> int:
    """Submit every unfinished job after the ones it needs; a job submitted earlier and still queued keeps its id."""
    if not dry_run and not shutil.which("sbatch"):
        raise InputError("sbatch is not on PATH: run this on a SLURM login node, or add --dry-run to print the "
                         "sbatch commands")
    submitted_file = out / "slurm_jobs.json"
    submitted = json.loads(submitted_file.read_text()) if submitted_file.is_file() else {}
    queued = queued_jobs() if submitted and not dry_run else set()
    ids: Dict[str, str] = {}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for job in jobs:
        if job.done.is_file():
            continue
        if submitted.get(job.name) in queued:
            ids[job.name] = submitted[job.name]
            print(f"{job.name}: queued as SLURM job {ids[job.name]} (submitted before)")
            continue
        argv = sbatch_argv(job, ids, out)
        if dry_run:
            ids[job.name] = f"${job.name}"
            print(" ".join(a if "$" in a else shlex.quote(a) for a in argv))  # $name: that job's id
            continue
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise InputError(f"sbatch refused {job.name}: {proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}")
        ids[job.name] = submitted[job.name] = proc.stdout.strip().split(";")[0]
        atomic_write_text(submitted_file, json.dumps(submitted, indent=1))
        print(f"{job.name}: submitted as SLURM job {ids[job.name]}", flush=True)
    return 0


# ----------------------------------------------------------------------------- the report

def run_result(model: str, topology: str, family: str, run: Path) -> Optional[dict]:
    """A finished pair of jobs as scripts.compare records a run (``comparison.report`` reads it), else None."""
    import yaml

    from common.logging import read_metrics
    from comparison.runs import detect_divergence, loss_curve
    from comparison.report import METRIC

    metric_file = run / ("top1.json" if family == "deit" else "fid_samples/fid.json")
    if not metric_file.is_file():
        return None
    scored = json.loads(metric_file.read_text())
    value = scored["top1"] if family == "deit" else scored["metrics"]["fid"]
    final = json.loads((run / "final_metrics.json").read_text())
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    records = read_metrics(run)
    from safetensors import safe_open

    with safe_open(str(run / "model.safetensors"), "pt") as weights:
        depth = 1 + max(int(k.split(".")[1]) for k in weights.keys() if k.startswith("blocks."))
    return {"topology": topology, "depth": depth, "lr": cfg["optim"].get("lr") or cfg["optim"].get("base_lr"),
            "seed": cfg["train"]["seed"], "name": f"{model}_{topology}", METRIC[f"imagenet_{family}"][0]: value,
            "steps": final.get("steps"), "params": final.get("params"), "divergence": detect_divergence(records),
            "loss_curve": loss_curve(records)}


def write_paper_report(opts, study: dict, jobs: Sequence[Job], command: str) -> Path:
    """``OUT/report.md``: ours beside the paper's per model, and a ``scripts.compare`` report per model."""
    from comparison.report import METRIC, write_report

    lines = ["# The paper's ImageNet table", "", "Regenerate (finished jobs under the same --out are kept):", "",
             f"    {command}", "",
             "| model | metric | Pre-Norm | SiameseNorm | Siamese - Pre | paper: Pre-Norm | paper: SiameseNorm | "
             "paper: Siamese - Pre |", "|---|---|---|---|---|---|---|---|"]
    for model in opts.models:
        family, paper = study["models"][model]["family"], study["models"][model]["paper"]
        key, label, _ = METRIC[f"imagenet_{family}"]
        results = [r for t in TOPOLOGIES if (r := run_result(model, t, family, opts.out / "runs" / f"{model}_{t}"))]
        ours = {r["topology"]: r[key] for r in results}
        write_report(results, opts.out / "runs", opts.out / model, f"imagenet_{family}",
                     pending=[f"{model}_{t}" for t in TOPOLOGIES if t not in ours], command=command)
        cells = [f"{ours[t]:.2f}" if t in ours else "--" for t in TOPOLOGIES]
        gap = f"{ours['siamese'] - ours['pre']:+.2f}" if len(ours) == 2 else "--"
        lines.append(f"| [{model}]({model}/report.md) | {label} | {cells[0]} | {cells[1]} | {gap} | {paper['pre']} | "
                     f"{paper['siamese']} | {paper['siamese'] - paper['pre']:+.2f} |")
    pending = [j.name for j in jobs if not j.done.is_file()]
    lines += ["", f"One seed each, as the paper reports. {len(jobs) - len(pending)} of {len(jobs)} jobs finished"
              + (f"; unfinished: {', '.join(pending)}." if pending else ".")]
    if (opts.fid_samples, opts.sample_steps) != (PAPER_FID["samples"], PAPER_FID["steps"]):
        lines.append(f"\n**Not the paper's protocol**: FID of {opts.fid_samples} samples of {opts.sample_steps} "
                     f"steps (the paper: {PAPER_FID['samples']} of {PAPER_FID['steps']}).")
    if opts.set_deit or opts.set_dit:
        lines.append("\n**Not the shipped recipes**: trained with overrides " + " ".join(opts.set_deit + opts.set_dit))
    path = opts.out / "report.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
