"""Episodic store: the SQLite schema and its migrations, reads, and the writer thread.

``changes`` holds the delta-encoded state changes appended in time order (row id ascends
with ``t_ns``, so a commit writes only the right-most leaf pages), ``keyframes`` where the
full state restarts, ``gaps`` where it is unknown; ``decisions``, ``events``, ``baselines``
and ``chunk_access`` beside them. WAL with ``synchronous=NORMAL``: a commit survives kill -9.
:class:`StoreWriter` owns the only writing connection, in its own thread; the event loop
only appends to its bounded pending list. Readers use their own connections. Layout,
durability and why: ``docs/MEMORY.md``, "Storage layout" and "Writer, batching,
durability".
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from drivers.osthread import name_os_thread
from edge_agent.memory._fs import sidecars
from edge_agent.memory.aging import Aging, AgingPolicy
from edge_agent.memory.baselines import Baseline
from edge_agent.memory.delta import Row, RowBlock, series
from edge_agent.memory.errors import MemoryStoreError, SchemaVersionError, StoreLocked

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

#: One tuple of statements per schema version; applied in order, each in one transaction.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
        "CREATE TABLE signals (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)",
        "CREATE TABLE changes (id INTEGER PRIMARY KEY, t_ns INTEGER NOT NULL, "
        "signal INTEGER NOT NULL, value REAL)",
        "CREATE TABLE keyframes (t_ns INTEGER PRIMARY KEY, change_id INTEGER NOT NULL)",
        "CREATE TABLE gaps (id INTEGER PRIMARY KEY, start_ns INTEGER NOT NULL, "
        "end_ns INTEGER NOT NULL, reason TEXT NOT NULL)",
        "CREATE TABLE decisions (id INTEGER PRIMARY KEY, t_ns INTEGER NOT NULL, "
        "window_seq INTEGER, body TEXT NOT NULL)",
        "CREATE TABLE events (id INTEGER PRIMARY KEY, t_ns INTEGER NOT NULL, "
        "kind TEXT NOT NULL, signal INTEGER, detail TEXT)",
        "CREATE INDEX decisions_t ON decisions(t_ns)",
        "CREATE INDEX events_t ON events(t_ns)",
        "CREATE TABLE baselines (signal INTEGER PRIMARY KEY, updated_ns INTEGER NOT NULL, "
        "weight REAL NOT NULL, mean REAL NOT NULL, m2 REAL NOT NULL, fast_weight REAL NOT NULL, "
        "fast_mean REAL NOT NULL, min REAL, max REAL, last_seen_ns INTEGER NOT NULL, "
        "count INTEGER NOT NULL)",
        "CREATE TABLE chunk_access (chunk INTEGER PRIMARY KEY, last_access_ns INTEGER NOT NULL)",
    ),
)

_BUSY_TIMEOUT_S = 5.0


# -- connections and schema ---------------------------------------------------------------------


def connect(
    path: Path, *, readonly: bool = False, journal_size_limit: int = 16 << 20
) -> sqlite3.Connection:
    """Open ``path`` in autocommit mode (we issue BEGIN/COMMIT ourselves).

    Writers get WAL, ``synchronous=NORMAL`` and ``journal_size_limit``; a new file gets
    ``auto_vacuum=INCREMENTAL`` first so aging can hand pages back in small steps.
    Read-only connections never create the file. Raises :class:`MemoryStoreError`.
    """
    try:
        if readonly:
            if not path.exists():
                raise MemoryStoreError(f"no memory store at {path}")
            conn = sqlite3.connect(
                f"file:{quote(str(path))}?mode=ro",
                uri=True,
                isolation_level=None,
                timeout=_BUSY_TIMEOUT_S,
                check_same_thread=False,
            )
            conn.execute("PRAGMA query_only=ON")
            return conn
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            path, isolation_level=None, timeout=_BUSY_TIMEOUT_S, check_same_thread=False
        )
        if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise MemoryStoreError(f"{path}: cannot switch to WAL (journal_mode={mode})")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA journal_size_limit={int(journal_size_limit)}")
        conn.execute("PRAGMA temp_store=MEMORY")
        return conn
    except sqlite3.Error as exc:
        raise MemoryStoreError(f"{path}: cannot open: {exc}") from exc


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the schema to :data:`SCHEMA_VERSION`; return the version found before.

    A file from a newer build is refused (:class:`SchemaVersionError`) and not touched.
    """
    found = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if found > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"memory store schema version {found} is newer than this agent's "
            f"({SCHEMA_VERSION}); refusing to touch it"
        )
    for version in range(found + 1, SCHEMA_VERSION + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in MIGRATIONS[version - 1]:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version={version}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        log.info("memory store migrated to schema version %d", version)
    return found


class StoreLock:
    """Exclusive advisory lock ``<db>.lock`` (``flock``) held by the one writing process.

    The kernel drops it when the process dies (kill -9 included), so a stale lock file
    never blocks a restart. The file holds the owner's pid, for the error message.
    :meth:`acquire` raises ``StoreLocked`` naming that pid when another process holds it.
    """

    def __init__(self, db: Path) -> None:
        self.path = db.with_name(db.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> StoreLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise StoreLocked(
                f"memory store {self.path.with_suffix('')} is in use by process {owner} "
                "(a running agent?); stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # no pid: nobody holds it
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def chunk_of(t_ns: int, chunk_ns: int) -> int:
    """Aging chunk number of a time (chunks are ``aging_chunk_s`` long, aligned to UNIX 0)."""
    return t_ns // chunk_ns


# -- reads ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class History:
    """One signal between ``since_ns`` and ``until_ns``.

    ``initial`` is the state at ``since_ns`` (NaN: unknown); ``changes`` the changes after it,
    including transitions to unknown (NaN) at the start of a gap; ``gaps`` the stretches with
    no data. ``truncated``: more than ``limit`` changes, the rest left out.
    """

    signal: str
    since_ns: int
    until_ns: int
    initial: float
    changes: list[tuple[int, float]]
    gaps: list[tuple[int, int, str]]
    truncated: bool


class MemoryStore:
    """Reads over one connection (and the SQL the writer thread runs on its own).

    ``on_read(chunks)`` (optional) is told which aging chunks a read touched, which is how
    the size cap's LRU learns what is in use.
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        *,
        chunk_ns: int = 3600 * 10**9,
        on_read: Callable[[set[int]], None] | None = None,
    ) -> None:
        self.conn = conn
        self.path = path
        self.chunk_ns = chunk_ns
        self.on_read = on_read
        self._ids: dict[str, int] | None = None

    @classmethod
    def open_readonly(cls, path: Path, *, chunk_ns: int = 3600 * 10**9) -> MemoryStore:
        """For the CLI and readers: never creates, never writes. Checks the schema version.
        Raises ``MemoryStoreError`` (``SchemaVersionError`` for a schema this code cannot read)."""
        conn = connect(path, readonly=True)
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise MemoryStoreError(f"{path}: not a memory store: {exc}") from exc
        if version == 0:
            conn.close()
            raise MemoryStoreError(f"{path}: empty database, not a memory store yet")
        if version > SCHEMA_VERSION:
            conn.close()
            raise SchemaVersionError(
                f"{path}: schema version {version} is newer than this tool's ({SCHEMA_VERSION})"
            )
        return cls(conn, path, chunk_ns=chunk_ns)

    def close(self) -> None:
        self.conn.close()

    # signals

    def signal_ids(self) -> dict[str, int]:
        if self._ids is None:
            self._ids = dict(self.conn.execute("SELECT name, id FROM signals ORDER BY id"))
        return dict(self._ids)

    def ensure_signals(self, names: Sequence[str]) -> dict[str, int]:
        """Ids of ``names``, registering the new ones (writer connection only).
        Raises ``sqlite3.Error`` (the writer counts and recovers)."""
        known = self.signal_ids()
        missing = [n for n in names if n not in known]
        if missing:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                self.conn.executemany(
                    "INSERT OR IGNORE INTO signals(name) VALUES (?)", [(n,) for n in missing]
                )
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self._ids = None
        return self.signal_ids()

    def _signal_id(self, name: str) -> int:
        ids = self.signal_ids()
        if name not in ids:
            known = ", ".join(ids) or "none"
            raise KeyError(f"unknown signal {name!r}; known: {known}")
        return ids[name]

    # time anchors

    def last_times(self) -> tuple[int | None, int | None]:
        """``(newest change t_ns, last window end recorded at a keyframe or clean stop)``."""
        row = self.conn.execute("SELECT t_ns FROM changes ORDER BY id DESC LIMIT 1").fetchone()
        meta = self.conn.execute(
            "SELECT value FROM meta WHERE key = 'last_window_end_ns'"
        ).fetchone()
        return (int(row[0]) if row else None, int(meta[0]) if meta else None)

    def _keyframe_before(self, t_ns: int) -> tuple[int, int] | None:
        row = self.conn.execute(
            "SELECT t_ns, change_id FROM keyframes WHERE t_ns <= ? ORDER BY t_ns DESC LIMIT 1",
            (t_ns,),
        ).fetchone()
        return (int(row[0]), int(row[1])) if row else None

    def _keyframe_after(self, t_ns: int) -> tuple[int, int] | None:
        row = self.conn.execute(
            "SELECT t_ns, change_id FROM keyframes WHERE t_ns > ? ORDER BY t_ns LIMIT 1",
            (t_ns,),
        ).fetchone()
        return (int(row[0]), int(row[1])) if row else None

    def gaps(self, since_ns: int, until_ns: int) -> list[tuple[int, int, str]]:
        """Gaps overlapping ``[since, until]``, oldest first."""
        return [
            (int(a), int(b), str(r))
            for a, b, r in self.conn.execute(
                "SELECT start_ns, end_ns, reason FROM gaps WHERE end_ns > ? AND start_ns <= ? "
                "ORDER BY start_ns",
                (since_ns, until_ns),
            )
        ]

    def _rows(
        self, from_id: int, before_id: int | None, until_ns: int, signal: int | None
    ) -> list[Row]:
        sql = "SELECT t_ns, signal, value FROM changes WHERE id >= ?"
        args: list[int] = [from_id]
        if before_id is not None:
            sql += " AND id < ?"
            args.append(before_id)
        if signal is not None:
            sql += " AND signal = ?"
            args.append(signal)
        sql += " AND t_ns <= ? ORDER BY id"
        args.append(until_ns)
        return [(int(t), int(s), v) for t, s, v in self.conn.execute(sql, args)]

    def _touch(self, since_ns: int, until_ns: int) -> None:
        if self.on_read is not None:
            first, last = chunk_of(since_ns, self.chunk_ns), chunk_of(until_ns, self.chunk_ns)
            self.on_read(set(range(first, min(last, first + 10_000) + 1)))

    def state_at(self, t_ns: int, names: Sequence[str] | None = None) -> dict[str, float]:
        """The stored state of every signal (or of ``names``) at ``t_ns``; NaN: unknown."""
        ids = self.signal_ids()
        wanted = list(ids) if names is None else list(names)
        for n in wanted:
            self._signal_id(n)
        out = dict.fromkeys(wanted, math.nan)
        kf = self._keyframe_before(t_ns)
        if kf is None or any(a <= t_ns < b for a, b, _ in self.gaps(t_ns, t_ns)):
            return out
        nxt = self._keyframe_after(kf[0])
        by_id = {ids[n]: n for n in wanted}
        for _, sid, value in self._rows(kf[1], nxt[1] if nxt else None, t_ns, None):
            name = by_id.get(sid)
            if name is not None:
                out[name] = math.nan if value is None else float(value)
        self._touch(t_ns, t_ns)
        return out

    def history(self, name: str, since_ns: int, until_ns: int, *, limit: int = 100_000) -> History:
        """State of ``name`` at ``since_ns`` and its changes up to ``until_ns``."""
        sid = self._signal_id(name)
        kf = self._keyframe_before(since_ns)
        if kf is None:
            kf = self._keyframe_after(since_ns)
        gaps = self.gaps(since_ns, until_ns)
        if kf is None or kf[0] > until_ns:
            return History(name, since_ns, until_ns, math.nan, [], gaps, truncated=False)
        end = self._keyframe_after(until_ns)
        rows = self._rows(kf[1], end[1] if end else None, until_ns, sid)
        if gaps:
            # The state is unknown from a gap's start: a marker row makes that a change, and
            # makes the keyframe after the gap one too, even if it repeats the old value.
            markers: list[Row] = [(a, sid, None) for a, _, _ in gaps if a > kf[0]]
            rows = sorted(rows + markers, key=lambda r: r[0])
        initial, changes = series(rows, sid, since_ns, until_ns)
        if any(a <= since_ns < b for a, b, _ in gaps):
            initial = math.nan
        truncated = len(changes) > limit
        self._touch(since_ns, until_ns)
        return History(name, since_ns, until_ns, initial, changes[:limit], gaps, truncated)

    def decisions(
        self, since_ns: int, until_ns: int, *, limit: int = 10_000
    ) -> list[tuple[int, int | None, str]]:
        return [
            (int(t), None if s is None else int(s), str(b))
            for t, s, b in self.conn.execute(
                "SELECT t_ns, window_seq, body FROM decisions WHERE t_ns >= ? AND t_ns <= ? "
                "ORDER BY id LIMIT ?",
                (since_ns, until_ns, limit),
            )
        ]

    def events(
        self, since_ns: int, until_ns: int, *, limit: int = 10_000
    ) -> list[tuple[int, str, str | None, str | None]]:
        names = {v: k for k, v in self.signal_ids().items()}
        return [
            (int(t), str(k), None if s is None else names.get(int(s), str(s)), d)
            for t, k, s, d in self.conn.execute(
                "SELECT t_ns, kind, signal, detail FROM events WHERE t_ns >= ? AND t_ns <= ? "
                "ORDER BY id LIMIT ?",
                (since_ns, until_ns, limit),
            )
        ]

    def load_baselines(self) -> dict[str, tuple[int, Baseline]]:
        """``name -> (updated_ns, baseline)`` for every persisted baseline."""
        names = {v: k for k, v in self.signal_ids().items()}
        out: dict[str, tuple[int, Baseline]] = {}
        for row in self.conn.execute(
            "SELECT signal, updated_ns, weight, mean, m2, fast_weight, fast_mean, min, max, "
            "last_seen_ns, count FROM baselines"
        ):
            name = names.get(int(row[0]))
            if name is None:
                continue
            out[name] = (
                int(row[1]),
                Baseline(
                    weight=float(row[2]),
                    mean=float(row[3]),
                    m2=float(row[4]),
                    fast_weight=float(row[5]),
                    fast_mean=float(row[6]),
                    min=math.inf if row[7] is None else float(row[7]),
                    max=-math.inf if row[8] is None else float(row[8]),
                    last_seen_ns=int(row[9]),
                    count=int(row[10]),
                ),
            )
        return out

    def replay(self, since_ns: int) -> Iterable[Row]:
        """Every row from the keyframe at or before ``since_ns`` on (for consolidation)."""
        kf = self._keyframe_before(since_ns) or self._keyframe_after(since_ns)
        if kf is None:
            return iter(())
        cur = self.conn.execute(
            "SELECT t_ns, signal, value FROM changes WHERE id >= ? ORDER BY id", (kf[1],)
        )
        return ((int(t), int(s), v) for t, s, v in cur)

    def sizes(self) -> dict[str, int]:
        page_size = int(self.conn.execute("PRAGMA page_size").fetchone()[0])
        pages = int(self.conn.execute("PRAGMA page_count").fetchone()[0])
        free = int(self.conn.execute("PRAGMA freelist_count").fetchone()[0])
        wal, _ = sidecars(self.path)
        return {
            "page_size": page_size,
            "db_bytes": pages * page_size,
            "used_bytes": (pages - free) * page_size,
            "free_bytes": free * page_size,
            "wal_bytes": wal.stat().st_size if wal.exists() else 0,
        }

    def stats(self) -> dict[str, Any]:
        """Sizes, rows per table, oldest and newest data, gaps, per-signal baselines."""
        c = self.conn
        rows: dict[str, int] = {}
        oldest: dict[str, int | None] = {}
        newest: dict[str, int | None] = {}
        for table in ("changes", "keyframes", "decisions", "events", "gaps", "signals"):
            rows[table] = int(c.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # noqa: S608
        for table in ("changes", "decisions", "events"):
            lo = c.execute(f"SELECT t_ns FROM {table} ORDER BY id LIMIT 1").fetchone()  # noqa: S608
            hi = c.execute(f"SELECT t_ns FROM {table} ORDER BY id DESC LIMIT 1").fetchone()  # noqa: S608
            oldest[table] = int(lo[0]) if lo else None
            newest[table] = int(hi[0]) if hi else None
        kf = c.execute("SELECT min(t_ns) FROM keyframes").fetchone()
        baselines = self.load_baselines()
        signals = []
        for name in self.signal_ids():
            entry: dict[str, Any] = {"name": name}
            if name in baselines:
                _, b = baselines[name]
                entry.update(
                    mean=b.mean if b.weight > 0 else None,
                    std=b.std if b.weight > 0 else None,
                    min=b.min if math.isfinite(b.min) else None,
                    max=b.max if math.isfinite(b.max) else None,
                    last_seen_ns=b.last_seen_ns or None,
                    count=b.count,
                )
            signals.append(entry)
        return {
            "path": str(self.path),
            "schema_version": int(c.execute("PRAGMA user_version").fetchone()[0]),
            **self.sizes(),
            "rows": rows,
            "oldest_ns": oldest,
            "newest_ns": newest,
            "reconstructible_from_ns": int(kf[0]) if kf and kf[0] is not None else None,
            "gaps": [
                {"start_ns": a, "end_ns": b, "reason": r}
                for a, b, r in self.gaps(-(2**63), 2**63 - 1)
            ][-20:],
            "signals": signals,
        }


# -- the writer thread ---------------------------------------------------------------------------


@dataclass(slots=True)
class WriteItem:
    """What one window (or one call) hands to the writer. Built on the loop, never mutated
    after :meth:`StoreWriter.submit`."""

    rows: RowBlock | None = None
    #: Time of the keyframe that ``rows`` start with, if they do.
    keyframe_ns: int | None = None
    #: Last grid point this item covers (for "offline" gaps after a restart).
    window_end_ns: int | None = None
    #: ``(t_ns, window_seq, json)``.
    decisions: list[tuple[int, int | None, str]] = field(default_factory=list)
    #: ``(t_ns, kind, signal_id, detail)``.
    events: list[tuple[int, str, int | None, str | None]] = field(default_factory=list)
    #: ``(start_ns, end_ns, reason)``.
    gaps: list[tuple[int, int, str]] = field(default_factory=list)
    #: Baseline rows to upsert (the newest submitted wins).
    baselines: list[tuple[Any, ...]] | None = None
    #: The caller's clock (UNIX ns): aging's "now" advances with it.
    now_ns: int = 0

    @property
    def n_rows(self) -> int:
        return len(self.rows) if self.rows is not None else 0

    @property
    def first_ns(self) -> int | None:
        return int(self.rows.t_ns[0]) if self.rows is not None and len(self.rows) else None

    @property
    def size(self) -> int:
        return self.n_rows + len(self.decisions) + len(self.events) + len(self.gaps)


@dataclass(slots=True)
class WriterStats:
    submitted_items: int = 0
    committed_items: int = 0
    committed_rows: int = 0
    commits: int = 0
    commit_errors: int = 0
    dropped_items: int = 0
    dropped_rows: int = 0
    pending_rows: int = 0
    high_water_rows: int = 0
    last_commit_ms: float = 0.0
    max_commit_ms: float = 0.0
    checkpoints: int = 0
    last_checkpoint_ms: float = 0.0
    last_error: str = ""


_RETRIES = 3
#: How much lower than the agent's the writer thread's CPU priority is (nice increment).
_WRITER_NICE = 5


class StoreWriter:
    """The dedicated writer thread: batches, commits, checkpoints and ages the store.

    :meth:`submit` (any thread, typically the event loop) appends to a pending list bounded
    at ``max_pending_rows``; an item that does not fit is **dropped and counted**, and the
    time of its first row is reported once through :meth:`take_loss` so the caller can
    invalidate its delta encoder (the next window becomes a keyframe) and record a gap.
    The thread commits everything pending every ``commit_interval_s`` (sooner when a quarter
    of the bound is pending or :meth:`flush` asks), each commit one transaction. Between
    commits it runs aging steps (each one short transaction within the step budget) and a
    passive WAL checkpoint every ``checkpoint_interval_s``.
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        *,
        max_pending_rows: int,
        commit_interval_s: float,
        checkpoint_interval_s: float,
        aging: AgingPolicy | None,
        journal_size_limit: int = 16 << 20,
        name: str = "memory-writer",
    ) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = conn
        self._journal_size_limit = journal_size_limit
        self._max_pending = max_pending_rows
        self._commit_rows = max(1, max_pending_rows // 4)
        self._interval = commit_interval_s
        self._checkpoint_interval = checkpoint_interval_s
        self.aging = Aging(aging) if aging is not None else None
        self.stats = WriterStats()
        self._cond = threading.Condition(threading.Lock())
        self._pending: list[WriteItem] = []
        self._pending_rows = 0
        self._submitted = 0  # items accepted so far
        self._done = 0  # items committed (or given up on) so far
        self._stop = False
        self._flush = 0
        self._pause = False
        self._paused = False
        self._loss_ns: int | None = None
        self._touched: set[int] = set()
        self._now_ns = 0
        self._last_event_ns = 0
        self._last_decision_ns = 0
        self._failed: Exception | None = None
        self._last_window_end: int | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.native_id: int | None = None

    # -- any thread -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: WriteItem) -> bool:
        """Queue ``item``; False (and counted) when the pending bound would be exceeded."""
        n = item.size
        with self._cond:
            if self._stop or self._pending_rows + n > self._max_pending:
                self.stats.dropped_items += 1
                self.stats.dropped_rows += item.n_rows
                first = item.first_ns if item.first_ns is not None else item.window_end_ns
                if first is not None and (self._loss_ns is None or first < self._loss_ns):
                    self._loss_ns = first
                return False
            self._pending.append(item)
            self._pending_rows += n
            self._submitted += 1
            self.stats.submitted_items += 1
            self.stats.pending_rows = self._pending_rows
            self.stats.high_water_rows = max(self.stats.high_water_rows, self._pending_rows)
            if self._pending_rows >= self._commit_rows:
                self._cond.notify()
        return True

    def take_loss(self) -> int | None:
        """Time of the first row lost since the last call (dropped or failed), or None."""
        if self._loss_ns is None:
            return None
        with self._cond:
            loss, self._loss_ns = self._loss_ns, None
        return loss

    def touch(self, chunks: set[int]) -> None:
        """Record that ``chunks`` were read (LRU); persisted with the next commit."""
        with self._cond:
            self._touched |= chunks

    @property
    def pending_rows(self) -> int:
        return self._pending_rows

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Block until everything submitted before the call is committed (True) or timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._submitted
            self._flush += 1
            self._cond.notify_all()
            try:
                while self._done < target and self._thread.is_alive():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._flush -= 1
            return self._done >= target

    def stop(self, timeout_s: float = 30.0) -> None:
        """Commit what is pending, checkpoint, close the connection and end the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        elif self._conn is not None:  # never started
            self._conn.close()
            self._conn = None

    def pause(self, timeout_s: float = 30.0) -> None:
        """Commit what is pending and close the connection (for an online restore).
        Raises ``MemoryStoreError``."""
        with self._cond:
            self._pause = True
            self._flush += 1
            self._cond.notify_all()
            deadline = time.monotonic() + timeout_s
            while not self._paused and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MemoryStoreError("memory writer did not pause in time")
                self._cond.wait(left)
            self._flush -= 1

    def resume(self, *, discard_pending: bool = False) -> None:
        """Reopen the connection after :meth:`pause`; optionally drop what queued meanwhile."""
        with self._cond:
            if discard_pending:
                for item in self._pending:
                    self.stats.dropped_items += 1
                    self.stats.dropped_rows += item.n_rows
                self._done += len(self._pending)
                self._pending = []
                self._pending_rows = 0
            self._pause = False
            self._cond.notify_all()
            while self._paused and self._thread.is_alive():
                self._cond.wait(1.0)

    # -- the thread -----------------------------------------------------------------------------

    def _main(self) -> None:
        self.native_id = threading.get_native_id()
        name_os_thread(self._thread.name)
        # Persistence is background work: when the CPU is contended, the event loop's thread
        # (perception, reasoning) should run first. Lowering our own priority is always
        # allowed; Linux applies it to this thread only.
        with contextlib.suppress(OSError):
            nice = os.getpriority(os.PRIO_PROCESS, self.native_id)
            os.setpriority(os.PRIO_PROCESS, self.native_id, min(19, nice + _WRITER_NICE))
        try:
            self._loop()
        except Exception as exc:  # the thread must say why it died
            self._failed = exc
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            log.exception("memory writer thread failed")
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            if self._conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.close()
                self._conn = None

    def _loop(self) -> None:
        next_commit = time.monotonic() + self._interval
        next_checkpoint = time.monotonic() + self._checkpoint_interval
        aging = self.aging
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if now >= next_commit and not (self._pending or self._touched):
                        next_commit = now + self._interval  # nothing to commit: no spinning
                    commit_due = (
                        self._stop
                        or self._pause
                        or (self._flush > 0 and bool(self._pending or self._touched))
                        or self._pending_rows >= self._commit_rows
                        or now >= next_commit
                    )
                    aging_due = aging is not None and aging.wants_step(now)
                    if commit_due or aging_due or now >= next_checkpoint:
                        break
                    timeout = min(next_commit, next_checkpoint) - now
                    if aging is not None:
                        timeout = min(timeout, aging.seconds_until_due(now))
                    self._cond.wait(max(timeout, 0.0005))
                items: list[WriteItem] = []
                touched: set[int] = set()
                if commit_due:
                    items, self._pending = self._pending, []
                    touched, self._touched = self._touched, set()
                    self._pending_rows = 0
                    self.stats.pending_rows = 0
                stop, pause = self._stop, self._pause
            if commit_due:
                if items or touched:
                    self._commit(items, touched)
                next_commit = time.monotonic() + self._interval
            if stop:
                self._close_cleanly()
                return
            if pause:
                self._pause_here()
                next_commit = time.monotonic() + self._interval
                continue
            now = time.monotonic()
            if now >= next_checkpoint:
                self._checkpoint("PASSIVE")
                next_checkpoint = now + self._checkpoint_interval
            if aging_due and aging is not None and self._conn is not None:
                aging.step(self._conn, self._now_ns, now)

    def _commit(self, items: list[WriteItem], touched: set[int]) -> None:
        conn = self._conn
        assert conn is not None
        for item in items:
            self._now_ns = max(self._now_ns, item.now_ns)
        started = time.perf_counter()
        for attempt in range(_RETRIES):
            try:
                self._write(conn, items, touched)
                break
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                self.stats.commit_errors += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                log.error("memory commit failed (attempt %d/%d): %s", attempt + 1, _RETRIES, exc)
                time.sleep(0.05 * (attempt + 1))
        else:
            lost = [it.first_ns for it in items if it.first_ns is not None]
            with self._cond:
                self.stats.dropped_items += len(items)
                self.stats.dropped_rows += sum(it.n_rows for it in items)
                if lost and (self._loss_ns is None or min(lost) < self._loss_ns):
                    self._loss_ns = min(lost)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        self.stats.last_commit_ms = elapsed_ms
        self.stats.max_commit_ms = max(self.stats.max_commit_ms, elapsed_ms)
        with self._cond:
            self._done += len(items)
            self._cond.notify_all()

    def _write(self, conn: sqlite3.Connection, items: list[WriteItem], touched: set[int]) -> None:
        rows_total = sum(it.n_rows for it in items)
        for it in items:
            if it.window_end_ns is not None and (
                self._last_window_end is None or it.window_end_ns > self._last_window_end
            ):
                self._last_window_end = it.window_end_ns
        conn.execute("BEGIN IMMEDIATE")
        if rows_total:
            conn.executemany(
                "INSERT INTO changes(t_ns, signal, value) VALUES (?, ?, ?)",
                itertools.chain.from_iterable(it.rows.params() for it in items if it.rows),
            )
            # Row ids are max(id) + 1 onwards, consecutive: this connection is the only writer.
            last_id = int(conn.execute("SELECT last_insert_rowid()").fetchone()[0])
            first_id = last_id - rows_total + 1
            offset = 0
            keyframes = []
            for it in items:
                if it.keyframe_ns is not None and it.n_rows:
                    keyframes.append((it.keyframe_ns, first_id + offset))
                offset += it.n_rows
            if keyframes:
                conn.executemany(
                    "INSERT OR REPLACE INTO keyframes(t_ns, change_id) VALUES (?, ?)", keyframes
                )
                ends = [it.window_end_ns for it in items if it.window_end_ns is not None]
                if ends:
                    conn.execute(
                        "INSERT OR REPLACE INTO meta(key, value) VALUES ('last_window_end_ns', ?)",
                        (str(max(ends)),),
                    )
        gaps = [g for it in items for g in it.gaps]
        if gaps:
            conn.executemany("INSERT INTO gaps(start_ns, end_ns, reason) VALUES (?, ?, ?)", gaps)
        decisions = []
        for it in items:
            for t, seq, body in it.decisions:
                self._last_decision_ns = max(self._last_decision_ns, t)
                decisions.append((self._last_decision_ns, seq, body))
        if decisions:
            conn.executemany(
                "INSERT INTO decisions(t_ns, window_seq, body) VALUES (?, ?, ?)", decisions
            )
        events = []
        for it in items:
            for t, kind, sid, detail in it.events:
                # Kept in time order (aging deletes by id ranges up to a time).
                self._last_event_ns = max(self._last_event_ns, t)
                events.append((self._last_event_ns, kind, sid, detail))
        if events:
            conn.executemany(
                "INSERT INTO events(t_ns, kind, signal, detail) VALUES (?, ?, ?, ?)", events
            )
        newest_baselines = next((it.baselines for it in reversed(items) if it.baselines), None)
        if newest_baselines:
            conn.executemany(
                "INSERT OR REPLACE INTO baselines(signal, updated_ns, weight, mean, m2, "
                "fast_weight, fast_mean, min, max, last_seen_ns, count) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                newest_baselines,
            )
        if touched:
            conn.executemany(
                "INSERT OR REPLACE INTO chunk_access(chunk, last_access_ns) VALUES (?, ?)",
                [(c, self._now_ns) for c in touched],
            )
        conn.execute("COMMIT")
        self.stats.commits += 1
        self.stats.committed_items += len(items)
        self.stats.committed_rows += rows_total

    def _checkpoint(self, mode: str) -> None:
        if self._conn is None:
            return
        started = time.perf_counter()
        try:
            self._conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        except sqlite3.Error as exc:
            log.warning("memory checkpoint failed: %s", exc)
            return
        self.stats.checkpoints += 1
        self.stats.last_checkpoint_ms = (time.perf_counter() - started) * 1e3

    def _close_cleanly(self) -> None:
        if self._conn is not None and self._last_window_end is not None:
            try:
                self._conn.execute(
                    "INSERT OR REPLACE INTO meta(key, value) VALUES ('last_window_end_ns', ?)",
                    (str(self._last_window_end),),
                )
            except sqlite3.Error as exc:
                log.warning("memory: cannot record the last window time: %s", exc)
        self._checkpoint("TRUNCATE")
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _pause_here(self) -> None:
        self._close_cleanly()
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            while self._pause and not self._stop:
                self._cond.wait(1.0)
        if not self._stop:
            self._conn = connect(self.path, journal_size_limit=self._journal_size_limit)
            migrate(self._conn)
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stats_dict(self) -> dict[str, Any]:
        s = self.stats
        out: dict[str, Any] = {
            "alive": self.alive,
            "submitted_items": s.submitted_items,
            "committed_items": s.committed_items,
            "committed_rows": s.committed_rows,
            "commits": s.commits,
            "commit_errors": s.commit_errors,
            "dropped_items": s.dropped_items,
            "dropped_rows": s.dropped_rows,
            "pending_rows": self._pending_rows,
            "max_pending_rows": self._max_pending,
            "high_water_rows": s.high_water_rows,
            "last_commit_ms": round(s.last_commit_ms, 3),
            "max_commit_ms": round(s.max_commit_ms, 3),
            "checkpoints": s.checkpoints,
            "last_error": s.last_error,
        }
        if self.aging is not None:
            out["aging"] = self.aging.stats_dict()
        return out


def baseline_rows(
    ids: Sequence[int], updated_ns: int, baselines: Mapping[int, Baseline]
) -> list[tuple[Any, ...]]:
    """Rows for the ``baselines`` table (``ids[j]`` is column ``j``'s signal id)."""
    out: list[tuple[Any, ...]] = []
    for j, sid in enumerate(ids):
        b = baselines[j]
        out.append(
            (
                sid,
                updated_ns,
                b.weight,
                b.mean,
                b.m2,
                b.fast_weight,
                b.fast_mean,
                b.min if math.isfinite(b.min) else None,
                b.max if math.isfinite(b.max) else None,
                b.last_seen_ns,
                b.count,
            )
        )
    return out


__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "History",
    "MemoryStore",
    "StoreLock",
    "StoreWriter",
    "WriteItem",
    "WriterStats",
    "baseline_rows",
    "chunk_of",
    "connect",
    "migrate",
]
