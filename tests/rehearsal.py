"""Shared pieces of the rehearsal tests: an ImageNet-like folder with the real thing's oddities, the user-facing
commands run as users run them (``python -m ...`` / ``torchrun``, in a subprocess, from the repository root), the
check that a run changed nothing of its recipe but what the test shrank, and an Inception weights file with random
weights in torch-fidelity's layout (also used by test_fid.py).

The image files are the kinds a real ImageNet copy holds besides plain RGB JPEGs: very different sizes and aspect
ratios, grayscale and CMYK JPEGs, a PNG under a ``.JPEG`` name, an EXIF orientation tag, and one truncated file
(the only unreadable one).
"""
from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from common.config import flatten, read_yaml

ROOT = Path(__file__).resolve().parents[1]
WNIDS = ("n01440764", "n01443537", "n01484850", "n01491361")
# (width, height): thin strips, a typical photo, a thumbnail, portrait, a small square
SIZES = ((40, 300), (500, 375), (17, 17), (300, 40), (375, 500), (64, 48), (90, 33))
TRUNCATED = "truncated.JPEG"
ODD_KINDS = ("gray", "cmyk", "png", "exif")


def _photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Smooth colour gradients plus noise: JPEG-friendly, different per image."""
    yy, xx = np.mgrid[0:height, 0:width] / max(width, height)
    base = rng.uniform(0, 255, 3) * 0.5 + 60 * np.stack([np.sin(5 * xx), np.cos(3 * yy), xx * yy], -1)
    noise = rng.normal(0, 20, (height, width, 3))
    return Image.fromarray(np.clip(base + 60 + noise, 0, 255).astype(np.uint8))


def _write(path: Path, image: Image.Image, kind: str) -> None:
    if kind == "gray":
        image.convert("L").save(path, "JPEG", quality=90)
    elif kind == "cmyk":
        image.convert("CMYK").save(path, "JPEG", quality=90)
    elif kind == "png":
        image.save(path, "PNG")  # PNG bytes under a .JPEG name, as a few ImageNet files are
    elif kind == "exif":
        exif = Image.Exif()
        exif[0x0112] = 6  # Orientation: rotate 90 CW to display
        image.save(path, "JPEG", quality=90, exif=exif)
    else:
        image.save(path, "JPEG", quality=90)


def write_image_folder(root: Path, classes: int, per_class: int, seed: int, truncated_in: int = 0) -> dict:
    """``root/<wnid>/*.JPEG``: ``per_class`` files per class cycling through SIZES, the odd kinds (gray, CMYK,
    PNG bytes, EXIF) spread over the classes, and one truncated JPEG in class ``truncated_in``.

    Returns ``{"files": n, "truncated": relative path, "kinds": {kind: relative path}}``.
    """
    rng = np.random.default_rng(seed)
    kinds, n = {}, 0
    for c, wnid in enumerate(WNIDS[:classes]):
        folder = root / wnid
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            width, height = SIZES[(i + c) % len(SIZES)]
            kind = ODD_KINDS[(2 * c + i) % len(ODD_KINDS)] if i < 2 else "rgb"
            name = f"{wnid}_{i:04d}.JPEG"
            _write(folder / name, _photo(rng, width, height), kind)
            kinds.setdefault(kind, f"{wnid}/{name}")
            n += 1
    buffer = io.BytesIO()
    _photo(rng, 320, 240).save(buffer, "JPEG", quality=90)
    truncated = f"{WNIDS[truncated_in]}/{TRUNCATED}"
    (root / truncated).write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    assert set(kinds) == {"rgb", *ODD_KINDS}, kinds  # every oddity is present
    return {"files": n + 1, "truncated": truncated, "kinds": kinds}


def recipe_changes(recipe: Path, run_dir: Path) -> dict:
    """The settings of a recipe (with its ``base:`` files) that a run's saved ``config.yaml`` holds differently,
    ``{"section.key": (recipe value, run value)}``: what the command line changed."""
    want = flatten(read_yaml(recipe))
    got = flatten(yaml.safe_load((run_dir / "config.yaml").read_text()))
    return {k: (v, got.get(k)) for k, v in want.items() if got.get(k) != v}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(module: str, *args, nproc: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` (or ``torchrun --nproc_per_node NPROC -m MODULE ARGS``) from the repository root,
    one compute thread per process (tests/conftest.py), as a user runs it on a CPU."""
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                      "--master_port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, *launcher, "-m", module, *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Assert exit code 0, showing the end of the output otherwise."""
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{' '.join(proc.args)}\n{proc.stderr[-4000:]}"
    return proc
