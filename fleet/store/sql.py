"""What the SQLite and PostgreSQL stores run alike: the reads, labels, rollouts and sessions.

:class:`SqlStore` holds every query whose text is the same on both engines once the
placeholder is chosen (SQL written with ``?``; each backend's :meth:`_sql` gives it its own
style). A backend supplies the connection (:meth:`SqlStore._run`, mapping driver errors to
:mod:`fleet.errors`) and the transaction (:meth:`SqlStore._txn`), and keeps what differs:
connecting, the ingest's batch write, ``record_state``'s upserts, migrations and the ping.

Design: ``docs/ARCHITECTURE.md``, "The fleet store's tables".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleet.errors import LeadershipLost
from fleet.store import _common, runs
from fleet.store.access_sql import AccessSql
from fleet.store.base import (
    QUARANTINE_PAYLOAD_MAX,
    DeviceInfo,
    Gap,
    IngestSession,
    NodeInfo,
    Quarantined,
)
from fleet.store.console_sql import ConsoleSql
from fleet.store.sqlbase import Connection, Cursor
from wire.messages import StateMsg


class SqlStore(AccessSql, ConsoleSql):
    """The shared half of :class:`fleet.store.base.Store` over a DB-API connection.

    Subclasses set :attr:`PARAM` and implement :meth:`_run` and :meth:`_txn`. Every public
    method raises :class:`fleet.errors.FleetStoreError` (or ``StoreRefused``) on failure,
    through :meth:`_run`.
    """

    #: Where the ingest's audit (:meth:`record_new_gaps`) looks up stored keys and their t_ns.
    _KEYS = "messages"

    # -- registry ----------------------------------------------------------------------------

    def device_site(self, device: str) -> str | None:
        sql = self._sql("SELECT site FROM devices WHERE device = ?")

        def go(db: Connection) -> str | None:
            row = db.execute(sql, (device,)).fetchone()
            return None if row is None else str(row[0])

        return self._run("device_site", go)

    def register_device(self, device: str, site: str, device_type: str = "generic") -> None:
        # first_seen_ns is 0 for a device registered ahead of its first message.
        sql = self._sql(
            "INSERT INTO devices (device, site, device_type, first_seen_ns) "
            "VALUES (?, ?, ?, 0) ON CONFLICT (device) DO UPDATE SET "
            "site = excluded.site, device_type = excluded.device_type"
        )

        def go(db: Connection) -> None:
            with self._txn(db):
                db.execute(sql, (device, site, device_type))

        self._run("register_device", go)

    def ensure_device(
        self, device: str, site: str, received_ns: int, *, auto_register: bool
    ) -> bool:
        known = self._sql("SELECT 1 FROM devices WHERE device = ?")
        insert = self._sql(
            "INSERT INTO devices (device, site, first_seen_ns) VALUES (?, ?, ?) "
            "ON CONFLICT (device) DO NOTHING"
        )

        def go(db: Connection) -> bool:
            if db.execute(known, (device,)).fetchone():
                return True
            if not auto_register:
                return False
            with self._txn(db):
                db.execute(insert, (device, site, received_ns))
            return True

        return self._run("ensure_device", go)

    def quarantine(self, items: Sequence[Quarantined]) -> None:
        if not items:
            return
        sql = self._sql(
            "INSERT INTO quarantine (received_ns, topic, device, reason, where_path, payload) "
            "VALUES (?, ?, ?, ?, ?, ?)"
        )
        rows = [
            (
                q.received_ns,
                q.topic,
                q.device,
                q.reason,
                q.where,
                q.payload[:QUARANTINE_PAYLOAD_MAX],
            )
            for q in items
        ]

        def go(db: Connection) -> None:
            with self._txn(db):
                cur: Cursor = db.cursor()
                cur.executemany(sql, rows)

        self._run("quarantine", go)

    def _apply_state(
        self,
        db: Connection,
        device: str,
        state: StateMsg,
        current: tuple[str | None, int | None, object] | None,
    ) -> None:
        """The last step of ``record_state``, inside its transaction: the device's state
        fields from ``state`` if it is newer than the stored ``(boot, t_ns, online)``.
        Never the site: a device's site is the one it was registered with."""
        boot, t_ns, online = current or (None, None, False)
        if not _common.state_applies((boot, t_ns, bool(online)), state):
            return
        db.execute(
            self._sql(
                "UPDATE devices SET device_type = ?, online = ?, boot_id = ?, state_t_ns = ?, "
                "agent_version = ?, model_sha256 = ?, model_health_json = ? WHERE device = ?"
            ),
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

    # -- reads -------------------------------------------------------------------------------

    def devices(self) -> list[DeviceInfo]:
        sql = self._sql(_common.DEVICE_SELECT + " ORDER BY d.device")
        return self._run(
            "devices", lambda db: [_common.device_info(r) for r in db.execute(sql).fetchall()]
        )

    def device(self, name: str) -> DeviceInfo | None:
        sql = self._sql(_common.DEVICE_SELECT + " WHERE d.device = ?")

        def go(db: Connection) -> DeviceInfo | None:
            row = db.execute(sql, (name,)).fetchone()
            return None if row is None else _common.device_info(row)

        return self._run("device", go)

    def telemetry(
        self, device: str, *, since_ns: int | None = None, limit: int = 100
    ) -> list[tuple[int, int, str, bytes]]:
        limit = _common.check_limit(limit)
        sql = self._sql(
            "SELECT t_ns, seq, boot_id, body FROM messages "
            "WHERE device = ? AND kind = 'telemetry' AND t_ns >= ? "
            "ORDER BY t_ns DESC, seq DESC LIMIT ?"
        )

        def go(db: Connection) -> list[tuple[int, int, str, bytes]]:
            rows = db.execute(sql, (device, -1 if since_ns is None else since_ns, limit))
            return [(r[0], r[1], r[2], bytes(r[3])) for r in reversed(rows.fetchall())]

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
        sql = self._sql(
            "SELECT device, t_ns, seq, body FROM messages WHERE "  # noqa: S608 - constants
            + " AND ".join(where)
            + " ORDER BY t_ns DESC, device DESC, seq DESC LIMIT ?"
        )

        def go(db: Connection) -> list[tuple[str, int, int, bytes]]:
            rows = db.execute(sql, (*args, limit)).fetchall()
            return [(r[0], r[1], r[2], bytes(r[3])) for r in reversed(rows)]

        return self._run("decisions", go)

    def gaps(self, device: str | None = None) -> list[Gap]:
        sql = self._sql(runs.gaps_sql(device is not None))
        args = () if device is None else (device, device)
        return self._run("gaps", lambda db: _common.gap_rows(db.execute(sql, args).fetchall()))

    def record_new_gaps(self, since_ns: int, until_ns: int, found_ns: int) -> list[Gap]:
        holes_sql = self._sql(_common.holes_received_sql(self._KEYS))
        still_open = self._sql(_common.hole_still_open_sql(self._KEYS))
        record = self._sql(_common.RECORD_HOLE)

        def go(db: Connection) -> list[Gap]:
            # Read outside the write transaction (no writer waits for it), then check each
            # hole again and record it in one short write.
            holes = _common.gap_rows(db.execute(holes_sql, (since_ns, until_ns)).fetchall())
            if not holes:
                return []
            new = []
            with self._txn(db):
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
        sql = self._sql(
            "SELECT topic, payload, reason, where_path, received_ns, device FROM quarantine "
            "ORDER BY received_ns DESC, id DESC LIMIT ?"
        )

        def go(db: Connection) -> list[Quarantined]:
            rows = db.execute(sql, (limit,)).fetchall()
            return [Quarantined(r[0], bytes(r[1]), r[2], r[3], r[4], r[5]) for r in rows]

        return self._run("quarantined", go)

    def counts(self) -> dict[str, int]:
        def go(db: Connection) -> dict[str, int]:
            kinds = db.execute("SELECT kind, COUNT(*) FROM messages GROUP BY kind").fetchall()
            q = db.execute("SELECT COUNT(*) FROM quarantine").fetchone()
            d = db.execute("SELECT COUNT(*) FROM devices").fetchone()
            return _common.counts_from(kinds, int(q[0]) if q else 0, int(d[0]) if d else 0)

        return self._run("counts", go)

    # -- labels and rollouts -----------------------------------------------------------------

    def set_labels(self, device: str, *, group: str | None, tier: str | None) -> bool:
        set_group = self._sql("UPDATE devices SET group_name = ? WHERE device = ?")
        set_tier = self._sql("UPDATE devices SET tier = ? WHERE device = ?")
        exists = self._sql("SELECT 1 FROM devices WHERE device = ?")

        def go(db: Connection) -> bool:
            with self._txn(db):
                n = 0
                if group is not None:
                    n = db.execute(set_group, (group, device)).rowcount
                if tier is not None:
                    n = db.execute(set_tier, (tier, device)).rowcount
                if group is None and tier is None:
                    n = len(db.execute(exists, (device,)).fetchall())
                return n > 0

        return self._run("set_labels", go)

    def labels(self) -> dict[str, tuple[str, str]]:
        def go(db: Connection) -> dict[str, tuple[str, str]]:
            rows = db.execute("SELECT device, group_name, tier FROM devices").fetchall()
            return {r[0]: (r[1], r[2]) for r in rows}

        return self._run("labels", go)

    def expire(self, kind: str, before_ns: int, limit: int) -> int:
        sql, args, record_floor = _common.expire_sql(kind, before_ns, limit)

        def go(db: Connection) -> int:
            with self._txn(db):
                n = int(db.execute(self._sql(sql), args).rowcount)
                if record_floor:
                    db.execute(self._sql(_common.RECORD_FLOOR), (kind, before_ns))
                    db.execute(self._sql(runs.EXPIRE_RUNS))
                return n

        return self._run("expire", go)

    #: Appended to a read of rows about to be rewritten: PostgreSQL locks them (in the
    #: read's order); SQLite's write transaction holds the whole database already.
    _FOR_UPDATE = ""

    def compact_runs(self, limit: int = 10_000) -> int:
        def go(db: Connection) -> int:
            boots = db.execute(self._sql(runs.FOLDABLE), (limit,)).fetchall()
            folded = 0
            for device, boot in boots:
                with self._txn(db):
                    rows = db.execute(
                        self._sql(runs.BOOT_RUNS + self._FOR_UPDATE), (device, boot)
                    ).fetchall()
                    read = [(str(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows]
                    keep = runs.merged(read)
                    if len(keep) < len(read):
                        cur = db.cursor()
                        cur.executemany(self._sql(runs.DELETE_RUN), [r[:3] for r in read])
                        cur.executemany(self._sql(runs.PUT_RUN), keep)
                        folded += len(read) - len(keep)
            return folded

        return self._run("compact_runs", go)

    def prepare_history(self, now_ns: int) -> int:
        return 0  # one table per kind of history: nothing to make ready (PostgreSQL overrides)

    def put_bundle(self, sha256: str, data: bytes, now_ns: int) -> None:
        sql = self._sql(
            "INSERT INTO bundles (sha256, size, created_ns, data) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (sha256) DO NOTHING"
        )

        def go(db: Connection) -> None:
            with self._txn(db):
                db.execute(sql, (sha256, len(data), now_ns, data))

        self._run("put_bundle", go)

    def bundle(self, sha256: str) -> bytes | None:
        sql = self._sql("SELECT data FROM bundles WHERE sha256 = ?")

        def go(db: Connection) -> bytes | None:
            row = db.execute(sql, (sha256,)).fetchone()
            return None if row is None else bytes(row[0])

        return self._run("bundle", go)

    _INSERT_ROLLOUT = (
        "INSERT INTO rollouts (id, state, created_ns, updated_ns, doc) VALUES (?, ?, ?, ?, ?) "
    )

    def insert_rollout(self, rollout_id: str, state: str, doc: str, now_ns: int) -> bool:
        sql = self._sql(self._INSERT_ROLLOUT + "ON CONFLICT (id) DO NOTHING")

        def go(db: Connection) -> bool:
            with self._txn(db):
                return int(db.execute(sql, (rollout_id, state, now_ns, now_ns, doc)).rowcount) == 1

        return self._run("insert_rollout", go)

    #: Appended to the leader read of a fenced save: PostgreSQL holds the row until the
    #: save commits, so a node taking the lead waits for it (SQLite has one writer anyway).
    _FOR_SHARE = ""

    def save_rollout(
        self, rollout_id: str, state: str, doc: str, now_ns: int, *, epoch: int | None = None
    ) -> None:
        """Save a rollout's document; with ``epoch``, only while that epoch leads (else
        :class:`fleet.errors.LeadershipLost`, nothing written)."""
        sql = self._sql(
            self._INSERT_ROLLOUT + "ON CONFLICT (id) DO UPDATE SET "
            "state = excluded.state, updated_ns = excluded.updated_ns, doc = excluded.doc"
        )
        lead = "SELECT node, epoch FROM fleet_leader WHERE id = 1" + self._FOR_SHARE  # noqa: S608 - a constant clause

        def go(db: Connection) -> None:
            with self._txn(db):
                if epoch is not None:
                    row = db.execute(lead).fetchone()
                    if row is None or int(row[1]) != epoch:
                        who = "nobody" if row is None else f"{row[0]} (epoch {row[1]})"
                        raise LeadershipLost(
                            f"rollout {rollout_id} not saved: epoch {epoch} no longer leads; "
                            f"{who} does"
                        )
                db.execute(sql, (rollout_id, state, now_ns, now_ns, doc))

        self._run("save_rollout", go)

    # -- nodes -------------------------------------------------------------------------------

    def node_seen(
        self, node: str, *, host: str, pid: int, started_ns: int, now_ns: int, stats_json: str
    ) -> None:
        """Record that ``node`` runs (a heartbeat, with its ingest figures)."""
        sql = self._sql(
            "INSERT INTO fleet_nodes (node, host, pid, started_ns, seen_ns, stats_json) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (node) DO UPDATE SET host = excluded.host, "
            "pid = excluded.pid, started_ns = excluded.started_ns, seen_ns = excluded.seen_ns, "
            "stats_json = excluded.stats_json"
        )

        def go(db: Connection) -> None:
            with self._txn(db):
                db.execute(sql, (node, host, pid, started_ns, now_ns, stats_json))

        self._run("node_seen", go)

    def node_gone(self, node: str) -> None:
        """``node`` stopped cleanly: forget it."""
        sql = self._sql("DELETE FROM fleet_nodes WHERE node = ?")

        def go(db: Connection) -> None:
            with self._txn(db):
                db.execute(sql, (node,))

        self._run("node_gone", go)

    def nodes(self) -> list[NodeInfo]:
        def go(db: Connection) -> list[NodeInfo]:
            lead = db.execute("SELECT node, epoch FROM fleet_leader WHERE id = 1").fetchone()
            rows = db.execute(
                "SELECT node, host, pid, started_ns, seen_ns, stats_json FROM fleet_nodes "
                "ORDER BY node"
            ).fetchall()
            out = []
            for r in rows:
                leads = lead is not None and lead[0] == r[0]
                epoch = int(lead[1]) if leads else None
                stats = _common.json_object(r[5])
                out.append(
                    NodeInfo(
                        str(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4]), stats, leads, epoch
                    )
                )
            return out

        return self._run("nodes", go)

    def take_lead(self, node: str, now_ns: int) -> int:
        """``node`` now leads the rollouts: a new epoch (the fencing token), returned. Call
        only while holding the lead's lock (:mod:`fleet.leader`)."""
        sql = self._sql(
            "INSERT INTO fleet_leader (id, node, epoch, since_ns) VALUES (1, ?, 1, ?) "
            "ON CONFLICT (id) DO UPDATE SET node = excluded.node, "
            "epoch = fleet_leader.epoch + 1, since_ns = excluded.since_ns RETURNING epoch"
        )

        def go(db: Connection) -> int:
            with self._txn(db):
                return int(db.execute(sql, (node, now_ns)).fetchone()[0])

        return self._run("take_lead", go)

    def rollouts(self, *, active_only: bool = False) -> list[tuple[str, str, str]]:
        where = " WHERE state IN ('running', 'paused')" if active_only else ""
        sql = self._sql(f"SELECT id, state, doc FROM rollouts{where} ORDER BY created_ns DESC, id")  # noqa: S608 - a constant clause
        return self._run(
            "rollouts", lambda db: [(r[0], r[1], r[2]) for r in db.execute(sql).fetchall()]
        )

    def add_rollout_request(self, rollout_id: str, action: str, now_ns: int) -> None:
        sql = self._sql(
            "INSERT INTO rollout_requests (rollout_id, action, requested_ns) VALUES (?, ?, ?)"
        )

        def go(db: Connection) -> None:
            with self._txn(db):
                db.execute(sql, (rollout_id, action, now_ns))

        self._run("add_rollout_request", go)

    def pending_rollout_requests(self) -> list[tuple[int, str, str]]:
        def go(db: Connection) -> list[tuple[int, str, str]]:
            rows = db.execute(
                "SELECT id, rollout_id, action FROM rollout_requests "
                "WHERE done_ns IS NULL ORDER BY id"
            ).fetchall()
            return [(int(r[0]), r[1], r[2]) for r in rows]

        return self._run("pending_rollout_requests", go)

    def finish_rollout_requests(self, ids: Sequence[int], now_ns: int) -> None:
        sql = self._sql("UPDATE rollout_requests SET done_ns = ? WHERE id = ? AND done_ns IS NULL")

        def go(db: Connection) -> None:
            with self._txn(db):
                cur: Cursor = db.cursor()
                cur.executemany(sql, [(now_ns, i) for i in ids])

        self._run("finish_rollout_requests", go)

    def ota_status_since(
        self, received_ns: int, *, limit: int = 10_000, after: bytes | None = None
    ) -> list[tuple[int, bytes]]:
        text, args = _common.ota_status_page(received_ns, limit, after)
        sql = self._sql(text)

        def go(db: Connection) -> list[tuple[int, bytes]]:
            return [(int(r[0]), bytes(r[1])) for r in db.execute(sql, args).fetchall()]

        return self._run("ota_status_since", go)

    # -- ingest sessions ---------------------------------------------------------------------

    def ingest_sessions(self) -> list[IngestSession]:
        return self._run(
            "ingest_sessions",
            lambda db: _common.session_rows(db.execute(_common.SESSIONS_SELECT).fetchall()),
        )

    def save_ingest_sessions(
        self, sessions: Sequence[IngestSession], *, if_state: str | None = None
    ) -> int:
        sql = self._sql(_common.sessions_sql(if_state is not None))

        def go(db: Connection) -> int:
            with self._txn(db):
                return sum(
                    int(db.execute(sql, _common.session_params(s, if_state)).rowcount)
                    for s in sessions
                )

        return self._run("save_ingest_sessions", go)
