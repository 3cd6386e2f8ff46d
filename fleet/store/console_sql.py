"""The reads behind the fleet API and console, one query text for SQLite and PostgreSQL:
a signal's series downsampled in SQL, and keyset pages of decisions, OTA reports and the
quarantine. Every method raises :class:`fleet.errors.FleetStoreError` on a store failure.
Layout: docs/ARCHITECTURE.md, "The fleet API"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleet.store.base import Quarantined
from fleet.store.sqlbase import Connection, SqlBase

#: The newest row's key sorts below this; a first page starts under it.
_TOP = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket of a signal's series: first and last point time, min, max, the mean
    weighted by each point's sample count, and the number of points."""

    t0_ns: int
    t1_ns: int
    min: float
    max: float
    mean: float
    points: int


def _bucket(r: Sequence[Any]) -> Bucket:
    return Bucket(int(r[0]), int(r[1]), float(r[2]), float(r[3]), float(r[4]), int(r[5]))


class ConsoleSql(SqlBase):
    """Reads for people: series, pages of decisions, OTA history and quarantine."""

    def signals(self, device: str) -> list[str]:
        """The signals ``device`` has points for, by name (an index skip-scan: one probe
        per signal, not a scan of the series)."""
        sql = self._sql(
            "WITH RECURSIVE s(x) AS (SELECT MIN(signal) FROM signal_points WHERE device = ? "
            "UNION ALL SELECT (SELECT MIN(signal) FROM signal_points WHERE device = ? AND "
            "signal > s.x) FROM s WHERE s.x IS NOT NULL) SELECT x FROM s WHERE x IS NOT NULL"
        )
        return self._run(
            "signals", lambda db: [r[0] for r in db.execute(sql, (device, device)).fetchall()]
        )

    def series(
        self, device: str, signal: str, *, since_ns: int, until_ns: int, bucket_ns: int
    ) -> list[Bucket]:
        """``signal`` of ``device`` over ``[since_ns, until_ns)`` in buckets of ``bucket_ns``
        (min of mins, max of maxes, mean weighted by samples), oldest first."""
        sql = self._sql(
            "SELECT MIN(t_ns), MAX(t_ns), MIN(min), MAX(max), "
            "CASE WHEN SUM(n) > 0 THEN SUM(mean * n) / SUM(n) ELSE AVG(mean) END, COUNT(*) "
            "FROM signal_points WHERE device = ? AND signal = ? AND t_ns >= ? AND t_ns < ? "
            "GROUP BY (t_ns - ?) / ? ORDER BY 1"
        )
        args = (device, signal, since_ns, until_ns, since_ns, max(1, bucket_ns))
        return self._run(
            "series", lambda db: [_bucket(r) for r in db.execute(sql, args).fetchall()]
        )

    def decisions_page(
        self,
        *,
        device: str | None = None,
        label: str | None = None,
        since_ns: int = 0,
        until_ns: int = _TOP,
        before: tuple[int, str, int] | None = None,
        limit: int = 100,
    ) -> list[tuple[str, int, int, str, bytes]]:
        """``(device, t_ns, seq, boot_id, body)`` newest first; ``before`` is the
        ``(t_ns, device, seq)`` of the last row of the previous page."""
        where = ["kind = 'decision'", "t_ns >= ?", "t_ns < ?"]
        args: list[Any] = [since_ns, until_ns]
        if before is not None:
            where.append("(t_ns, device, seq) < (?, ?, ?)")
            args += before
        if device is not None:
            where.append("device = ?")
            args.append(device)
        if label is not None:
            where.append("label = ?")
            args.append(label)
        sql = self._sql(
            "SELECT device, t_ns, seq, boot_id, body FROM messages WHERE "  # noqa: S608 - constant clauses
            + " AND ".join(where)
            + " ORDER BY t_ns DESC, device DESC, seq DESC LIMIT ?"
        )
        args.append(limit)

        def go(db: Connection) -> list[tuple[str, int, int, str, bytes]]:
            return [
                (r[0], int(r[1]), int(r[2]), r[3], bytes(r[4]))
                for r in db.execute(sql, tuple(args)).fetchall()
            ]

        return self._run("decisions_page", go)

    def ota_history(self, device: str, *, limit: int = 100) -> list[tuple[int, int, bytes]]:
        """``(t_ns, seq, body)`` of the device's newest ``ota/status`` reports, newest first."""
        sql = self._sql(
            "SELECT t_ns, seq, body FROM messages WHERE device = ? AND kind = 'ota/status' "
            "ORDER BY t_ns DESC, seq DESC LIMIT ?"
        )
        return self._run(
            "ota_history",
            lambda db: [
                (int(r[0]), int(r[1]), bytes(r[2])) for r in db.execute(sql, (device, limit))
            ],
        )

    def quarantine_page(
        self, *, before_id: int | None = None, limit: int = 100
    ) -> list[tuple[int, Quarantined]]:
        """``(id, message)`` of quarantined messages, newest first, below ``before_id``."""
        sql = self._sql(
            "SELECT id, topic, payload, reason, where_path, received_ns, device FROM quarantine "
            "WHERE id < ? ORDER BY id DESC LIMIT ?"
        )
        bound = before_id if before_id is not None else _TOP

        def go(db: Connection) -> list[tuple[int, Quarantined]]:
            return [
                (int(r[0]), Quarantined(r[1], bytes(r[2]), r[3], r[4], int(r[5]), r[6]))
                for r in db.execute(sql, (bound, limit)).fetchall()
            ]

        return self._run("quarantine_page", go)

    def decisions_received(
        self, after: tuple[int, str, str, int] | None, *, limit: int = 1000
    ) -> list[tuple[int, str, str, int, int, bytes]]:
        """``(received_ns, device, boot_id, seq, t_ns, body)`` of decisions in arrival order
        after the row ``after`` (its first four fields): how the live events follow them."""
        where = "kind = 'decision'"
        args: list[Any] = []
        if after is not None:
            where += " AND received_ns >= ? AND (received_ns, device, boot_id, seq) > (?, ?, ?, ?)"
            args = [after[0], *after]
        sql = self._sql(
            "SELECT received_ns, device, boot_id, seq, t_ns, body FROM messages WHERE "  # noqa: S608 - constant clauses
            + where
            + " ORDER BY received_ns, device, boot_id, seq LIMIT ?"
        )
        args.append(limit)

        def go(db: Connection) -> list[tuple[int, str, str, int, int, bytes]]:
            return [
                (int(r[0]), r[1], r[2], int(r[3]), int(r[4]), bytes(r[5]))
                for r in db.execute(sql, tuple(args)).fetchall()
            ]

        return self._run("decisions_received", go)

    def newest_received(self, kind: str) -> tuple[int, str, str, int] | None:
        """The arrival key of the newest stored message of ``kind`` (where live events start)."""
        sql = self._sql(
            "SELECT received_ns, device, boot_id, seq FROM messages WHERE kind = ? "
            "ORDER BY received_ns DESC, device DESC, boot_id DESC, seq DESC LIMIT 1"
        )

        def go(db: Connection) -> tuple[int, str, str, int] | None:
            r = db.execute(sql, (kind,)).fetchone()
            return None if r is None else (int(r[0]), r[1], r[2], int(r[3]))

        return self._run("newest_received", go)
