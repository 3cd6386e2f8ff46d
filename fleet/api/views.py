"""The API's response shapes (pydantic, so the OpenAPI document follows the code) and the
pure conversions from store records to them. Cursors are opaque to clients: base64url of a
JSON list holding the last row's sort key."""

from __future__ import annotations

import base64
import binascii
import json
from datetime import UTC, datetime
from typing import Any

import msgspec
from pydantic import BaseModel, Field

from fleet.access import AuditEntry
from fleet.api.problems import ApiProblem
from fleet.store import DeviceInfo, Gap, Quarantined
from fleet.store.console_sql import Bucket
from wire.messages import DecisionMsg, OtaStatusMsg


def iso(t_ns: int | None) -> str | None:
    """RFC 3339 UTC with microseconds, or None."""
    if not t_ns:
        return None
    return datetime.fromtimestamp(t_ns / 1e9, UTC).isoformat(timespec="microseconds")


def encode_cursor(key: list[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


def decode_cursor(text: str, width: int) -> list[Any]:
    """The key a cursor holds; 400 (``query.cursor``) for anything this API did not make."""
    try:
        key = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        key = None
    if not isinstance(key, list) or len(key) != width:
        raise ApiProblem(
            400, "malformed cursor (pass back the 'next' of a previous page)", "query.cursor"
        )
    return key


def id_cursor(text: str | None) -> int | None:
    """The row id a one-key cursor holds (None: the first page); 400 for anything else."""
    if text is None:
        return None
    (key,) = decode_cursor(text, 1)
    if not isinstance(key, int):
        raise ApiProblem(400, "malformed cursor", "query.cursor")
    return key


class Page(BaseModel):
    """A page of items; ``next`` is the cursor of the following page (None: the last)."""

    next: str | None = None


class Device(BaseModel):
    device: str
    site: str
    device_type: str
    online: bool
    last_seen: str | None
    last_seen_ns: int | None
    boot_id: str | None
    agent_version: str
    model_sha256: str
    group: str
    tier: str
    last_seq: int | None
    latency_ms: dict[str, float]
    model_health: dict[str, Any]


class DevicePage(Page):
    items: list[Device]


def device_view(d: DeviceInfo, labels: tuple[str, str]) -> Device:
    return Device(
        device=d.device,
        site=d.site,
        device_type=d.device_type,
        online=d.online,
        last_seen=iso(d.last_seen_ns),
        last_seen_ns=d.last_seen_ns,
        boot_id=d.boot_id,
        agent_version=d.agent_version,
        model_sha256=d.model_sha256,
        group=labels[0],
        tier=labels[1],
        last_seq=d.last_seq,
        latency_ms=d.latency_ms,
        model_health=d.model_health if d.online else {},
    )


class GapView(BaseModel):
    device: str
    boot_id: str
    first_missing: int
    last_missing: int
    missing: int


def gap_view(g: Gap) -> GapView:
    return GapView(
        device=g.device,
        boot_id=g.boot_id,
        first_missing=g.first_missing,
        last_missing=g.last_missing,
        missing=g.last_missing - g.first_missing + 1,
    )


class OtaEvent(BaseModel):
    t: str | None
    seq: int
    bundle_id: str
    state: str
    kind: str | None
    version: str
    reason: str


def ota_view(t_ns: int, seq: int, body: bytes) -> OtaEvent:
    m = msgspec.json.decode(body, type=OtaStatusMsg)
    return OtaEvent(
        t=iso(t_ns), seq=seq, bundle_id=m.bundle_id, state=m.state, kind=m.kind,
        version=m.version, reason=m.reason,
    )  # fmt: skip


class DeviceDetail(Device):
    first_seen: str | None
    gaps: list[GapView]
    ota_history: list[OtaEvent]
    signals: list[str]
    rollouts: list[str] = Field(description="Rollouts that include this device, newest first.")


class SeriesPoint(BaseModel):
    t: str | None
    t_ns: int
    min: float
    max: float
    mean: float
    points: int


class Series(BaseModel):
    device: str
    signal: str
    since: str | None
    until: str | None
    bucket_ns: int
    points: list[SeriesPoint]


def series_point(b: Bucket) -> SeriesPoint:
    mid = (b.t0_ns + b.t1_ns) // 2
    return SeriesPoint(t=iso(mid), t_ns=mid, min=b.min, max=b.max, mean=b.mean, points=b.points)


class TopSignal(BaseModel):
    signal: str
    contribution: float | None


class Decision(BaseModel):
    device: str
    t: str | None
    t_ns: int
    seq: int
    boot_id: str
    label: str
    score: float | None
    alarm: bool = Field(description="The decision raised or holds an alarm.")
    alarms: list[str]
    raised: list[str]
    cleared: list[str]
    top_signals: list[TopSignal]
    rules_fired: list[dict[str, str]]
    model_sha256: str
    model_version: str
    model_ran: bool
    attribution: str
    degraded: bool
    mode: str


class DecisionPage(Page):
    items: list[Decision]


def decision_view(device: str, t_ns: int, seq: int, boot_id: str, body: bytes) -> Decision:
    m = msgspec.json.decode(body, type=DecisionMsg)
    return Decision(
        device=device,
        t=iso(t_ns),
        t_ns=t_ns,
        seq=seq,
        boot_id=boot_id,
        label=m.label,
        score=m.score,
        alarm=bool(m.alarms or m.raised),
        alarms=list(m.alarms),
        raised=list(m.raised),
        cleared=list(m.cleared),
        top_signals=[
            TopSignal(signal=s.signal, contribution=s.contribution) for s in m.top_signals
        ],
        rules_fired=[{"rule": r.rule, "reason": r.reason} for r in m.rules_fired],
        model_sha256=m.model.sha256,
        model_version=m.model.version,
        model_ran=m.model.ran,
        attribution=m.attribution,
        degraded=m.degraded,
        mode=m.mode,
    )


class QuarantineItem(BaseModel):
    id: int
    received: str | None
    topic: str
    device: str | None
    reason: str
    where: str
    payload: str = Field(description="The payload as text (invalid UTF-8 replaced), cut to 4 KiB.")


class QuarantinePage(Page):
    items: list[QuarantineItem]


def quarantine_view(qid: int, q: Quarantined) -> QuarantineItem:
    return QuarantineItem(
        id=qid, received=iso(q.received_ns), topic=q.topic, device=q.device, reason=q.reason,
        where=q.where, payload=q.payload.decode("utf-8", "replace"),
    )  # fmt: skip


class AuditItem(BaseModel):
    id: int
    t: str | None
    actor: str
    via: str
    remote: str
    action: str
    target: str
    result: str
    detail: dict[str, Any]


class AuditPage(Page):
    items: list[AuditItem]


def audit_view(e: AuditEntry) -> AuditItem:
    return AuditItem(
        id=e.id, t=iso(e.t_ns), actor=e.actor, via=e.via, remote=e.remote, action=e.action,
        target=e.target, result=e.result, detail=e.detail,
    )  # fmt: skip
