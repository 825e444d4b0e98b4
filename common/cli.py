"""Command-line conventions shared by every entry point: bad input ends in one line naming the fix.

    with one_line_errors():
        run(cfg)

An error about the user's input is an :class:`InputError` (a ``ValueError``): a setting, a missing or damaged
file, a locked or read-only run directory, a diverged run, a full disk. The project raises it, or one of its
subclasses (``ConfigError``, ``CheckpointError``, ``ResumeError``, ``RunLockedError``, ``DiskWriteError``, ...),
wherever it checks what the user gave; it ends the process with status 2 (argparse's status for bad arguments)
and one line ``error: <message>``. Anything else keeps its traceback: a plain ``ValueError`` or
``FileNotFoundError`` is a bug until a check declares it an input error.

Several processes: say-once is rank 0's job. Every process runs the same command on the same input, so rank 0
prints the line and every other rank exits 2 without printing it; nothing waits for anything. A message only
another rank meets (a file its node cannot read, its own disk) is not lost: every rank also writes its message
to the launcher's error file (``TORCHELASTIC_ERROR_FILE``, which torchrun and accelerate launch give each
process, and ``scripts/cluster/srun_task.sh`` under SLURM), and the launcher's failure summary shows it with the
rank (under SLURM, ``scripts/cluster/train.sbatch`` prints each distinct message with the ranks that met it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import NoReturn


class InputError(ValueError):
    """The project's one type of error about user input (settings, files, run directories); one line, exit 2."""


class InputNotFoundError(InputError, FileNotFoundError):
    """A file or folder the input names does not exist (still a ``FileNotFoundError`` for Python callers)."""


class InputExit(SystemExit):
    """Exit status 2 that still reads as its message (``str(exit)``) to a caller that catches it."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def process_rank() -> int:
    """This process's rank as the launcher set it (torchrun, accelerate launch, srun_task.sh); 0 alone."""
    return int(os.environ.get("RANK", "0") or 0)


def _record_for_launcher(message: str, rank: int) -> None:
    """Write ``message`` to the launcher's error file of this process (``TORCHELASTIC_ERROR_FILE``), in
    torch.distributed.elastic's format: its failure summary prints ``py_callstack`` (the message and the rank),
    scripts/cluster/train.sbatch groups the ``message`` fields. Nothing without a launcher."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    shown = message if rank == 0 else f"{message} (rank {rank})"
    record = {"message": {"message": message, "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))}}}
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass  # the line on rank 0 and the exit status remain


def exit_input_error(err: BaseException) -> NoReturn:
    """End this process with status 2: ``error: <err>`` on rank 0's stderr, the launcher's error file on every rank."""
    message = f"error: {err}"
    rank = process_rank()
    _record_for_launcher(message, rank)
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    raise InputExit(message) from None


@contextlib.contextmanager
def one_line_errors(*entry_point_errors: type):
    """Turn an :class:`InputError` into ``error: ...`` on stderr and exit status 2; every other exception passes
    with its traceback. ``entry_point_errors`` names an entry point's own error types for the reader; each must be
    an :class:`InputError` (one type decides what is input)."""
    for kind in entry_point_errors:
        if not (isinstance(kind, type) and issubclass(kind, InputError)):
            raise TypeError(f"{kind!r} is not an InputError subclass; declare it as one to give it one line")
    try:
        yield
    except InputError as err:
        exit_input_error(err)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are said once: argparse's usage and ``PROG: error: ...`` on rank 0, exit
    status 2 on every rank."""

    def error(self, message: str) -> NoReturn:
        rank = process_rank()
        _record_for_launcher(f"{self.prog}: error: {message}", rank)
        if rank == 0:
            super().error(message)  # prints the usage and the message, exits 2
        raise InputExit(f"{self.prog}: error: {message}")
