"""Hot-path pieces of a training step, this tree against an earlier revision, side by side on the CPU.

* ``erase``: the batch half of random erasing (:class:`vision.augment.NormalizeErase`, DeiT recipe: re_prob 0.25,
  pixel mode) on a batch of 224 px images: the earlier revision's CUDA path (noise for every pixel, kept inside
  the boxes) beside this tree's accelerator path (the boxes' values only, one pass per slot), both run on the
  CPU; the CPU paths of both; and the normalisation before the erasing, then and now.
* ``ema``: one EMA update (:class:`common.ema.ModelEma`, with the trainer's device-side skip flag) of DiT-B/2
  SiameseNorm's 232 tensors at width ``--ema-width`` (48: the update's host work, what a GPU step waits for,
  rather than the memory traffic of the lerps, which a GPU runs asynchronously).

The earlier code is read from git (``git show REV:path``) and imported beside the current one; the variants
alternate round by round on one thread, so a busy machine slows all alike; the figure is the median of the
per-round ratios. cudnn.benchmark, the third item of this change, acts on CUDA only and has no CPU figure.

    python -m scripts.bench_hot_path --before 08f319b           # about 2 minutes on one core
    python -m scripts.bench_hot_path --before 08f319b --only erase --rounds 3
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]


def module_at(rev: str, path: str, name: str):
    """The module at ``path`` as it was at git revision ``rev``, imported under ``name``."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    file = Path(tempfile.mkdtemp()) / Path(path).name
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def alternate(variants: Dict[str, Callable[[], object]], rounds: int, label: str) -> Dict[str, float]:
    """Median seconds per call of each variant, one call each per round, in turns."""
    times = {k: [] for k in variants}
    for fn in variants.values():
        fn()  # warm-up
    for r in range(rounds):
        for k, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
        print(f"  {label} round {r + 1}/{rounds}: " + "  ".join(f"{k} {1e3 * t[-1]:.1f} ms" for k, t in times.items()),
              flush=True)
    return {k: statistics.median(t) for k, t in times.items()}, times


def bench_erase(before: str, rounds: int, batch: int) -> dict:
    import vision.augment as new
    from vision.data import DataConfig

    old = module_at(before, "vision/data.py", "_before_vision_data")  # the engine lived in vision/data.py then
    data, augment = DataConfig(dataset="fashion_mnist"), new.AugmentConfig(re_prob=0.25, re_mode="pixel")
    worker = new.RandomErasingBoxes(augment.re_prob, augment.re_mode, augment.re_count)
    random.seed(0)
    images, boxes = torch.utils.data.default_collate(
        [worker(torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8)) for _ in range(batch)])
    was, now = old.NormalizeErase(data, augment), new.NormalizeErase(data, augment)
    no_boxes = torch.zeros_like(boxes)  # height 0: normalisation only
    base = now.images(images, no_boxes)
    sizes = now.fill_sizes(boxes, 3)

    def fill(vectorised: bool):
        x = base.clone()
        for k, total in enumerate(sizes):
            if total:
                (now._fill_vectorised if vectorised else now._fill)(x, boxes[:, k], k, total)
        return x

    reference = was._erase_masked(base.clone(), boxes)
    assert torch.equal(fill(False), reference) and torch.equal(fill(True), reference), "the outputs differ"
    assert torch.equal(was.images(images, no_boxes), base), "the normalisations differ"
    variants = {"erase before, CUDA path": lambda: was._erase_masked(base.clone(), boxes),
                "erase before, CPU path": lambda: was._erase_boxes(base.clone(), boxes),
                "erase now, accelerator path": lambda: fill(True), "erase now, CPU path": lambda: fill(False),
                "copy only": base.clone,
                "normalise before": lambda: was.images(images, no_boxes),
                "normalise now": lambda: now.images(images, no_boxes)}
    medians, _ = alternate(variants, rounds, "erase")
    copy = medians.pop("copy only")
    ms = {k: 1e3 * (v - copy if k.startswith("erase") else v) for k, v in medians.items()}
    boxed = int((boxes[:, :, 2] > 0).any(1).sum())
    out = {"batch": batch, "samples with a box": boxed, "ms (erase: less the copy of the batch)": ms,
           "CUDA path before / now": ms["erase before, CUDA path"] / ms["erase now, accelerator path"],
           "CPU path before / now": ms["erase before, CPU path"] / ms["erase now, CPU path"],
           "normalise before / now": ms["normalise before"] / ms["normalise now"]}
    print(f"erase (batch {batch}, {boxed} samples with a box), on this CPU: the accelerator path "
          f"{out['CUDA path before / now']:.1f}x faster than before ({ms['erase before, CUDA path']:.0f} -> "
          f"{ms['erase now, accelerator path']:.0f} ms), the CPU path {out['CPU path before / now']:.2f}x "
          f"({ms['erase before, CPU path']:.1f} -> {ms['erase now, CPU path']:.1f} ms); normalisation "
          f"{out['normalise before / now']:.2f}x ({ms['normalise before']:.0f} -> {ms['normalise now']:.0f} ms)")
    return out


def bench_ema(before: str, rounds: int, model_name: str, width: int) -> dict:
    import common.ema as new
    from diffusion.models import DiT_models

    old = module_at(before, "common/ema.py", "_before_common_ema")
    model = DiT_models[model_name](topology="siamese", **({"hidden_size": width, "num_heads": 3} if width else {}))
    was, now = old.ModelEma(model, 0.9999), new.ModelEma(model, 0.9999)
    skip = torch.zeros(())
    n = sum(1 for v in model.state_dict().values() if v.is_floating_point())
    medians, _ = alternate({"before": lambda: was.update(model, skip=skip), "now": lambda: now.update(model, skip=skip)},
                           rounds, "ema")
    assert all(torch.equal(a, b) for a, b in zip(was.state_dict().values(), now.state_dict().values()))
    out = {"model": f"{model_name} siamese" + (f" at width {width}" if width else ""), "lerped tensors": n,
           "ms": {k: 1e3 * v for k, v in medians.items()},
           "before / now": medians["before"] / medians["now"]}
    print(f"ema ({out['model']}, {n} tensors): now {1e3 * medians['now']:.1f} ms, before "
          f"{1e3 * medians['before']:.1f} ms: {out['before / now']:.2f}x")
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_hot_path", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the git revision to compare against (e.g. the merge base)")
    p.add_argument("--only", choices=("erase", "ema"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch-size", type=int, default=256, help="erase: images per batch (DeiT: 256 per GPU)")
    p.add_argument("--ema-model", default="DiT-B/2")
    p.add_argument("--ema-width", type=int, default=48, help="hidden size (0: the model's own)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = {}
    if a.only in (None, "erase"):
        out["erase"] = bench_erase(a.before, a.rounds, a.batch_size)
    if a.only in (None, "ema"):
        out["ema"] = bench_ema(a.before, a.rounds, a.ema_model, a.ema_width)
    return out


if __name__ == "__main__":
    main()
