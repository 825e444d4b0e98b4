"""Command-line conventions shared by every entry point: bad input ends in one line naming the fix.

    with one_line_errors():
        run(cfg)

Errors about the user's input -- a setting, a missing file or dataset, a damaged or incompatible checkpoint,
a locked run directory, a diverged run, a full or read-only disk, and the error types an entry point names --
end the process with status 2 (argparse's status for bad arguments) and their message instead of a traceback;
with several processes, every one exits 2 and the message is printed once (by rank 0; another rank's own
error after a short wait). Anything else (a bug) keeps its
traceback.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RANK_ERROR_DELAY_S = 10.0  # long enough for rank 0 to meet the same error on a loaded machine


class InputError(ValueError):
    """Base class of the project's errors about user input (settings, files, run directories)."""


def _raised_by_project(err: BaseException) -> bool:
    """A plain ValueError raised by this project's own checks (they carry the fix), not by a library."""
    frames = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(err.__traceback__)]
    return bool(frames) and Path(frames[-1]).resolve().parent.parent == PROJECT_ROOT


def is_input_error(err: BaseException) -> bool:
    from common.checkpoint import CheckpointError
    from common.config import ConfigError
    from common.durable import DiskWriteError
    from common.logging import NonFiniteLossError
    from common.train_state import RunLockedError

    if isinstance(err, (InputError, ConfigError, CheckpointError, FileNotFoundError, NonFiniteLossError,
                        RunLockedError, DiskWriteError)):
        return True
    return type(err) is ValueError and _raised_by_project(err)


class InputExit(SystemExit):
    """Exit status 2 that still reads as its message (``str(exit)``) to a caller that catches it."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def one_line_errors(*input_errors: type):
    """Turn input errors (and ``input_errors``, an entry point's own error types) into ``error: ...`` on
    stderr and exit status 2."""
    try:
        yield
    except Exception as err:
        if not (isinstance(err, input_errors) or is_input_error(err)):
            raise
        message = f"error: {err}"
        rank = os.environ.get("RANK", "0")
        if rank != "0":
            # Every rank meets the same bad input; rank 0 says it. The launcher ends the other ranks as soon as one
            # exits, so they wait first: a rank's own error (one rank 0 does not meet) is still printed after it.
            time.sleep(RANK_ERROR_DELAY_S)
            message = f"error (rank {rank}): {err}"
        print(message, file=sys.stderr, flush=True)
        raise InputExit(message) from None
