"""The store at scale: PostgreSQL through psycopg 3, shared by any number of ingest workers.

Each :class:`PostgresStore` owns one connection in autocommit mode and wraps each operation
in an explicit transaction. A connection that breaks (server restart, network) is replaced
on the next call; the failed call raises :class:`FleetStoreError` and the caller retries
(ingest is idempotent). Deadlocks between workers are unlikely (batches are inserted in key
order) but, when PostgreSQL reports one, the transaction is retried here.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from fleet.errors import FleetStoreError, SchemaTooNew, StoreRefused
from fleet.store import _common, runs
from fleet.store.base import (
    DATA_KINDS,
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
DAY_NS = 86_400 * 1_000_000_000
#: Days of message partitions made ahead (fleet serve makes them every 10 minutes).
PARTITION_DAYS_AHEAD = 7
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
#: One message: its key first (unique in message_keys, whatever partition the message is
#: in), then the message if the key was new. Arguments: the key's five columns, then all eight.
_INSERT_MESSAGE = (
    "WITH new AS (INSERT INTO message_keys (device, boot_id, seq, kind, t_ns) "
    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (device, boot_id, seq) DO NOTHING RETURNING 1) "
    "INSERT INTO messages (device, boot_id, seq, kind, t_ns, received_ns, label, body) "
    "SELECT %s::text, %s::text, %s::int8, %s::text, %s::int8, %s::int8, %s::text, %s::bytea "
    "FROM new"
)
#: The batch copied to ingest_batch, the same way: the keys that were new, their messages.
_INSERT_BATCH = (
    "WITH new AS (INSERT INTO message_keys (device, boot_id, seq, kind, t_ns) "
    "SELECT device, boot_id, seq, kind, t_ns FROM ingest_batch ORDER BY device, boot_id, seq "
    "ON CONFLICT (device, boot_id, seq) DO NOTHING RETURNING device, boot_id, seq) "
    "INSERT INTO messages (device, boot_id, seq, kind, t_ns, received_ns, label, body) "
    "SELECT b.device, b.boot_id, b.seq, b.kind, b.t_ns, b.received_ns, b.label, b.body "
    "FROM ingest_batch b JOIN new USING (device, boot_id, seq)"
)
#: Retention in the default partition (rows of days with no partition): rows and their keys.
_EXPIRE_DEFAULT = (
    "WITH old AS (DELETE FROM messages_default WHERE (device, boot_id, seq, kind, t_ns) IN "
    "(SELECT device, boot_id, seq, kind, t_ns FROM messages_default WHERE kind = %s "
    "AND t_ns < %s LIMIT %s) RETURNING device, boot_id, seq), "
    "keys AS (DELETE FROM message_keys WHERE (device, boot_id, seq) IN (SELECT * FROM old)) "
    "SELECT count(*) FROM old"
)
#: Keys of a kind older than a dropped day's end whose message is not in the default
#: partition: their day's partition is gone.
_EXPIRE_KEYS = (
    "DELETE FROM message_keys WHERE (device, boot_id, seq) IN (SELECT k.device, k.boot_id, "
    "k.seq FROM message_keys k WHERE k.kind = %s AND k.t_ns < %s AND NOT EXISTS (SELECT 1 "
    "FROM messages_default d WHERE d.device = k.device AND d.boot_id = k.boot_id "
    "AND d.seq = k.seq AND d.kind = k.kind AND d.t_ns = k.t_ns) LIMIT %s)"
)
#: Where a key not inserted holds another body: through message_keys to the stored copy
#: (its kind and t_ns name the one partition to look in).
_CONFLICTS_OF = (
    "SELECT b.device, b.boot_id, b.seq FROM {batch} "
    "JOIN message_keys k USING (device, boot_id, seq) "
    "JOIN messages m ON m.device = k.device AND m.boot_id = k.boot_id AND m.seq = k.seq "
    "AND m.kind = k.kind AND m.t_ns = k.t_ns WHERE m.body <> b.body"
)


def _day_partitions(db: psycopg.Connection[tuple[Any, ...]], kind: str) -> list[tuple[str, int]]:
    """``(name, UTC day number)`` of ``kind``'s day partitions of ``messages`` (named by
    ``fleet_partition_name``: ``messages_ota_status_20261205``)."""
    prefix = "messages_" + re.sub("[^a-z]", "_", kind) + "_"
    rows = db.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'messages'::regclass"
    ).fetchall()
    out: list[tuple[str, int]] = []
    for (name,) in rows:
        stamp = str(name).removeprefix(prefix)
        if stamp != name and len(stamp) == 8 and stamp.isdigit():
            day = datetime.strptime(stamp, "%Y%m%d").replace(tzinfo=UTC)
            out.append((str(name), int(day.timestamp()) // 86_400))
    return out


def _columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows -> one list per column (the arrays an ``unnest`` takes)."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(c) for c in zip(*rows, strict=True)]


class PostgresStore(SqlStore):
    """:class:`fleet.store.base.Store` on PostgreSQL. Use one per worker thread or process.

    ``insert_mode`` picks how a batch of messages is written: ``"copy"`` (binary COPY into a
    temporary table, then one statement that inserts the new keys into ``message_keys`` and
    the messages whose key was new) or ``"executemany"`` (the same per row, pipelined). COPY
    is the default because it measured faster for 500-row batches (``bench.fleet_ingest``).
    Messages live in day partitions (schema v13): :meth:`prepare_history` makes them,
    :meth:`expire` drops them.
    """

    PARAM = "%s"
    #: One unpartitioned index for key lookups instead of one per day partition.
    _KEYS = "message_keys"
    _FOR_UPDATE = " FOR UPDATE"
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
                cur.executemany(
                    _INSERT_MESSAGE + _RETURNING_KEY,
                    [(*m[:5], *m) for m in batch.messages],
                    returning=True,
                )
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
            cur.execute(_INSERT_BATCH + _RETURNING_KEY)
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
                stored = runs.runs_of(batch.messages, new)
                if stored:
                    cur.execute(runs.INSERT_RUNS_PG, tuple(_columns(stored, 5)))
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
            cur.execute(_CONFLICTS_OF.format(batch="ingest_batch b"))
        else:
            cols = _columns([(r.device, r.boot_id, r.seq, r.body) for r in batch.rows], 4)
            cur.execute(
                _CONFLICTS_OF.format(
                    batch="unnest(%s::text[], %s::text[], %s::int8[], %s::bytea[]) "
                    "AS b (device, boot_id, seq, body)"
                ),
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

    def prepare_history(self, now_ns: int) -> int:
        today = now_ns // DAY_NS

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> int:
            with db.transaction():
                row = db.execute(
                    "SELECT count(*) FILTER (WHERE fleet_ensure_partition(k, d)) "
                    "FROM unnest(%s::text[]) AS k, generate_series(%s::int8, %s::int8) AS d",
                    (list(DATA_KINDS), today - 1, today + PARTITION_DAYS_AHEAD),
                ).fetchone()
            return int(row[0]) if row else 0

        return self._run("prepare_history", go)

    def expire(self, kind: str, before_ns: int, limit: int) -> int:
        if kind not in DATA_KINDS:
            return super().expire(kind, before_ns, limit)

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> int:
            gone = 0
            with db.transaction():
                # Short: dropping a partition locks the whole table against the ingest. The
                # same lock as fleet_ensure_partition: no partition is made meanwhile.
                db.execute("SELECT pg_advisory_xact_lock(hashtext('fleet_partitions'))")
                for name, day in _day_partitions(db, kind):
                    if (day + 1) * DAY_NS <= before_ns:
                        row = db.execute(
                            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(name))
                        ).fetchone()
                        gone += int(row[0]) if row else 0
                        db.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))
            with db.transaction():
                row = db.execute(_EXPIRE_DEFAULT, (kind, before_ns, limit)).fetchone()
                gone += int(row[0]) if row else 0
                db.execute(self._sql(_common.RECORD_FLOOR), (kind, before_ns))
                db.execute(self._sql(runs.EXPIRE_RUNS))
            # The keys of the days dropped, ``limit`` per transaction: none of them holds a
            # lock the ingest needs, and until they go a late copy is a duplicate.
            below = before_ns // DAY_NS * DAY_NS
            while True:
                with db.transaction():
                    n = db.execute(_EXPIRE_KEYS, (kind, below, limit)).rowcount
                if n < limit:
                    return gone

        return self._run("expire", go)

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
