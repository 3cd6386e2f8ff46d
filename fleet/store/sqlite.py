"""The embedded store: one SQLite file in WAL mode.

Several workers (threads or processes) may each open their own :class:`SqliteStore` on the
same file. Writes take the database lock up front (``BEGIN IMMEDIATE``) so that two writers
never both hold a read snapshot and then deadlock upgrading it; ``busy_timeout`` makes the
second wait instead of failing. ``synchronous=FULL``: each commit is on disk when it returns,
because the ingest acks a message to the broker right after its commit and the broker then
forgets it (NORMAL would keep the file consistent on power loss but could lose the last
commits, messages nobody would send again).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from fleet.errors import FleetStoreError, SchemaTooNew, StoreRefused
from fleet.store import _common, runs
from fleet.store.base import (
    IngestResult,
    Row,
)
from fleet.store.migrations import LATEST, pending, sqlite_statements
from fleet.store.sql import SqlStore

if TYPE_CHECKING:
    from wire.messages import StateMsg

_T = TypeVar("_T")
#: How long a writer waits for another's transaction before giving up.
BUSY_TIMEOUT_MS = 15_000
#: The longest a ping waits for the write lock: it asks "could a write start now?".
PING_WAIT_MS = 1_000
#: A device registered ahead of its first message has first_seen_ns 0 until that message.
_FIRST_SEEN = (
    "first_seen_ns = CASE WHEN first_seen_ns = 0 THEN excluded.first_seen_ns ELSE first_seen_ns END"
)


def _busy_timeout(url: str, query: str) -> int:
    try:
        options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise FleetStoreError(f"store URL {url!r}: cannot parse its query {query!r}") from None
    unknown = sorted(set(options) - {"busy_timeout_ms"})
    if unknown:
        raise FleetStoreError(
            f"store URL {url!r}: unknown option(s) {', '.join(unknown)} (known: busy_timeout_ms)"
        )
    text = options.get("busy_timeout_ms", str(BUSY_TIMEOUT_MS))
    if not text.isdigit() or not 1 <= int(text) <= 3_600_000:
        raise FleetStoreError(
            f"store URL {url!r}: busy_timeout_ms={text!r}: expected milliseconds, 1..3600000"
        )
    return int(text)


_INSERT_MESSAGE = (
    "INSERT INTO messages (device, boot_id, seq, kind, t_ns, received_ns, label, body) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (device, boot_id, seq) DO NOTHING"
)


class SqliteStore(SqlStore):
    """:class:`fleet.store.base.Store` on SQLite. Use one per worker thread or process.
    Making one raises ``FleetStoreError`` for a URL it cannot use or a file it cannot open.

    The URL may carry ``?busy_timeout_ms=N`` (default 15000): how long a write waits for another
    writer's transaction (a CLI command, another worker, a ``sqlite3`` shell) before it fails
    and the ingest retries it.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        parts = urlsplit(url)
        path = unquote(parts.path)
        if parts.scheme.lower() != "sqlite" or parts.netloc or not path.startswith("/"):
            raise FleetStoreError(
                f"store URL {url!r}: expected sqlite:///absolute/path.db (three slashes, then "
                "an absolute path)"
            )
        self.path = path
        self.busy_timeout_ms = _busy_timeout(url, parts.query)
        # The lock makes one Store safe to hand between threads (asyncio.to_thread runs on
        # any pool thread); it is not meant to be shared by busy workers.
        self._lock = threading.Lock()
        deadline = time.monotonic() + self.busy_timeout_ms / 1000
        while True:
            try:
                self._db = sqlite3.connect(
                    path,
                    timeout=self.busy_timeout_ms / 1000,
                    isolation_level=None,
                    check_same_thread=False,
                )
                self._db.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")
                mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                # FULL: the ingest PUBACKs a message once its commit returns, and the
                # broker never sends it again; under NORMAL a WAL commit is not synced and
                # a power cut could take back messages already acked.
                self._db.execute("PRAGMA synchronous = FULL")
                break
            except sqlite3.OperationalError as exc:
                # Switching a new file to WAL takes an exclusive lock and does not wait on
                # the busy handler: two processes opening one new store at once (fleet
                # serve's ingest and its rollout service) would fail here. Retry briefly.
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise FleetStoreError(f"store {url}: cannot open {path}: {exc}") from None
                with contextlib.suppress(sqlite3.Error, AttributeError):
                    self._db.close()
                time.sleep(0.05)
            except sqlite3.Error as exc:
                raise FleetStoreError(f"store {url}: cannot open {path}: {exc}") from None
        if str(mode).lower() != "wal":
            raise FleetStoreError(f"store {url}: cannot switch {path} to WAL mode (got {mode})")

    # -- plumbing ------------------------------------------------------------------------

    def _run(self, what: str, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        with self._lock:
            try:
                return fn(self._db)
            except (sqlite3.IntegrityError, sqlite3.DataError, OverflowError) as exc:
                # OverflowError: an int past 64 bits, which the driver cannot even send.
                raise StoreRefused(f"store {self.url}: {what} refused: {exc}") from None
            except sqlite3.Error as exc:
                raise FleetStoreError(f"store {self.url}: {what} failed: {exc}") from None

    def _txn(self, db: sqlite3.Connection) -> AbstractContextManager[sqlite3.Connection]:
        return self._write(db)

    @contextmanager
    def _write(self, db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            # Inside the try: a COMMIT that fails (I/O error, disk full) can leave the
            # transaction open, and every later BEGIN on this connection would fail.
            db.execute("COMMIT")
        except BaseException:
            # SQLite may already have rolled back on its own (disk full, I/O error).
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    # -- schema --------------------------------------------------------------------------

    @staticmethod
    def _applied(db: sqlite3.Connection) -> set[int]:
        db.execute(
            "CREATE TABLE IF NOT EXISTS schema_version ("
            "version INTEGER PRIMARY KEY, description TEXT NOT NULL)"
        )
        return {int(r[0]) for r in db.execute("SELECT version FROM schema_version")}

    def migrate(self) -> int:
        def go(db: sqlite3.Connection) -> int:
            applied = self._applied(db)
            if max(applied, default=0) > LATEST:
                raise SchemaTooNew(self.url, max(applied), LATEST)
            for m in pending(applied):
                with self._write(db):
                    # Another worker may have migrated while this one waited for the lock.
                    if m.version in self._applied(db):
                        continue
                    for stmt in sqlite_statements(m.sqlite_sql):
                        db.execute(stmt)
                    db.execute(
                        "INSERT INTO schema_version (version, description) VALUES (?, ?)",
                        (m.version, m.description),
                    )
            return max(self._applied(db), default=0)

        return self._run("migrate", go)

    # -- writes --------------------------------------------------------------------------

    def ingest(self, rows: Sequence[Row]) -> IngestResult:
        if not rows:
            return IngestResult(0, 0)
        batch = _common.prepare(rows)

        def go(db: sqlite3.Connection) -> IngestResult:
            with self._write(db):
                new = self._insert_messages(db, batch)
                inserted = len(new)
                db.executemany(runs.INSERT_RUN, runs.runs_of(batch.messages, new))
                conflicts = batch.conflicts
                if inserted < len(batch.messages):
                    conflicts = conflicts + self._conflicting(db, batch)
                if conflicts:
                    db.executemany(
                        "INSERT INTO quarantine (received_ns, topic, device, reason, where_path, "
                        "payload) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        _common.conflict_rows(conflicts),
                    )
                db.executemany(
                    "INSERT INTO signal_minutes (device, signal, minute, min, max, sum_wmean, "
                    "sum_n, sum_mean, points) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (device, signal, minute) DO UPDATE SET "
                    "min = MIN(min, excluded.min), max = MAX(max, excluded.max), "
                    "sum_wmean = sum_wmean + excluded.sum_wmean, sum_n = sum_n + excluded.sum_n, "
                    "sum_mean = sum_mean + excluded.sum_mean, points = points + excluded.points",
                    _common.minute_rollups(batch.points, new, len(batch.messages)),
                )
                db.executemany(
                    "INSERT INTO boots (device, boot_id, first_received_ns) VALUES (?, ?, ?) "
                    "ON CONFLICT (device, boot_id) DO UPDATE SET "
                    "first_received_ns = MIN(first_received_ns, excluded.first_received_ns)",
                    batch.boots,
                )
                db.executemany(
                    "INSERT INTO devices (device, site, first_seen_ns, last_seen_ns) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (device) DO UPDATE SET "
                    "last_seen_ns = MAX(COALESCE(last_seen_ns, 0), excluded.last_seen_ns), "
                    + _FIRST_SEEN,
                    batch.devices,
                )
                db.executemany(
                    "UPDATE devices SET latency_json = ?2, latency_t_ns = ?3 "
                    "WHERE device = ?1 AND (latency_t_ns IS NULL OR latency_t_ns <= ?3)",
                    batch.latencies,
                )
            n = len(conflicts)
            return IngestResult(inserted, len(rows) - inserted - n, n)

        return self._run("ingest", go)

    @staticmethod
    def _insert_messages(db: sqlite3.Connection, batch: _common.Batch) -> set[tuple[str, str, int]]:
        """Insert the batch's messages; the keys of those that were new. All of them, but
        for a redelivery: then the batch is inserted again row by row (rare, and needed to
        know which rows were new: the minute rollups must not count a message twice)."""
        db.execute("SAVEPOINT batch")
        cur = db.executemany(_INSERT_MESSAGE, batch.messages)
        if cur.rowcount == len(batch.messages):
            db.execute("RELEASE batch")
            return {(m[0], m[1], m[2]) for m in batch.messages}
        db.execute("ROLLBACK TO batch")
        new = {
            (m[0], m[1], m[2]) for m in batch.messages if db.execute(_INSERT_MESSAGE, m).rowcount
        }
        db.execute("RELEASE batch")
        return new

    @staticmethod
    def _conflicting(db: sqlite3.Connection, batch: _common.Batch) -> list[Row]:
        """Rows of ``batch`` that were not inserted because their key holds another body.

        Only asked when some row was not inserted (a redelivery, rare): the rows just
        inserted compare equal to themselves, so every row of the batch is looked up."""
        found = []
        for row in batch.rows:
            stored = db.execute(
                "SELECT body FROM messages WHERE device = ? AND boot_id = ? AND seq = ?",
                (row.device, row.boot_id, row.seq),
            ).fetchone()
            if stored is not None and bytes(stored[0]) != row.body:
                found.append(row)
        return found

    def record_state(self, device: str, site: str, state: StateMsg, received_ns: int) -> None:
        def go(db: sqlite3.Connection) -> None:
            with self._write(db):
                db.execute(
                    "INSERT INTO boots (device, boot_id, first_received_ns, watermark, held) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (device, boot_id) DO UPDATE SET "
                    "first_received_ns = MIN(first_received_ns, excluded.first_received_ns), "
                    "watermark = MAX(COALESCE(watermark, -1), excluded.watermark), "
                    # The higher of the two; one that is NULL does not count (PostgreSQL's
                    # GREATEST); a boot's held only rises.
                    "held = MAX(COALESCE(held, excluded.held), COALESCE(excluded.held, held))",
                    (device, state.boot_id, received_ns, state.seq, _common.held_of(state)),
                )
                db.execute(
                    "INSERT INTO devices (device, site, first_seen_ns, last_seen_ns) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (device) DO UPDATE SET "
                    "last_seen_ns = MAX(COALESCE(last_seen_ns, 0), excluded.last_seen_ns), "
                    + _FIRST_SEEN,
                    (device, site, received_ns, received_ns),
                )
                row = db.execute(
                    "SELECT boot_id, state_t_ns, online FROM devices WHERE device = ?", (device,)
                ).fetchone()
                self._apply_state(db, device, state, row)

        self._run("record_state", go)

    def ping(self) -> None:
        # "SELECT 1" answers even while another connection holds the write lock (a VACUUM,
        # a long CLI transaction), when every write fails: the ingest would take its own
        # failures for a message the store refuses. So a ping takes the write lock and
        # gives it back, waiting at most PING_WAIT_MS for it.
        def go(db: sqlite3.Connection) -> None:
            wait = min(self.busy_timeout_ms, PING_WAIT_MS)
            db.execute(f"PRAGMA busy_timeout = {wait}")
            try:
                db.execute("BEGIN IMMEDIATE")
                db.execute("ROLLBACK")
            finally:
                db.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")

        self._run("ping", go)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __repr__(self) -> str:
        return f"SqliteStore({self.url!r})"
