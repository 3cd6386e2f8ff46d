"""The embedded store: one SQLite file in WAL mode.

Several workers (threads or processes) may each open their own :class:`SqliteStore` on the
same file. Writes take the database lock up front (``BEGIN IMMEDIATE``) so that two writers
never both hold a read snapshot and then deadlock upgrading it; ``busy_timeout`` makes the
second wait instead of failing. ``synchronous=FULL``: each commit is on disk when it returns,
because the ingest acks a message to the broker right after its commit and the broker then
forgets it (NORMAL would keep the file consistent on power loss but could lose the last
commits, messages nobody would send again).

The URL may carry ``?busy_timeout_ms=N`` (default 15000): how long a write waits for another
writer's transaction (a CLI command, another worker, a ``sqlite3`` shell) before it fails
and the ingest retries it.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from fleet.errors import FleetStoreError, SchemaTooNew, StoreRefused
from fleet.store import _common
from fleet.store.base import (
    QUARANTINE_PAYLOAD_MAX,
    DeviceInfo,
    Gap,
    IngestResult,
    IngestSession,
    Quarantined,
    Row,
)
from fleet.store.migrations import LATEST, pending, sqlite_statements

if TYPE_CHECKING:
    from wire.messages import StateMsg

_T = TypeVar("_T")
#: How long a writer waits for another's transaction before giving up.
BUSY_TIMEOUT_MS = 15_000
#: The longest a ping waits for the write lock: it asks "could a write start now?".
PING_WAIT_MS = 1_000
_QMAX = QUARANTINE_PAYLOAD_MAX
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


class SqliteStore:
    """:class:`fleet.store.base.Store` on SQLite. Use one per worker thread or process."""

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
                cur = db.executemany(
                    "INSERT INTO messages (device, boot_id, seq, kind, t_ns, received_ns, "
                    "label, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (device, boot_id, seq) DO NOTHING",
                    batch.messages,
                )
                inserted = cur.rowcount
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

    def quarantine(self, items: Sequence[Quarantined]) -> None:
        if not items:
            return

        def go(db: sqlite3.Connection) -> None:
            with self._write(db):
                db.executemany(
                    "INSERT INTO quarantine (received_ns, topic, device, reason, where_path, "
                    "payload) VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (q.received_ns, q.topic, q.device, q.reason, q.where, q.payload[:_QMAX])
                        for q in items
                    ],
                )

        self._run("quarantine", go)

    def record_state(self, device: str, site: str, state: StateMsg, received_ns: int) -> None:
        def go(db: sqlite3.Connection) -> None:
            with self._write(db):
                db.execute(
                    "INSERT INTO boots (device, boot_id, first_received_ns, watermark) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (device, boot_id) DO UPDATE SET "
                    "first_received_ns = MIN(first_received_ns, excluded.first_received_ns), "
                    "watermark = MAX(COALESCE(watermark, -1), excluded.watermark)",
                    (device, state.boot_id, received_ns, state.seq),
                )
                db.execute(
                    "INSERT INTO devices (device, site, first_seen_ns, last_seen_ns) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (device) DO UPDATE SET "
                    "last_seen_ns = MAX(COALESCE(last_seen_ns, 0), excluded.last_seen_ns), "
                    + _FIRST_SEEN,
                    (device, site, received_ns, received_ns),
                )
                boot, t_ns = db.execute(
                    "SELECT boot_id, state_t_ns FROM devices WHERE device = ?", (device,)
                ).fetchone()
                if not _common.state_applies(boot, t_ns, state.boot_id, state.t_ns):
                    return
                # Never the site: a device's site is the one it was registered with.
                db.execute(
                    "UPDATE devices SET device_type = ?, online = ?, boot_id = ?, "
                    "state_t_ns = ?, agent_version = ?, model_sha256 = ?, "
                    "model_health_json = ? WHERE device = ?",
                    (
                        state.device_type,
                        1 if state.state == "online" else 0,
                        state.boot_id,
                        state.t_ns if boot != state.boot_id else max(t_ns or 0, state.t_ns),
                        state.agent_version,
                        state.model_sha256,
                        _common.model_health_json(state),
                        device,
                    ),
                )

        self._run("record_state", go)

    def ensure_device(
        self, device: str, site: str, received_ns: int, *, auto_register: bool
    ) -> bool:
        def go(db: sqlite3.Connection) -> bool:
            if db.execute("SELECT 1 FROM devices WHERE device = ?", (device,)).fetchone():
                return True
            if not auto_register:
                return False
            with self._write(db):
                db.execute(
                    "INSERT INTO devices (device, site, first_seen_ns) VALUES (?, ?, ?) "
                    "ON CONFLICT (device) DO NOTHING",
                    (device, site, received_ns),
                )
            return True

        return self._run("ensure_device", go)

    def device_site(self, device: str) -> str | None:
        def go(db: sqlite3.Connection) -> str | None:
            row = db.execute("SELECT site FROM devices WHERE device = ?", (device,)).fetchone()
            return None if row is None else str(row[0])

        return self._run("device_site", go)

    def register_device(self, device: str, site: str, device_type: str = "generic") -> None:
        # first_seen_ns is 0 for a device registered ahead of its first message.
        def go(db: sqlite3.Connection) -> None:
            with self._write(db):
                db.execute(
                    "INSERT INTO devices (device, site, device_type, first_seen_ns) "
                    "VALUES (?, ?, ?, 0) ON CONFLICT (device) DO UPDATE SET "
                    "site = excluded.site, device_type = excluded.device_type",
                    (device, site, device_type),
                )

        self._run("register_device", go)

    # -- reads ---------------------------------------------------------------------------

    def devices(self) -> list[DeviceInfo]:
        def go(db: sqlite3.Connection) -> list[DeviceInfo]:
            rows = db.execute(_common.DEVICE_SELECT + " ORDER BY d.device").fetchall()
            return [_common.device_info(r) for r in rows]

        return self._run("devices", go)

    def device(self, name: str) -> DeviceInfo | None:
        def go(db: sqlite3.Connection) -> DeviceInfo | None:
            row = db.execute(_common.DEVICE_SELECT + " WHERE d.device = ?", (name,)).fetchone()
            return None if row is None else _common.device_info(row)

        return self._run("device", go)

    def telemetry(
        self, device: str, *, since_ns: int | None = None, limit: int = 100
    ) -> list[tuple[int, int, str, bytes]]:
        limit = _common.check_limit(limit)

        def go(db: sqlite3.Connection) -> list[tuple[int, int, str, bytes]]:
            rows = db.execute(
                "SELECT t_ns, seq, boot_id, body FROM messages "
                "WHERE device = ? AND kind = 'telemetry' AND t_ns >= ? "
                "ORDER BY t_ns DESC, seq DESC LIMIT ?",
                (device, -1 if since_ns is None else since_ns, limit),
            ).fetchall()
            return [(r[0], r[1], r[2], bytes(r[3])) for r in reversed(rows)]

        return self._run("telemetry", go)

    def decisions(
        self,
        *,
        since_ns: int | None = None,
        device: str | None = None,
        label: str | None = None,
        limit: int = 100,
    ) -> list[tuple[str, int, int, bytes]]:
        limit = _common.check_limit(limit)
        where = ["kind = 'decision'", "t_ns >= ?"]
        args: list[Any] = [-1 if since_ns is None else since_ns]
        if device is not None:
            where.append("device = ?")
            args.append(device)
        if label is not None:
            where.append("label = ?")
            args.append(label)
        sql = (
            "SELECT device, t_ns, seq, body FROM messages WHERE "  # noqa: S608 - constants
            + " AND ".join(where)
            + " ORDER BY t_ns DESC, device DESC, seq DESC LIMIT ?"
        )

        def go(db: sqlite3.Connection) -> list[tuple[str, int, int, bytes]]:
            rows = db.execute(sql, (*args, limit)).fetchall()
            return [(r[0], r[1], r[2], bytes(r[3])) for r in reversed(rows)]

        return self._run("decisions", go)

    def gaps(self, device: str | None = None) -> list[Gap]:
        sql = _common.gaps_sql("?", device is not None)
        args = () if device is None else (device, device)
        return self._run("gaps", lambda db: _common.gap_rows(db.execute(sql, args).fetchall()))

    def record_new_gaps(self, since_ns: int, until_ns: int, found_ns: int) -> list[Gap]:
        sql = _common.holes_received_sql("?")

        def go(db: sqlite3.Connection) -> list[Gap]:
            # Read outside the write lock (WAL: no writer waits for it), then check each
            # hole again and record it in one short write transaction.
            holes = _common.gap_rows(db.execute(sql, (since_ns, until_ns)).fetchall())
            if not holes:
                return []
            new = []
            with self._write(db):
                for g in holes:
                    key = (g.device, g.boot_id, g.first_missing, g.last_missing)
                    if db.execute(_common.HOLE_STILL_OPEN, key).fetchone() is None:
                        continue
                    if db.execute(_common.RECORD_HOLE, (*key, found_ns)).rowcount == 1:
                        new.append(g)
            return new

        return self._run("record_new_gaps", go)

    def quarantined(self, *, limit: int = 100) -> list[Quarantined]:
        limit = _common.check_limit(limit)

        def go(db: sqlite3.Connection) -> list[Quarantined]:
            rows = db.execute(
                "SELECT topic, payload, reason, where_path, received_ns, device FROM quarantine "
                "ORDER BY received_ns DESC, id DESC LIMIT ?",
                (limit,),
            ).fetchall()
            return [Quarantined(r[0], bytes(r[1]), r[2], r[3], r[4], r[5]) for r in rows]

        return self._run("quarantined", go)

    def counts(self) -> dict[str, int]:
        def go(db: sqlite3.Connection) -> dict[str, int]:
            kinds = db.execute("SELECT kind, COUNT(*) FROM messages GROUP BY kind").fetchall()
            q = db.execute("SELECT COUNT(*) FROM quarantine").fetchone()[0]
            d = db.execute("SELECT COUNT(*) FROM devices").fetchone()[0]
            return _common.counts_from(kinds, int(q), int(d))

        return self._run("counts", go)

    # -- rollouts ------------------------------------------------------------------------

    def set_labels(self, device: str, *, group: str | None, tier: str | None) -> bool:
        def go(db: sqlite3.Connection) -> bool:
            with self._write(db):
                n = 0
                if group is not None:
                    n = db.execute(
                        "UPDATE devices SET group_name = ? WHERE device = ?", (group, device)
                    ).rowcount
                if tier is not None:
                    n = db.execute(
                        "UPDATE devices SET tier = ? WHERE device = ?", (tier, device)
                    ).rowcount
                if group is None and tier is None:
                    n = len(
                        db.execute("SELECT 1 FROM devices WHERE device = ?", (device,)).fetchall()
                    )
                return n > 0

        return self._run("set_labels", go)

    def labels(self) -> dict[str, tuple[str, str]]:
        def go(db: sqlite3.Connection) -> dict[str, tuple[str, str]]:
            rows = db.execute("SELECT device, group_name, tier FROM devices").fetchall()
            return {r[0]: (r[1], r[2]) for r in rows}

        return self._run("labels", go)

    def insert_rollout(self, rollout_id: str, state: str, doc: str, now_ns: int) -> bool:
        def go(db: sqlite3.Connection) -> bool:
            with self._write(db):
                cur = db.execute(
                    "INSERT INTO rollouts (id, state, created_ns, updated_ns, doc) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                    (rollout_id, state, now_ns, now_ns, doc),
                )
                return cur.rowcount == 1

        return self._run("insert_rollout", go)

    def save_rollout(self, rollout_id: str, state: str, doc: str, now_ns: int) -> None:
        def go(db: sqlite3.Connection) -> None:
            with self._write(db):
                db.execute(
                    "INSERT INTO rollouts (id, state, created_ns, updated_ns, doc) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                    "state = excluded.state, updated_ns = excluded.updated_ns, doc = excluded.doc",
                    (rollout_id, state, now_ns, now_ns, doc),
                )

        self._run("save_rollout", go)

    def rollouts(self, *, active_only: bool = False) -> list[tuple[str, str, str]]:
        where = " WHERE state IN ('running', 'paused')" if active_only else ""

        def go(db: sqlite3.Connection) -> list[tuple[str, str, str]]:
            sql = f"SELECT id, state, doc FROM rollouts{where} ORDER BY created_ns DESC, id"  # noqa: S608 - a constant clause
            return [(r[0], r[1], r[2]) for r in db.execute(sql).fetchall()]

        return self._run("rollouts", go)

    def add_rollout_request(self, rollout_id: str, action: str, now_ns: int) -> None:
        def go(db: sqlite3.Connection) -> None:
            with self._write(db):
                db.execute(
                    "INSERT INTO rollout_requests (rollout_id, action, requested_ns) "
                    "VALUES (?, ?, ?)",
                    (rollout_id, action, now_ns),
                )

        self._run("add_rollout_request", go)

    def pending_rollout_requests(self) -> list[tuple[int, str, str]]:
        def go(db: sqlite3.Connection) -> list[tuple[int, str, str]]:
            rows = db.execute(
                "SELECT id, rollout_id, action FROM rollout_requests "
                "WHERE done_ns IS NULL ORDER BY id"
            ).fetchall()
            return [(int(r[0]), r[1], r[2]) for r in rows]

        return self._run("pending_rollout_requests", go)

    def finish_rollout_requests(self, ids: Sequence[int], now_ns: int) -> None:
        def go(db: sqlite3.Connection) -> None:
            with self._write(db):
                db.executemany(
                    "UPDATE rollout_requests SET done_ns = ? WHERE id = ? AND done_ns IS NULL",
                    [(now_ns, i) for i in ids],
                )

        self._run("finish_rollout_requests", go)

    def ota_status_since(
        self, received_ns: int, *, limit: int = 10_000, after: bytes | None = None
    ) -> list[tuple[int, bytes]]:
        sql, args = _common.ota_status_page(received_ns, limit, after, "?")

        def go(db: sqlite3.Connection) -> list[tuple[int, bytes]]:
            rows = db.execute(sql, args).fetchall()
            return [(int(r[0]), bytes(r[1])) for r in rows]

        return self._run("ota_status_since", go)

    # -- ingest sessions -----------------------------------------------------------------

    def ingest_sessions(self) -> list[IngestSession]:
        return self._run(
            "ingest_sessions",
            lambda db: _common.session_rows(db.execute(_common.SESSIONS_SELECT).fetchall()),
        )

    def save_ingest_sessions(
        self, sessions: Sequence[IngestSession], *, if_state: str | None = None
    ) -> int:
        sql = _common.sessions_sql("?", if_state is not None)

        def go(db: sqlite3.Connection) -> int:
            with self._write(db):
                return sum(
                    db.execute(sql, _common.session_params(s, if_state)).rowcount for s in sessions
                )

        return self._run("save_ingest_sessions", go)

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
