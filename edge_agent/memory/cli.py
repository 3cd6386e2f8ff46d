"""``edge-agent memory``: look into the memory store from a shell, list and restore snapshots.

The store is found through ``--config`` (its ``[memory]`` section and ``agent.state_dir``)
or given with ``--db``. Reads open it read-only, safe while the agent runs; ``restore`` needs
the agent stopped (it takes the store's writer lock).

Exit codes: 0 ok; 1 the operation failed (no store, checksum mismatch, agent running,
declined); 2 bad usage or input. Diagnostics go to stderr; ``--json`` prints one JSON
document on stdout.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from edge_agent.config import load_config
from edge_agent.console import make_console
from edge_agent.errors import ConfigError
from edge_agent.memory._fs import iso_utc
from edge_agent.memory.config import MemorySection
from edge_agent.memory.errors import (
    MemoryStoreError,
    SnapshotChecksumError,
    SnapshotError,
    StoreLocked,
)
from edge_agent.memory.snapshots import (
    SnapshotInfo,
    find_snapshot,
    list_snapshots,
    restore_snapshot,
    verify_snapshot,
)
from edge_agent.memory.store import MemoryStore, StoreLock

memory_app = typer.Typer(
    name="memory",
    help="Inspect the memory store: history of a signal, sizes, snapshots, restore.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEFAULT_CONFIG = Path("/etc/edge-agent/agent.toml")

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help=f"Agent config (TOML). Default: {DEFAULT_CONFIG}."),
]
DbOpt = Annotated[
    Path | None, typer.Option("--db", help="Memory database file (instead of the config's).")
]
SnapDirOpt = Annotated[
    Path | None,
    typer.Option("--snapshot-dir", help="Snapshot directory (instead of the config's)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]

_RELATIVE = re.compile(r"^-?(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)$")
_UNIT_NS = {"ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9, "d": 86_400 * 10**9}
_UNIT_NS["w"] = 7 * _UNIT_NS["d"]


def parse_time(text: str, now_ns: int) -> int:
    """UNIX ns from ``now``, a relative age (``30s``, ``10m``, ``2h``, ``1d``, ``1w``, ``500ms``:
    that long before now) or ISO 8601 (``2025-01-02T03:04:05Z``; no zone means UTC).
    Raises ValueError with what was expected."""
    s = text.strip()
    if s == "now":
        return now_ns
    m = _RELATIVE.match(s)
    if m:
        return now_ns - round(float(m[1]) * _UNIT_NS[m[2]])
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise ValueError(
            f"expected ISO 8601 (2025-01-02T03:04:05Z), a relative age (30s, 10m, 2h, 1d) "
            f"or 'now'; got {text!r}"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return round(dt.timestamp() * 1e9)


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"edge-agent memory: {message}", err=True)
    raise typer.Exit(code)


def _locate(config: Path | None, db: Path | None, snapshot_dir: Path | None) -> tuple[Path, Path]:
    """``(database, snapshot directory)`` from the options, else from the config."""
    if db is not None:
        snaps = (
            snapshot_dir if snapshot_dir is not None else db.parent / MemorySection().snapshot_dir
        )
        return db, snaps
    path = config if config is not None else DEFAULT_CONFIG
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        _fail(str(exc), 2)
    # cfg.state_dir is agent.state_dir resolved against the config file's folder, as the
    # agent resolves it: the CLI must find the store wherever it is started from.
    cfg_db, cfg_snaps = cfg.memory.resolve(cfg.state_dir)
    return cfg_db, snapshot_dir if snapshot_dir is not None else cfg_snaps


def _open(db: Path) -> MemoryStore:
    try:
        return MemoryStore.open_readonly(db)
    except MemoryStoreError as exc:
        _fail(str(exc), 1)


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _fmt_value(x: float) -> str:
    return "unknown" if math.isnan(x) else f"{x:.6g}"


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _fmt_age(t_ns: int | None, now_ns: int) -> str:
    if t_ns is None:
        return "-"
    s = (now_ns - t_ns) / 1e9
    if s < 120:
        return f"{s:.0f} s ago"
    if s < 7200:
        return f"{s / 60:.0f} min ago"
    if s < 172_800:
        return f"{s / 3600:.1f} h ago"
    return f"{s / 86400:.1f} d ago"


def _console() -> Console:
    return make_console(highlight=False)


# -- query ---------------------------------------------------------------------------------------


@memory_app.command()
def query(
    signal: Annotated[str, typer.Option("--signal", "-s", help="Signal name.")],
    since: Annotated[
        str, typer.Option(help="Start: ISO 8601, a relative age (10m, 2h, 1d) or 'now'.")
    ] = "1h",
    until: Annotated[str, typer.Option(help="End, same forms as --since.")] = "now",
    limit: Annotated[int, typer.Option(min=1, help="At most this many changes.")] = 10_000,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    db: DbOpt = None,
    snapshot_dir: SnapDirOpt = None,
) -> None:
    """A signal's stored history: its value at --since, then every change up to --until."""
    now = time.time_ns()
    try:
        since_ns = parse_time(since, now)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from None
    try:
        until_ns = parse_time(until, now)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--until") from None
    if since_ns > until_ns:
        raise typer.BadParameter(
            f"--since ({iso_utc(since_ns)}) is after --until ({iso_utc(until_ns)})"
        )
    path, _ = _locate(config, db, snapshot_dir)
    store = _open(path)
    try:
        h = store.history(signal, since_ns, until_ns, limit=limit)
    except KeyError as exc:
        _fail(str(exc.args[0]), 2)
    except MemoryStoreError as exc:
        _fail(str(exc), 1)
    finally:
        store.close()
    if json_out:
        doc = {
            "signal": h.signal,
            "since_ns": h.since_ns,
            "until_ns": h.until_ns,
            "since": iso_utc(h.since_ns),
            "until": iso_utc(h.until_ns),
            "initial": _num(h.initial),
            "changes": [{"t_ns": t, "t": iso_utc(t), "value": _num(v)} for t, v in h.changes],
            "gaps": [
                {"start_ns": a, "end_ns": b, "reason": r, "start": iso_utc(a), "end": iso_utc(b)}
                for a, b, r in h.gaps
            ],
            "truncated": h.truncated,
        }
        typer.echo(json.dumps(doc, indent=2))
        return
    table = Table(title=f"{h.signal}: {iso_utc(h.since_ns)} .. {iso_utc(h.until_ns)}")
    table.add_column("time (UTC)")
    table.add_column("value", justify="right")
    table.add_column("note")
    table.add_row(iso_utc(h.since_ns), _fmt_value(h.initial), "state at --since")
    gap_starts = {a: r for a, _, r in h.gaps}
    for t, v in h.changes:
        note = f"gap: {gap_starts[t]}" if t in gap_starts and math.isnan(v) else ""
        table.add_row(iso_utc(t), _fmt_value(v), note)
    console = _console()
    console.print(table)
    summary = f"{len(h.changes)} change(s)"
    if h.gaps:
        summary += f", {len(h.gaps)} gap(s)"
    if h.truncated:
        summary += f"; truncated at --limit {limit}"
    console.print(summary)


# -- stats ---------------------------------------------------------------------------------------


def _writer_pid(db: Path) -> int | None:
    """The pid in the store's lock file if that process is alive (the agent, usually)."""
    lock = db.with_name(db.name + ".lock")
    try:
        pid = int(lock.read_text().strip() or "0")
        if pid <= 0:
            return None
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


@memory_app.command()
def stats(
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    db: DbOpt = None,
    snapshot_dir: SnapDirOpt = None,
) -> None:
    """Sizes, rows, oldest and newest data, last snapshot, per-signal baselines."""
    path, snaps_dir = _locate(config, db, snapshot_dir)
    store = _open(path)
    try:
        doc = store.stats()
    except MemoryStoreError as exc:
        _fail(str(exc), 1)
    finally:
        store.close()
    snaps = list_snapshots(snaps_dir)
    doc["snapshot_dir"] = str(snaps_dir)
    doc["snapshots"] = len(snaps)
    doc["last_snapshot"] = snaps[0].to_json() if snaps else None
    doc["writer_pid"] = _writer_pid(path)
    if json_out:
        typer.echo(json.dumps(doc, indent=2))
        return
    now = time.time_ns()
    console = _console()
    overview = Table(title=f"memory store {path}", show_header=False)
    overview.add_column("key")
    overview.add_column("value")
    overview.add_row("schema version", str(doc["schema_version"]))
    overview.add_row(
        "file",
        f"{_fmt_bytes(doc['db_bytes'])} ({_fmt_bytes(doc['used_bytes'])} used), "
        f"WAL {_fmt_bytes(doc['wal_bytes'])}",
    )
    rows = doc["rows"]
    overview.add_row(
        "rows",
        f"{rows['changes']} changes, {rows['keyframes']} keyframes, {rows['decisions']} "
        f"decisions, {rows['events']} events, {rows['gaps']} gaps",
    )
    oldest, newest = doc["oldest_ns"]["changes"], doc["newest_ns"]["changes"]
    overview.add_row(
        "data",
        f"{iso_utc(oldest)} ({_fmt_age(oldest, now)}) .. {iso_utc(newest)} "
        f"({_fmt_age(newest, now)})"
        if oldest is not None and newest is not None
        else "none",
    )
    last = snaps[0] if snaps else None
    overview.add_row(
        "last snapshot",
        f"{last.name} ({_fmt_age(last.created_ns, now)}, {_fmt_bytes(last.bytes)}), "
        f"{len(snaps)} kept in {snaps_dir}"
        if last is not None
        else f"none in {snaps_dir}",
    )
    pid = doc["writer_pid"]
    overview.add_row("writer", f"agent pid {pid}" if pid else "not running")
    console.print(overview)
    per_signal = Table(title="signals (baselines)")
    for col in ("signal", "mean", "std", "min", "max", "last seen"):
        per_signal.add_column(col, justify="left" if col == "signal" else "right")

    def cell(x: Any) -> str:
        return "-" if x is None else f"{x:.6g}"

    for s in doc["signals"]:
        per_signal.add_row(
            s["name"],
            cell(s.get("mean")),
            cell(s.get("std")),
            cell(s.get("min")),
            cell(s.get("max")),
            _fmt_age(s.get("last_seen_ns"), now),
        )
    console.print(per_signal)


# -- snapshots -------------------------------------------------------------------------------------


@memory_app.command()
def snapshots(
    verify: Annotated[
        bool, typer.Option("--verify", help="Check every sha256 (reads all).")
    ] = False,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    db: DbOpt = None,
    snapshot_dir: SnapDirOpt = None,
) -> None:
    """List snapshots, newest first (name, time, size, rows, checksum)."""
    _, snaps_dir = _locate(config, db, snapshot_dir)
    found = list_snapshots(snaps_dir)
    checks: dict[str, str] = {}
    if verify:
        for info in found:
            try:
                verify_snapshot(info)
                checks[info.name] = "ok"
            except SnapshotError as exc:
                checks[info.name] = f"BAD: {exc}"
    if json_out:
        items = []
        for info in found:
            item = info.to_json()
            if verify:
                item["verified"] = checks[info.name] == "ok"
            items.append(item)
        typer.echo(json.dumps({"snapshot_dir": str(snaps_dir), "snapshots": items}, indent=2))
        return
    console = _console()
    if not found:
        console.print(f"no snapshots in {snaps_dir}")
        return
    now = time.time_ns()
    table = Table(title=f"snapshots in {snaps_dir}")
    for col in ("name", "created (UTC)", "age", "size", "changes", "sha256"):
        table.add_column(col, no_wrap=col in ("name", "sha256"))
    if verify:
        table.add_column("check")
    for info in found:
        row = [
            info.name,
            iso_utc(info.created_ns),
            _fmt_age(info.created_ns, now),
            _fmt_bytes(info.bytes),
            str(info.rows.get("changes", "-")),
            info.sha256[:12],
        ]
        if verify:
            row.append(checks[info.name])
        table.add_row(*row)
    console.print(table)
    if verify and any(v != "ok" for v in checks.values()):
        raise typer.Exit(1)


# -- restore ---------------------------------------------------------------------------------------


@memory_app.command()
def restore(
    snapshot: Annotated[str, typer.Argument(help="Snapshot name (see `snapshots`) or path.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    config: ConfigOpt = None,
    db: DbOpt = None,
    snapshot_dir: SnapDirOpt = None,
) -> None:
    """Roll the store back to SNAPSHOT (agent stopped; checksum verified first).

    The current database is kept as <db>.before-restore-<time>.
    """
    path, snaps_dir = _locate(config, db, snapshot_dir)
    try:
        info: SnapshotInfo = find_snapshot(snaps_dir, snapshot)
    except SnapshotError as exc:
        _fail(str(exc), 2)
    try:
        verify_snapshot(info)
    except SnapshotChecksumError as exc:
        _fail(str(exc), 1)
    except SnapshotError as exc:
        _fail(str(exc), 1)
    if not yes and not typer.confirm(
        f"Roll {path} back to {info.name} (taken {iso_utc(info.created_ns)})? "
        "Data stored after it will no longer be in the store.",
        err=True,
    ):
        _fail("restore cancelled", 1)
    lock = StoreLock(path)
    try:
        lock.acquire()
    except StoreLocked as exc:
        _fail(f"{exc} (e.g. systemctl stop edge-agent)", 1)
    try:
        kept = restore_snapshot(info, path, now_ns=time.time_ns())
    except SnapshotError as exc:
        _fail(str(exc), 1)
    finally:
        lock.release()
    typer.echo(f"restored {path} from {info.name}")
    if kept is not None:
        typer.echo(f"previous database kept as {kept}")


__all__ = ["memory_app", "parse_time"]
