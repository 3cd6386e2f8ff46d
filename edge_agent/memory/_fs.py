"""Durable file operations (STYLE.md 11): temp file in the same directory, fsync the file,
``os.replace``, fsync the directory. Gateways lose power; a rename is only durable once the
directory entry is on disk."""

from __future__ import annotations

import hashlib
import os
from datetime import UTC, datetime
from pathlib import Path

# One fsync_dir for every package (edge_agent may import ota); re-exported for memory/.
from ota.fsutil import fsync_dir

__all__ = [
    "atomic_write_bytes",
    "fsync_dir",
    "fsync_file",
    "iso_utc",
    "sha256_file",
    "sidecars",
    "utc_stamp",
]

_CHUNK = 1 << 20


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file."""
    tmp = path.with_name(f".tmp-{path.name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_file(path: Path) -> tuple[str, int]:
    """``(hex sha256, size in bytes)`` of ``path``, read in 1 MiB blocks (hashlib drops the
    GIL on large blocks, so this is cheap to run in a worker thread)."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def utc_stamp(t_ns: int) -> str:
    """``20250102T030405.678Z``: sortable, safe in file names."""
    dt = datetime.fromtimestamp(t_ns / 1e9, tz=UTC)
    return dt.strftime("%Y%m%dT%H%M%S") + f".{(t_ns // 1_000_000) % 1000:03d}Z"


def iso_utc(t_ns: int) -> str:
    """RFC 3339 UTC with milliseconds, e.g. ``2025-01-02T03:04:05.678Z``."""
    dt = datetime.fromtimestamp(t_ns / 1e9, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{(t_ns // 1_000_000) % 1000:03d}Z"


def sidecars(db: Path) -> tuple[Path, Path]:
    """SQLite's ``-wal`` and ``-shm`` files of ``db``."""
    return db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")
