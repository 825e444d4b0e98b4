"""Ours beside each peer's own code on the same work, one row per measure, alternating run by run.

Rows (``--rows``, default all five):

* ``sample``: ``diffusion.sample --grid`` against facebookresearch/DiT's ``sample.py`` (``--dit-repo``): the same
  DiT-S/8 weights (a state dict in DiT's layout, written here), 256 px, DiT's eight labels, 50 DDPM steps, CFG 4, a
  tiny local AutoencoderKL for both; samples/s. sample.py runs unmodified under ``benchmarks/dit_shim.py`` (its
  docstring says what it changes: on a CPU, CUDA reported absent; the SD VAE loaded from the local folder);
* ``evaluate``: ``vision.evaluate`` against timm's ``validate.py`` (``--timm-repo``): the same weights (timm's
  ``deit_tiny_patch16_224`` at ``--width``/``--depth``, a state dict written here), the same JPEG folder
  (``--images`` ImageNet-sized JPEGs), batch and workers; images/s;
* ``train``: ``vision.train`` against timm's ``train.py`` (``--timm-repo``), what ``benchmarks.vs_timm`` measures
  (its docstring: same model, data and augmentation), ``--train-epochs`` epochs of ``--train-steps`` steps;
* ``train_dit``: ``diffusion.train`` against fast-DiT's ``train.py`` (``--fast-dit-repo``, chuanyangjin/fast-DiT,
  run unmodified under ``benchmarks/dit_shim.py``): the same DiT (``--dit-model``, 256 px: 32x32x4 latents), batch,
  workers and steps, each on latents in its own format (ours: posterior moments, a fresh draw per step; fast-DiT:
  one drawn latent per ``.npy`` file, what its ``extract_features.py`` writes), its own defaults otherwise (fast-DiT:
  gradient checkpointing in every block, its EMA loop, no checkpoint before its 50,000th step (a checkpoint from a
  single process fails in it: ``model.module`` without DDP); ours: no grids, ``train.sample_every=0``, and its
  checkpoint at the end);
* ``fid``: ``diffusion.fid`` against torch-fidelity's ``fidelity`` (the pip package) on the same two folders of
  ``--fid-count`` 64 px PNGs and the same Inception weights (``benchmarks.fid``'s commands); images/s.

Each whole command is timed as a user runs it (start-up included) in a fresh process, with its CPU time (its main
process's, polled, and its children's: loader workers, compile workers); the training rows add the steady rate
after ``--train-warmup`` steps and which process bounds it (main process or data worker,
:func:`benchmarks.harness.bound`). Every process gets ``--threads`` threads (``OMP_NUM_THREADS``). Each row runs
ours and the peer's ``--rounds`` times, alternating, the order flipped every round
(:func:`benchmarks.harness.alternate`), prints each round's rates, CPU, ratio (ours/peer: above 1, ours is faster)
and load (LOADED above ``--max-load``), then the median ratio and the median of the peer's CPU seconds over ours
(the same work on both sides: above 1, ours spends less CPU on it, a figure a busy machine disturbs less than the
clock); the end is the table (measure, peer, ratios, rates, conditions, command) and ``vs_peers.json`` in
``--workdir``.

``--device cuda`` runs every row on the GPU (``benchmarks.gpu_check``'s ``peers`` part does, in a GPU window);
``--precision bf16`` (the default on CUDA) trains and evaluates both sides under bf16 autocast (ours
``train.precision=bf16`` / ``precision=bf16``, timm ``--amp --amp-dtype bfloat16``, fast-DiT accelerate's
``mixed_precision``); sampling and FID stay fp32, the peers having no bf16 path. The peers' scripts are not in
their pip packages: pass checkouts of their repositories::

    git clone --depth 1 https://github.com/facebookresearch/DiT /tmp/DiT
    git clone --depth 1 https://github.com/huggingface/pytorch-image-models /tmp/timm-repo
    git clone --depth 1 https://github.com/chuanyangjin/fast-DiT /tmp/fast-DiT
    python -m benchmarks.vs_peers --dit-repo /tmp/DiT --timm-repo /tmp/timm-repo --fast-dit-repo /tmp/fast-DiT
    python -m benchmarks.vs_peers --rows sample --dit-repo /tmp/DiT --rounds 1             # one row, a try
    python -m benchmarks.vs_peers --rows train,train_dit --train-epochs 8 ...             # 320-step trainings
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from benchmarks.harness import (CpuClock, add_common_args, alternate, bound, conditions, describe_bound,
                                describe_conditions, load_note, stopped_with)

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("sample", "evaluate", "train", "train_dit", "fid")
# the checkout each row's peer is in, and the file that shows a checkout is the right one
NEEDS = {"sample": "dit_repo", "evaluate": "timm_repo", "train": "timm_repo", "train_dit": "fast_dit_repo"}
PEER_FILES = {"dit_repo": "sample.py", "timm_repo": "validate.py", "fast_dit_repo": "extract_features.py"}
DIT_LABELS = 8  # sample.py draws DiT's eight fixed labels; diffusion.sample --grid draws the same eight
SHIM = ROOT / "benchmarks" / "dit_shim.py"
FAST_DIT_STEP_LINE = r"\(step=\d+\) Train Loss"  # fast-DiT's train.py's log line (--log-every 1: every step)


@dataclass
class Row:
    """One measure: ours and the peer's, each a call that runs once and returns its figures (:func:`run_command`:
    ``rate`` in ``unit``, higher is faster; wall and CPU seconds; a trainer's ``steady`` rate and ``bound``), the
    command that reruns the row, and the data workers of each side."""

    measure: str
    peer: str
    unit: str
    ours: Callable[[], dict]
    theirs: Callable[[], dict]
    command: str
    workers: Optional[int] = None


def run_command(command: Sequence[str], env: dict, cwd: Optional[Path] = None) -> dict:
    """``command`` run once: its wall seconds, its main process's CPU seconds and its children's
    (:class:`benchmarks.harness.CpuClock`); its output is shown only if it fails (then this benchmark stops)."""
    start = time.perf_counter()
    proc = subprocess.Popen(list(command), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    clock = CpuClock(proc.pid)
    with stopped_with(proc):
        output = proc.communicate()[0]
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"error: {shlex.join(map(str, command))} failed (exit {proc.returncode}):\n{output[-4000:]}")
    main_cpu_s, children_cpu_s = clock.totals()
    return {"wall_s": seconds, "main_cpu_s": main_cpu_s, "children_cpu_s": children_cpu_s}


def command_rate(work: float, command: Sequence[str], env: dict, cwd: Optional[Path] = None,
                 workers: Optional[int] = None) -> Callable[[], dict]:
    """A call that runs ``command`` once: ``work`` (images, samples) per second of it, and its CPU; with
    ``workers`` data workers, which process bounds it (over the whole command)."""
    def call():
        figures = run_command(command, env, cwd)
        figures["rate"] = work / figures["wall_s"]
        if workers is not None:
            figures.update(bound(figures["wall_s"], figures["main_cpu_s"], figures["children_cpu_s"], workers))
        return figures
    return call


def side_note(figures: dict) -> str:
    """A side's CPU in a round: ``CPU 12.3 s (main 8.1 + children 4.2)``, a trainer's steady rate and bound."""
    note = (f"CPU {figures['main_cpu_s'] + figures['children_cpu_s']:.1f} s (main {figures['main_cpu_s']:.1f} + "
            f"children {figures['children_cpu_s']:.1f}) in {figures['wall_s']:.1f} s")
    if "steady" in figures:
        note += f"; {figures['steady']:.2f} after the warm-up"
    return note + (f"; {describe_bound(figures)}" if "bound" in figures else "")


def median_bound(samples: List[dict]) -> Optional[dict]:
    """The bound of a side over its rounds: the median busy fractions, and the process the busier median names."""
    if not samples or "bound" not in samples[0]:
        return None
    main, worker = (statistics.median(s[k] for s in samples) for k in ("main_busy", "worker_busy"))
    return {"main_busy": main, "worker_busy": worker, "bound": "data worker" if worker > main else "main process"}


def measure_row(row: Row, rounds: int, max_load: float, threads: int) -> dict:
    """``rounds`` alternating rounds of ours and the peer's (the order flipped each round); prints each round with
    its figures and load, then the medians and the conditions."""
    def on_round(index, runs):
        ours, theirs = runs["ours"][-1].value, runs["peer"][-1].value
        print(f"{row.measure} round {index + 1}/{rounds}: ours {ours['rate']:.2f} {row.unit} ({side_note(ours)}), "
              f"{row.peer} {theirs['rate']:.2f} ({side_note(theirs)}): ratio {ours['rate'] / theirs['rate']:.3f}; "
              f"{load_note(runs.loads[-1], max_load, row.workers)}", flush=True)

    runs = alternate({"ours": row.ours, "peer": row.theirs}, rounds, flip=True, on_round=on_round)
    sides = {side: [r.value for r in rs] for side, rs in runs.items()}
    ratios = [o["rate"] / t["rate"] for o, t in zip(sides["ours"], sides["peer"])]
    cpu = {side: [s["main_cpu_s"] + s["children_cpu_s"] for s in v] for side, v in sides.items()}
    cpu_ratios = [t / o for o, t in zip(cpu["ours"], cpu["peer"])]  # the same work: above 1, ours spends less CPU
    result = {"measure": row.measure, "peer": row.peer, "unit": row.unit,
              "ours": statistics.median(s["rate"] for s in sides["ours"]),
              "theirs": statistics.median(s["rate"] for s in sides["peer"]),
              "ratio": statistics.median(ratios), "ratios": ratios, "rounds": rounds, "command": row.command,
              "cpu_s": {side: statistics.median(v) for side, v in cpu.items()},
              "cpu_ratio": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios,
              "runs": sides, "conditions": conditions(runs, max_load, threads, row.workers)}
    if "steady" in sides["ours"][0]:
        result["steady_ratios"] = [o["steady"] / t["steady"] for o, t in zip(sides["ours"], sides["peer"])]
        result["steady_ratio"] = statistics.median(result["steady_ratios"])
    result["bound"] = {side: median_bound(v) for side, v in sides.items()}
    print(f"{row.measure}: ours {result['ours']:.2f} {row.unit}, {row.peer} {result['theirs']:.2f}; ratio "
          f"{result['ratio']:.3f} (median of {rounds} rounds: {', '.join(f'{r:.3f}' for r in ratios)})"
          + (f"; after the warm-up {result['steady_ratio']:.3f} ("
             f"{', '.join(f'{r:.3f}' for r in result['steady_ratios'])})" if "steady_ratio" in result else "")
          + f"; CPU seconds, {row.peer} over ours: {result['cpu_ratio']:.3f} ("
          f"{', '.join(f'{r:.3f}' for r in cpu_ratios)})", flush=True)
    for side, name in (("ours", "ours"), ("peer", row.peer)):
        if result["bound"][side]:
            print(f"  {name}: {describe_bound(result['bound'][side])}", flush=True)
    print("  " + describe_conditions(result["conditions"]), flush=True)
    return result


def conditions_cell(r: dict) -> str:
    """The table's conditions: the load over the rounds, LOADED where any round was above --max-load, the bound."""
    c = r["conditions"]
    loads = [x for load in c["round_loads"] for x in load]
    cell = f"load {min(loads):.1f}-{max(loads):.1f}" + (
        f", LOADED {len(c['loaded_rounds'])}/{len(c['round_loads'])}" if c["loaded_rounds"] else "")
    bounds = [b["bound"] for b in r["bound"].values() if b]
    return cell + (f"; bound: {' / '.join(bounds)}" if bounds else "")


def print_table(results: List[dict]) -> None:
    """The final table, in docs/benchmarks.md's columns (Markdown)."""
    print("\n| measure | peer | ratio (ours/peer) | CPU (peer/ours) | ours | peer | conditions | command |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in results:
        steady = f" (after warm-up {r['steady_ratio']:.2f}x)" if "steady_ratio" in r else ""
        print(f"| {r['measure']} | {r['peer']} | {r['ratio']:.2f}x [{', '.join(f'{x:.2f}' for x in r['ratios'])}]"
              f"{steady} | {r['cpu_ratio']:.2f}x | {r['ours']:.2f} {r['unit']} | {r['theirs']:.2f} {r['unit']} | "
              f"{conditions_cell(r)} | `{r['command']}` |")


# ------------------------------------------------------------------------------------------------- the rows

def environment(threads: int, pythonpath: Sequence[str], **extra: str) -> dict:
    t = str(threads)
    return {**os.environ, "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t,
            "PYTHONPATH": os.pathsep.join(map(str, pythonpath)), "HF_HUB_OFFLINE": "1", **extra}


def write_sd_vae(folder: Path) -> Path:
    """A tiny AutoencoderKL of the SD VAE's shape (4 latent channels, 8x down) in random weights: both sides decode
    with it, so neither downloads the 330 MB one."""
    if not (folder / "config.json").exists():
        import torch
        from diffusers import AutoencoderKL

        torch.manual_seed(0)
        AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                      block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4,
                      norm_num_groups=4).save_pretrained(folder)
    return folder


def write_dit_weights(path: Path, model: str, image_size: int) -> Path:
    """A ``model`` state dict in facebookresearch/DiT's layout (its names are ours for the Pre-Norm DiT), 1000
    classes and a null class, as DiT's ``sample.py --ckpt`` and ``diffusion.sample --checkpoint`` both read it."""
    if not path.exists():
        import torch

        from diffusion.models import DiT_models

        torch.manual_seed(0)
        torch.save(DiT_models[model](input_size=image_size // 8, num_classes=1000).state_dict(), path)
    return path


def sample_row(a, work: Path) -> Row:
    work.mkdir(parents=True, exist_ok=True)
    vae = write_sd_vae(work / "sd_vae")
    weights = write_dit_weights(work / "dit.pt", a.dit_model, a.image_size)
    ours = [sys.executable, "-m", "diffusion.sample", "--checkpoint", str(weights), "--model", a.dit_model,
            "--image-size", str(a.image_size), "--num-classes", "1000", "--vae", str(vae), "--steps", str(a.steps),
            "--cfg-scale", str(a.cfg_scale), "--batch-size", str(DIT_LABELS), "--grid", str(work / "ours.png"),
            "--device", a.device, "--quiet"]
    theirs = [sys.executable, str(SHIM), str(a.dit_repo), str(vae), "sample.py", a.device, "--",
              "--model", a.dit_model, "--image-size", str(a.image_size), "--num-classes", "1000", "--vae", "ema",
              "--num-sampling-steps", str(a.steps), "--cfg-scale", str(a.cfg_scale), "--ckpt", str(weights)]
    peer_dir = work / "dit_cwd"  # sample.py writes sample.png where it runs
    peer_dir.mkdir(exist_ok=True)
    return Row("sampling", "DiT sample.py", "samples/s",
               command_rate(DIT_LABELS, ours, environment(a.threads, [ROOT])),
               command_rate(DIT_LABELS, theirs, environment(a.threads, []), cwd=peer_dir),
               row_command(a, "sample"))


def write_deit_weights(path: Path, a) -> Path:
    """timm's ``deit_tiny_patch16_224`` at ``--width``/``--depth``/``--heads``, two classes, as a state dict."""
    if not path.exists():
        import timm
        import torch

        torch.manual_seed(0)
        model = timm.create_model("deit_tiny_patch16_224", embed_dim=a.width, depth=a.depth, num_heads=a.heads,
                                  num_classes=2)
        torch.save(model.state_dict(), path)
    return path


def evaluate_row(a, work: Path) -> Row:
    from benchmarks.synthetic import write_jpegs
    from benchmarks.vs_timm import timm_amp

    folder = work / "images"
    done = folder / ".complete"
    if not done.exists() or done.read_text() != str(a.images):
        write_jpegs(folder, a.images, seed=1, split="val")
        done.write_text(str(a.images))
    weights = write_deit_weights(work / "deit.pth", a)
    ours = [sys.executable, "-m", "vision.evaluate", "model.name=deit_tiny_patch16_224",
            f"model.kwargs={{embed_dim: {a.width}, depth: {a.depth}, num_heads: {a.heads}}}",
            "data.dataset=imagefolder", f"data.path={folder}", "data.num_classes=2", f"data.num_workers={a.workers}",
            f"batch_size={a.batch_size}", f"precision={a.precision}", f"checkpoint={weights}",
            f"output={work / 'ours.json'}"]
    theirs = [sys.executable, str(Path(a.timm_repo) / "validate.py"), str(folder), "--split", "val",
              "--model", "deit_tiny_patch16_224", "--model-kwargs", f"embed_dim={a.width}", f"depth={a.depth}",
              f"num_heads={a.heads}", "--num-classes", "2", "--checkpoint", str(weights), "-b", str(a.batch_size),
              "-j", str(a.workers), "--device", a.device, "--log-freq", "1000", *timm_amp(a)]
    return Row("evaluation", "timm validate.py", "images/s",
               command_rate(a.images, ours, environment(a.threads, [ROOT]), workers=a.workers),
               command_rate(a.images, theirs, environment(a.threads, []), cwd=work, workers=a.workers),
               row_command(a, "evaluate"), a.workers)


def trainer_figures(m: dict) -> dict:
    """A training run's figures (:func:`benchmarks.vs_timm.measure`) as a row's: the whole command's rate first."""
    return {**m, "rate": m["whole"], "steady": m["wall"]}


def train_row(a, work: Path) -> Row:
    from benchmarks import vs_timm

    settings = argparse.Namespace(width=a.width, depth=a.depth, heads=a.heads, batch_size=a.batch_size,
                                  workers=a.workers, threads=a.threads, ours_tree=str(ROOT), epochs=a.train_epochs,
                                  warmup=a.train_warmup, device=a.device, precision=a.precision)
    folder = vs_timm.write_folder(work / "images", a.train_steps * a.batch_size)
    env = environment(a.threads, [ROOT])
    runs = {"ours": 0, "timm": 0}

    def train(name: str) -> dict:
        out = work / f"{name}_{runs[name]}"
        runs[name] += 1
        return trainer_figures(vs_timm.train_once(name, folder, out, settings, env, Path(a.timm_repo) / "train.py"))

    return Row("DeiT training", "timm train.py", "images/s", lambda: train("ours"), lambda: train("timm"),
               row_command(a, "train"), a.workers)


def write_fast_dit_features(root: Path, count: int, seed: int = 0) -> Path:
    """``count`` drawn latents (1x4x32x32 float32) and labels, one ``.npy`` file each, in the layout of fast-DiT's
    ``extract_features.py`` (``imagenet256_features/``, ``imagenet256_labels/``); kept."""
    import numpy as np

    done = root / ".complete"
    if not done.exists() or int(done.read_text()) != count:
        rng = np.random.default_rng(seed)
        for name in ("imagenet256_features", "imagenet256_labels"):
            (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            np.save(root / "imagenet256_features" / f"{i}.npy", rng.standard_normal((1, 4, 32, 32), dtype=np.float32))
            np.save(root / "imagenet256_labels" / f"{i}.npy", rng.integers(0, 1000, (1,)))
        done.write_text(str(count))
    return root


def dit_train_row(a, work: Path) -> Row:
    """diffusion.train (the DiT recipe) against fast-DiT's train.py: ``--train-epochs`` epochs of ``--train-steps``
    steps each, from latents of ``--train-steps`` x ``--batch-size`` images."""
    from benchmarks import vs_timm
    from benchmarks.synthetic import write_latents

    work.mkdir(parents=True, exist_ok=True)
    count, steps = a.train_steps * a.batch_size, a.train_steps * a.train_epochs
    latents = work / "latents"
    if not (latents / "metadata.json").exists():
        write_latents(latents, count, shard_size=min(count, 1024))
    features = write_fast_dit_features(work / "features", count)
    vae = write_sd_vae(work / "sd_vae")
    ours_env = environment(a.threads, [ROOT])
    theirs_env = environment(a.threads, [], ACCELERATE_MIXED_PRECISION="bf16" if a.precision == "bf16" else "no")
    runs = {"ours": 0, "peer": 0}

    def train(name: str) -> dict:
        out = work / f"{name}_{runs[name]}"
        runs[name] += 1
        subprocess.run(["rm", "-rf", str(out)], check=True)
        if name == "ours":
            command = [sys.executable, "-m", "diffusion.train", "--config", str(ROOT / "configs" / "dit_b2_pre.yaml"),
                       f"model.name={a.dit_model}", f"data.path={latents}", "data.autoencoder=none",
                       f"data.num_workers={a.workers}", f"optim.batch_size={a.batch_size}", f"optim.steps={steps}",
                       f"train.precision={a.precision}", f"train.threads={a.threads}", "train.log_every=1",
                       "train.sample_every=0", "train.tensorboard=false", f"train.ckpt_every={10 ** 9}",
                       "train.resume=null", f"train.output_dir={out}"]
            trainer = vs_timm.run(name, command, ours_env)
            ends = vs_timm.ours_step_ends(out)
        else:
            out.mkdir(parents=True)
            command = [sys.executable, str(SHIM), str(a.fast_dit_repo), str(vae), "train.py", a.device, "--",
                       "--model", a.dit_model, "--feature-path", str(features), "--results-dir", str(out),
                       "--global-batch-size", str(a.batch_size), "--epochs", str(a.train_epochs),
                       "--num-workers", str(a.workers), "--log-every", "1"]
            trainer = vs_timm.run(name, command, theirs_env, FAST_DIT_STEP_LINE, cwd=out)
            ends = trainer.stamps
        return trainer_figures(vs_timm.measure(ends, trainer, a.train_warmup, a.batch_size, a.workers))

    return Row("DiT training", "fast-DiT train.py", "images/s", lambda: train("ours"), lambda: train("peer"),
               row_command(a, "train_dit"), a.workers)


def fid_row(a, work: Path) -> Row:
    from benchmarks.fid import fid_commands
    from benchmarks.synthetic import write_png_folder
    from diffusion.evaluation.features import INCEPTION_WEIGHTS_FILE, write_random_inception

    work.mkdir(parents=True, exist_ok=True)
    weights = work / INCEPTION_WEIGHTS_FILE
    if not weights.exists():
        write_random_inception(weights)
    samples = write_png_folder(work / "samples", a.fid_count, seed=1)
    reference = write_png_folder(work / "reference", a.fid_count, seed=2)
    commands = fid_commands(samples, reference, weights, 50, work / "ours.json", a.device)
    env = environment(a.threads, [ROOT])
    return Row("FID", "torch-fidelity fidelity", "images/s",
               command_rate(2 * a.fid_count, commands["diffusion.fid"], env),
               command_rate(2 * a.fid_count, commands["torch-fidelity"], environment(a.threads, [])),
               row_command(a, "fid"))


BUILDERS = {"sample": sample_row, "evaluate": evaluate_row, "train": train_row, "train_dit": dit_train_row,
            "fid": fid_row}


def row_command(a, name: str) -> str:
    """The command that reruns row ``name`` with these settings (its checkout, and every option not at its default)."""
    repo = f" --{NEEDS[name].replace('_', '-')} {getattr(a, NEEDS[name])}" if name in NEEDS else ""
    options = "".join(f" {flag} {value}" for flag, value in a.changed)
    return f"python -m benchmarks.vs_peers --rows {name}{repo}{options}"


# ------------------------------------------------------------------------------------------------- the CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_peers", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)} (default: all)")
    p.add_argument("--dit-repo", default=None, help="a checkout of facebookresearch/DiT (row sample)")
    p.add_argument("--timm-repo", default=None,
                   help="a checkout of huggingface/pytorch-image-models (rows evaluate and train)")
    p.add_argument("--fast-dit-repo", default=None, help="a checkout of chuanyangjin/fast-DiT (row train_dit)")
    add_common_args(p, rounds=5, rounds_help="runs of each side per row, alternating, the order flipped each round "
                                             "(default 5)", threads=1, threads_help="CPU threads of every process")
    p.add_argument("--workdir", default=None, help="where generated inputs are written and kept (default: temporary)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every row runs (default cpu)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="rows evaluate, train and train_dit, both sides (sample and fid stay fp32: their peers have no "
                        "bf16 path); default: bf16 on cuda, fp32 on cpu")
    s = p.add_argument_group("sample and train_dit")
    s.add_argument("--dit-model", default="DiT-S/8", help="a DiT of DiT's models.py (default DiT-S/8)")
    s.add_argument("--image-size", type=int, choices=(256, 512), default=256)
    s.add_argument("--steps", type=int, default=50, help="DDPM sampling steps (default 50)")
    s.add_argument("--cfg-scale", type=float, default=4.0)
    v = p.add_argument_group("evaluate and train (timm's deit_tiny_patch16_224 at this size, 224 px), train_dit")
    v.add_argument("--width", type=int, default=64)
    v.add_argument("--depth", type=int, default=2)
    v.add_argument("--heads", type=int, default=2)
    v.add_argument("--batch-size", type=int, default=64)
    v.add_argument("--workers", type=int, default=1, help="loader workers of each side")
    v.add_argument("--images", type=int, default=512, help="evaluate: JPEGs in the evaluated folder")
    v.add_argument("--train-steps", type=int, default=40, help="train, train_dit: steps per epoch (the training "
                                                               "images or latents are steps x batch size)")
    v.add_argument("--train-epochs", type=int, default=1, help="train, train_dit: epochs per run")
    v.add_argument("--train-warmup", type=int, default=5, help="train, train_dit: steps left out of the steady rate")
    f = p.add_argument_group("fid")
    f.add_argument("--fid-count", type=int, default=1000, help="PNGs in each of the two folders")
    a = p.parse_args(argv)
    a.changed = [(action.option_strings[0], getattr(a, action.dest)) for action in p._actions
                 if action.option_strings and action.dest not in ("help", "rows", "workdir", *PEER_FILES)
                 and getattr(a, action.dest) != action.default]
    a.precision = a.precision or ("bf16" if a.device == "cuda" else "fp32")
    a.rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in a.rows if r not in ROWS]
    if unknown or not a.rows:
        p.error(f"--rows {','.join(unknown) or '(none)'}: choose from {', '.join(ROWS)}")
    for name in ("rounds", "threads", "steps", "batch_size", "workers", "images", "train_steps", "train_epochs",
                 "fid_count"):
        if getattr(a, name) is None or getattr(a, name) < (0 if name == "workers" else 1):
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be positive")
    if a.train_warmup < 0 or a.train_warmup + 1 >= a.train_steps:
        p.error(f"--train-warmup {a.train_warmup}: must leave at least two of --train-steps {a.train_steps}")
    for option in sorted({NEEDS[r] for r in a.rows if r in NEEDS}):
        flag, value = "--" + option.replace("_", "-"), getattr(a, option)
        rows = ", ".join(r for r in a.rows if NEEDS.get(r) == option)
        if value is None:
            p.error(f"row {rows} needs {flag}, a checkout of the peer's repository (see --help)")
        if not (Path(value) / PEER_FILES[option]).is_file():
            p.error(f"{flag} {value}: no {PEER_FILES[option]} there; pass the root of a checkout (see --help)")
    return a


def main(argv=None) -> List[dict]:
    """One result per row; a row whose command failed is ``{"row", "failed": its message}`` and the others still
    run (the command line then exits 1)."""
    a = parse_args(argv)
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="bench_vs_peers_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for name in a.rows:
        print(f"== {name}: setting up in {work / name}", flush=True)
        try:
            results.append(measure_row(BUILDERS[name](a, work / name), a.rounds, a.max_load, a.threads))
        except SystemExit as failure:  # run_command's: a command failed, its output is in the message
            print(failure, file=sys.stderr, flush=True)
            results.append({"row": name, "failed": str(failure)})
    print_table([r for r in results if "failed" not in r])
    for r in results:
        if "failed" in r:
            print(f"row {r['row']} failed: {r['failed'].splitlines()[0]}")
    (work / "vs_peers.json").write_text(json.dumps({"device": a.device, "precision": a.precision, "rows": results},
                                                   indent=2) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(1 if any("failed" in r for r in main()) else 0)
