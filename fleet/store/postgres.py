"""The store at scale: PostgreSQL through psycopg 3, shared by any number of ingest workers.

Each :class:`PostgresStore` owns one connection in autocommit mode and wraps each operation
in an explicit transaction. A connection that breaks (server restart, network) is replaced
on the next call; the failed call raises :class:`FleetStoreError` and the caller retries
(ingest is idempotent). Deadlocks between workers are unlikely (batches are inserted in key
order) but, when PostgreSQL reports one, the transaction is retried here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import psycopg
from psycopg import errors as pg_errors

from fleet.errors import FleetStoreError, SchemaTooNew, StoreRefused
from fleet.store import _common
from fleet.store.base import (
    IngestResult,
    Row,
    redact_url,
)
from fleet.store.migrations import LATEST, pending
from fleet.store.sql import SqlStore

if TYPE_CHECKING:
    from wire.messages import StateMsg

_T = TypeVar("_T")
#: Any fixed key works: it only serialises concurrent migrate() calls on one server.
_MIGRATE_LOCK = 0x6564_6765_666C_74  # "edgeflt"
_RETRIES = 3
#: A device registered ahead of its first message has first_seen_ns 0 until that message.
_FIRST_SEEN = (
    "first_seen_ns = CASE WHEN devices.first_seen_ns = 0 THEN EXCLUDED.first_seen_ns "
    "ELSE devices.first_seen_ns END"
)
_UPSERT_DEVICES = (
    "INSERT INTO devices (device, site, first_seen_ns, last_seen_ns) "  # noqa: S608 - constants
    "SELECT * FROM unnest(%s::text[], %s::text[], %s::int8[], %s::int8[]) ORDER BY 1 "
    "ON CONFLICT (device) DO UPDATE SET "
    "last_seen_ns = GREATEST(devices.last_seen_ns, EXCLUDED.last_seen_ns), " + _FIRST_SEEN
)
_MESSAGE_COLUMNS = "device, boot_id, seq, kind, t_ns, received_ns, label, body"
_RETURNING_KEY = " RETURNING device, boot_id, seq"
#: Adds the minute rollups of the telemetry just inserted (a redelivery was not).
_UPSERT_MINUTES = (
    "INSERT INTO signal_minutes (device, signal, minute, min, max, sum_wmean, sum_n, sum_mean, "
    "points) SELECT * FROM unnest(%s::text[], %s::text[], %s::int8[], %s::float8[], "
    "%s::float8[], %s::float8[], %s::int8[], %s::float8[], %s::int8[]) ORDER BY 1, 2, 3 "
    "ON CONFLICT (device, signal, minute) DO UPDATE SET "
    "min = LEAST(signal_minutes.min, EXCLUDED.min), "
    "max = GREATEST(signal_minutes.max, EXCLUDED.max), "
    "sum_wmean = signal_minutes.sum_wmean + EXCLUDED.sum_wmean, "
    "sum_n = signal_minutes.sum_n + EXCLUDED.sum_n, "
    "sum_mean = signal_minutes.sum_mean + EXCLUDED.sum_mean, "
    "points = signal_minutes.points + EXCLUDED.points"
)
_INSERT_MESSAGES = (
    "INSERT INTO messages (device, boot_id, seq, kind, t_ns, received_ns, label, body) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
    "ON CONFLICT (device, boot_id, seq) DO NOTHING"
)


def _columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows -> one list per column (the arrays an ``unnest`` takes)."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(c) for c in zip(*rows, strict=True)]


class PostgresStore(SqlStore):
    """:class:`fleet.store.base.Store` on PostgreSQL. Use one per worker thread or process.

    ``insert_mode`` picks how a batch of messages is written: ``"copy"`` (binary COPY into a
    temporary table, then one ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``) or
    ``"executemany"`` (pipelined single-row inserts). COPY is the default because it measured
    faster for 500-row batches (see the report / ``bench``).
    """

    PARAM = "%s"
    _FOR_SHARE = " FOR SHARE"

    def __init__(self, url: str, *, insert_mode: Literal["copy", "executemany"] = "copy") -> None:
        self._dsn = url
        self.url = redact_url(url)
        self.insert_mode = insert_mode
        self._lock = threading.Lock()
        self._db: psycopg.Connection[tuple[Any, ...]] | None = None
        self._tmp_ready = False
        with self._lock:
            self._connect()

    # -- plumbing ------------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        if self._db is not None and not self._db.closed and not self._db.broken:
            return self._db
        if self._db is not None:
            self._db.close()
        try:
            # A URL's own connect_timeout wins; without one, a dead server must not hang us.
            if "connect_timeout" in self._dsn:
                self._db = psycopg.connect(self._dsn, autocommit=True)
            else:
                self._db = psycopg.connect(self._dsn, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            # psycopg's message can quote the conninfo; keep only its first line, which
            # names the host and the failure, and never the password.
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise FleetStoreError(
                f"store {self.url}: cannot connect: {first.replace(self._dsn, self.url)}"
            ) from None
        self._tmp_ready = False
        return self._db

    def _run(self, what: str, fn: Callable[[psycopg.Connection[tuple[Any, ...]]], _T]) -> _T:
        with self._lock:
            for attempt in range(_RETRIES):
                db = self._connect()
                try:
                    return fn(db)
                except (pg_errors.DeadlockDetected, pg_errors.SerializationFailure) as exc:
                    if attempt == _RETRIES - 1:
                        raise FleetStoreError(
                            f"store {self.url}: {what} failed after {_RETRIES} attempts: {exc}"
                        ) from None
                except psycopg.OperationalError as exc:
                    # A connection dropped while idle (server restart, failover) shows on its
                    # next use: reconnect and run once more. Writes are idempotent or, for
                    # quarantine, at worst kept twice.
                    if not db.broken or attempt > 0:
                        raise FleetStoreError(f"store {self.url}: {what} failed: {exc}") from None
                except (psycopg.DataError, psycopg.IntegrityError, OverflowError) as exc:
                    # OverflowError: an int past 64 bits, which psycopg cannot even send.
                    raise StoreRefused(f"store {self.url}: {what} refused: {exc}") from None
                except psycopg.Error as exc:
                    raise FleetStoreError(f"store {self.url}: {what} failed: {exc}") from None
            raise AssertionError("unreachable")

    def _txn(self, db: psycopg.Connection[tuple[Any, ...]]) -> AbstractContextManager[Any]:
        return db.transaction()

    # -- schema --------------------------------------------------------------------------

    @staticmethod
    def _applied(db: psycopg.Connection[tuple[Any, ...]]) -> set[int]:
        row = db.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
        if not row or not row[0]:
            return set()
        return {int(r[0]) for r in db.execute("SELECT version FROM schema_version").fetchall()}

    def migrate(self) -> int:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> int:
            applied = self._applied(db)
            if max(applied, default=0) > LATEST:
                raise SchemaTooNew(self.url, max(applied), LATEST)
            for m in pending(applied):
                with db.transaction():
                    # Two workers starting together: the second waits, then finds the work done.
                    db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_LOCK,))
                    db.execute(
                        "CREATE TABLE IF NOT EXISTS schema_version ("
                        "version INTEGER PRIMARY KEY, description TEXT NOT NULL)"
                    )
                    if m.version in self._applied(db):
                        continue
                    db.execute(m.postgres_sql.encode())
                    db.execute(
                        "INSERT INTO schema_version (version, description) VALUES (%s, %s)",
                        (m.version, m.description),
                    )
            return max(self._applied(db), default=0)

        return self._run("migrate", go)

    # -- writes --------------------------------------------------------------------------

    def _insert_messages(
        self, db: psycopg.Connection[tuple[Any, ...]], batch: _common.Batch
    ) -> set[tuple[str, str, int]]:
        """Insert the batch's messages; the keys of those that were new."""
        if self.insert_mode == "executemany":
            keys: set[tuple[str, str, int]] = set()
            with db.cursor() as cur:
                cur.executemany(_INSERT_MESSAGES + _RETURNING_KEY, batch.messages, returning=True)
                while True:
                    keys.update((r[0], r[1], int(r[2])) for r in cur.fetchall())
                    if not cur.nextset():
                        break
            return keys
        if not self._tmp_ready:
            # ON COMMIT DELETE ROWS empties it after every batch; it lives with the session.
            db.execute(
                "CREATE TEMP TABLE IF NOT EXISTS ingest_batch "
                "(LIKE messages INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
            )
            self._tmp_ready = True
        with db.cursor() as cur:
            with cur.copy(
                f"COPY ingest_batch ({_MESSAGE_COLUMNS}) FROM STDIN (FORMAT BINARY)"
            ) as cp:
                cp.set_types(["text", "text", "int8", "text", "int8", "int8", "text", "bytea"])
                for m in batch.messages:
                    cp.write_row(m)
            cur.execute(
                f"INSERT INTO messages ({_MESSAGE_COLUMNS}) "  # noqa: S608 - constants
                f"SELECT {_MESSAGE_COLUMNS} FROM ingest_batch "
                "ORDER BY device, boot_id, seq "
                "ON CONFLICT (device, boot_id, seq) DO NOTHING" + _RETURNING_KEY
            )
            return {(r[0], r[1], int(r[2])) for r in cur.fetchall()}

    def ingest(self, rows: Sequence[Row]) -> IngestResult:
        if not rows:
            return IngestResult(0, 0)
        batch = _common.prepare(rows)

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> IngestResult:
            try:
                return write(db)
            except BaseException:
                # A temp table created in a rolled-back transaction is gone again.
                self._tmp_ready = False
                raise

        def write(db: psycopg.Connection[tuple[Any, ...]]) -> IngestResult:
            with db.transaction(), db.cursor() as cur:
                new = self._insert_messages(db, batch)
                inserted = len(new)
                conflicts = batch.conflicts
                if inserted < len(batch.messages):
                    conflicts = conflicts + self._conflicting(cur, batch)
                if conflicts:
                    cur.executemany(
                        "INSERT INTO quarantine (received_ns, topic, device, reason, where_path, "
                        "payload) "
                        "VALUES (%s, %s, %s, %s, %s, %s)",
                        _common.conflict_rows(conflicts),
                    )
                minutes = _common.minute_rollups(batch.points, new, len(batch.messages))
                if minutes:
                    cur.execute(_UPSERT_MINUTES, tuple(_columns(minutes, 9)))
                # One statement per table over arrays, not executemany: that is one server
                # round of parse, plan and execute per device, which cost more than the COPY
                # of the whole batch. The keys are unique (prepare merged them), and ORDER BY
                # keeps the lock order that prevents deadlocks between workers.
                b_dev, b_boot, b_first = _columns(batch.boots, 3)
                cur.execute(
                    "INSERT INTO boots (device, boot_id, first_received_ns) "
                    "SELECT * FROM unnest(%s::text[], %s::text[], %s::int8[]) ORDER BY 1, 2 "
                    "ON CONFLICT (device, boot_id) DO UPDATE SET first_received_ns = "
                    "LEAST(boots.first_received_ns, EXCLUDED.first_received_ns)",
                    (b_dev, b_boot, b_first),
                )
                d_dev, d_site, d_first, d_last = _columns(batch.devices, 4)
                cur.execute(_UPSERT_DEVICES, (d_dev, d_site, d_first, d_last))
                cur.executemany(
                    "UPDATE devices SET latency_json = %(j)s, latency_t_ns = %(t)s "
                    "WHERE device = %(d)s AND (latency_t_ns IS NULL OR latency_t_ns <= %(t)s)",
                    [{"d": d, "j": j, "t": t} for d, j, t in batch.latencies],
                )
            n = len(conflicts)
            return IngestResult(inserted, len(rows) - inserted - n, n)

        return self._run("ingest", go)

    def _conflicting(self, cur: psycopg.Cursor[tuple[Any, ...]], batch: _common.Batch) -> list[Row]:
        """Rows of ``batch`` that were not inserted because their key holds another body.

        Only asked when some row was not inserted (a redelivery, rare). The comparison
        runs in the server: against the batch already copied to ``ingest_batch``, or, in
        ``executemany`` mode, against the batch's keys and bodies sent as arrays. Under
        READ COMMITTED this statement sees a row another worker committed while our
        insert waited on its key."""
        if self.insert_mode == "copy":
            cur.execute(
                "SELECT b.device, b.boot_id, b.seq FROM ingest_batch b "
                "JOIN messages m USING (device, boot_id, seq) WHERE m.body <> b.body"
            )
        else:
            cols = _columns([(r.device, r.boot_id, r.seq, r.body) for r in batch.rows], 4)
            cur.execute(
                "SELECT b.device, b.boot_id, b.seq FROM unnest(%s::text[], %s::text[], "
                "%s::int8[], %s::bytea[]) AS b (device, boot_id, seq, body) "
                "JOIN messages m USING (device, boot_id, seq) WHERE m.body <> b.body",
                cols,
            )
        keys = {(str(d), str(b), int(q)) for d, b, q in cur.fetchall()}
        return [r for r in batch.rows if (r.device, r.boot_id, r.seq) in keys]

    def record_state(self, device: str, site: str, state: StateMsg, received_ns: int) -> None:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> None:
            with db.transaction():
                db.execute(
                    "INSERT INTO boots (device, boot_id, first_received_ns, watermark, held) "
                    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (device, boot_id) DO UPDATE SET "
                    "first_received_ns = LEAST(boots.first_received_ns, "
                    "EXCLUDED.first_received_ns), "
                    "watermark = GREATEST(boots.watermark, EXCLUDED.watermark), "
                    "held = GREATEST(boots.held, EXCLUDED.held)",
                    (device, state.boot_id, received_ns, state.seq, _common.held_of(state)),
                )
                # FOR UPDATE: two workers handling two states of one device decide in turn.
                db.execute(
                    "INSERT INTO devices (device, site, first_seen_ns, last_seen_ns) "
                    "VALUES (%s, %s, %s, %s) ON CONFLICT (device) DO UPDATE SET "
                    "last_seen_ns = GREATEST(devices.last_seen_ns, EXCLUDED.last_seen_ns), "
                    + _FIRST_SEEN,
                    (device, site, received_ns, received_ns),
                )
                row = db.execute(
                    "SELECT boot_id, state_t_ns, online FROM devices WHERE device = %s FOR UPDATE",
                    (device,),
                ).fetchone()
                self._apply_state(db, device, state, row)

        self._run("record_state", go)

    def ping(self) -> None:
        # A standby (a failover that left us on the wrong server) or a database set
        # read-only answers a SELECT and refuses every write: that is an outage, not data
        # the store refuses, so the ping must fail too.
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> None:
            row = db.execute("SELECT current_setting('transaction_read_only')").fetchone()
            if row is None or row[0] != "off":
                raise FleetStoreError(f"store {self.url}: the database is read-only")

        self._run("ping", go)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()

    def __repr__(self) -> str:
        return f"PostgresStore({self.url!r})"
