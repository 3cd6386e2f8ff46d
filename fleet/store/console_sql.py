"""The reads behind the fleet API and console, one query text for SQLite and PostgreSQL:
a signal's series downsampled in SQL, and keyset pages of decisions, OTA reports and the
quarantine. Every method raises :class:`fleet.errors.FleetStoreError` on a store failure.
Layout: docs/ARCHITECTURE.md, "The fleet API"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.store import _common
from fleet.store.base import DeviceInfo, Quarantined
from fleet.store.sqlbase import Connection, SqlBase

#: The newest row's key sorts below this; a first page starts under it.
_TOP = 2**63 - 1
MINUTE_NS = 60_000_000_000


def bucket_of(bucket_ns: int) -> int:
    """The bucket :meth:`ConsoleSql.series` uses for ``bucket_ns``: whole minutes from a
    minute up (read from the minute rollups: 1,440 rows a day instead of 86,400 points at
    1 Hz), as asked below."""
    if bucket_ns < MINUTE_NS:
        return max(1, bucket_ns)
    return -(-bucket_ns // MINUTE_NS) * MINUTE_NS


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


#: How far before a range the series of short buckets reads messages: a message's later
#: periods (``more``) may fall in the range though its own time is before it.
LOOKBACK_NS = 10 * 60_000_000_000


class _Bucket:
    """A series bucket being summed: its first and last point time and their statistics."""

    __slots__ = ("stats", "t0", "t1")

    def __init__(self, t: int, stats: _common.Stats) -> None:
        self.t0 = self.t1 = t
        self.stats = stats

    def add(self, stat: tuple[int, float, float, float, int]) -> None:
        t, mean, lo, hi, n = stat
        self.t0, self.t1 = min(self.t0, t), max(self.t1, t)
        self.stats.add(mean, lo, hi, n)

    def done(self) -> Bucket:
        s = self.stats
        return Bucket(self.t0, self.t1, float(s.lo), float(s.hi), float(s.mean), s.count)


@dataclass(frozen=True, slots=True)
class DeviceFilter:
    """Which devices a page holds: each field given must match (``q``: part of the name,
    any case); sorted by ``sort`` (``device``, ``site``, ``last_seen``, ``version``) then
    name, descending with ``desc``."""

    site: str | None = None
    tier: str | None = None
    device_type: str | None = None
    online: bool | None = None
    version: str | None = None
    group: str | None = None
    q: str | None = None
    sort: str = "device"
    desc: bool = False


_SORT_SQL = {
    "device": "d.device",
    "site": "d.site",
    "last_seen": "COALESCE(d.last_seen_ns, 0)",
    "version": "d.agent_version",
}
_EQUALS = (
    ("site", "d.site"), ("tier", "d.tier"), ("device_type", "d.device_type"),
    ("online", "d.online"), ("version", "d.agent_version"), ("group", "d.group_name"),
)  # fmt: skip


def _like(text: str) -> str:
    escaped = text.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


class ConsoleSql(SqlBase):
    """Reads for people: devices, series, pages of decisions, OTA history and quarantine."""

    def devices_page(
        self, f: DeviceFilter, *, after: tuple[Any, str] | None = None, limit: int = 100
    ) -> list[tuple[DeviceInfo, str, str]]:
        """``(device, group, tier)`` of one page of the devices ``f`` matches, in its order;
        ``after`` is the last row's ``(sort value, name)`` of the previous page. Filtered,
        sorted and cut in SQL: a page costs the same with 100 or 10,000 devices."""
        key = _SORT_SQL[f.sort]
        where: list[str] = []
        args: list[Any] = []
        for field, column in _EQUALS:
            value = getattr(f, field)
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if f.q:
            where.append("LOWER(d.device) LIKE ? ESCAPE '\\'")
            args.append(_like(f.q))
        if after is not None:
            where.append(f"({key}, d.device) {'<' if f.desc else '>'} (?, ?)")
            args += after
        order = "DESC" if f.desc else "ASC"
        sql = self._sql(
            _common.DEVICE_SELECT.replace("FROM devices d", ", d.group_name, d.tier FROM devices d")
            + (" WHERE " + " AND ".join(where) if where else "")
            + f" ORDER BY {key} {order}, d.device {order} LIMIT ?"
        )
        args.append(limit)

        def go(db: Connection) -> list[tuple[DeviceInfo, str, str]]:
            return [(_common.device_info(r), r[12], r[13]) for r in db.execute(sql, tuple(args))]

        return self._run("devices_page", go)

    def signals(self, device: str) -> list[str]:
        """The signals ``device`` has points for, by name (an index skip-scan: one probe
        per signal, not a scan of the series)."""
        sql = self._sql(
            "WITH RECURSIVE s(x) AS (SELECT MIN(signal) FROM signal_minutes WHERE device = ? "
            "UNION ALL SELECT (SELECT MIN(signal) FROM signal_minutes WHERE device = ? AND "
            "signal > s.x) FROM s WHERE s.x IS NOT NULL) SELECT x FROM s WHERE x IS NOT NULL"
        )
        return self._run(
            "signals", lambda db: [r[0] for r in db.execute(sql, (device, device)).fetchall()]
        )

    def series(
        self, device: str, signal: str, *, since_ns: int, until_ns: int, bucket_ns: int
    ) -> list[Bucket]:
        """``signal`` of ``device`` over ``[since_ns, until_ns)`` in buckets of ``bucket_ns``
        (min of mins, max of maxes, mean weighted by samples), oldest first. Buckets of a
        minute or more are made of whole minutes from ``signal_minutes`` (see
        :func:`bucket_of`), shorter ones from the points themselves."""
        bucket = bucket_of(bucket_ns)
        if bucket >= MINUTE_NS:
            sql = self._sql(
                "SELECT MIN(minute), MAX(minute), MIN(min), MAX(max), CASE WHEN SUM(sum_n) > 0 "
                "THEN SUM(sum_wmean) / SUM(sum_n) ELSE SUM(sum_mean) / SUM(points) END, "
                "SUM(points) FROM signal_minutes WHERE device = ? AND signal = ? AND "
                "minute >= ? AND minute < ? GROUP BY (minute - ?) / ? ORDER BY 1"
            )
            first = since_ns // MINUTE_NS
            args: tuple[Any, ...] = (
                device, signal, first, -(-until_ns // MINUTE_NS), first, bucket // MINUTE_NS,
            )  # fmt: skip

            def minutes(db: Connection) -> list[Bucket]:
                return [
                    Bucket(
                        int(r[0]) * MINUTE_NS,
                        (int(r[1]) + 1) * MINUTE_NS - 1,
                        float(r[2]),
                        float(r[3]),
                        float(r[4]),
                        int(r[5]),
                    )
                    for r in db.execute(sql, args).fetchall()
                ]

            return self._run("series", minutes)
        # Under a minute: the messages themselves (a range of at most a few hours), read
        # from LOOKBACK_NS earlier, as a message's later periods may fall in the range.
        sql = self._sql(
            "SELECT body FROM messages WHERE device = ? AND kind = 'telemetry' AND t_ns >= ? "
            "AND t_ns < ? ORDER BY t_ns"
        )
        args = (device, since_ns - LOOKBACK_NS, until_ns)

        def points(db: Connection) -> list[Bucket]:
            acc: dict[int, _Bucket] = {}
            for (body,) in db.execute(sql, args):
                for stat in _common.signal_stats(bytes(body), signal):
                    t, mean, lo, hi, n = stat
                    if not since_ns <= t < until_ns:
                        continue
                    k = (t - since_ns) // bucket
                    if k in acc:
                        acc[k].add(stat)
                    else:
                        acc[k] = _Bucket(t, _common.Stats(mean, lo, hi, n))
            return [b.done() for _, b in sorted(acc.items())]

        return self._run("series", points)

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

    def fleet_state(self) -> tuple[int, int, dict[str, int]]:
        """Devices online, devices offline, and rollouts by state (for the metrics)."""
        devices = self._sql("SELECT online, COUNT(*) FROM devices GROUP BY online")
        rollouts = self._sql("SELECT state, COUNT(*) FROM rollouts GROUP BY state")

        def go(db: Connection) -> tuple[int, int, dict[str, int]]:
            by = {bool(r[0]): int(r[1]) for r in db.execute(devices).fetchall()}
            states = {str(r[0]): int(r[1]) for r in db.execute(rollouts).fetchall()}
            return by.get(True, 0), by.get(False, 0), states

        return self._run("fleet_state", go)
