"""What the SQLite and PostgreSQL backends share: batch preparation, the state rule, SQL text.

Pure functions over rows and values; no database access here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from fleet.errors import FleetStoreError
from fleet.store.base import (
    DATA_KINDS,
    QUARANTINE_PAYLOAD_MAX,
    DeviceInfo,
    Gap,
    IngestSession,
    Row,
)
from wire.messages import StateMsg
from wire.topics import topic


class _DecisionBits(msgspec.Struct):
    """The two decision fields the store indexes; the body was validated by the caller."""

    label: str | None = None
    stage_latency_ms: dict[str, float | None] = msgspec.field(default_factory=dict)


_DECISION = msgspec.json.Decoder(_DecisionBits)


class _Period(msgspec.Struct, array_like=True):
    t_ns: int
    keyframe: bool
    signals: dict[str, tuple[float, float, float, float, int]]


class _TelemetryBits(msgspec.Struct):
    """What the per-signal series takes from a telemetry body (validated by the caller)."""

    t_ns: int
    signals: dict[str, tuple[float, float, float, float, int]]
    more: list[_Period] = msgspec.field(default_factory=list)


_TELEMETRY = msgspec.json.Decoder(_TelemetryBits)

#: One point of a signal's series: device, signal, t_ns, boot_id, seq, mean, min, max, n.
Point = tuple[str, str, int, str, int, float, float, float, int]


def _periods(body: bytes) -> list[tuple[int, dict[str, tuple[float, float, float, float, int]]]]:
    """``(t_ns, signals)`` of each period of a telemetry body (its first and every ``more``);
    none for a body that is not telemetry (the ingest validated it; only a tool writing rows
    directly could store one)."""
    try:
        bits = _TELEMETRY.decode(body)
    except (msgspec.DecodeError, ValueError):
        return []
    return [(bits.t_ns, bits.signals)] + [(p.t_ns, p.signals) for p in bits.more]


def _finite(mean: float, lo: float, hi: float) -> bool:
    # A chart cannot draw a non-finite statistic and SQL cannot sort one: left out.
    return math.isfinite(mean) and math.isfinite(lo) and math.isfinite(hi)


def points_of(r: Row) -> list[Point]:
    """The per-signal points of one telemetry row; a row that is not telemetry has none and
    is still stored, as every row is."""
    return [
        (r.device, name, t_ns, r.boot_id, r.seq, mean, lo, hi, n)
        for t_ns, signals in _periods(r.body)
        for name, (mean, lo, hi, _last, n) in signals.items()
        if _finite(mean, lo, hi)
    ]


def signal_stats(body: bytes, signal: str) -> list[tuple[int, float, float, float, int]]:
    """``(t_ns, mean, min, max, n)`` of ``signal`` in each period of a telemetry body that
    has it."""
    out = []
    for t_ns, signals in _periods(body):
        s = signals.get(signal)
        if s is not None and _finite(s[0], s[1], s[2]):
            out.append((t_ns, s[0], s[1], s[2], s[4]))
    return out


class Stats:
    """Statistics of points summed into one bucket: min of mins, max of maxes, and the mean
    weighted by samples (the plain mean of means when no point counted a sample)."""

    __slots__ = ("count", "hi", "lo", "n", "sum_mean", "sum_wmean")

    def __init__(self, mean: float, lo: float, hi: float, n: int) -> None:
        self.lo, self.hi = lo, hi
        self.sum_wmean, self.n, self.sum_mean, self.count = mean * n, n, mean, 1

    def add(self, mean: float, lo: float, hi: float, n: int) -> None:
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)
        self.sum_wmean += mean * n
        self.n += n
        self.sum_mean += mean
        self.count += 1

    @property
    def mean(self) -> float:
        return self.sum_wmean / self.n if self.n > 0 else self.sum_mean / self.count


MINUTE_NS = 60_000_000_000


def minute_rollups(
    points: Sequence[Point], new: set[tuple[str, str, int]], messages: int
) -> list[tuple[Any, ...]]:
    """The ``signal_minutes`` additions of the points of the messages just inserted
    (``new``: their keys; all of them when ``len(new) == messages``), sorted by key (lock
    order): device, signal, minute, min, max, sum of mean x n, sum of n, sum of mean,
    points. A redelivered or conflicting message was not inserted, so it adds nothing."""
    everything = len(new) == messages
    acc: dict[tuple[str, str, int], Stats] = {}
    for device, signal, t_ns, boot, seq, mean, lo, hi, n in points:
        if not everything and (device, boot, seq) not in new:
            continue
        key = (device, signal, t_ns // MINUTE_NS)
        a = acc.get(key)
        if a is None:
            acc[key] = Stats(mean, lo, hi, n)
        else:
            a.add(mean, lo, hi, n)
    return [(*k, a.lo, a.hi, a.sum_wmean, a.n, a.sum_mean, a.count) for k, a in sorted(acc.items())]


@dataclass(slots=True)
class Batch:
    """One ingest batch, prepared for the SQL of either backend.

    Rows are sorted by key so that concurrent workers take row locks in the same order (no
    deadlock between two PostgreSQL transactions inserting overlapping batches). A key
    given twice in the batch is inserted once, from its first row (arrival order): the
    later rows are ``repeats`` (the same bytes) or ``conflicts`` (other bytes).
    """

    messages: list[tuple[str, str, int, str, int, int, str | None, bytes]]
    #: The Row of each entry of ``messages``, in the same order.
    rows: list[Row]
    boots: list[tuple[str, str, int]]  # device, boot_id, first received_ns
    devices: list[tuple[str, str, int, int]]  # device, site, first received, last received
    latencies: list[tuple[str, str, int]]  # device, latency_json, t_ns of that decision
    #: The per-signal points of the telemetry rows (see :func:`points_of`).
    points: list[Point] = field(default_factory=list)
    repeats: int = 0
    conflicts: list[Row] = field(default_factory=list)


def prepare(rows: Sequence[Row]) -> Batch:
    """Check and arrange ``rows``. Raises FleetStoreError naming the bad row."""
    messages = []
    firsts: list[Row] = []
    repeats = 0
    conflicts: list[Row] = []
    seen: dict[tuple[str, str, int], bytes] = {}
    boots: dict[tuple[str, str], int] = {}
    devices: dict[str, tuple[str, int, int]] = {}
    latest: dict[str, tuple[int, dict[str, float]]] = {}
    points: list[Point] = []
    # sorted() is stable: rows of one key keep their arrival order, so the first is kept.
    for i, r in enumerate(sorted(rows, key=lambda r: (r.device, r.boot_id, r.seq))):
        if r.kind not in DATA_KINDS:
            raise FleetStoreError(
                f"ingest row {i} ({r.device}/{r.boot_id}/{r.seq}): kind {r.kind!r} is not "
                f"a data kind; expected one of {', '.join(DATA_KINDS)}"
            )
        kept = seen.get((r.device, r.boot_id, r.seq))
        if kept is not None:
            if kept == r.body:
                repeats += 1
            else:
                conflicts.append(r)
            continue
        seen[(r.device, r.boot_id, r.seq)] = r.body
        firsts.append(r)
        label = None
        if r.kind == "decision":
            try:
                bits = _DECISION.decode(r.body)
            except msgspec.DecodeError as exc:
                raise FleetStoreError(
                    f"ingest row {i} ({r.device}/{r.boot_id}/{r.seq}): decision body does "
                    f"not parse: {exc}"
                ) from None
            label = bits.label
            stages = {
                k: float(v)
                for k, v in bits.stage_latency_ms.items()
                if v is not None and math.isfinite(v)
            }
            prev = latest.get(r.device)
            if prev is None or r.t_ns >= prev[0]:
                latest[r.device] = (r.t_ns, stages)
        elif r.kind == "telemetry":
            points += points_of(r)
        messages.append((r.device, r.boot_id, r.seq, r.kind, r.t_ns, r.received_ns, label, r.body))
        key = (r.device, r.boot_id)
        boots[key] = min(boots.get(key, r.received_ns), r.received_ns)
        site, first, last = devices.get(r.device, (r.site, r.received_ns, r.received_ns))
        devices[r.device] = (site, min(first, r.received_ns), max(last, r.received_ns))
    return Batch(
        messages=messages,
        rows=firsts,
        points=points,
        repeats=repeats,
        conflicts=conflicts,
        boots=[(d, b, ns) for (d, b), ns in sorted(boots.items())],
        devices=[(d, s, f, la) for d, (s, f, la) in sorted(devices.items())],
        latencies=[
            (d, json.dumps(stages, sort_keys=True), t) for d, (t, stages) in sorted(latest.items())
        ],
    )


def conflict_rows(rows: Sequence[Row]) -> list[tuple[int, str, str, str, str, bytes]]:
    """Quarantine rows ``(received_ns, topic, device, reason, where_path, payload)`` for
    data messages whose key was stored with another body: the first body stays, this one
    is kept for a person to look at.

    Exactly the same bytes again is a redelivery (a duplicate, dropped); other bytes under
    the same ``(device, boot_id, seq)`` mean a device bug or a forged device, never
    something to drop silently."""
    return [
        (
            r.received_ns,
            topic(r.site, r.device, r.kind),
            r.device,
            f"conflict: seq {r.seq} of boot {r.boot_id} is already stored with another "
            "body; the first one is kept",
            "$",
            r.body[:QUARANTINE_PAYLOAD_MAX],
        )
        for r in rows
    ]


def state_applies(current: tuple[str | None, int | None, bool], state: StateMsg) -> bool:
    """Whether ``state`` may set online/offline over the registry's ``current``
    ``(boot_id, state_t_ns, online)``.

    The registry follows the newest boot. A state of the boot it already follows applies in
    arrival order (a Last Will is composed at connect time, so its ``t_ns`` is older than the
    birth it pairs with and cannot be ordered by time). A state of another boot applies only
    if it was made after the state that set the current boot: a Last Will or clean offline of
    an old boot that arrives late is older than the new boot's birth and must not mark the
    new boot offline. (This trusts device clocks to move forward across a reboot.) One
    exception in a boot: an ``online`` made before the state the registry holds does not
    bring an offline device back (a device republishes ``online`` while it runs; the last
    one, handled by another worker, can be stored after the ``offline`` that followed it).
    """
    current_boot, current_t_ns, current_online = current
    if current_boot is None or current_t_ns is None:
        return True
    if current_boot == state.boot_id:
        late_online = state.state == "online" and not current_online
        return not (late_online and state.t_ns < current_t_ns)
    return state.t_ns > current_t_ns


def latency_from_json(text: str) -> dict[str, float]:
    try:
        data: Any = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}


def model_health_json(state: StateMsg) -> str:
    """``devices.model_health_json`` for a state message: what an ``online`` state reports
    (``{}`` when it reports nothing: the model is healthy, or an older agent)."""
    health = state.model_health
    if state.state != "online" or isinstance(health, msgspec.UnsetType):
        return "{}"
    return json.dumps(
        {
            "ood": list(health.ood),
            "alarm_storm": health.alarm_storm,
            "acquisition_mismatch": health.acquisition_mismatch,
        },
        separators=(",", ":"),
    )


def json_object(text: str) -> dict[str, Any]:
    """A stored JSON object, or ``{}`` for anything else (damaged, or not an object)."""
    try:
        data: Any = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


model_health_from_json = json_object


#: Columns read by :func:`device_info`, in order; ``last_seq`` comes from a subquery.
DEVICE_SELECT = """
SELECT d.device, d.site, d.device_type, d.online, d.last_seen_ns, d.boot_id,
       d.agent_version, d.model_sha256, d.first_seen_ns, d.latency_json,
       (SELECT MAX(m.seq) FROM messages m WHERE m.device = d.device AND m.boot_id = d.boot_id),
       d.model_health_json
FROM devices d
"""


def device_info(row: Sequence[Any]) -> DeviceInfo:
    return DeviceInfo(
        device=row[0],
        site=row[1],
        device_type=row[2],
        online=bool(row[3]),
        last_seen_ns=row[4],
        boot_id=row[5],
        agent_version=row[6],
        model_sha256=row[7],
        first_seen_ns=row[8],
        last_seq=row[10],
        latency_ms=latency_from_json(row[9]),
        model_health=model_health_from_json(row[11]),
    )


def expire_sql(kind: str, before_ns: int, limit: int) -> tuple[str, tuple[object, ...], bool]:
    """The ``?`` DELETE of :meth:`fleet.store.base.Store.expire` for ``kind``, its
    arguments, and whether the cut is recorded in ``history_floors`` (message kinds)."""
    if kind in DATA_KINDS:
        return (
            "DELETE FROM messages WHERE (device, boot_id, seq) IN (SELECT device, boot_id, seq "
            "FROM messages WHERE kind = ? AND t_ns < ? LIMIT ?)",
            (kind, before_ns, limit),
            True,
        )
    if kind == "quarantine":
        return (
            "DELETE FROM quarantine WHERE id IN "
            "(SELECT id FROM quarantine WHERE received_ns < ? LIMIT ?)",
            (before_ns, limit),
            False,
        )
    if kind == "minutes":
        return (
            "DELETE FROM signal_minutes WHERE (device, signal, minute) IN (SELECT device, "
            "signal, minute FROM signal_minutes WHERE minute < ? LIMIT ?)",
            (before_ns // MINUTE_NS, limit),
            False,
        )
    raise FleetStoreError(f"cannot expire {kind!r}: not a kind of history this store keeps")


#: The newest cut of a message kind (it only moves forward).
RECORD_FLOOR = (
    "INSERT INTO history_floors (kind, floor_ns) VALUES (?, ?) ON CONFLICT (kind) DO UPDATE "
    "SET floor_ns = CASE WHEN excluded.floor_ns > history_floors.floor_ns "
    "THEN excluded.floor_ns ELSE history_floors.floor_ns END"
)


def holes_received_sql(keys: str = "messages") -> str:
    """Holes behind the data messages received in ``[since, until)``: each such message
    whose seq - 1 is not stored is the upper edge of one; its lower edge is the highest
    stored seq below it (none: the hole starts at 0). Two index lookups per message
    received in the window (``(kind, received_ns)``, then the primary key), in the
    database; the rows it returns are only the holes, each with the boot's ``held`` for
    :func:`gap_rows`. Bind ``(since, until)``. ``keys``: where the neighbours are looked up
    (``messages``, or PostgreSQL's ``message_keys``: one index, not one per partition)."""
    return f"""
SELECT e.device, e.boot_id,
       COALESCE((SELECT MAX(p.seq) FROM {keys} p
                 WHERE p.device = e.device AND p.boot_id = e.boot_id AND p.seq < e.seq), -1) + 1,
       e.seq - 1,
       (SELECT b.held FROM boots b WHERE b.device = e.device AND b.boot_id = e.boot_id)
FROM messages e
WHERE e.kind IN ('telemetry', 'decision', 'ota/status')
  AND e.received_ns >= ? AND e.received_ns < ? AND e.seq > 0
  AND NOT EXISTS (SELECT 1 FROM {keys} q
                  WHERE q.device = e.device AND q.boot_id = e.boot_id AND q.seq = e.seq - 1)
ORDER BY 1, 2, 3
"""  # noqa: S608 - a table name of ours


def hole_still_open_sql(keys: str = "messages") -> str:
    """Still missing (a hole can fill between the read and the write) and not yet recorded."""
    return (
        f"SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM {keys} WHERE device = ? AND boot_id = ? "  # noqa: S608
        "AND seq BETWEEN ? AND ?)"
    )


RECORD_HOLE = (
    "INSERT INTO ingest_gaps (device, boot_id, first_missing, last_missing, found_ns) "
    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (device, boot_id, first_missing) DO NOTHING"
)


def gap_rows(rows: Sequence[Sequence[Any]]) -> list[Gap]:
    """``(device, boot_id, first, last[, held])`` rows as gaps. A boot's ``held`` is the
    lowest seq its device still holds (see :class:`wire.messages.StateMsg`): what is missing
    at or above it is on its way, not lost, so a range is cut below it (dropped if it lies
    wholly above). NULL: the device keeps nothing once the broker has it; every hole counts."""
    gaps = []
    for r in rows:
        last = int(r[3])
        held = r[4] if len(r) > 4 else None
        if held is not None:
            last = min(last, int(held) - 1)
        if last >= int(r[2]):
            gaps.append(Gap(str(r[0]), str(r[1]), int(r[2]), last))
    return gaps


def held_of(state: StateMsg) -> int | None:
    """A state message's ``held`` as a column value (None when absent)."""
    return None if isinstance(state.held, msgspec.UnsetType) else state.held


def counts_from(kinds: Sequence[Sequence[Any]], quarantined: int, devices: int) -> dict[str, int]:
    out = dict.fromkeys(DATA_KINDS, 0)
    for kind, n in kinds:
        out[str(kind)] = int(n)
    out["quarantined"] = quarantined
    out["devices"] = devices
    return out


def ota_status_page(
    received_ns: int, limit: int, after: bytes | None
) -> tuple[str, tuple[object, ...]]:
    """One page of ``ota_status_since``: SQL and its arguments. Keyset paging on
    (received_ns, body): the (kind, received_ns) index gives the order by arrival; only rows
    of the same nanosecond are sorted by body."""
    n = check_limit(limit)
    if after is None:
        sql = (
            "SELECT received_ns, body FROM messages WHERE kind = 'ota/status' "
            "AND received_ns > ? ORDER BY received_ns, body LIMIT ?"
        )
        args: tuple[object, ...] = (received_ns, n)
    else:
        sql = (
            "SELECT received_ns, body FROM messages WHERE kind = 'ota/status' "
            "AND received_ns >= ? AND (received_ns > ? OR body > ?) "
            "ORDER BY received_ns, body LIMIT ?"
        )
        args = (received_ns, received_ns, after, n)
    return sql, args


def check_limit(limit: int) -> int:
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise FleetStoreError(f"limit must be a non-negative int, got {limit!r}")
    return limit


_SESSION_COLUMNS = (
    "client_id", "prefix", "node", "group_name", "idx", "broker", "state", "created_ns",
    "last_seen_ns", "ended_ns", "drained",
)  # fmt: skip
#: What a write changes: a session keeps its client id and the time it was first recorded.
_SESSION_UPDATED = tuple(c for c in _SESSION_COLUMNS if c not in ("client_id", "created_ns"))
#: Every column of ``ingest_sessions``, in :class:`IngestSession` field order.
SESSIONS_SELECT = f"SELECT {', '.join(_SESSION_COLUMNS)} FROM ingest_sessions ORDER BY client_id"  # noqa: S608


def sessions_sql(if_state: bool) -> str:
    """Write one session: an upsert, or with
    ``if_state`` an update of the row only while it is in that state."""
    if if_state:
        sets = ", ".join(f"{c} = ?" for c in _SESSION_UPDATED)
        return f"UPDATE ingest_sessions SET {sets} WHERE client_id = ? AND state = ?"  # noqa: S608
    values = ", ".join("?" for _ in _SESSION_COLUMNS)
    sets = ", ".join(f"{c} = excluded.{c}" for c in _SESSION_UPDATED)
    return (
        f"INSERT INTO ingest_sessions ({', '.join(_SESSION_COLUMNS)}) VALUES ({values}) "  # noqa: S608
        f"ON CONFLICT (client_id) DO UPDATE SET {sets}"
    )


def session_params(s: IngestSession, if_state: str | None) -> tuple[object, ...]:
    """The parameters of :func:`sessions_sql` for ``s``."""
    changed = (s.prefix, s.node, s.group, s.index, s.broker, s.state, s.last_seen_ns,
               s.ended_ns, s.drained)  # fmt: skip
    if if_state is None:
        return (s.client_id, *changed[:6], s.created_ns, *changed[6:])
    return (*changed, s.client_id, if_state)


def session_rows(rows: Sequence[Sequence[Any]]) -> list[IngestSession]:
    """Rows of :data:`SESSIONS_SELECT` (both drivers return str and int for its columns)."""
    return [IngestSession(*r) for r in rows]
