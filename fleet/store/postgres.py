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
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import psycopg
from psycopg import errors as pg_errors

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
    redact_url,
)
from fleet.store.migrations import LATEST, pending

if TYPE_CHECKING:
    from wire.messages import StateMsg

_T = TypeVar("_T")
#: Any fixed key works: it only serialises concurrent migrate() calls on one server.
_MIGRATE_LOCK = 0x6564_6765_666C_74  # "edgeflt"
_RETRIES = 3
_QMAX = QUARANTINE_PAYLOAD_MAX
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


class PostgresStore:
    """:class:`fleet.store.base.Store` on PostgreSQL. Use one per worker thread or process.

    ``insert_mode`` picks how a batch of messages is written: ``"copy"`` (binary COPY into a
    temporary table, then one ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``) or
    ``"executemany"`` (pipelined single-row inserts). COPY is the default because it measured
    faster for 500-row batches (see the report / ``bench``).
    """

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
    ) -> int:
        if self.insert_mode == "executemany":
            with db.cursor() as cur:
                cur.executemany(_INSERT_MESSAGES, batch.messages)
                return cur.rowcount
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
                "ON CONFLICT (device, boot_id, seq) DO NOTHING"
            )
            return cur.rowcount

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
                inserted = self._insert_messages(db, batch)
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

    def quarantine(self, items: Sequence[Quarantined]) -> None:
        if not items:
            return

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> None:
            with db.transaction(), db.cursor() as cur:
                cur.executemany(
                    "INSERT INTO quarantine (received_ns, topic, device, reason, where_path, "
                    "payload) VALUES (%s, %s, %s, %s, %s, %s)",
                    [
                        (q.received_ns, q.topic, q.device, q.reason, q.where, q.payload[:_QMAX])
                        for q in items
                    ],
                )

        self._run("quarantine", go)

    def record_state(self, device: str, site: str, state: StateMsg, received_ns: int) -> None:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> None:
            with db.transaction():
                db.execute(
                    "INSERT INTO boots (device, boot_id, first_received_ns, watermark) "
                    "VALUES (%s, %s, %s, %s) ON CONFLICT (device, boot_id) DO UPDATE SET "
                    "first_received_ns = LEAST(boots.first_received_ns, "
                    "EXCLUDED.first_received_ns), "
                    "watermark = GREATEST(boots.watermark, EXCLUDED.watermark)",
                    (device, state.boot_id, received_ns, state.seq),
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
                    "SELECT boot_id, state_t_ns FROM devices WHERE device = %s FOR UPDATE",
                    (device,),
                ).fetchone()
                boot, t_ns = row if row else (None, None)
                if not _common.state_applies(boot, t_ns, state.boot_id, state.t_ns):
                    return
                # Never the site: a device's site is the one it was registered with.
                db.execute(
                    "UPDATE devices SET device_type = %s, online = %s, boot_id = %s, "
                    "state_t_ns = %s, agent_version = %s, model_sha256 = %s, "
                    "model_health_json = %s WHERE device = %s",
                    (
                        state.device_type,
                        state.state == "online",
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
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> bool:
            if db.execute("SELECT 1 FROM devices WHERE device = %s", (device,)).fetchone():
                return True
            if not auto_register:
                return False
            db.execute(
                "INSERT INTO devices (device, site, first_seen_ns) VALUES (%s, %s, %s) "
                "ON CONFLICT (device) DO NOTHING",
                (device, site, received_ns),
            )
            return True

        return self._run("ensure_device", go)

    def device_site(self, device: str) -> str | None:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> str | None:
            row = db.execute("SELECT site FROM devices WHERE device = %s", (device,)).fetchone()
            return None if row is None else str(row[0])

        return self._run("device_site", go)

    def register_device(self, device: str, site: str, device_type: str = "generic") -> None:
        # first_seen_ns is 0 for a device registered ahead of its first message.
        self._run(
            "register_device",
            lambda db: db.execute(
                "INSERT INTO devices (device, site, device_type, first_seen_ns) "
                "VALUES (%s, %s, %s, 0) ON CONFLICT (device) DO UPDATE SET "
                "site = EXCLUDED.site, device_type = EXCLUDED.device_type",
                (device, site, device_type),
            ),
        )

    # -- reads ---------------------------------------------------------------------------

    def devices(self) -> list[DeviceInfo]:
        return self._run(
            "devices",
            lambda db: [
                _common.device_info(r)
                for r in db.execute(_common.DEVICE_SELECT + " ORDER BY d.device").fetchall()
            ],
        )

    def device(self, name: str) -> DeviceInfo | None:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> DeviceInfo | None:
            row = db.execute(_common.DEVICE_SELECT + " WHERE d.device = %s", (name,)).fetchone()
            return None if row is None else _common.device_info(row)

        return self._run("device", go)

    def telemetry(
        self, device: str, *, since_ns: int | None = None, limit: int = 100
    ) -> list[tuple[int, int, str, bytes]]:
        limit = _common.check_limit(limit)

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> list[tuple[int, int, str, bytes]]:
            rows = db.execute(
                "SELECT t_ns, seq, boot_id, body FROM messages "
                "WHERE device = %s AND kind = 'telemetry' AND t_ns >= %s "
                "ORDER BY t_ns DESC, seq DESC LIMIT %s",
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
        where = ["kind = 'decision'", "t_ns >= %s"]
        args: list[Any] = [-1 if since_ns is None else since_ns]
        if device is not None:
            where.append("device = %s")
            args.append(device)
        if label is not None:
            where.append("label = %s")
            args.append(label)
        sql = (
            "SELECT device, t_ns, seq, body FROM messages WHERE "  # noqa: S608 - constants
            + " AND ".join(where)
            + " ORDER BY t_ns DESC, device DESC, seq DESC LIMIT %s"
        )

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> list[tuple[str, int, int, bytes]]:
            rows = db.execute(sql.encode(), (*args, limit)).fetchall()
            return [(r[0], r[1], r[2], bytes(r[3])) for r in reversed(rows)]

        return self._run("decisions", go)

    def gaps(self, device: str | None = None) -> list[Gap]:
        sql = _common.gaps_sql("%s", device is not None).encode()
        args = () if device is None else (device, device)
        return self._run("gaps", lambda db: _common.gap_rows(db.execute(sql, args).fetchall()))

    def record_new_gaps(self, since_ns: int, until_ns: int, found_ns: int) -> list[Gap]:
        sql = _common.holes_received_sql("%s").encode()
        still_open = _common.HOLE_STILL_OPEN.replace("?", "%s")
        record = _common.RECORD_HOLE.replace("?", "%s")

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> list[Gap]:
            holes = _common.gap_rows(db.execute(sql, (since_ns, until_ns)).fetchall())
            if not holes:
                return []
            new = []
            with db.transaction():
                for g in holes:
                    key = (g.device, g.boot_id, g.first_missing, g.last_missing)
                    if db.execute(still_open, key).fetchone() is None:
                        continue
                    if db.execute(record, (*key, found_ns)).rowcount == 1:
                        new.append(g)
            return new

        return self._run("record_new_gaps", go)

    def quarantined(self, *, limit: int = 100) -> list[Quarantined]:
        limit = _common.check_limit(limit)

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> list[Quarantined]:
            rows = db.execute(
                "SELECT topic, payload, reason, where_path, received_ns, device FROM quarantine "
                "ORDER BY received_ns DESC, id DESC LIMIT %s",
                (limit,),
            ).fetchall()
            return [Quarantined(r[0], bytes(r[1]), r[2], r[3], r[4], r[5]) for r in rows]

        return self._run("quarantined", go)

    def counts(self) -> dict[str, int]:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> dict[str, int]:
            kinds = db.execute("SELECT kind, COUNT(*) FROM messages GROUP BY kind").fetchall()
            q = db.execute("SELECT COUNT(*) FROM quarantine").fetchone()
            d = db.execute("SELECT COUNT(*) FROM devices").fetchone()
            return _common.counts_from(kinds, int(q[0]) if q else 0, int(d[0]) if d else 0)

        return self._run("counts", go)

    # -- rollouts ------------------------------------------------------------------------

    def set_labels(self, device: str, *, group: str | None, tier: str | None) -> bool:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> bool:
            with db.transaction():
                n = 0
                if group is not None:
                    n = db.execute(
                        "UPDATE devices SET group_name = %s WHERE device = %s", (group, device)
                    ).rowcount
                if tier is not None:
                    n = db.execute(
                        "UPDATE devices SET tier = %s WHERE device = %s", (tier, device)
                    ).rowcount
                if group is None and tier is None:
                    n = len(
                        db.execute("SELECT 1 FROM devices WHERE device = %s", (device,)).fetchall()
                    )
                return n > 0

        return self._run("set_labels", go)

    def labels(self) -> dict[str, tuple[str, str]]:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> dict[str, tuple[str, str]]:
            rows = db.execute("SELECT device, group_name, tier FROM devices").fetchall()
            return {r[0]: (r[1], r[2]) for r in rows}

        return self._run("labels", go)

    def insert_rollout(self, rollout_id: str, state: str, doc: str, now_ns: int) -> bool:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> bool:
            with db.transaction():
                cur = db.execute(
                    "INSERT INTO rollouts (id, state, created_ns, updated_ns, doc) "
                    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
                    (rollout_id, state, now_ns, now_ns, doc),
                )
                return cur.rowcount == 1

        return self._run("insert_rollout", go)

    def save_rollout(self, rollout_id: str, state: str, doc: str, now_ns: int) -> None:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> None:
            with db.transaction():
                db.execute(
                    "INSERT INTO rollouts (id, state, created_ns, updated_ns, doc) "
                    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
                    "state = EXCLUDED.state, updated_ns = EXCLUDED.updated_ns, doc = EXCLUDED.doc",
                    (rollout_id, state, now_ns, now_ns, doc),
                )

        self._run("save_rollout", go)

    def rollouts(self, *, active_only: bool = False) -> list[tuple[str, str, str]]:
        where = " WHERE state IN ('running', 'paused')" if active_only else ""

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> list[tuple[str, str, str]]:
            sql = f"SELECT id, state, doc FROM rollouts{where} ORDER BY created_ns DESC, id"  # noqa: S608 - a constant clause
            return [(r[0], r[1], r[2]) for r in db.execute(sql).fetchall()]

        return self._run("rollouts", go)

    def add_rollout_request(self, rollout_id: str, action: str, now_ns: int) -> None:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> None:
            with db.transaction():
                db.execute(
                    "INSERT INTO rollout_requests (rollout_id, action, requested_ns) "
                    "VALUES (%s, %s, %s)",
                    (rollout_id, action, now_ns),
                )

        self._run("add_rollout_request", go)

    def pending_rollout_requests(self) -> list[tuple[int, str, str]]:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> list[tuple[int, str, str]]:
            with db.transaction():
                rows = db.execute(
                    "SELECT id, rollout_id, action FROM rollout_requests "
                    "WHERE done_ns IS NULL ORDER BY id"
                ).fetchall()
            return [(int(r[0]), r[1], r[2]) for r in rows]

        return self._run("pending_rollout_requests", go)

    def finish_rollout_requests(self, ids: Sequence[int], now_ns: int) -> None:
        def go(db: psycopg.Connection[tuple[Any, ...]]) -> None:
            with db.transaction(), db.cursor() as cur:
                cur.executemany(
                    "UPDATE rollout_requests SET done_ns = %s WHERE id = %s AND done_ns IS NULL",
                    [(now_ns, i) for i in ids],
                )

        self._run("finish_rollout_requests", go)

    def ota_status_since(
        self, received_ns: int, *, limit: int = 10_000, after: bytes | None = None
    ) -> list[tuple[int, bytes]]:
        sql, args = _common.ota_status_page(received_ns, limit, after, "%s")

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> list[tuple[int, bytes]]:
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
        sql = _common.sessions_sql("%s", if_state is not None).encode()

        def go(db: psycopg.Connection[tuple[Any, ...]]) -> int:
            with db.transaction():
                return sum(
                    db.execute(sql, _common.session_params(s, if_state)).rowcount for s in sessions
                )

        return self._run("save_ingest_sessions", go)

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
