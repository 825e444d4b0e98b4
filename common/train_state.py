"""Training checkpoints that survive a kill at any moment, and resume exactly.

A training checkpoint is one ``torch.save`` file ``<dir>/step_<step:09d>.pt`` holding a plain dict that the
trainer fills, by convention::

    {"model": state_dict, "ema": state_dict | None, "optimizer": ..., "scheduler": ..., "step": int,
     "epoch": int, "sampler": sampler.state_dict(), "rng": [capture_rng_state() of rank 0, rank 1, ...],
     "config": plain dict, "weights_metadata": what the task writes into its weights files, ...}

Everything in it is readable with ``torch.load(weights_only=True)`` (no pickled code), so
``common.checkpoint.load_weights(model, path)`` can read the weights straight out of it (``key="ema"``
for the EMA weights).

* :class:`CheckpointManager` writes atomically (temporary file, fsync, ``os.replace``) so a kill leaves
  either the previous complete checkpoint or the new complete one, never a truncated file under a final
  name; :meth:`CheckpointManager.latest` skips unreadable files anyway (a disk that filled up), and
  retention keeps the last ``keep_last`` checkpoints plus every ``keep_every``-th step.
* :func:`capture_rng_state` / :func:`restore_rng_state`: python, numpy, torch CPU and all CUDA devices,
  in a ``weights_only``-safe form.
* :func:`resolve_resume`: ``resume`` setting (``None`` / ``"auto"`` / a path) -> the file to load or None.
* :func:`preserved_rng`: run evaluation or sampling without moving the training randomness.
* :class:`RunLock`: one run per run directory.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import random
import re
import socket
import warnings
from pathlib import Path
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from common.cli import InputError, InputNotFoundError
from common.durable import atomic_write

CKPT_PATTERN = re.compile(r"^step_(\d+)\.pt$")


def step_stem(step: int) -> str:
    """``step_000000010``: the name of a step's files (its checkpoint ``.pt``, a DiT run's sample grid ``.png``), one
    width for all so that they sort by step and line up."""
    return f"step_{step:09d}"


# ----------------------------------------------------------------------------- RNG state

def capture_rng_state() -> dict:
    """The state of every global random generator, as tensors/ints/tuples (``weights_only``-loadable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) != torch.cuda.device_count():
            warnings.warn(f"checkpoint has CUDA RNG states for {len(cuda_states)} devices, this process sees "
                          f"{torch.cuda.device_count()}; restoring the overlap")
        for i, s in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


@contextlib.contextmanager
def preserved_rng():
    """Run a block (an evaluation, a sample grid) and put every global random generator back as it was."""
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)


# ----------------------------------------------------------------------------- files

def atomic_torch_save(obj, path: Union[str, os.PathLike]) -> Path:
    """``torch.save`` to ``<path>.tmp``, flush to disk, rename over ``path`` (:func:`common.durable.atomic_write`)."""
    path = Path(path)
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)  # through a file object, a full disk surfaces as the OSError it is
    return path


def checkpoint_size(model: torch.nn.Module, ema: bool) -> Tuple[int, int]:
    """``(bytes of one training checkpoint, bytes of one weights file)`` of ``model``, known before any is written:
    its weights and buffers, the EMA's copy, and the optimizer's two moments (AdamW's, LAMB's) of every trained
    weight."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return weights * (2 if ema else 1) + moments, weights


def load_training_checkpoint(path: Union[str, os.PathLike]) -> dict:
    """Read a training checkpoint without executing code (``weights_only=True``)."""
    from common.checkpoint import read_file  # a damaged file becomes a CheckpointError naming it

    return read_file(path)


class CheckpointManager:
    """Numbered training checkpoints in one directory, with atomic writes and retention.

    Args:
        directory: where ``step_<n>.pt`` files live.
        keep_last: how many of the newest checkpoints to keep (>= 1).
        keep_every: also keep every checkpoint whose step is a multiple of this (None: none extra).
    """

    def __init__(self, directory: Union[str, os.PathLike], keep_last: int = 2, keep_every: Optional[int] = None):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1 so that resuming stays possible")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every={keep_every} must be a positive number of steps or null")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_every = keep_every

    def path_for(self, step: int) -> Path:
        return self.directory / f"{step_stem(step)}.pt"

    def steps(self) -> List[int]:
        """Steps of the complete-named checkpoint files, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [int(m.group(1)) for p in self.directory.iterdir() if (m := CKPT_PATTERN.match(p.name))]
        return sorted(found)

    def save(self, state: dict, step: int) -> Path:
        path = atomic_torch_save(state, self.path_for(step))
        self.prune()
        return path

    def prune(self) -> None:
        steps = self.steps()
        keep = set(steps[-self.keep_last:])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                self.path_for(s).unlink(missing_ok=True)

    def latest(self) -> Optional[Tuple[Path, dict]]:
        """Newest checkpoint that loads completely, as ``(path, state)``; None if there is none.

        Unreadable newer files (a kill or a full disk mid-write) are skipped with a warning; if every checkpoint is
        unreadable the run stops here, naming them, rather than restarting from step 0 over them.
        """
        steps = self.steps()
        failures = []
        for step in reversed(steps):
            path = self.path_for(step)
            try:
                return path, load_training_checkpoint(path)
            except Exception as err:  # a truncated or foreign file: fall back to the previous one
                failures.append(f"{path.name} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
                warnings.warn(f"skipping unreadable checkpoint {path}: {type(err).__name__}: {err}")
        if failures:
            from common.checkpoint import CheckpointError

            raise CheckpointError(f"no readable checkpoint in {self.directory}: {'; '.join(failures)}. Restore one of "
                                  "them, or move the directory away to start the run over")
        return None


def resolve_resume(resume: Optional[str], manager: CheckpointManager) -> Optional[Tuple[Path, dict]]:
    """Turn the ``resume`` setting into ``(path, state)`` or None.

    ``None``/``"none"``: start fresh; ``"auto"``: newest complete checkpoint in the run, or fresh if none;
    anything else: that file, which must exist.
    """
    if resume is None or str(resume).lower() in ("", "none", "false"):
        return None
    if str(resume).lower() == "auto":
        return manager.latest()
    path = Path(resume)
    if not path.is_file():
        raise InputNotFoundError(f"resume={resume!r}: no such checkpoint file; use resume=auto to continue the "
                                f"newest checkpoint in {manager.directory}, or resume=null to start fresh")
    return path, load_training_checkpoint(path)


def restore_process_rng(rng_states: list, rank: int, world: int, path) -> None:
    """Restore this rank's RNG states from a checkpoint written by ``len(rng_states)`` processes.

    With another process count the states cannot be matched to ranks: warn and keep the fresh seeds (per-sample
    seeded data stays identical; only global-RNG users such as drop path or mixup are re-seeded).
    """
    if len(rng_states) == world:
        restore_rng_state(rng_states[rank])
    else:
        warnings.warn(f"{path} was written by {len(rng_states)} processes, this run has {world}: the data order stays "
                      "the same, but randomness drawn from the global RNGs is re-seeded")


class RunLockedError(InputError, RuntimeError):
    """The run directory is in use by another live run."""


class RunDirectoryError(InputError):
    """The run directory cannot be written (a read-only file system, missing permissions)."""


def _cannot_write(run_dir: Path, reason: str) -> RunDirectoryError:
    return RunDirectoryError(f"cannot write the run directory {run_dir} ({reason}): give train.output_dir a place "
                             "this process may write to, or fix the permissions")


def check_run_directory(run_dir: Union[str, os.PathLike]) -> None:
    """Refuse, before any work, a run directory that cannot be written: the directory, or the nearest existing
    folder above it where it would be made, must be writable (``os.access``, which also reports a read-only mount)."""
    run_dir = Path(run_dir)
    existing = next((p for p in (run_dir, *run_dir.absolute().parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise _cannot_write(run_dir, f"{existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only_mount(existing) else f"no write permission on {existing}"
        raise _cannot_write(run_dir, reason)


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


_HELD_LOCK_FDS: set = set()


def _close_lock_fds_in_child() -> None:
    # A forked child (a DataLoader worker) must not share the lock: with it, an orphaned worker of a killed run
    # would keep the run directory locked for the seconds it takes to notice its parent is gone.
    for fd in _HELD_LOCK_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_lock_fds_in_child)


class RunLock:
    """One run per run directory: an exclusive ``flock`` on ``<run_dir>/.lock``, held while the run lives.

    The kernel drops the lock when its process dies (``kill -9`` included), so the lock of a killed run is taken
    over by the next one; :meth:`acquire` then returns what that run had written into the file (who and when).
    Forked children (DataLoader workers) close their copy, so only the run's own process holds it.
    """

    def __init__(self, run_dir: Union[str, os.PathLike]):
        self.path = Path(run_dir) / ".lock"
        self.fd: Optional[int] = None

    def acquire(self) -> str:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides
        except OSError as err:  # read-only, no permission, a file in the way
            raise _cannot_write(self.path.parent, err.strerror or str(err)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunLockedError(f"{self.path.parent} is in use by another run ({holder}); wait for it to finish, or "
                               "give this run another train.output_dir") from None
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        started = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}".encode(), 0)
        os.fsync(fd)
        self.fd = fd
        _HELD_LOCK_FDS.add(fd)
        return previous

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)  # an empty file: released cleanly (a killed run leaves its line behind)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        _HELD_LOCK_FDS.discard(self.fd)
        os.close(self.fd)
        self.fd = None
