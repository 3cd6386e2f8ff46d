"""The fleet :class:`~fleet.store.base.Store` in memory, for tests about logic, not SQL.

Same contract as the SQL stores (tests/test_memstore.py runs one scenario on both and
compares every read): idempotent ingest with duplicates and conflicts, the registry and its
state rule, gaps, rollouts and their requests, ``ota/status`` pages and ingest sessions.
Nothing is durable and nothing is shared between instances; the batch preparation and the
state rule are the SQL stores' own (:mod:`fleet.store._common`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fleet.errors import LeadershipLost
from fleet.store import _common
from fleet.store.base import (
    DeviceInfo,
    Gap,
    IngestResult,
    IngestSession,
    NodeInfo,
    Quarantined,
    Row,
)
from fleet.store.migrations import LATEST
from wire.messages import StateMsg


@dataclass
class _Device:
    device: str
    site: str
    first_seen_ns: int
    device_type: str = "generic"
    last_seen_ns: int | None = None
    online: bool = False
    boot_id: str | None = None
    state_t_ns: int | None = None
    agent_version: str = ""
    model_sha256: str = ""
    latency: dict[str, float] = field(default_factory=dict)
    latency_t_ns: int | None = None
    model_health: dict[str, Any] = field(default_factory=dict)
    group: str = ""
    tier: str = "normal"


@dataclass
class _Boot:
    first_received_ns: int
    watermark: int | None = None
    held: int | None = None


class MemoryStore:
    """:class:`fleet.store.base.Store` in dictionaries."""

    def __init__(self) -> None:
        self.url = "memory://"
        self._messages: dict[tuple[str, str, int], Row] = {}
        self._bundles: dict[str, bytes] = {}
        self._floor = 0  # the newest cut of a message kind (history_floors)
        self._labels: dict[tuple[str, str, int], str | None] = {}
        self._devices: dict[str, _Device] = {}
        self._boots: dict[tuple[str, str], _Boot] = {}
        self._quarantine: list[Quarantined] = []
        self._recorded_gaps: set[tuple[str, str, int]] = set()
        self._rollouts: dict[str, tuple[str, int, int, str]] = {}  # state, created, updated, doc
        self._requests: list[list[Any]] = []  # id, rollout, action, requested, done
        self._sessions: dict[str, IngestSession] = {}
        self._nodes: dict[str, tuple[str, int, int, int, str]] = {}
        self._leader: tuple[str, int] | None = None

    def migrate(self) -> int:
        return LATEST

    # -- writes --------------------------------------------------------------------------

    def ingest(self, rows: Sequence[Row]) -> IngestResult:
        if not rows:
            return IngestResult(0, 0)
        batch = _common.prepare(rows)
        inserted = 0
        conflicts = list(batch.conflicts)
        for r, msg in zip(batch.rows, batch.messages, strict=True):
            key = (r.device, r.boot_id, r.seq)
            stored = self._messages.get(key)
            if stored is None:
                self._messages[key] = r
                self._labels[key] = msg[6]
                inserted += 1
            elif stored.body != r.body:
                conflicts.append(r)
        self.quarantine(
            [
                Quarantined(topic, payload, reason, where, received, device)
                for received, topic, device, reason, where, payload in _common.conflict_rows(
                    conflicts
                )
            ]
        )
        for device, boot, first in batch.boots:
            b = self._boots.setdefault((device, boot), _Boot(first))
            b.first_received_ns = min(b.first_received_ns, first)
        for device, site, first, last in batch.devices:
            self._seen(device, site, first, last)
        for device, text, t_ns in batch.latencies:
            d = self._devices[device]
            if d.latency_t_ns is None or d.latency_t_ns <= t_ns:
                d.latency, d.latency_t_ns = _common.latency_from_json(text), t_ns
        n = len(conflicts)
        return IngestResult(inserted, len(rows) - inserted - n, n)

    def _seen(self, device: str, site: str, first: int, last: int) -> _Device:
        d = self._devices.get(device)
        if d is None:
            d = self._devices[device] = _Device(device, site, first)
        elif d.first_seen_ns == 0:
            d.first_seen_ns = first
        d.last_seen_ns = max(d.last_seen_ns or 0, last)
        return d

    def quarantine(self, items: Sequence[Quarantined]) -> None:
        self._quarantine += [replace(q, payload=q.payload[:4096]) for q in items]

    def record_state(self, device: str, site: str, state: StateMsg, received_ns: int) -> None:
        b = self._boots.setdefault((device, state.boot_id), _Boot(received_ns))
        b.first_received_ns = min(b.first_received_ns, received_ns)
        b.watermark = max(b.watermark if b.watermark is not None else -1, state.seq)
        held = _common.held_of(state)
        if held is not None:
            b.held = held if b.held is None else max(b.held, held)
        d = self._seen(device, site, received_ns, received_ns)
        if not _common.state_applies((d.boot_id, d.state_t_ns, d.online), state):
            return
        d.state_t_ns = (
            state.t_ns if d.boot_id != state.boot_id else max(d.state_t_ns or 0, state.t_ns)
        )
        d.device_type, d.online, d.boot_id = (
            state.device_type,
            state.state == "online",
            state.boot_id,
        )
        d.agent_version, d.model_sha256 = state.agent_version, state.model_sha256
        d.model_health = _common.model_health_from_json(_common.model_health_json(state))

    def ensure_device(
        self, device: str, site: str, received_ns: int, *, auto_register: bool
    ) -> bool:
        if device in self._devices:
            return True
        if auto_register:
            self._devices[device] = _Device(device, site, received_ns)
        return auto_register

    def device_site(self, device: str) -> str | None:
        d = self._devices.get(device)
        return None if d is None else d.site

    def register_device(self, device: str, site: str, device_type: str = "generic") -> None:
        d = self._devices.setdefault(device, _Device(device, site, 0))
        d.site, d.device_type = site, device_type

    # -- reads ---------------------------------------------------------------------------

    def devices(self) -> list[DeviceInfo]:
        return [self._info(self._devices[k]) for k in sorted(self._devices)]

    def device(self, name: str) -> DeviceInfo | None:
        d = self._devices.get(name)
        return None if d is None else self._info(d)

    def _info(self, d: _Device) -> DeviceInfo:
        seqs = [s for (dev, b, s) in self._messages if dev == d.device and b == d.boot_id]
        return DeviceInfo(
            device=d.device,
            site=d.site,
            device_type=d.device_type,
            online=d.online,
            last_seen_ns=d.last_seen_ns,
            boot_id=d.boot_id,
            agent_version=d.agent_version,
            model_sha256=d.model_sha256,
            first_seen_ns=d.first_seen_ns,
            last_seq=max(seqs) if seqs else None,
            latency_ms=dict(d.latency),
            model_health=dict(d.model_health),
        )

    def telemetry(
        self, device: str, *, since_ns: int | None = None, limit: int = 100
    ) -> list[tuple[int, int, str, bytes]]:
        limit = _common.check_limit(limit)
        low = -1 if since_ns is None else since_ns
        rows = [
            r
            for r in self._messages.values()
            if r.device == device and r.kind == "telemetry" and r.t_ns >= low
        ]
        rows.sort(key=lambda r: (r.t_ns, r.seq))
        return [(r.t_ns, r.seq, r.boot_id, r.body) for r in rows[max(0, len(rows) - limit) :]]

    def decisions(
        self,
        *,
        since_ns: int | None = None,
        device: str | None = None,
        label: str | None = None,
        limit: int = 100,
    ) -> list[tuple[str, int, int, bytes]]:
        limit = _common.check_limit(limit)
        low = -1 if since_ns is None else since_ns
        rows = [
            r
            for k, r in self._messages.items()
            if r.kind == "decision"
            and r.t_ns >= low
            and (device is None or r.device == device)
            and (label is None or self._labels[k] == label)
        ]
        rows.sort(key=lambda r: (r.t_ns, r.device, r.seq))
        return [(r.device, r.t_ns, r.seq, r.body) for r in rows[max(0, len(rows) - limit) :]]

    def gaps(self, device: str | None = None) -> list[Gap]:
        seqs: dict[tuple[str, str], list[int]] = {}
        for dev, boot, seq in self._messages:
            if device is None or dev == device:
                seqs.setdefault((dev, boot), []).append(seq)
        found: list[Gap] = []
        for (dev, boot), b in self._boots.items():
            if device is not None and dev != device:
                continue
            have = sorted(seqs.get((dev, boot), []))
            holes = _holes(dev, boot, have, b.watermark)
            if self._floor:
                holes = [g for g in holes if self._uncut(g, b.first_received_ns)]
            found += _cut(holes, b.held)
        first = {k: b.first_received_ns for k, b in self._boots.items()}
        return sorted(
            found,
            key=lambda g: (g.device, first[(g.device, g.boot_id)], g.boot_id, g.first_missing),
        )

    def _uncut(self, g: Gap, first_received_ns: int) -> bool:
        """Retention cannot have removed ``g`` (see fleet.store.runs.gaps_sql)."""
        below = self._messages.get((g.device, g.boot_id, g.first_missing - 1))
        if below is not None:
            return below.t_ns >= self._floor  # a hole or a tail: the message before it
        return first_received_ns >= self._floor  # a head or a boot of which nothing is left

    def prepare_history(self, now_ns: int) -> int:
        return 0  # one dict, nothing to make ready

    def expire(self, kind: str, before_ns: int, limit: int) -> int:
        if kind == "quarantine":
            old = [q for q in self._quarantine if q.received_ns < before_ns][:limit]
            self._quarantine = [q for q in self._quarantine if q not in old]
            return len(old)
        if kind == "minutes":
            return 0  # no rollups here
        keys = [k for k, r in self._messages.items() if r.kind == kind and r.t_ns < before_ns]
        for k in keys[:limit]:
            del self._messages[k]
        self._floor = max(self._floor, before_ns)
        return min(len(keys), limit)

    def compact_runs(self, limit: int = 10_000) -> int:
        return 0  # gaps come from the stored keys themselves: nothing kept beside them

    def record_new_gaps(self, since_ns: int, until_ns: int, found_ns: int) -> list[Gap]:
        new: list[Gap] = []
        for r in sorted(self._messages.values(), key=lambda r: (r.device, r.boot_id, r.seq)):
            if not (since_ns <= r.received_ns < until_ns) or r.seq == 0:
                continue
            if (r.device, r.boot_id, r.seq - 1) in self._messages:
                continue
            below = [
                s for (d, b, s) in self._messages if d == r.device and b == r.boot_id and s < r.seq
            ]
            first = max(below) + 1 if below else 0
            key = (r.device, r.boot_id, first)
            cut = _cut([Gap(r.device, r.boot_id, first, r.seq - 1)], self._boots_held(r))
            if cut and key not in self._recorded_gaps:
                self._recorded_gaps.add(key)
                new += cut
        return new

    def _boots_held(self, r: Row) -> int | None:
        b = self._boots.get((r.device, r.boot_id))
        return None if b is None else b.held

    def quarantined(self, *, limit: int = 100) -> list[Quarantined]:
        limit = _common.check_limit(limit)
        ordered = sorted(
            enumerate(self._quarantine), key=lambda iq: (iq[1].received_ns, iq[0]), reverse=True
        )
        return [q for _, q in ordered[:limit]]

    def counts(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for r in self._messages.values():
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        return _common.counts_from(list(kinds.items()), len(self._quarantine), len(self._devices))

    # -- labels and rollouts -------------------------------------------------------------

    def set_labels(self, device: str, *, group: str | None, tier: str | None) -> bool:
        d = self._devices.get(device)
        if d is None:
            return False
        if group is not None:
            d.group = group
        if tier is not None:
            d.tier = tier
        return True

    def labels(self) -> dict[str, tuple[str, str]]:
        return {k: (d.group, d.tier) for k, d in self._devices.items()}

    def put_bundle(self, sha256: str, data: bytes, now_ns: int) -> None:
        self._bundles.setdefault(sha256, data)

    def bundle(self, sha256: str) -> bytes | None:
        return self._bundles.get(sha256)

    def insert_rollout(self, rollout_id: str, state: str, doc: str, now_ns: int) -> bool:
        if rollout_id in self._rollouts:
            return False
        self._rollouts[rollout_id] = (state, now_ns, now_ns, doc)
        return True

    def save_rollout(
        self, rollout_id: str, state: str, doc: str, now_ns: int, *, epoch: int | None = None
    ) -> None:
        if epoch is not None and (self._leader is None or self._leader[1] != epoch):
            raise LeadershipLost(f"rollout {rollout_id} not saved: epoch {epoch} no longer leads")
        created = self._rollouts.get(rollout_id, (state, now_ns, now_ns, doc))[1]
        self._rollouts[rollout_id] = (state, created, now_ns, doc)

    # -- nodes ---------------------------------------------------------------------------

    def node_seen(
        self, node: str, *, host: str, pid: int, started_ns: int, now_ns: int, stats_json: str
    ) -> None:
        self._nodes[node] = (host, pid, started_ns, now_ns, stats_json)

    def node_gone(self, node: str) -> None:
        self._nodes.pop(node, None)

    def nodes(self) -> list[NodeInfo]:
        out = []
        for node, (host, pid, started, seen, stats) in sorted(self._nodes.items()):
            leads = self._leader is not None and self._leader[0] == node
            epoch = self._leader[1] if leads and self._leader else None
            info = NodeInfo(
                node, host, pid, started, seen, _common.json_object(stats), leads, epoch
            )
            out.append(info)
        return out

    def take_lead(self, node: str, now_ns: int) -> int:
        epoch = (self._leader[1] if self._leader else 0) + 1
        self._leader = (node, epoch)
        return epoch

    def rollouts(self, *, active_only: bool = False) -> list[tuple[str, str, str]]:
        items = sorted(self._rollouts.items(), key=lambda kv: (-kv[1][1], kv[0]))
        return [
            (rid, state, doc)
            for rid, (state, _, _, doc) in items
            if not active_only or state in ("running", "paused")
        ]

    def add_rollout_request(self, rollout_id: str, action: str, now_ns: int) -> None:
        self._requests.append([len(self._requests) + 1, rollout_id, action, now_ns, None])

    def pending_rollout_requests(self) -> list[tuple[int, str, str]]:
        return [(i, rid, action) for i, rid, action, _, done in self._requests if done is None]

    def finish_rollout_requests(self, ids: Sequence[int], now_ns: int) -> None:
        for req in self._requests:
            if req[0] in ids and req[4] is None:
                req[4] = now_ns

    def ota_status_since(
        self, received_ns: int, *, limit: int = 10_000, after: bytes | None = None
    ) -> list[tuple[int, bytes]]:
        n = _common.check_limit(limit)
        rows = sorted(
            (r.received_ns, r.body) for r in self._messages.values() if r.kind == "ota/status"
        )
        if after is None:
            page = [(t, b) for t, b in rows if t > received_ns]
        else:
            page = [(t, b) for t, b in rows if t > received_ns or (t == received_ns and b > after)]
        return page[:n]

    # -- ingest sessions -----------------------------------------------------------------

    def ingest_sessions(self) -> list[IngestSession]:
        return [self._sessions[k] for k in sorted(self._sessions)]

    def save_ingest_sessions(
        self, sessions: Sequence[IngestSession], *, if_state: str | None = None
    ) -> int:
        n = 0
        for s in sessions:
            old = self._sessions.get(s.client_id)
            if if_state is not None:
                if old is None or old.state != if_state:
                    continue
                self._sessions[s.client_id] = replace(s, created_ns=old.created_ns)
            else:
                created = old.created_ns if old is not None else s.created_ns
                self._sessions[s.client_id] = replace(s, created_ns=created)
            n += 1
        return n

    def ping(self) -> None:
        return None

    def close(self) -> None:
        return None


def _cut(gaps: list[Gap], held: int | None) -> list[Gap]:
    """What of ``gaps`` lies below the boot's ``held`` (see fleet.store._common.gap_rows)."""
    if held is None:
        return gaps
    return [
        replace(g, last_missing=min(g.last_missing, held - 1))
        for g in gaps
        if g.first_missing < held
    ]


def _holes(device: str, boot: str, have: Iterable[int], watermark: int | None) -> list[Gap]:
    """Head, holes between stored seqs and the tail up to the watermark, of one boot."""
    seqs = list(have)
    out: list[Gap] = []
    if not seqs:
        if watermark is not None and watermark > 0:
            out.append(Gap(device, boot, 0, watermark - 1))
        return out
    if seqs[0] > 0:
        out.append(Gap(device, boot, 0, seqs[0] - 1))
    out += [Gap(device, boot, a + 1, b - 1) for a, b in itertools.pairwise(seqs) if b > a + 1]
    if watermark is not None and watermark - 1 > seqs[-1]:
        out.append(Gap(device, boot, seqs[-1] + 1, watermark - 1))
    return out
