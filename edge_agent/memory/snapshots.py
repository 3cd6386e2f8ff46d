"""Snapshots of the store, restore, and recovery from a corrupt file at start.

A snapshot is a consistent online copy and a checksummed manifest, written durably
(:func:`take_snapshot`); a restore verifies it before it replaces anything
(:func:`restore_snapshot`); a store found corrupt at start is moved aside and the newest
good snapshot restored (:func:`recover_if_corrupt`).

Design: ``docs/MEMORY.md``, "Snapshots, restore, recovery".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.memory._fs import (
    atomic_write_bytes,
    fsync_dir,
    fsync_file,
    iso_utc,
    sha256_file,
    sidecars,
    utc_stamp,
)
from edge_agent.memory.errors import SnapshotChecksumError, SnapshotError
from edge_agent.memory.store import SCHEMA_VERSION

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "edgefleet-memory-snapshot/1"
_PREFIX = "memory-"


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    name: str
    path: Path
    manifest: Path
    bytes: int
    sha256: str
    created_ns: int
    schema_version: int
    rows: dict[str, int]
    newest_ns: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "bytes": self.bytes,
            "sha256": self.sha256,
            "created_ns": self.created_ns,
            "created": iso_utc(self.created_ns),
            "schema_version": self.schema_version,
            "rows": self.rows,
            "newest_ns": self.newest_ns,
        }


@dataclass(frozen=True, slots=True)
class Recovery:
    """What happened at start when the database was found corrupt."""

    reason: str
    moved_to: Path
    restored_from: str | None
    at_ns: int

    def to_json(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "moved_to": str(self.moved_to),
            "restored_from": self.restored_from,
            "at_ns": self.at_ns,
            "at": iso_utc(self.at_ns),
        }


# -- taking -------------------------------------------------------------------------------------


def take_snapshot(db: Path, snapshot_dir: Path, *, keep: int, now_ns: int) -> SnapshotInfo:
    """Snapshot ``db`` into ``snapshot_dir``, then prune to the newest ``keep``.

    Blocking (seconds for a large store): run it in a worker thread. The writer is not
    blocked: the copy reads through its own connection inside one read transaction.

    A snapshot is two files in the snapshot directory:

    * ``memory-<UTC stamp>.db`` -- a consistent copy made with SQLite's online backup API in
      one step over a read transaction (WAL: the writer keeps committing meanwhile), switched
      to ``journal_mode=DELETE`` so it is one self-contained file;
    * ``memory-<UTC stamp>.json`` -- its manifest: size, sha256, creation time, schema version,
      row counts and the newest data time.

    Both are written as temp files in the same directory, fsynced, renamed into place, and the
    directory fsynced (STYLE.md 11). The manifest goes last: a snapshot without one (a crash
    half-way) does not exist and is cleaned up. Pruning keeps the newest ``keep``.
    """
    if not db.exists():
        raise SnapshotError(f"no memory store at {db}")
    name = _PREFIX + utc_stamp(now_ns)
    try:
        snapshot_dir.mkdir(parents=True, exist_ok=True)
        n = 1
        while (snapshot_dir / f"{name}.json").exists() or (snapshot_dir / f"{name}.db").exists():
            n += 1
            name = f"{_PREFIX}{utc_stamp(now_ns)}-{n}"
        final = snapshot_dir / f"{name}.db"
        tmp = snapshot_dir / f".tmp-{name}.db"
        tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise SnapshotError(f"snapshot directory {snapshot_dir} is not usable: {exc}") from exc
    try:
        src = sqlite3.connect(db, isolation_level=None, timeout=5.0)
        try:
            dst = sqlite3.connect(tmp, isolation_level=None)
            try:
                src.backup(dst)  # pages=-1: one step, one consistent read transaction
                dst.execute("PRAGMA journal_mode=DELETE").fetchone()
                rows, newest, version = _describe(dst)
            finally:
                dst.close()
        finally:
            src.close()
        fsync_file(tmp)
        digest, size = sha256_file(tmp)
        os.replace(tmp, final)
        fsync_dir(snapshot_dir)
    except (sqlite3.Error, OSError) as exc:
        tmp.unlink(missing_ok=True)
        raise SnapshotError(f"snapshot of {db} failed: {exc}") from exc
    info = SnapshotInfo(
        name=name,
        path=final,
        manifest=snapshot_dir / f"{name}.json",
        bytes=size,
        sha256=digest,
        created_ns=now_ns,
        schema_version=version,
        rows=rows,
        newest_ns=newest,
    )
    manifest = {
        "format": MANIFEST_FORMAT,
        "file": final.name,
        "bytes": size,
        "sha256": digest,
        "created_ns": now_ns,
        "created": iso_utc(now_ns),
        "schema_version": version,
        "source": str(db),
        "rows": rows,
        "newest_ns": newest,
    }
    try:
        atomic_write_bytes(info.manifest, (json.dumps(manifest, indent=2) + "\n").encode())
    except OSError as exc:
        final.unlink(missing_ok=True)
        raise SnapshotError(f"cannot write snapshot manifest {info.manifest}: {exc}") from exc
    try:
        prune(snapshot_dir, keep)
    except SnapshotError as exc:
        raise SnapshotError(f"snapshot {name} was written, but {exc}") from exc
    return info


def _describe(conn: sqlite3.Connection) -> tuple[dict[str, int], int | None, int]:
    rows = {
        t: int(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0])  # noqa: S608
        for t in ("changes", "decisions", "events")
    }
    hi = conn.execute("SELECT t_ns FROM changes ORDER BY id DESC LIMIT 1").fetchone()
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    return rows, (int(hi[0]) if hi else None), version


def prune(snapshot_dir: Path, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` snapshots, and leftovers of interrupted ones.

    Raises :class:`SnapshotError` when the directory cannot be read or a file not removed.
    """
    try:
        return _prune(snapshot_dir, keep)
    except OSError as exc:
        raise SnapshotError(f"pruning snapshots in {snapshot_dir} failed: {exc}") from exc


def _prune(snapshot_dir: Path, keep: int) -> list[str]:
    removed: list[str] = []
    snaps = list_snapshots(snapshot_dir)
    for info in snaps[keep:]:
        info.manifest.unlink(missing_ok=True)  # manifest first: the snapshot stops existing
        info.path.unlink(missing_ok=True)
        removed.append(info.name)
    listed = {s.path.name for s in snaps[:keep]}
    for leftover in snapshot_dir.glob(f"{_PREFIX}*.db"):
        if leftover.name not in listed and not leftover.with_suffix(".json").exists():
            leftover.unlink(missing_ok=True)
    for tmp in snapshot_dir.glob(".tmp-*"):
        tmp.unlink(missing_ok=True)
    if removed:
        fsync_dir(snapshot_dir)
    return removed


# -- listing and verifying ------------------------------------------------------------------------


def list_snapshots(snapshot_dir: Path) -> list[SnapshotInfo]:
    """Snapshots with a readable manifest, newest first (unreadable ones are logged, skipped)."""
    if not snapshot_dir.is_dir():
        return []
    out: list[SnapshotInfo] = []
    for manifest in snapshot_dir.glob(f"{_PREFIX}*.json"):
        try:
            out.append(_read_manifest(manifest))
        except SnapshotError as exc:
            log.warning("%s", exc)
    out.sort(key=lambda s: (s.created_ns, s.name), reverse=True)
    return out


def _read_manifest(manifest: Path) -> SnapshotInfo:
    try:
        raw = json.loads(manifest.read_text(encoding="utf-8"))
        file = str(raw["file"])
        info = SnapshotInfo(
            name=manifest.stem,
            path=manifest.with_name(file),
            manifest=manifest,
            bytes=int(raw["bytes"]),
            sha256=str(raw["sha256"]),
            created_ns=int(raw["created_ns"]),
            schema_version=int(raw["schema_version"]),
            rows={str(k): int(v) for k, v in dict(raw.get("rows", {})).items()},
            newest_ns=None if raw.get("newest_ns") is None else int(raw["newest_ns"]),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"unreadable snapshot manifest {manifest}: {exc}") from exc
    if raw.get("format") != MANIFEST_FORMAT:
        raise SnapshotError(
            f"snapshot manifest {manifest}: format {raw.get('format')!r}, "
            f"expected {MANIFEST_FORMAT!r}"
        )
    if "/" in file or file.startswith("."):
        raise SnapshotError(f"snapshot manifest {manifest}: bad file name {file!r}")
    return info


def find_snapshot(snapshot_dir: Path, ref: str) -> SnapshotInfo:
    """A snapshot by name (``memory-...``, with or without ``.db``/``.json``) or by path."""
    p = Path(ref)
    stem = p.stem if p.suffix in (".db", ".json") else p.name
    folder = p.parent if len(p.parts) > 1 else snapshot_dir
    manifest = folder / f"{stem}.json"
    if manifest.is_file():
        return _read_manifest(manifest)
    names = ", ".join(s.name for s in list_snapshots(snapshot_dir)) or "none"
    raise SnapshotError(f"no snapshot {ref!r} in {snapshot_dir}; available: {names}")


def verify_snapshot(info: SnapshotInfo) -> None:
    """Size and sha256 against the manifest; raises :class:`SnapshotChecksumError`."""
    if not info.path.is_file():
        raise SnapshotError(f"snapshot file {info.path} is missing")
    digest, size = sha256_file(info.path)
    if size != info.bytes or digest != info.sha256:
        raise SnapshotChecksumError(
            f"snapshot {info.name} does not match its manifest "
            f"(size {size} vs {info.bytes}, sha256 {digest[:16]}... vs {info.sha256[:16]}...); "
            "refusing to restore it"
        )
    if info.schema_version > SCHEMA_VERSION:
        raise SnapshotError(
            f"snapshot {info.name} has schema version {info.schema_version}, newer than this "
            f"agent's ({SCHEMA_VERSION})"
        )


# -- restoring ----------------------------------------------------------------------------------


def restore_snapshot(info: SnapshotInfo, db: Path, *, now_ns: int) -> Path | None:
    """Roll ``db`` back to ``info``. The caller holds the store lock and no connection.

    Returns where the previous database was kept (``None`` if there was none).

    Restore verifies size and sha256 against the manifest (:class:`SnapshotChecksumError`
    otherwise, nothing touched), copies the snapshot next to the database, runs
    ``PRAGMA quick_check`` on the copy, keeps the current database as
    ``<name>.before-restore-<stamp>`` (a hard link), removes the old WAL and shared-memory files
    (a stale WAL applied to another file would corrupt it) and renames the copy into place.
    """
    verify_snapshot(info)
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = db.with_name(f".restore-{db.name}")
    try:
        shutil.copyfile(info.path, tmp)
        fsync_file(tmp)
        problem = check_database(tmp)
        if problem is not None:
            raise SnapshotError(f"snapshot {info.name} fails its integrity check: {problem}")
        # The checksum was of the file as read; make sure the copy is what we verified.
        digest, _ = sha256_file(tmp)
        if digest != info.sha256:
            raise SnapshotChecksumError(f"copy of snapshot {info.name} changed while copying")
        kept: Path | None = None
        if db.exists():
            _checkpoint_quietly(db)
            kept = db.with_name(f"{db.name}.before-restore-{utc_stamp(now_ns)}")
            try:
                os.link(db, kept)
            except OSError:
                shutil.copyfile(db, kept)
        for side in sidecars(db):
            side.unlink(missing_ok=True)
        os.replace(tmp, db)
        fsync_dir(db.parent)
    except OSError as exc:
        raise SnapshotError(f"restore of {info.name} into {db} failed: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    log.warning("memory store %s rolled back to snapshot %s", db, info.name)
    return kept


def _checkpoint_quietly(db: Path) -> None:
    """Fold a leftover WAL into the old file before it is kept aside (best effort)."""
    with contextlib.suppress(sqlite3.Error):
        conn = sqlite3.connect(db, isolation_level=None, timeout=1.0)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            conn.close()


def check_database(path: Path) -> str | None:
    """None when ``path`` opens and passes ``PRAGMA quick_check``; else what is wrong."""
    try:
        conn = sqlite3.connect(path, isolation_level=None, timeout=5.0)
    except sqlite3.Error as exc:
        return f"cannot open: {exc}"
    try:
        result = [str(r[0]) for r in conn.execute("PRAGMA quick_check(20)")]
    except sqlite3.Error as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    if result == ["ok"]:
        return None
    return "; ".join(result)[:2000]


def recover_if_corrupt(db: Path, snapshot_dir: Path, *, now_ns: int) -> Recovery | None:
    """At start, with the store lock held: check ``db``; if corrupt, move it aside and restore
    the newest good snapshot. Returns what was done, or None when the file was fine/absent.

    At start, :func:`recover_if_corrupt` runs ``PRAGMA quick_check``; a file that fails it or
    cannot be opened is moved aside as ``<name>.corrupt-<stamp>`` (with its WAL) and the newest
    snapshot that verifies is restored, both logged at ERROR. With no good snapshot the agent
    starts with an empty store, also logged at ERROR.
    """
    if not db.exists() or db.stat().st_size == 0:
        return None
    problem = check_database(db)
    if problem is None:
        return None
    stamp = utc_stamp(now_ns)
    aside = db.with_name(f"{db.name}.corrupt-{stamp}")
    os.replace(db, aside)
    for side in sidecars(db):
        if side.exists():
            os.replace(side, side.with_name(f"{side.name}.corrupt-{stamp}"))
    fsync_dir(db.parent)
    log.error("memory store %s is corrupt (%s); moved aside to %s", db, problem, aside)
    restored: str | None = None
    for info in list_snapshots(snapshot_dir):
        try:
            restore_snapshot(info, db, now_ns=now_ns)
        except SnapshotError as exc:
            log.error("memory recovery: snapshot %s unusable: %s", info.name, exc)
            continue
        restored = info.name
        break
    if restored is not None:
        log.error(
            "memory store %s restored from snapshot %s after corruption; data after it is lost",
            db,
            restored,
        )
    else:
        log.error("memory store %s: no good snapshot to restore; starting empty", db)
    return Recovery(reason=problem, moved_to=aside, restored_from=restored, at_ns=now_ns)


__all__ = [
    "MANIFEST_FORMAT",
    "Recovery",
    "SnapshotInfo",
    "check_database",
    "find_snapshot",
    "list_snapshots",
    "prune",
    "recover_if_corrupt",
    "restore_snapshot",
    "take_snapshot",
    "verify_snapshot",
]
