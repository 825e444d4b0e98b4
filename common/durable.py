"""Durable file writes: after a kill or a power loss a path holds either its old content or its new content,
never a torn or empty file.

    with atomic_write("out/model.safetensors") as tmp:   # any writer that takes a path or opens one
        save_file(tensors, tmp)
    atomic_savez("out/chunk_000003.npz", images=images)
    atomic_write_text("out/settings.json", json.dumps(settings))

The new content goes to ``<name>.tmp`` next to the target, gets the permissions the user's umask gives a new file
(teammates on a shared file system read what a run writes), is flushed to disk (``fsync``), renamed over the
target (``os.replace``, atomic on POSIX), and the directory is flushed so the rename itself survives a power
loss. A failure removes the temporary file and leaves the target untouched.
"""
from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

from common.cli import InputError

PathLike = Union[str, os.PathLike]
TMP_SUFFIX = ".tmp"
# Write failures that are about the disk, not the program: they end in one line naming the file.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM)


class DiskWriteError(InputError, OSError):
    """A file could not be written for a reason of the disk (full, quota, read-only, permissions)."""


def disk_failure(err: BaseException) -> Optional[str]:
    """The disk's reason behind a failed write (``"No space left on device"``), or None for other failures.

    Libraries wrap the operating system's error: torch in a ``RuntimeError`` about zip positions, safetensors in a
    ``SafetensorError`` whose message carries it; the chain of causes and the message are both read.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_ERRNOS:
            return os.strerror(err.errno)
        for code in DISK_ERRNOS:
            if f"(os error {code})" in str(err) or os.strerror(code) in str(err):
                return os.strerror(code)
        err = err.__cause__ or err.__context__
    return None


def raise_disk_failure(err: BaseException, path: PathLike, kept: str) -> None:
    """Raise :class:`DiskWriteError` (one line: the file, the reason, what was kept) if ``err`` is a disk failure."""
    reason = disk_failure(err)
    if reason is not None:
        raise DiskWriteError(f"could not write {path}: {reason}. {kept} Free space (or fix the permissions) on "
                             f"{Path(path).parent} and run the same command again") from None


def _umask() -> int:
    """The process's umask: from /proc on Linux (no change to it, so no race with other threads), else by setting it
    and setting it straight back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_file(path: PathLike) -> None:
    """Flush a written file's data to disk (it may have been written by a library that closed it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: PathLike) -> None:
    """Flush a directory entry (a create or rename inside it) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def temporary_path(path: PathLike) -> Path:
    """Where :func:`atomic_write` puts the new content of ``path`` until it is complete."""
    path = Path(path)
    return path.with_name(path.name + TMP_SUFFIX)


@contextmanager
def atomic_write(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; on success make it durable and rename it over
    ``path``. Parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # writers that create private temporary files (safetensors: 0600)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only file system refuses even to remove what is not there
            pass
        raise_disk_failure(err, path, f"{path.name} keeps its previous content, if it had one." if path.exists()
                           else "Nothing was written there.")
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: PathLike, text: str) -> Path:
    with atomic_write(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_savez(path: PathLike, **arrays) -> Path:
    """``np.savez`` to exactly ``path`` (through an open file: numpy would append ``.npz`` to a bare name)."""
    import numpy as np

    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return Path(path)
