"""Durable file operations (STYLE.md 11): temp file in the same directory, fsync the file,
``os.replace``, fsync the directory. A gateway loses power at any moment; a rename is only
durable once the directory entry is on disk. Every write of ``ota`` goes through here."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def atomic_write(path: Path, data: bytes, *, mode: int = 0o640) -> None:
    """Replace ``path`` with ``data``: after a crash it holds the old bytes or the new ones.

    ``OSError`` (``ENOSPC`` included) leaves the old file untouched and no temp file behind.
    """
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
