"""Ours beside each peer's own code on the same work, one row per measure, alternating run by run.

Rows (``--rows``, default all four):

* ``sample``: ``diffusion.sample --grid`` against facebookresearch/DiT's ``sample.py`` (``--dit-repo``): the same
  DiT-S/8 weights (a state dict in DiT's layout, written here), 256 px, DiT's eight labels, 50 DDPM steps, CFG 4, a
  tiny local AutoencoderKL for both; samples/s. sample.py runs unmodified under ``benchmarks/dit_sample_shim.py``
  (its docstring says what it changes: CUDA reported absent, the SD VAE loaded from the local folder);
* ``evaluate``: ``vision.evaluate`` against timm's ``validate.py`` (``--timm-repo``): the same weights (timm's
  ``deit_tiny_patch16_224`` at ``--width``/``--depth``, a state dict written here), the same JPEG folder
  (``--images`` ImageNet-sized JPEGs), batch and workers; images/s;
* ``train``: ``vision.train`` against timm's ``train.py`` (``--timm-repo``), what ``benchmarks.vs_timm`` measures
  (its docstring: same model, data and augmentation); images/s by the clock over the steps after its warm-up;
* ``fid``: ``diffusion.fid`` against torch-fidelity's ``fidelity`` (the pip package) on the same two folders of
  ``--fid-count`` 64 px PNGs and the same Inception weights (``benchmarks.fid``'s commands); images/s.

``sample``, ``evaluate`` and ``fid`` time each whole command as a user runs it (start-up included) in a fresh
process; every process gets ``--threads`` threads (``OMP_NUM_THREADS``). Each row runs ours and the peer's
``--rounds`` times, alternating, the order flipped every round (:func:`benchmarks.harness.alternate`), prints each
round's rates and ratio (ours/peer: above 1, ours is faster) and the median ratio; the end is the table (measure,
peer, ratio, command). The peers' scripts are not in their pip packages: pass checkouts of their repositories::

    git clone --depth 1 https://github.com/facebookresearch/DiT /tmp/DiT
    git clone --depth 1 https://github.com/huggingface/pytorch-image-models /tmp/timm-repo
    python -m benchmarks.vs_peers --dit-repo /tmp/DiT --timm-repo /tmp/timm-repo            # all rows, 5 rounds
    python -m benchmarks.vs_peers --rows sample --dit-repo /tmp/DiT --rounds 1             # one row, a try
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

from benchmarks.harness import add_common_args, alternate

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("sample", "evaluate", "train", "fid")
NEEDS = {"sample": "dit_repo", "evaluate": "timm_repo", "train": "timm_repo"}  # the checkout each row's peer is in
PEER_FILES = {"dit_repo": "sample.py", "timm_repo": "validate.py"}
DIT_LABELS = 8  # sample.py draws DiT's eight fixed labels; diffusion.sample --grid draws the same eight


@dataclass
class Row:
    """One measure: ours and the peer's, each a call that runs once and returns its rate (``unit``, higher is
    faster), and the command that reruns the row."""

    measure: str
    peer: str
    unit: str
    ours: Callable[[], float]
    theirs: Callable[[], float]
    command: str


def run_command(command: Sequence[str], env: dict, cwd: Optional[Path] = None) -> float:
    """Seconds ``command`` takes; its output is shown only if it fails (then this benchmark stops)."""
    start = time.perf_counter()
    done = subprocess.run(list(command), env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"error: {shlex.join(map(str, command))} failed (exit {done.returncode}):\n"
                 f"{(done.stdout + done.stderr)[-4000:]}")
    return seconds


def command_rate(work: float, command: Sequence[str], env: dict, cwd: Optional[Path] = None) -> Callable[[], float]:
    """A call that runs ``command`` once and returns ``work`` (images, samples) per second of it."""
    return lambda: work / run_command(command, env, cwd)


def measure_row(row: Row, rounds: int) -> dict:
    """``rounds`` alternating rounds of ours and the peer's (the order flipped each round); prints each round."""
    def on_round(index, runs):
        ours, theirs = runs["ours"][-1].value, runs["peer"][-1].value
        print(f"{row.measure} round {index + 1}/{rounds}: ours {ours:.2f} {row.unit}, {row.peer} {theirs:.2f}: "
              f"ratio {ours / theirs:.3f}", flush=True)

    runs = alternate({"ours": row.ours, "peer": row.theirs}, rounds, flip=True, on_round=on_round)
    ours, theirs = [r.value for r in runs["ours"]], [r.value for r in runs["peer"]]
    ratios = [o / t for o, t in zip(ours, theirs)]
    result = {"measure": row.measure, "peer": row.peer, "unit": row.unit, "ours": statistics.median(ours),
              "theirs": statistics.median(theirs), "ratio": statistics.median(ratios), "ratios": ratios,
              "rounds": rounds, "command": row.command}
    print(f"{row.measure}: ours {result['ours']:.2f} {row.unit}, {row.peer} {result['theirs']:.2f}; ratio "
          f"{result['ratio']:.3f} (median of {rounds} rounds: {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)
    return result


def print_table(results: List[dict]) -> None:
    """The final table, in docs/benchmarks.md's columns (Markdown)."""
    print("\n| measure | peer | ratio (ours/peer) | ours | peer | command |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['measure']} | {r['peer']} | {r['ratio']:.2f}x | {r['ours']:.2f} {r['unit']} | "
              f"{r['theirs']:.2f} {r['unit']} | `{r['command']}` |")


# ------------------------------------------------------------------------------------------------- the rows

def environment(threads: int, pythonpath: Sequence[str]) -> dict:
    t = str(threads)
    return {**os.environ, "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t,
            "PYTHONPATH": os.pathsep.join(map(str, pythonpath)), "HF_HUB_OFFLINE": "1"}


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
            "--device", "cpu", "--quiet"]
    theirs = [sys.executable, str(ROOT / "benchmarks" / "dit_sample_shim.py"), str(a.dit_repo), str(vae), "--",
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

    folder = work / "images"
    done = folder / ".complete"
    if not done.exists() or done.read_text() != str(a.images):
        write_jpegs(folder, a.images, seed=1, split="val")
        done.write_text(str(a.images))
    weights = write_deit_weights(work / "deit.pth", a)
    ours = [sys.executable, "-m", "vision.evaluate", "model.name=deit_tiny_patch16_224",
            f"model.kwargs={{embed_dim: {a.width}, depth: {a.depth}, num_heads: {a.heads}}}",
            "data.dataset=imagefolder", f"data.path={folder}", "data.num_classes=2", f"data.num_workers={a.workers}",
            f"batch_size={a.batch_size}", "precision=fp32", f"checkpoint={weights}", f"output={work / 'ours.json'}"]
    theirs = [sys.executable, str(Path(a.timm_repo) / "validate.py"), str(folder), "--split", "val",
              "--model", "deit_tiny_patch16_224", "--model-kwargs", f"embed_dim={a.width}", f"depth={a.depth}",
              f"num_heads={a.heads}", "--num-classes", "2", "--checkpoint", str(weights), "-b", str(a.batch_size),
              "-j", str(a.workers), "--device", "cpu", "--log-freq", "1000"]
    return Row("evaluation", "timm validate.py", "images/s",
               command_rate(a.images, ours, environment(a.threads, [ROOT])),
               command_rate(a.images, theirs, environment(a.threads, []), cwd=work),
               row_command(a, "evaluate"))


def train_row(a, work: Path) -> Row:
    from benchmarks import vs_timm

    settings = argparse.Namespace(width=a.width, depth=a.depth, heads=a.heads, batch_size=a.batch_size,
                                  workers=a.workers, threads=a.threads, ours_tree=str(ROOT))
    folder = vs_timm.write_folder(work / "images", a.train_steps * a.batch_size)
    env = environment(a.threads, [ROOT])
    runs = {"ours": 0, "timm": 0}

    def train(name: str) -> float:
        out = work / f"{name}_{runs[name]}"
        runs[name] += 1
        subprocess.run(["rm", "-rf", str(out)], check=True)
        if name == "ours":
            _, _, clock = vs_timm.run(name, vs_timm.ours_command(folder, out, settings), env)
            ends = vs_timm.ours_step_ends(out)
        else:
            command = vs_timm.timm_command(Path(a.timm_repo) / "train.py", folder, out, settings)
            _, ends, clock = vs_timm.run(name, command, env)
        return vs_timm.measure(ends, clock, a.train_warmup, a.batch_size)["wall"]

    return Row("DeiT training", "timm train.py", "images/s", lambda: train("ours"), lambda: train("timm"),
               row_command(a, "train"))


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
    commands = fid_commands(samples, reference, weights, 50, work / "ours.json")
    env = environment(a.threads, [ROOT])
    return Row("FID", "torch-fidelity fidelity", "images/s",
               command_rate(2 * a.fid_count, commands["diffusion.fid"], env),
               command_rate(2 * a.fid_count, commands["torch-fidelity"], environment(a.threads, [])),
               row_command(a, "fid"))


BUILDERS = {"sample": sample_row, "evaluate": evaluate_row, "train": train_row, "fid": fid_row}


def row_command(a, name: str) -> str:
    """The command that reruns row ``name`` with these settings (its checkout, and every option not at its default)."""
    repo = f" --{NEEDS[name].replace('_', '-')} {getattr(a, NEEDS[name])}" if name in NEEDS else ""
    return f"python -m benchmarks.vs_peers --rows {name}{repo}" + "".join(f" {flag} {value}" for flag, value in a.changed)


# ------------------------------------------------------------------------------------------------- the CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_peers", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)} (default: all)")
    p.add_argument("--dit-repo", default=None, help="a checkout of facebookresearch/DiT (row sample)")
    p.add_argument("--timm-repo", default=None,
                   help="a checkout of huggingface/pytorch-image-models (rows evaluate and train)")
    add_common_args(p, rounds=5, rounds_help="runs of each side per row, alternating, the order flipped each round "
                                             "(default 5)", threads=1, threads_help="CPU threads of every process")
    p.add_argument("--workdir", default=None, help="where generated inputs are written and kept (default: temporary)")
    s = p.add_argument_group("sample")
    s.add_argument("--dit-model", default="DiT-S/8", help="a DiT of DiT's models.py (default DiT-S/8)")
    s.add_argument("--image-size", type=int, choices=(256, 512), default=256)
    s.add_argument("--steps", type=int, default=50, help="DDPM sampling steps (default 50)")
    s.add_argument("--cfg-scale", type=float, default=4.0)
    v = p.add_argument_group("evaluate and train (timm's deit_tiny_patch16_224 at this size, 224 px)")
    v.add_argument("--width", type=int, default=64)
    v.add_argument("--depth", type=int, default=2)
    v.add_argument("--heads", type=int, default=2)
    v.add_argument("--batch-size", type=int, default=64)
    v.add_argument("--workers", type=int, default=1, help="loader workers of each side")
    v.add_argument("--images", type=int, default=512, help="evaluate: JPEGs in the evaluated folder")
    v.add_argument("--train-steps", type=int, default=40, help="train: steps per run (one epoch)")
    v.add_argument("--train-warmup", type=int, default=5, help="train: steps left out of the figure")
    f = p.add_argument_group("fid")
    f.add_argument("--fid-count", type=int, default=1000, help="PNGs in each of the two folders")
    a = p.parse_args(argv)
    a.changed = [(action.option_strings[0], getattr(a, action.dest)) for action in p._actions
                 if action.option_strings and action.dest not in ("help", "rows", "dit_repo", "timm_repo", "workdir")
                 and getattr(a, action.dest) != action.default]
    a.rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in a.rows if r not in ROWS]
    if unknown or not a.rows:
        p.error(f"--rows {','.join(unknown) or '(none)'}: choose from {', '.join(ROWS)}")
    for name in ("rounds", "threads", "steps", "batch_size", "workers", "images", "train_steps", "fid_count"):
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
    a = parse_args(argv)
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="bench_vs_peers_"))
    results = []
    for name in a.rows:
        print(f"== {name}: setting up in {work / name}", flush=True)
        results.append(measure_row(BUILDERS[name](a, work / name), a.rounds))
    print_table(results)
    (work / "vs_peers.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
