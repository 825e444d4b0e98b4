"""`make gpu-check`: the GPU figures in one command, printed and written as JSON part by part.

    make gpu-check                                       # python -m benchmarks.gpu_check --out runs/gpu_check.json
    python3 -m benchmarks.gpu_check --budget-s 300 --out OUT.json  # what fits in 5 minutes, the rest named as skipped
    python3 -m benchmarks.gpu_check --only data_feed sampling      # some parts
    python3 -m benchmarks.gpu_check --only peers --peers .peers    # ours beside the peers' scripts, on the GPU

It runs from a checkout without installing it (``PYTHONPATH=.``, ``python3 -m benchmarks.gpu_check``), on torch 2.6
or later. It is one file of independent parts, a function each (over 500 lines for that reason: one script is the
one thing to carry to a bare GPU machine). The parts, in the order they run (the most telling first):

1. ``trainer``: the real trainers as a CUDA user runs them by default (``Trainer``: accelerate, bf16 autocast,
   ``torch.compile``, fused AdamW, EMA, the device prefetcher) on generated data: DiT-B/2 at batch 256 and DeiT-S
   at batch 256, SiameseNorm (Pre-Norm: ``trainer_pre``, the last part); ``train/images_per_s`` read from
   their ``metrics.jsonl`` (the windows after the first, which compiles), and MFU: that rate times the training FLOPs
   of one image (forward and backward, counted by ``torch.utils.flop_counter`` on the model) over the GPU's dense
   bf16 peak (:data:`PEAK_BF16`);
2. ``step_time``: forward, backward and the trainer's fused AdamW, Pre-Norm vs SiameseNorm, each variant built,
   timed and freed alone (so its peak memory is its own): time, peak memory, activation memory and their ratios;
   DeiT-S/224 at batch 128, DiT-B/2 (32x32x4 latents) at batch 64; eager (``--compiled-step-time``: also
   compiled, when the budget allows, and the compile's break-even in steps: its warm-up's extra seconds over each
   step's saving, what ``train.compile=auto``'s bar is checked against);
3. ``host_syncs``: per training step of both trainers (eager, the recipes' own settings), the device values the
   host reads from project code and the synchronisations CUDA's sync-debug mode reports; logging steps (which
   read on purpose) and the first ``--sync-warmup`` steps (one-time copies of constants, compilation) are left
   out and listed apart;
4. ``data_feed``: the DeiT feed with the recipe's workers (``configs/deit_recipe.yaml``: auto), images/s in
   steady state: the batches the workers had ready before the clock starts are taken first (workers x prefetch
   x 2), then enough batches are timed to empty that head start many times over;
5. ``sampling``: what ``diffusion.sample`` runs (fp32 with TF32 matmuls, no autocast): DiT-B/2 images/s with 250
   DDPM steps through an SD-VAE-sized decoder (random weights: the same compute), and the FID-50K time that implies
   (sampling plus Inception features). Needs diffusers and torch-fidelity;
6. ``trainer_pre``: part 1 with Pre-Norm;
7. ``peers``: ``benchmarks.vs_peers``' rows on the GPU, ours beside each peer's own script (DiT's ``sample.py``,
   timm's ``validate.py`` and ``train.py``, fast-DiT's ``train.py``, torch-fidelity) with the same model, data and
   batch, bf16 autocast for training and evaluation on both sides (sampling and FID in fp32, the peers having no
   bf16 path): DeiT-S and DiT-B/2 at batch 128, ``--peer-rounds`` alternating rounds; the peers' checkouts are read
   from ``--peers`` (a row whose checkout is missing is left out and named).

``--budget-s`` is a promise, counted from the command's start (imports included): a part (or a trainer run, or the
compiled step times) whose expected duration does not fit in what is left is skipped; the expectation is the piece's
measured duration once it has run, before that an H200 guess scaled by how far the parts measured so far overran
their guesses. A part still running when the budget (less 5%, at least 5 s, for writing the results and exiting) is
up is stopped there (SIGALRM). Every part is named in ``parts`` with its status (done, skipped, stopped, failed) and
reason; the JSON file is written after every part, so a part killed by an outer time limit leaves the others. A
failing part is recorded with its error and the others still run.

It stops with a clear message on a machine without a CUDA GPU (``--allow-cpu --tiny`` runs the same code on tiny
models on a CPU; the tests use that).
"""
from __future__ import annotations

import time

STARTED = time.perf_counter()  # a budget counts from here: the imports are part of the wait

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from benchmarks.harness import PEAK_BF16, time_call  # noqa: E402
from common.distributed import cuda_available  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("trainer", "step_time", "host_syncs", "data_feed", "sampling", "trainer_pre", "peers")
# Seconds each piece takes on an H200 (measured runs round up); --tiny divides them by TINY_SPEEDUP.
ESTIMATE_S = {"trainer run": 90, "step_time eager": 40, "step_time compiled": 240, "host_syncs": 45,
              "data_feed": 30, "sampling": 45, "peers": 480}
TINY_SPEEDUP = 4


def log(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


class BudgetSpent(BaseException):
    """The budget's time is up (raised in the main thread by SIGALRM): the part running stops there. A
    BaseException, so that no ``except Exception`` inside a part takes it for the part's own failure."""


class Plan:
    """The time budget. ``fits(piece)`` says whether a piece's expected duration fits in what is left: the longest
    measured duration of that piece once one has run (:meth:`record`), before that the H200 guess in
    :data:`ESTIMATE_S` scaled by how far the measured pieces overran (or underran) their own guesses. Inside
    :meth:`deadline` a part still running when the budget (less a reserve for writing the results) is up is stopped
    by :class:`BudgetSpent`, so no guess can overrun the budget."""

    RESERVE = 0.05  # of the budget, at least RESERVE_MIN_S and at most RESERVE_MAX_S: writing the results after a
    RESERVE_MIN_S, RESERVE_MAX_S = 5.0, 30.0  # stop and the interpreter's exit (compile workers, CUDA) take seconds

    def __init__(self, budget_s: float | None, tiny: bool, clock: Callable[[], float] = time.perf_counter,
                 start: Optional[float] = None):
        self.clock, self.budget_s, self.scale = clock, budget_s, 1 / TINY_SPEEDUP if tiny else 1.0
        self.start = clock() if start is None else start
        self.measured: Dict[str, List[float]] = {}
        self.in_part, self.spent = False, False

    def left(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - (self.clock() - self.start)

    def record(self, piece: str, seconds: float) -> None:
        """A piece's measured duration (a stopped piece's is a lower bound: it counts as it stands)."""
        self.measured.setdefault(piece, []).append(seconds)

    def guess(self, piece: str) -> float:
        return ESTIMATE_S[piece] * self.scale

    def overrun(self) -> float:
        """Measured over guessed seconds, summed over the pieces that ran (1 before any has)."""
        guessed = sum(self.guess(piece) * len(times) for piece, times in self.measured.items())
        return sum(sum(times) for times in self.measured.values()) / guessed if guessed else 1.0

    def estimate(self, piece: str, count: int = 1) -> float:
        if piece in self.measured:
            return max(self.measured[piece]) * count
        return self.guess(piece) * self.overrun() * count

    def fits(self, piece: str, count: int = 1) -> bool:
        return not self.spent and self.estimate(piece, count) <= self.left()

    def reason(self, piece: str) -> str:
        if self.spent:
            return "budget: spent (a part was stopped at the budget)"
        how = "measured" if piece in self.measured else "estimated"
        return f"budget: needs about {self.estimate(piece):.0f} s ({how}), {max(self.left(), 0):.0f} s left"

    def stop_after_s(self) -> float:
        """Seconds from now until a running part is stopped: the budget less the reserve for writing the results."""
        reserve = min(max(self.RESERVE * self.budget_s, self.RESERVE_MIN_S), self.RESERVE_MAX_S)
        return max(self.left() - reserve, 1e-3)

    @contextlib.contextmanager
    def deadline(self, give_up: Optional[Callable[[], None]] = None):
        """Stop the part running (:class:`BudgetSpent`) when the budget less the reserve is up; between parts only
        mark it spent. Python runs the signal's handler between bytecodes, so a part inside one long call (a
        convolution on an overloaded CPU has taken minutes) would not stop: halfway through the reserve a watchdog
        thread calls ``give_up`` instead, which records that and ends the process."""
        if self.budget_s is None or not hasattr(signal, "setitimer"):
            yield
            return

        def alarm(signum, frame):
            self.spent = True
            if self.in_part:
                signal.setitimer(signal.ITIMER_REAL, 1.0)  # again in a second, should the part swallow this one
                raise BudgetSpent()

        def still_inside_a_part():
            if self.in_part and give_up is not None:
                give_up()

        stop_after = self.stop_after_s()
        watchdog = threading.Timer(stop_after + (self.left() - stop_after) / 2, still_inside_a_part)
        watchdog.daemon = True
        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, stop_after)
        watchdog.start()
        try:
            yield
        finally:
            watchdog.cancel()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    @contextlib.contextmanager
    def part(self):
        """A part runs: the deadline may stop it."""
        self.in_part = True
        try:
            if self.spent:
                raise BudgetSpent()
            yield
        finally:
            self.in_part = False


# ------------------------------------------------------------------------------------------- inputs
def image_folder(workdir: Path, tiny: bool) -> Path:
    """An ImageNet-layout folder (train/ and val/, two classes) of ImageNet-sized JPEGs, written once per check:
    2048 training images (8 steps of DeiT at batch 256, with repeated augmentation)."""
    from benchmarks.synthetic import write_jpegs

    root = workdir / "images"
    if not (root / "train").exists():
        write_jpegs(root, 64 if tiny else 2048)  # root/train/class0, class1
        write_jpegs(root, 8, seed=1, split="val")
    return root


def latent_folder(workdir: Path, tiny: bool) -> Path:
    """DiT latents (4x32x32 moments), written once per check: 1024 (4 steps of DiT at batch 256)."""
    from benchmarks.synthetic import write_latents

    root = workdir / "latents"
    if not root.exists():
        write_latents(root, 64 if tiny else 1024, shard_size=64 if tiny else 1024)
    return root


# ---------------------------------------------------------------------------------------- 1. trainer
def training_flops_per_image(model: torch.nn.Module, inputs: tuple) -> float:
    """FLOPs of one forward and backward per image (matmuls, convolutions, attention: torch's flop counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = model(*inputs)
        out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / len(inputs[0])


def trainer_runs(workdir: Path, tiny: bool, plan: Plan, out: dict, save: Callable[[], None],
                 topology: str = "siamese") -> dict:
    """The real trainers, compiled, bf16 on CUDA; each run's images/s from its metrics.jsonl and its MFU."""
    from common.config import load_config
    from common.trainer import Trainer

    runs = [("DiT-B/2", topology), ("DeiT-S", topology)]
    batch, windows, every = (8, 3, 2) if tiny else (256, 4, 5)
    steps = windows * every
    for family, topology in runs:
        label = f"{family} {topology} b{batch}"
        if not plan.fits("trainer run"):
            out[label] = {"skipped": plan.reason("trainer run")}
            continue
        log(f"trainer: {label}, {steps} steps, compiled")
        started = plan.clock()
        run_dir = workdir / "trainer" / label.replace("/", "").replace(" ", "_")
        common = [f"optim.batch_size={batch}", f"train.log_every={every}", f"train.stop_at_step={steps}",
                  f"train.ckpt_every={10 ** 9}", "train.compile=true", "train.tensorboard=false",
                  f"train.output_dir={run_dir}"] + (["train.precision=fp32"] if not torch.cuda.is_available() else [])
        if family == "DiT-B/2":
            from diffusion.task import DiTTask as task_cls
            from diffusion.train import TrainConfig as schema

            recipe, data = "dit_b2_" + topology, [f"data.path={latent_folder(workdir, tiny)}",
                                                  "data.autoencoder=none", "train.sample_every=0", "optim.steps=100000"]
            data += ["model.kwargs={hidden_size: 48, depth: 2, num_heads: 3}", "data.num_workers=1"] if tiny else []
        else:
            from vision.task import DeiTTask as task_cls
            from vision.train import TrainConfig as schema

            recipe = "deit_small_" + topology
            data = [f"data.path={image_folder(workdir, tiny)}",
                    "data.num_classes=2", "train.eval_every=0", "optim.epochs=1000"]
            data += ["model.kwargs={embed_dim: 48, depth: 2, num_heads: 3, patch_size: 8}", "data.input_size=32",
                     "data.num_workers=1"] if tiny else []
        torch._dynamo.reset()
        cfg = load_config(schema, ROOT / "configs" / f"{recipe}.yaml", [*common, *data])
        trainer = Trainer(cfg, task_cls(cfg))
        trainer.fit()
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        windows_seen = [r for r in records if "train/images_per_s" in r]
        steady = windows_seen[1:] or windows_seen
        rate = statistics.median(r["train/images_per_s"] for r in steady)
        model, device = trainer.model, trainer.accelerator.device
        if family == "DiT-B/2":
            n = model.input_size
            inputs = (torch.randn(2, model.in_channels, n, n, device=device),
                      torch.randint(0, 1000, (2,), device=device), torch.randint(0, model.num_classes, (2,), device=device))
        else:
            inputs = (torch.randn(2, 3, cfg.data.input_size, cfg.data.input_size, device=device),)
        flops = training_flops_per_image(model, inputs)
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
        out[label] = {"images_per_s": rate, "windows": [r["train/images_per_s"] for r in windows_seen],
                      "data_wait": statistics.median(r["train/data_wait"] for r in steady),
                      "train_flops_per_image": flops, "peak_bf16_flops": peak,
                      "mfu": rate * flops / peak if peak else None, "steps": steps, "log_every": every,
                      "seconds": plan.clock() - started}
        plan.record("trainer run", out[label]["seconds"])
        del trainer, model
        _free()
        save()
    return out


def _free():
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------- 2. step time
def trainer_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The trainer's fused AdamW (with DeiT's weight decay; the batch size plays no part in it)."""
    from common.trainer import OptimConfig, build_optimizer

    return build_optimizer(model, OptimConfig(batch_size=1, weight_decay=0.05), lr=1e-4)


def step_times(device, tiny: bool, plan: Plan, out: dict, save: Callable[[], None], compiled_too: bool) -> dict:
    import timm

    import vision  # noqa: F401  (registers the DeiT topologies)
    from diffusion.models import DiT_models
    from benchmarks.step import deit_loss, dit_loss, time_train_steps
    from benchmarks.synthetic import deit_batch, dit_batch

    deit_kw = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3) if tiny else {}
    dit_kw = dict(hidden_size=48, depth=2, num_heads=3) if tiny else {}
    size = 8 if tiny else 32
    cases = {
        "DeiT-S/224 b128": ({t: (lambda t=t: timm.create_model(f"deit_small_{t}_patch16_224" if t != "pre" else
                                                              "deit_small_patch16_224", **deit_kw))
                             for t in ("pre", "siamese")},
                            lambda: deit_batch(4, 32, 1000) if tiny else deit_batch(128, 224, 1000), deit_loss),
        "DiT-B/2 b64": ({t: (lambda t=t: DiT_models["DiT-B/2"](input_size=size, topology=t, **dit_kw))
                         for t in ("pre", "siamese")}, lambda: dit_batch(2 if tiny else 64, size, 4, 1000), dit_loss),
    }
    modes = [False] + ([True] if compiled_too else [])
    dtype = torch.bfloat16 if device.type == "cuda" else None
    for compiled in modes:
        mode, started = "compiled" if compiled else "eager", plan.clock()
        if compiled and not plan.fits("step_time compiled"):  # planned after the eager cases ran
            out["compiled"] = {"skipped": plan.reason("step_time compiled")}
            break
        for label, (builders, make_batch, loss_fn) in cases.items():
            log(f"step time: {label}, {mode}, each variant alone")
            torch._dynamo.reset()
            r = time_train_steps(builders, make_batch, loss_fn, steps=3 if tiny else 15, warmup=1 if tiny else 3,
                                 device=device, dtype=dtype, compile=compiled, log=log,
                                 make_optimizer=trainer_optimizer, sequential=True)
            out[f"{label} {mode}"] = {
                **r, "siamese/pre time": r["siamese"]["median_ms"] / r["pre"]["median_ms"],
                "siamese/pre peak memory": r["siamese"]["peak_mem_mb"] / r["pre"]["peak_mem_mb"],
                "siamese/pre activations": r["siamese"]["activation_mb"] / r["pre"]["activation_mb"]}
            save()
        plan.record(f"step_time {mode}", plan.clock() - started)
    for label in cases:
        if f"{label} compiled" in out:
            out[f"{label} compile break-even steps"] = compile_break_even(out[f"{label} eager"],
                                                                          out[f"{label} compiled"])
    out["precision"] = "bf16 autocast" if dtype else "fp32 (CPU)"
    out["optimizer"] = "the trainer's fused AdamW (common.trainer.build_optimizer)"
    return out


def compile_break_even(eager: dict, compiled: dict) -> dict:
    """Per variant, the steps after which the compiled step has repaid its compiling: the compiled warm-up's extra
    seconds over the eager one's, divided by what each timed step saves (inf where it saves nothing)."""
    out = {}
    for name in eager:
        if isinstance(eager[name], dict) and "warmup_s" in eager[name]:
            saving = (eager[name]["median_ms"] - compiled[name]["median_ms"]) / 1e3
            extra = compiled[name]["warmup_s"] - eager[name]["warmup_s"]
            out[name] = max(extra, 0.0) / saving if saving > 0 else math.inf
    return out


# ------------------------------------------------------------------------------------ 3. host syncs
def host_syncs(workdir: Path, tiny: bool, warmup: int) -> dict:
    """Both trainers for a few steps on generated data, their reads counted step by step."""
    from common.config import load_config
    from common.instrument import count_step_syncs
    from common.trainer import Trainer
    from diffusion.task import DiTTask
    from diffusion.train import TrainConfig as DiTConfig
    from vision.task import DeiTTask
    from vision.train import TrainConfig as DeiTConfig

    size, every, steps = (32, 4, 12) if tiny else (224, 5, 15)
    runs = {
        "vision.train (deit_small_siamese recipe)": (DeiTConfig, DeiTTask, "deit_small_siamese.yaml", [
            f"data.path={image_folder(workdir, tiny)}", "data.num_classes=2", f"data.input_size={size}",
            "optim.batch_size=16", "optim.epochs=1000", f"train.stop_at_step={steps}", "train.eval_every=0"]
            + (["model.kwargs={embed_dim: 48, depth: 2, num_heads: 3, patch_size: 8}", "data.num_workers=1"]
               if tiny else [])),
        "diffusion.train (dit_b2_siamese recipe)": (DiTConfig, DiTTask, "dit_b2_siamese.yaml", [
            f"data.path={latent_folder(workdir, tiny)}", "data.autoencoder=none", "train.sample_every=0",
            "optim.batch_size=16", f"optim.steps={steps}"]
            + (["model.kwargs={hidden_size: 48, depth: 2, num_heads: 3}", "data.num_workers=1"] if tiny else [])),
    }
    out = {}
    for label, (schema, task_cls, recipe, overrides) in runs.items():
        cfg = load_config(schema, ROOT / "configs" / recipe,
                          [*overrides, f"train.log_every={every}", "train.compile=false", f"train.ckpt_every={10 ** 9}",
                           "train.tensorboard=false", f"train.output_dir={workdir / 'syncs' / recipe}"])
        log(f"host syncs: {label}, {steps} steps")
        with count_step_syncs(Trainer) as steps_seen:
            Trainer(cfg, task_cls(cfg)).fit()
        counted = {s: r for s, r in steps_seen.items() if s > warmup and not r.logging}
        left_out = {s: r for s, r in steps_seen.items() if s <= warmup or r.logging}
        out[label] = {
            "counted steps": sorted(counted),
            "project host reads per step": {s: len(r.project_reads) for s, r in counted.items()},
            "cuda syncs per step": {s: len(r.cuda_syncs) for s, r in counted.items()},
            "max project host reads per step": max((len(r.project_reads) for r in counted.values()), default=0),
            "max cuda syncs per step": max((len(r.cuda_syncs) for r in counted.values()), default=0),
            "where": sorted({x for r in counted.values() for x in r.project_reads + r.cuda_syncs}),
            "left out (warm-up and logging steps)": {
                s: {"logging": r.logging, "project reads": len(r.project_reads), "cuda syncs": len(r.cuda_syncs),
                    "where": sorted(set(r.project_reads + r.cuda_syncs))} for s, r in left_out.items()},
        }
    out["how"] = (f"steps 1..{warmup} (one-time copies of constants, compilation) and logging steps (every "
                  f"{every}th, which read their window on purpose) are left out; the rest are counted one by one")
    return out


# ------------------------------------------------------------------------------------- 4. data feed
def data_feed(workdir: Path, device, tiny: bool) -> dict:
    """Images/s the DeiT feed delivers to the device in steady state with the recipe's workers (no model)."""
    from common.config import load_config
    from common.data import ResumableSampler, resolve_num_workers
    from common.distributed import build_accelerator
    from common.trainer import task_feed
    from vision.task import DeiTTask, TrainConfig

    folder = image_folder(workdir, tiny)
    sizes = ["data.input_size=32", "data.num_workers=2"] if tiny else []
    cfg = load_config(TrainConfig, ROOT / "configs" / "deit_small_siamese.yaml",
                      [f"data.path={folder}", "data.num_classes=2", *sizes])
    data = cfg.data
    task = DeiTTask(cfg)
    task.setup(build_accelerator("bf16" if torch.cuda.is_available() else "fp32", None, tensorboard=False))
    batch = 8 if tiny else 128
    workers, prefetch = resolve_num_workers(data.num_workers), 2  # the DataLoader's default prefetch factor
    head_start = max(2 * workers * prefetch, 2)  # batches the workers may hold ready when the clock starts, twice
    timed = 4 if tiny else max(100, 5 * workers * prefetch)
    needed = (head_start + timed + 1) * batch  # one epoch, so no epoch boundary drains the workers mid-measurement
    repeats = max(cfg.augment.repeated_aug, math.ceil(needed / len(task.train_set)))  # each repeat a new draw
    sampler = ResumableSampler(len(task.train_set), seed=0, repeats=repeats, epoch_samples=needed)
    batches = iter(task_feed(task, sampler, batch, data.num_workers, device))
    for _ in range(head_start):
        next(batches)
    elapsed = time_call(lambda: [next(batches) for _ in range(timed)], device).seconds
    return {"workers": workers, "prefetch_factor": prefetch, "batch": batch, "input_size": data.input_size,
            "taken before the clock": head_start, "timed batches": timed, "images_per_s": timed * batch / elapsed}


# -------------------------------------------------------------------------------------- 5. sampling
SD_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
              layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, sample_size=256, scaling_factor=0.18215)


def sampling(workdir: Path, device, tiny: bool) -> dict:
    """DiT-B/2 + an SD-VAE-sized decoder (random weights) through diffusion.sample's Sampler, fp32 as it runs."""
    from diffusers import AutoencoderKL

    from common.distributed import use_fast_cuda_kernels
    from diffusion.models import DiT_models
    from diffusion.spec import DiTSpec
    from diffusion.sampling.decoder import Decoder
    from diffusion.sampling.sampler import Sampler

    use_fast_cuda_kernels()  # what diffusion.sample's main sets
    vae_dir = workdir / "vae"
    vae_kw = dict(SD_VAE, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=8) if tiny else SD_VAE
    AutoencoderKL(**vae_kw).save_pretrained(vae_dir)
    size = 8 if tiny else 32
    model = DiT_models["DiT-B/2"](input_size=size, **(dict(hidden_size=48, depth=2, num_heads=3) if tiny else {}))
    spec = DiTSpec.published("DiT-B/2", input_size=size, autoencoder=str(vae_dir))
    steps, measured_steps, batch = 250, 5 if tiny else 25, 4 if tiny else 125
    sampler = Sampler(model.to(device).eval(), spec, Decoder(str(vae_dir), device),
                      spec.diffusion(sampling_steps=steps), device=str(device))
    # A shortened chain (measured_steps of the 250) and the decode timed apart; the chain scaled to 250.
    sampler.objective = spec.diffusion(sampling_steps=measured_steps).to(device)
    indices, labels = torch.arange(batch), torch.arange(batch) % 1000
    sampler(indices, labels)  # warm-up
    short_s = time_call(lambda: sampler(indices, labels), device).seconds
    latents = torch.randn(batch, 4, size, size, device=device)
    decode_s = time_call(lambda: sampler.decoder(latents), device).seconds
    chain_s = (short_s - decode_s) * steps / measured_steps
    per_image = (chain_s + decode_s) / batch
    inception_per_image = inception_seconds_per_image(workdir, device, tiny)
    return {"model": "DiT-B/2 (random weights), cfg 1, fp32 (TF32 matmuls), as diffusion.sample runs",
            "batch": batch, "steps": steps, "images_per_s": 1.0 / per_image,
            "decode_share": decode_s / (chain_s + decode_s), "inception_images_per_s": 1.0 / inception_per_image,
            "fid50k_minutes_one_gpu": 50_000 * (per_image + inception_per_image) / 60}


def inception_seconds_per_image(workdir: Path, device, tiny: bool) -> float:
    import torchvision

    from diffusion.evaluation.features import build_feature_extractor

    path = workdir / "inception.pth"
    model = torchvision.models.inception_v3(weights=None, aux_logits=False, num_classes=1008, init_weights=False)
    torch.save(model.state_dict(), path)
    extractor = build_feature_extractor("inception-v3-compat", ["2048"], path, device)
    images = torch.randint(0, 256, (8 if tiny else 100, 3, 64 if tiny else 256, 64 if tiny else 256),
                           dtype=torch.uint8, device=device)
    extractor(images)
    return time_call(lambda: extractor(images), device).seconds / len(images)


# ----------------------------------------------------------------------------------------- 7. peers
PEER_CHECKOUTS = {"dit_repo": "DiT", "timm_repo": "pytorch-image-models", "fast_dit_repo": "fast-DiT"}
# benchmarks.vs_peers' sizes: on a GPU DeiT-S (timm's deit_tiny at DeiT-S's width, depth and heads) and DiT-B/2,
# batch 128; --tiny: the smallest that runs every row on a CPU
PEER_SIZES = {False: ["--width", "384", "--depth", "12", "--heads", "6", "--batch-size", "128", "--workers", "6",
                      "--threads", "4", "--images", "1024", "--train-steps", "20", "--train-epochs", "3",
                      "--dit-model", "DiT-B/2", "--steps", "50", "--fid-count", "1000"],
              True: ["--width", "32", "--depth", "1", "--heads", "2", "--batch-size", "4", "--workers", "1",
                     "--threads", "1", "--images", "8", "--train-steps", "4", "--train-warmup", "1",
                     "--dit-model", "DiT-S/8", "--steps", "2", "--fid-count", "8"]}


def peers(workdir: Path, device, tiny: bool, peers_dir: Path, rounds: int) -> dict:
    """The side-by-side rows of ``benchmarks.vs_peers`` on this device (bf16 training and evaluation on CUDA, where
    both sides have it): every row whose peer checkout is in ``peers_dir`` (``DiT/``, ``fast-DiT/``,
    ``pytorch-image-models/``), and FID (torch-fidelity, a pip package). A row whose command fails is recorded
    with its error, and the others still run."""
    from benchmarks import vs_peers

    found = {option: peers_dir / name for option, name in PEER_CHECKOUTS.items()
             if (peers_dir / name / vs_peers.PEER_FILES[option]).is_file()}
    rows = [row for row in vs_peers.ROWS if vs_peers.NEEDS.get(row) in (None, *found)]
    argv = ["--rows", ",".join(rows), "--device", device.type, "--rounds", str(rounds), "--workdir",
            str(workdir / "peers"), *PEER_SIZES[tiny]]
    for option, path in found.items():
        argv += ["--" + option.replace("_", "-"), str(path)]
    log(f"peers: {', '.join(rows)} on {device.type}, {rounds} round(s)")
    try:
        results = vs_peers.main(argv)  # a row whose command failed is recorded as failed, the others still run
    except SystemExit as stop:  # vs_peers refused its arguments
        raise RuntimeError(str(stop)) from None
    missing = [f"{peers_dir / name} (rows {', '.join(r for r in vs_peers.ROWS if vs_peers.NEEDS.get(r) == option)})"
               for option, name in PEER_CHECKOUTS.items() if option not in found]
    return {"rows": results, "command": "python -m benchmarks.vs_peers " + " ".join(argv), "not found": missing}


# ------------------------------------------------------------------------------------------------ main
def _json_safe(value):
    """NaN (no GPU peak memory on a CPU) as null, which every JSON reader accepts."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def print_table(results: dict) -> None:
    for label, r in {**results.get("trainer", {}), **results.get("trainer_pre", {})}.items():
        if "images_per_s" in r:
            mfu = f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") else ""
            print(f"== trainer {label}: {r['images_per_s']:.0f} images/s{mfu} (data wait {r['data_wait']:.0%})")
    for label, r in results.get("step_time", {}).items():
        if isinstance(r, dict) and "pre" in r:
            print(f"== step {label:24s} pre {r['pre']['median_ms']:7.1f} ms {r['pre']['peak_mem_mb']:8.0f} MB | "
                  f"siamese {r['siamese']['median_ms']:7.1f} ms {r['siamese']['peak_mem_mb']:8.0f} MB | ratio time "
                  f"{r['siamese/pre time']:.3f}, peak {r['siamese/pre peak memory']:.3f}, "
                  f"activations {r['siamese/pre activations']:.3f}")
    for label, r in results.get("host_syncs", {}).items():
        if isinstance(r, dict):
            print(f"== host syncs, {label}: at most {r['max project host reads per step']} project reads and "
                  f"{r['max cuda syncs per step']} CUDA syncs per step over steps {r['counted steps']}")
    if "images_per_s" in results.get("data_feed", {}):
        r = results["data_feed"]
        print(f"== DeiT data feed: {r['images_per_s']:.0f} images/s with {r['workers']} workers ({r['input_size']} px)")
    if "images_per_s" in results.get("sampling", {}):
        r = results["sampling"]
        print(f"== sampling: {r['images_per_s']:.1f} images/s (250 steps, batch {r['batch']}); Inception "
              f"{r['inception_images_per_s']:.0f} images/s; FID-50K about {r['fid50k_minutes_one_gpu']:.0f} min on one "
              "GPU")
    for label, r in results.get("step_time", {}).items():
        if label.endswith("break-even steps"):
            print(f"== {label}: " + ", ".join(f"{name} {steps:.0f}" for name, steps in r.items()))
    for r in results.get("peers", {}).get("rows", []):
        if "failed" in r:
            print(f"== vs peers, {r['row']}: failed: {r['failed'].splitlines()[0]}")
        else:
            print(f"== vs peers, {r['measure']}: ours/{r['peer']} {r['ratio']:.2f}x ({r['ours']:.1f} / "
                  f"{r['theirs']:.1f} {r['unit']})")
    for name, status in results.get("parts", {}).items():
        if status["status"] != "done":
            print(f"== {name}: {status['status']}: {status.get('reason', '')}")


def run_parts(names: Sequence[str], jobs: dict, plan: Plan, results: dict, save: Callable[[], None],
              end: Callable[[int], None] = None) -> None:
    """Run the parts in order within the plan: a part whose expected duration does not fit in what is left is
    skipped; one still running at the budget is stopped and the rest skipped; a failing part is recorded with its
    error and the others still run. ``jobs``: ``{name: (piece, records_itself, run)}``; every status and reason goes
    to ``results["parts"]``, and ``save`` writes the results after every part. ``end(status)`` ends the process when
    a part cannot be stopped (:meth:`Plan.deadline`; default :func:`end_process`)."""
    parts = results.setdefault("parts", {})
    running = {"name": None, "since": 0.0}

    def give_up():
        """The watchdog's end: the part still inside one call at the budget is recorded, the rest skipped, the
        results written, and the process ends (the call cannot be interrupted from Python)."""
        seconds = plan.clock() - running["since"]
        parts[running["name"]] = {"status": "stopped", "seconds": seconds,
                                  "reason": f"budget: still inside one call after {seconds:.0f} s at the budget of "
                                            f"{plan.budget_s:g} s; the process ended there"}
        for rest in names:
            parts.setdefault(rest, {"status": "skipped", "reason": "budget: spent (a part was stopped at the budget)"})
        save()
        log(f"{running['name']}: {parts[running['name']]['reason']}")
        (end or end_process)(0)

    with plan.deadline(give_up):
        for name in names:
            piece, records_itself, run = jobs[name]
            if not plan.fits(piece):
                parts[name] = {"status": "skipped", "reason": plan.reason(piece)}
                log(f"{name}: skipped ({plan.reason(piece)})")
                save()
                continue
            started = running["since"] = plan.clock()
            running["name"] = name
            try:
                with plan.part():
                    results[name] = run()
                parts[name] = {"status": "done", "seconds": plan.clock() - started}
                if not records_itself:
                    plan.record(piece, parts[name]["seconds"])
            except BudgetSpent:
                seconds = plan.clock() - started
                plan.record(piece, seconds)
                parts[name] = {"status": "stopped", "seconds": seconds,
                               "reason": f"budget: stopped after {seconds:.0f} s, at the budget of {plan.budget_s:g} s"
                                         " (less the reserve for writing the results)"}
                log(f"{name}: {parts[name]['reason']}")
            except ImportError as err:
                parts[name] = {"status": "failed", "reason": f"{err} (carry the missing wheels and put them on "
                                                             "PYTHONPATH: docs/benchmarks.md)"}
            except Exception as err:  # one part's failure must not cost the others their figures
                parts[name] = {"status": "failed", "reason": f"{type(err).__name__}: {err}",
                               "traceback": traceback.format_exc()[-3000:]}
            if parts[name]["status"] == "failed":
                log(f"{name}: failed: {parts[name]['reason']}")
            _free()
            save()


def main(argv: Sequence[str] | None = None, started: Optional[float] = None) -> dict:
    """``started``: when the budget's clock started (the command line passes the module's import time, before
    torch's; by default the time of the call)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu_check.json", help="JSON results file (rewritten after every part)")
    p.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts")
    p.add_argument("--budget-s", type=float, default=None,
                   help="finish within this many seconds of the command's start: a part that would not fit (by its "
                        "measured duration once it has run, else by a guess scaled by how far the measured parts "
                        "overran theirs) is skipped, one still running at the budget is stopped; all are named in "
                        "the JSON's parts (default: no budget)")
    p.add_argument("--sync-warmup", type=int, default=2, help="first steps left out of the host-sync counts")
    p.add_argument("--compiled-step-time", action="store_true",
                   help="also time the compiled steps in step_time (the trainer part already runs compiled)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run on a machine without a CUDA GPU (its figures mean nothing; a check that the parts run)")
    p.add_argument("--peers", default=str(ROOT / ".peers"),
                   help="part peers: the folder holding the peers' checkouts, DiT/, fast-DiT/ and "
                        "pytorch-image-models/ (default: .peers in the checkout; docs/benchmarks.md says how to fill "
                        "it)")
    p.add_argument("--peer-rounds", type=int, default=1, help="part peers: alternating rounds per row (default 1)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny models and inputs in every part (with --allow-cpu: the CPU smoke run the tests use)")
    args = p.parse_args(argv)
    if not cuda_available() and not args.allow_cpu:  # a GPU this torch cannot use is named in a line before this one
        print("error: make gpu-check measures a CUDA GPU, and this torch sees none (torch.cuda.is_available() is "
              "False). Run it on a machine with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # idle OpenMP threads spin on a shared CPU, and one op can then take minutes
        torch.set_num_threads(1)
    plan = Plan(args.budget_s, args.tiny, start=started)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
               "python": sys.version.split()[0], "budget_s": args.budget_s, "parts": {}}
    for module in ("timm", "accelerate", "diffusers", "torch_fidelity", "torchvision"):
        try:
            results[module] = __import__(module).__version__
        except ImportError:
            results[module] = None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        results["wall_s"] = plan.clock() - plan.start
        out.write_text(json.dumps(_json_safe(results), indent=2, default=str))

    save()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        jobs = {  # part: (the piece its budget is planned by, whether it records its own durations, the part)
            "trainer": ("trainer run", True, lambda: trainer_runs(workdir, args.tiny, plan,
                                                                  results.setdefault("trainer", {}), save)),
            "step_time": ("step_time eager", True, lambda: step_times(device, args.tiny, plan,
                                                                      results.setdefault("step_time", {}), save,
                                                                      args.compiled_step_time)),
            "host_syncs": ("host_syncs", False, lambda: host_syncs(workdir, args.tiny, args.sync_warmup)),
            "data_feed": ("data_feed", False, lambda: data_feed(workdir, device, args.tiny)),
            "sampling": ("sampling", False, lambda: sampling(workdir, device, args.tiny)),
            "trainer_pre": ("trainer run", True, lambda: trainer_runs(workdir, args.tiny, plan,
                                                                      results.setdefault("trainer_pre", {}), save,
                                                                      "pre")),
            "peers": ("peers", False, lambda: peers(workdir, device, args.tiny, Path(args.peers), args.peer_rounds)),
        }
        run_parts(args.only or PARTS, jobs, plan, results, save)
    print_table(results)
    log(f"wrote {out} ({results['wall_s']:.0f} s)")
    return results


def end_process(status: int) -> None:
    """Exit now, with the results already written: the interpreter's own teardown (thread pools, compiled kernels,
    CUDA) has taken minutes on an overloaded CPU and is no part of the check, nor of its budget."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(started=STARTED)
    end_process(0)
