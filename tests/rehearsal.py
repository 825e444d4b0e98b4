"""Shared pieces of the rehearsal tests: an ImageNet-like folder with the real thing's oddities, the user-facing
commands run as users run them (``python -m ...`` / ``torchrun``, from the repository root), the check that a run
changed nothing of its recipe but what the test shrank, and an Inception weights file with random weights in
torch-fidelity's layout (also used by test_fid.py).

A one-process command runs in the test's own process, without an interpreter that starts and imports torch for it:
the module's ``main(argv)``, which ``python -m`` calls, its output captured at the file descriptors and the
process-wide state it finds or changes set and put back around it (:func:`run_in_process`). A ``torchrun`` command
is a real launch of real processes: what it proves (gloo, ranks, the launcher) needs them. The stop signals that
only a command's own process acts on are tested where they are the point (test_faults.py, test_latents.py,
test_sample.py).

The image files are the kinds a real ImageNet copy holds besides plain RGB JPEGs: very different sizes and aspect
ratios, grayscale and CMYK JPEGs, a PNG under a ``.JPEG`` name, an EXIF orientation tag, and one truncated file
(the only unreadable one).
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from common.config import flatten, read_yaml
from common.preemption import STOP_SIGNALS

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
    """``python -m MODULE ARGS`` from the repository root on one compute thread, as a user runs it on a CPU: in this
    process (:func:`run_in_process`), or with ``nproc`` > 1 ``torchrun --nproc_per_node NPROC -m MODULE ARGS``, a
    subprocess (one thread per process: tests/conftest.py) ended after ``timeout`` seconds."""
    argv = [str(a) for a in args]
    if nproc == 1:
        return run_in_process(module, argv)
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, *launcher, "-m", module, *argv]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_in_process(module: str, argv: list) -> subprocess.CompletedProcess:
    """``MODULE.main(argv)``, what ``python -m MODULE ARGS`` runs, returning what the process would have: its
    output on file descriptors 1 and 2 (DataLoader workers', tqdm's, logging's and warnings' included) and the exit
    status the interpreter gives (``SystemExit``'s code; 1 with the traceback for an exception)."""
    main = importlib.import_module(module).main
    with captured_fds() as output, as_in_a_fresh_process(module, argv):
        try:
            main(argv)
            returncode = 0
        except SystemExit as stop:
            returncode = exit_status(stop.code)
        except Exception:
            traceback.print_exc()
            returncode = 1
        gc.collect()  # the run's DataLoader workers end now, their last output still captured
    return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], returncode, output["stdout"],
                                       output["stderr"])


def exit_status(code) -> int:
    """The interpreter's exit status for ``SystemExit(code)``: 0 for None, a number as it is, anything else printed
    on stderr and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


@contextlib.contextmanager
def captured_fds():
    """File descriptors 1 and 2 into temporary files, read into ``{"stdout": ..., "stderr": ...}`` at the end, as
    pytest's ``capfd``: child processes inherit them, ``sys.stdout`` / ``sys.stderr`` write on them, and so do
    logging's handlers that wrote on the streams before."""
    output, streams = {}, (sys.stdout, sys.stderr)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for stream in streams:
            stream.flush()
        saved_fds = [os.dup(1), os.dup(2)]
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        captured = tuple(open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
                         for fd in (1, 2))
        sys.stdout, sys.stderr = captured
        move_log_handlers(streams, captured)
        try:
            yield output
        finally:
            for stream in captured:
                stream.flush()
            move_log_handlers(captured, streams)
            sys.stdout, sys.stderr = streams
            for fd, saved in zip((1, 2), saved_fds):
                os.dup2(saved, fd)
                os.close(saved)
            for name, file in (("stdout", out), ("stderr", err)):
                file.seek(0)  # read as subprocess.run(text=True) reads: universal newlines (tqdm's "\r" ends a line)
                output[name] = file.read().decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")


def move_log_handlers(streams, to) -> None:
    """Logging's handlers that hold one of ``streams`` write on its counterpart in ``to`` (one that looks up
    ``sys.stderr`` as it writes, as logging's last resort does, holds none)."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for handler in (h for logger in loggers for h in getattr(logger, "handlers", ())):
        for stream, new in zip(streams, to):
            if isinstance(handler, logging.StreamHandler) and vars(handler).get("stream") is stream:
                handler.setStream(new)


@contextlib.contextmanager
def as_in_a_fresh_process(module: str, argv: list):
    """What a command finds in a process of its own, and puts back what it changes there: accelerate's state, one
    compute thread, the repository root as working directory, ``sys.argv``, the environment, the signal handlers,
    a root logger without handlers (pytest's would take what logging's last resort prints on stderr), and warnings
    printed on stderr under the filters in force (pytest records them otherwise, and loses a DataLoader worker's)."""
    import torch
    from accelerate.state import AcceleratorState

    threads, cwd, sys_argv, environ = torch.get_num_threads(), os.getcwd(), sys.argv, dict(os.environ)
    handlers = {number: signal.getsignal(number)
                for number in (signal.SIGINT, *(getattr(signal, name) for name in STOP_SIGNALS))}
    root_logger = logging.getLogger()
    root_handlers, root_logger.handlers = root_logger.handlers, []
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(1)
    os.chdir(ROOT)
    sys.argv = [importlib.util.find_spec(module).origin, *argv]
    try:
        with warnings.catch_warnings():  # which also forgets the warnings shown once already
            warnings.showwarning = show_on_stderr
            yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.set_num_threads(threads)
        os.chdir(cwd)
        sys.argv = sys_argv
        os.environ.clear()
        os.environ.update(environ)
        for number, handler in handlers.items():
            signal.signal(number, handler)
        root_logger.handlers = root_handlers


def show_on_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    """Python's own display of a warning: formatted, on ``sys.stderr``."""
    (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Assert exit code 0, showing the end of the output otherwise."""
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{' '.join(proc.args)}\n{proc.stderr[-4000:]}"
    return proc
